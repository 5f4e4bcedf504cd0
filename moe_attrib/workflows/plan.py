"""The memory plan of a sharded collection run, printed before any work (`--fsdp`).

Per rank: the parameter shard, the layers gathered at a time, the activations kept for the backward
(an estimate from the config), the routed rows captured and, for EK-FAC, the float64 factors. It
sits above `moe_attrib.model.sharding` (which taps and fingerprints use) because it reads the discovery
report and EK-FAC's factor sizes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_attrib.collect.projection import PROJECTION, side_width
from moe_attrib.curvature.ekfac import memory_plan as factor_plan
from moe_attrib.model.discovery import discover
from moe_attrib.model.sharding import decoder_layers, is_dtensor
from moe_attrib.settings import output_dims
from moe_attrib.workflows.checks import UsageError


def memory_plan(
    model: nn.Module,
    world: int,
    token_batch_size: int,
    projection_dim: int | None,
    track_moe_experts: bool = True,
    factors: bool = False,
    projection: str = PROJECTION,
    recompute: bool = False,
    output_projection_dim: int | None = None,
) -> dict[str, int]:
    """Bytes per rank of a sharded collection run: parameter shards, the gathered layers, activations
    kept for the backward (an estimate from the config; with `recompute`, each layer's input plus one
    layer's activations), the routed grid's capture rows (for the projection kind `projection`) and,
    for EK-FAC, the float64 factors (whole on every rank: they are all-reduced)."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    params = [p.to_local() if is_dtensor(p) else p for p in model.parameters()]
    layer = max((sum(nbytes(p) for p in m.parameters()) for m in decoder_layers(model)), default=0)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = getattr(cfg, "hidden_size", 0)
    layers = len(decoder_layers(model))
    top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "moe_topk", None) or 1
    inter = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", 0) or 0
    size = next(model.parameters()).element_size()
    report = discover(model, track_moe_experts=track_moe_experts, warn=False)
    plan = {
        "parameters (this rank's shard)": sum(nbytes(p) for p in params),
        "gathered layers (2 at a time)": 2 * layer,
        "activations (estimate)": token_batch_size
        * (12 * hidden + 3 * top_k * inter)
        * size
        * (1 if recompute else layers)
        + (token_batch_size * layers * hidden * size if recompute else 0),
        "routed grid rows": 0,
        "EK-FAC factors (float64)": 0,
    }
    for lay in report.experts if track_moe_experts else []:
        width = sum(
            sum(lay.features(p))
            if projection_dim is None
            else sum(side_width(projection, f, projection_dim) for f in lay.features(p))
            for p in lay.projections
        )
        plan["routed grid rows"] += token_batch_size * top_k * width * 4
    if factors:
        dims = output_dims(report.output_layer, projection_dim, output_projection_dim)
        plan["EK-FAC factors (float64)"] = factor_plan(report, projection_dim, projection=projection, target_dims=dims)[
            "total"
        ]
    plan["world"] = world
    return plan


FIT = 0.9  # weights may take this share of a device's free memory (the rest: activations, rows)


def choose_sharding(
    weights: int, free: int, world: int, fsdp: bool, torchrun: bool, command: str
) -> tuple[bool, str | None]:
    """Whether a run must shard its model (FSDP2) to fit: `weights` bytes against `free` bytes of one
    device, `world` ranks. Returns `(shard, note)`: under torchrun a model that does not fit one device
    is sharded over the ranks automatically (the note says so); where no sharding over these ranks
    fits, or without torchrun, a `UsageError` says how many devices the weights need."""
    need = math.ceil(weights / (FIT * free)) if free > 0 else math.inf
    gib = f"{weights / 2**30:.1f} GiB of weights, one device has {free / 2**30:.1f} GiB free"
    if not fsdp and weights <= FIT * free:
        return False, None
    if fsdp or torchrun:
        if need <= world:
            note = None if fsdp else f"the model needs {gib}: sharding it over the {world} ranks (--fsdp)."
            return True, note
        raise UsageError(
            f"the model needs {gib}: sharded over {world} ranks it still does not fit; launch "
            f"`torchrun --nproc_per_node {need} -m moe_attrib {command} ... --fsdp` (or more ranks over nodes)."
        )
    raise UsageError(
        f"the model needs {gib}: shard it over {need} GPUs with "
        f"`torchrun --nproc_per_node {need} -m moe_attrib {command} ... --fsdp` (docs/distributed.md)."
    )


def format_memory_plan(plan: dict[str, int]) -> str:
    lines = [f"memory plan per rank (FSDP2 over {plan['world']} ranks):"]
    total = 0
    for name, value in plan.items():
        if name == "world":
            continue
        total += value
        lines.append(f"  {name:<32s} {_size(value):>12s}")
    lines.append(f"  {'total':<32s} {_size(total):>12s}")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
