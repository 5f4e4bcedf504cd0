"""Build a gradient index over a dataset: batches -> collector -> on-disk rows (resumable, data parallel)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
from torch import nn
from tqdm.auto import tqdm

from moe_attrib.collector import GradientCollector
from moe_attrib.data import Example, collate, fingerprint, labels_for, token_batches
from moe_attrib.discovery import discover
from moe_attrib.distributed import Dist
from moe_attrib.fingerprint import model_fingerprint
from moe_attrib.index import FORMAT_VERSION, IndexWriter, column_plan, flatten_batch, part_dir


class NonFiniteGradientError(ValueError):
    """An example whose loss or gradient is NaN/inf: it would poison every score it touches."""


def make_collector(model: nn.Module, report, projection_dim: int, seed: int, optimizer_state: str | None):
    """The collector an index is built with: seeded projections, optimizer-normalised if asked."""
    if not optimizer_state:
        return GradientCollector(model, report, projection_dim=projection_dim, seed=seed)
    from moe_attrib.normalizers import Normalizer, load_optimizer_state

    normalizer = Normalizer(model, report, load_optimizer_state(optimizer_state, model))
    return GradientCollector(model, report, projector=normalizer.projector(projection_dim, seed))


def build_index(
    model: nn.Module,
    examples: list[Example],
    index: str | Path,
    *,
    model_name: str = "",
    track_moe_experts: bool = True,
    projection_dim: int = 16,
    seed: int = 0,
    expert_blocks: str = "separate",
    token_batch_size: int = 8192,
    filter_modules: str | None = None,
    attribute_tokens: bool = False,
    optimizer_state: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    index_dtype: str = "float32",
    pad_id: int = 0,
    extra_settings: dict | None = None,
    dist: Dist | None = None,
    progress: bool = True,
) -> Path:
    """Per-example projected gradients of every example, one index row each (row = example index).

    Batches are formed by token budget and written as they finish; with `resume=True` an
    interrupted build continues where it stopped. Under torchrun each rank takes every
    `world`-th batch and writes its own rows; rank 0 moves the finished index into place.
    With `attribute_tokens=True` there is one row per token (token t's share of its example's
    gradient; rows of example i are `token_offsets[i]:token_offsets[i + 1]`). `optimizer_state`
    (a torch optimizer state file or HF Trainer checkpoint) normalises gradients by the
    optimizer's second moments (see `moe_attrib.normalizers`).

    The manifest records the model's weights fingerprint (`moe_attrib.fingerprint`), taken here
    before any expansion. An example with a non-finite loss or gradient stops the build with a
    `NonFiniteGradientError` naming it. `overwrite=True` replaces an existing index at `index`
    (only its files); any other non-empty directory there is refused. `index_dtype` ("float32",
    "float16", "bfloat16") is how rows are stored (`moe_attrib.index`; docs/build.md).
    """
    from moe_attrib.version import __version__

    dist = dist or Dist(0, 1, next(model.parameters()).device)
    weights = model_fingerprint(model)
    report = discover(model, track_moe_experts=track_moe_experts, filter_modules=filter_modules, warn=dist.is_main)
    if track_moe_experts and not report.experts and dist.is_main:
        warnings.warn(
            "moe-attrib: --track_moe_experts: this model has no fused experts modules; building a dense index.",
            UserWarning,
            stacklevel=2,
        )
    if not report.targets:
        raise ValueError(f"no module to attribute (filter_modules={filter_modules!r} matched nothing?)")
    blocks = column_plan(report, projection_dim, expert_blocks)
    batches = token_batches(examples, token_batch_size)
    layers = len(report.experts) if track_moe_experts else 0
    width = max((lay.num_experts for lay in report.experts), default=0) if track_moe_experts else 0
    settings = {
        "model": model_name,
        "model_fingerprint": weights,
        "data_fingerprint": fingerprint(examples),
        "rows": len(examples),
        "projection_dim": projection_dim,
        "seed": seed,
        "expert_blocks": expert_blocks,
        "track_moe_experts": track_moe_experts,
        "filter_modules": filter_modules,
        "token_batch_size": token_batch_size,
        "attribute_tokens": attribute_tokens,
        "optimizer_state": str(optimizer_state) if optimizer_state else None,
        "dtype": str(next(model.parameters()).dtype),
        **(extra_settings or {}),
    }
    lengths = np.array([len(ex.input_ids) for ex in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]) if attribute_tokens else None
    num_rows = int(offsets[-1]) if attribute_tokens else len(examples)
    manifest = {
        "format_version": FORMAT_VERSION,
        "moe_attrib_version": __version__,
        "complete": False,
        "rows": num_rows,
        "examples": len(examples),
        "dim": blocks[-1].stop,
        "settings": settings,
        "coverage": report.coverage,
        "blocks": [{"name": b.name, "start": b.start, "stop": b.stop, "shape": list(b.shape)} for b in blocks],
        "expert_layers": [lay.name for lay in report.experts] if track_moe_experts else [],
        "example_ids": [ex.index for ex in examples],
        "num_batches": len(batches),
    }
    shape = dict(
        rows=num_rows,
        dim=blocks[-1].stop,
        layers=layers,
        experts=width,
        num_batches=len(batches),
        examples=len(examples),
    )
    collector = make_collector(model, report, projection_dim, seed, optimizer_state)  # setup errors: no DIR.part
    collector.exact_lengths = dist.fsdp  # no per-rank retry of a batch: ranks of a sharded model run in lockstep
    if dist.is_main:
        writer = IndexWriter(
            index, manifest, resume=resume, token_offsets=offsets, overwrite=overwrite, index_dtype=index_dtype, **shape
        )
    dist.barrier()
    if not dist.is_main:
        writer = IndexWriter(index, manifest, create=False, index_dtype=index_dtype, **shape)

    mine = [b for b in range(len(batches)) if b % dist.world == dist.rank and not writer.is_done(b)]
    tokens = sum(len(examples[i].input_ids) for b in mine for i in batches[b])
    bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc=f"build rank {dist.rank}", disable=not progress)
    start = time.perf_counter()
    with collector:
        for b, real in dist.lockstep(mine, filler=0):
            ids, mask = collate(examples, batches[b], pad_id)
            out = collector.collect(
                ids.to(dist.device),
                mask.to(dist.device),
                labels_for(examples, batches[b], ids, mask).to(dist.device),
                fused_experts=True,
                per_token=attribute_tokens,
                expert_blocks=expert_blocks,
            )
            if not real:  # a sharded model's filler step (see Dist.lockstep)
                continue
            grads = flatten_batch(out, report, blocks, expert_blocks, per_token=attribute_tokens)
            members = np.asarray(batches[b])
            check_finite(grads, out.losses.float().cpu().numpy(), [examples[i].index for i in members], index)
            if attribute_tokens:
                rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members])
                grads = np.concatenate([grads[n, : lengths[i]] for n, i in enumerate(members)])
            else:
                rows = members
            counts = out.expert_counts.float().cpu().numpy() if layers else np.zeros((len(members), 0, 0), np.float32)
            writer.write(b, members, rows, grads, out.losses.float().cpu().numpy(), counts)
            bar.update(int(mask.sum()))
            bar.set_postfix(tok_s=f"{bar.n / max(time.perf_counter() - start, 1e-9):,.0f}")
    bar.close()
    dist.barrier()
    final = Path(index)
    if dist.is_main:
        final = writer.finish()
    dist.barrier()
    return final


def check_finite(grads: np.ndarray, losses: np.ndarray, example_ids: list[int], index: str | Path) -> None:
    """Raise `NonFiniteGradientError` naming the examples whose loss or gradient row is NaN/inf."""
    finite = np.isfinite(grads.reshape(len(example_ids), -1)).all(axis=1) & np.isfinite(losses)
    if finite.all():
        return
    bad = [example_ids[n] for n in np.flatnonzero(~finite)]
    raise NonFiniteGradientError(
        f"example(s) {bad[:10]} (row numbers of the data) have a non-finite loss or gradient (NaN/inf), which "
        "would rank first or poison scores. Drop those rows or load the model in --precision fp32, then delete "
        f"{part_dir(index)} and build again."
    )
