"""Which parameters a model has and how its MoE layers are laid out: discovery, per-expert views and the
layout registry, router taps, the output layer fused with the loss, the one-pass norms, layer recompute,
tiny test models, FSDP2 sharding and torchrun helpers."""
