"""FSDP2 sharding for collection (`--fsdp` under torchrun): models larger than one device.

Each decoder layer (and the root: embeddings, final norm, head) is one `fully_shard` unit, so a
rank holds 1/K of every parameter outside the layer running now; a layer's parameters are gathered
for its forward and again for its backward (collection needs activation gradients only, and the
backward through the experts' matmuls needs the weights), except the last layer's, which stay
gathered from its forward to its backward, and each layer's forward prefetches the next layer.
The model is built on the meta device and each rank reads only its own rows of every tensor from
the checkpoint's safetensors (memory mapped, so ranks of one host share the page cache): host
memory per rank is its shard, whatever K.
Checkpoints stored per expert (`experts.<e>.gate_proj.weight`, which transformers fuses on load)
are fused here too, from the rank's own experts only, with transformers' own conversion rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as tdist
from torch import nn

from moe_attrib.errors import MoeAttribError
from moe_attrib.model.discovery import decoder_layers as find_decoder_layers
from moe_attrib.model.distributed import Dist


class ShardingError(MoeAttribError, ValueError):
    """A model or checkpoint that `--fsdp` cannot shard or load shard by shard."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (`moe_attrib.model.discovery.decoder_layers`): one FSDP unit each."""
    try:
        return find_decoder_layers(model)
    except ValueError as err:
        raise ShardingError(f"{err} --fsdp shards one decoder layer per unit.") from err


def shard_model(model: nn.Module, dist: Dist, keep_gathered: int = 1, prefetch: bool = True) -> nn.Module:
    """`fully_shard` every decoder layer, then the root, over all ranks (in place; returns `model`).

    A layer is gathered for its forward and, after resharding, again for its backward; the last
    `keep_gathered` layers instead keep their gathered parameters from their forward to their backward
    (one all-gather fewer per step and layer, at the memory of that many gathered layers between the
    two: the last layer's backward comes right after the head's, so keeping it costs little).
    `prefetch`: each layer's forward starts the next layer's all-gather, so that communication overlaps
    the layer's compute (two layers gathered at a time, as the backward does by default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dist.device.type, (dist.world,))
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, reshard_after_forward=i < len(layers) - keep_gathered)
    fully_shard(model, mesh=mesh)
    if prefetch:
        for layer, following in zip(layers[:-1], layers[1:], strict=True):
            layer.set_modules_to_forward_prefetch([following])
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def is_dtensor(t: torch.Tensor) -> bool:
    """A parameter FSDP2 has sharded (a DTensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """Rows `[start, stop)` of dim 0 that this rank's shard of DTensor `t` holds (FSDP2: torch.chunk)."""
    from torch.distributed.tensor import Shard

    placements = t.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ShardingError(f"unexpected placement {placements} (FSDP2 shards dim 0).")
    mesh = t.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = t.shape[0]
    chunk = -(-rows // world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def sample_values(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`t.reshape(-1)[positions]` of a tensor that may be an FSDP2-sharded DTensor (gathered: only
    the sampled values travel, never the whole tensor). Every rank must call it, in the same order."""
    if not is_dtensor(t):
        return t.detach().reshape(-1)[positions.to(t.device)]
    start, stop = local_rows(t)
    per_row = t[0].numel() if t.dim() > 0 and t.shape[0] else 1
    local = t.to_local().detach().reshape(-1)
    lo, hi = start * per_row, stop * per_row
    mine = (positions >= lo) & (positions < hi)
    device = local.device
    values = torch.zeros(positions.numel(), dtype=torch.float64, device=device)
    values[mine.to(device)] = local[(positions[mine] - lo).to(device)].double()
    hits = mine.to(device=device, dtype=torch.float64)
    stacked = torch.stack([values, hits])
    gathered = [torch.empty_like(stacked) for _ in range(t.device_mesh.size())]
    tdist.all_gather(gathered, stacked, group=t.device_mesh.get_group())
    out = torch.zeros_like(values)
    for part in gathered:  # each position is held by one rank: pick it (sums would turn -0.0 into 0.0)
        out = torch.where(part[1] > 0, part[0], out)
    return out.to(t.dtype)


# -- loading ------------------------------------------------------------------------------------------
def _checkpoint_keys(directory: Path) -> dict[str, Path]:
    """Every tensor key of the checkpoint's safetensors files -> the file holding it."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: directory / f for k, f in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ShardingError(
            f"{directory}: no *.safetensors files; --fsdp reads checkpoints lazily from safetensors only "
            "(re-save the model with save_pretrained(safe_serialization=True))."
        )
    keys = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            keys.update(dict.fromkeys(fh.keys(), f))
    return keys


class _Reader:
    """Row slices of checkpoint tensors, read lazily from memory-mapped safetensors files."""

    def __init__(self, directory: Path):
        self.keys = _checkpoint_keys(directory)
        self.handles: dict[Path, object] = {}

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        from safetensors import safe_open

        f = self.keys[key]
        if f not in self.handles:
            self.handles[f] = safe_open(str(f), "pt")
        part = self.handles[f].get_slice(key)
        if start is None or not part.get_shape():
            return part[:]
        return part[start:stop]


