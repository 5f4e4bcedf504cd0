"""Per-example gradient collection: capture hooks and the routed-token grid, row formation, seeded
projections, optimizer normalisation, CUDA graphs, and the one collection loop with its prefetching."""
