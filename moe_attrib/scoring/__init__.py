"""Scoring queries against an index: top-k and score matrices, cross-module coupling, output-layer
balance, result records and their details."""