class _Plan:
    """Where each model key comes from: a checkpoint key, or per-expert keys fused by a transformers
    `WeightConverter` (the same renaming transformers applies on load, `rename_source_key`)."""

    def __init__(self, model: nn.Module, reader: _Reader):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        meta = dict(model.state_dict())
        prefix = getattr(model, "base_model_prefix", None)
        self.direct: dict[str, str] = {}
        self.fused: dict[str, tuple[object, dict[str, dict[int, str]]]] = {}
        for ckpt in reader.keys:
            key, pattern = rename_source_key(ckpt, renamings, converters, prefix, meta)
            if key not in meta and ckpt in meta:
                key, pattern = ckpt, None
            if pattern is None:
                self.direct[key] = ckpt
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            sources = self.fused.setdefault(key, (converter, {}))[1]
            sources.setdefault(pattern, {})[_expert_number(ckpt, key)] = ckpt


def _expert_number(ckpt: str, fused: str) -> int:
    """The expert index in a per-expert checkpoint key: the first integer component after the
    layer's own numbers (`...layers.3.mlp.experts.17.w1.weight` -> 17 for `...layers.3.mlp.experts.gate_up_proj`)."""
    layer_numbers = [p for p in fused.split(".") if p.isdigit()]
    numbers = [p for p in ckpt.split(".") if p.isdigit()]
    return int(numbers[len(layer_numbers)])


def _fused_rows(key: str, plan: _Plan, start: int, stop: int, reader: _Reader, spec: str) -> torch.Tensor:
    """Rows `[start, stop)` (experts) of a fused parameter, from the rank's own per-expert tensors."""
    from transformers.core_model_loading import MergeModulelist

    converter, sources = plan.fused[key]
    ops = converter.operations
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        raise ShardingError(
            f"{spec}: {key} is made by {ops} from the checkpoint, which does not stack experts on dim 0 first, so "
            "--fsdp cannot read it expert by expert. Load this model without --fsdp."
        )
    inputs = {}
    for pattern in converter.source_patterns:
        per_expert = sources.get(pattern, {})
        missing = [e for e in range(start, stop) if e not in per_expert]
        if missing:
            raise ShardingError(f"{spec}: the checkpoint lacks experts {missing[:5]} of {pattern} (for {key}).")
        inputs[pattern] = [reader.rows(per_expert[e]) for e in range(start, stop)]
    values = inputs
    for op in ops:
        values = op.convert(values, source_patterns=converter.source_patterns, target_patterns=[key])
    (out,) = values.values()
    return out


def load_sharded(spec: str, dtype: torch.dtype, dist: Dist, keep_gathered: int = 1, prefetch: bool = True) -> nn.Module:
    """The model of `spec` sharded over the ranks: built on meta, each rank filling its own rows.

    `tiny:<family>` models are built whole on each rank (they are tiny) and then sharded.
    `keep_gathered` and `prefetch`: see `shard_model`."""
    if spec.startswith("tiny:"):
        from moe_attrib.model.zoo import tiny_model

        model = tiny_model(spec.split(":", 1)[1], dtype=dtype).to(dist.device)
        return shard_model(model, dist, keep_gathered, prefetch)
    directory = Path(spec)
    if not directory.is_dir():
        raise ShardingError(
            f"--fsdp loads local save_pretrained directories (safetensors) only; {spec!r} is not one "
            "(download it first, e.g. `hf download ORG/NAME --local-dir DIR`)."
        )
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # computed in __init__ (rotary tables)
    reader = _Reader(directory)
    plan = _Plan(model, reader)  # before sharding: transformers looks its rules up by the model's class
    shard_model(model, dist, keep_gathered, prefetch)
    model.to_empty(device=dist.device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        for key, target in model.state_dict().items():
            _fill(key, target, plan, reader, spec)
    return model.eval()


def _fill(key: str, target: torch.Tensor, plan: _Plan, reader: _Reader, spec: str) -> None:
    sharded = is_dtensor(target)
    start, stop = local_rows(target) if sharded else (None, None)
    local = target.to_local() if sharded else target
    if sharded and start == stop:
        return
    if key in plan.direct:
        values = reader.rows(plan.direct[key], start, stop)
    elif key in plan.fused:
        values = _fused_rows(key, plan, start or 0, target.shape[0] if stop is None else stop, reader, spec)
    else:
        raise ShardingError(
            f"{spec}: the checkpoint has no tensor for {key!r} (directly or through transformers' conversion "
            "rules), so --fsdp cannot load it. Check the checkpoint is complete, or load it without --fsdp."
        )
    if tuple(values.shape) != tuple(local.shape):
        raise ShardingError(
            f"{spec}: checkpoint tensor for {key!r} has shape {tuple(values.shape)} where this rank's shard "
            f"is {tuple(local.shape)} (rows {start}:{stop}); the checkpoint does not match its config."
        )
    local.copy_(values.to(local.dtype))
