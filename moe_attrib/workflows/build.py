"""Build a gradient index over a dataset: batches -> collector -> on-disk rows (resumable, data parallel).

The batches run through the collection loop (`moe_attrib.collect.loop`: inputs prepared in a background
thread, CUDA graphs where they pay); each batch's rows, losses, counts and finiteness flags are formed
on the device and copied to pinned host memory asynchronously (`moe_attrib.collect.prefetch`), and a writer
thread stores finished batches, so the device computes the next batch meanwhile. The only host sync
per batch is the collector's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moe_attrib.collect.collector import GradientCollector, make_collector
from moe_attrib.collect.graphs import check_graphable, graphs_unavailable
from moe_attrib.collect.loop import CollectionLoop, Progress, Step
from moe_attrib.collect.prefetch import BackgroundWriter, HostCopy
from moe_attrib.collect.projection import check_kind
from moe_attrib.curvature.eigenbasis import DEFAULT_BUDGET, factors_fingerprint, parse_bytes, plan_eigenbasis
from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.data import Example, fingerprint, token_batches
from moe_attrib.errors import MoeAttribError
from moe_attrib.fingerprint import model_fingerprint
from moe_attrib.indexing.index import FORMAT_VERSION, IndexWriter, column_plan, part_dir, rows_of
from moe_attrib.model.discovery import discover
from moe_attrib.model.distributed import Dist
from moe_attrib.model.sharding import is_sharded
from moe_attrib.settings import (
    AUTO_MIN_BATCHES,
    SETTINGS_VERSION,
    CollectSettings,
    output_dims,
    own_output_dim,
    resolve,
)


class NonFiniteGradientError(MoeAttribError, ValueError):
    """An example whose loss or gradient is NaN/inf: it would poison every score it touches."""


def build_index(
    model: nn.Module,
    examples: list[Example],
    index: str | Path,
    settings: CollectSettings | None = None,
    *,
    model_name: str = "",
    ekfac: EKFAC | None = None,
    keep_factors: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    pad_id: int = 0,
    extra_settings: dict | None = None,
    dist: Dist | None = None,
    progress: bool = True,
    **overrides: Any,
) -> Path:
    """Per-example projected gradients of every example, one index row each (row = example index).

    How they are collected is `settings` (`moe_attrib.settings.CollectSettings`; its defaults when None);
    any of its fields may also be given as a keyword (`projection_dim=16`), a shortcut for
    `settings.replace(...)`. The fields are described below by name.

    Batches are formed by token budget and written as they finish; with `resume=True` an
    interrupted build continues where it stopped. Under torchrun each rank takes every
    `world`-th batch and writes its own rows; rank 0 moves the finished index into place.
    With `attribute_tokens=True` there is one row per token (token t's share of its example's
    gradient; rows of example i are `token_offsets[i]:token_offsets[i + 1]`). `optimizer_state`
    (a torch optimizer state file or HF Trainer checkpoint) normalises gradients by the
    optimizer's second moments (see `moe_attrib.collect.normalizers`). `projection` is the kind of seeded
    projection (`moe_attrib.collect.projection`), recorded in the manifest settings.

    The manifest records the model's weights fingerprint (`moe_attrib.fingerprint`), taken here
    before any expansion. An example with a non-finite loss or gradient stops the build with a
    `NonFiniteGradientError` naming it. `overwrite=True` replaces an existing index at `index`
    (only its files); any other non-empty directory there is refused. `index_dtype` ("float32",
    "float16", "bfloat16") is how rows are stored (`moe_attrib.indexing.index`; docs/build.md). `recompute=True`
    keeps only each decoder layer's inputs for the backward and runs the layer again there: the same
    rows with far less activation memory, for one more forward per batch (`moe_attrib.model.recompute`).
    `cuda_graphs=True` replays unpadded batches of a shape seen before from a CUDA graph
    (`moe_attrib.collect.graphs`): the same rows at small token batches' GPU speed, for one step's activations
    kept per captured shape; padded batches and a shape's first batch run eagerly. The default (None)
    does so where it pays and can run: on CUDA, without recompute or sharding, for shapes of at least
    `AUTO_MIN_BATCHES` batches (fixed-length chunks); `False` never.

    With fitted `ekfac` factors the rows are stored in their eigenbasis (`moe_attrib.curvature.eigenbasis`):
    `budget` bytes per example (an int or a string such as "256KiB"; default `DEFAULT_BUDGET`)
    allocated over every block by the corrected eigenvalues, the factors' sketch (projection_dim,
    seed, kind) standing in for `projection_dim`, `seed` and `projection`; the manifest records the
    allocation and the factors' fingerprint, and `score` preconditions elementwise. `keep_factors` also
    writes the factors into the index directory (`factors.safetensors`, `ekfac.json`: what `build` does when it
    fits them itself), so `load_ekfac(index)` and `score` find them there.
    """
    from moe_attrib.version import __version__

    (st,) = resolve("build_index", overrides, settings, kinds=(CollectSettings,))
    track_moe_experts, filter_modules, expert_blocks = st.track_moe_experts, st.filter_modules, st.expert_blocks
    projection_dim, seed, projection, index_dtype = st.projection_dim, st.seed, st.projection, st.index_dtype
    token_batch_size, attribute_tokens, optimizer_state = st.token_batch_size, st.attribute_tokens, st.optimizer_state
    recompute, cuda_graphs, budget = st.recompute, st.cuda_graphs, st.budget
    check_kind(projection)
    dist = dist or Dist(0, 1, next(model.parameters()).device)
    graph_min_batches = 0  # batches of one shape that earn it a graph; 0: no graphs
    if cuda_graphs:
        check_graphable(dist.device, recompute, is_sharded(model))
        graph_min_batches = 2  # asked for: any shape seen twice
    elif cuda_graphs is None and graphs_unavailable(dist.device, recompute, is_sharded(model)) is None:
        graph_min_batches = AUTO_MIN_BATCHES
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
    plan = None
    if ekfac is not None:
        budget = parse_bytes(DEFAULT_BUDGET if budget is None else budget)
        check_eigenbasis(ekfac, weights, expert_blocks, optimizer_state)
        plan = plan_eigenbasis(report, ekfac, budget, index_dtype)
        projection_dim, seed, projection = ekfac.projection_dim, ekfac.seed, ekfac.projection
        output_projection_dim, target_dims = ekfac.output_projection_dim, ekfac.target_dims(report)
        blocks = plan.blocks
        if not blocks:
            raise ValueError(f"a budget of {budget} bytes per example buys no column in {index_dtype}.")
    elif budget is not None or keep_factors:
        raise ValueError("budget= and keep_factors= are for an eigenbasis index: pass its factors, ekfac=.")
    else:
        output_projection_dim = own_output_dim(projection_dim, st.output_projection_dim)
        target_dims = output_dims(report.output_layer, projection_dim, output_projection_dim)
        blocks = column_plan(report, projection_dim, expert_blocks, projection, target_dims)
    batches = token_batches(examples, token_batch_size)
    layers = len(report.experts) if track_moe_experts else 0
    width = max((lay.num_experts for lay in report.experts), default=0) if track_moe_experts else 0
    settings = {
        "model": model_name,
        "model_fingerprint": weights,
        "data_fingerprint": fingerprint(examples),
        "rows": len(examples),
        "projection_dim": projection_dim,
        "output_projection_dim": output_projection_dim,
        "seed": seed,
        "projection": projection,
        "expert_blocks": expert_blocks,
        "track_moe_experts": track_moe_experts,
        "filter_modules": filter_modules,
        "token_batch_size": token_batch_size,
        "attribute_tokens": attribute_tokens,
        "optimizer_state": str(optimizer_state) if optimizer_state else None,
        "dtype": str(next(model.parameters()).dtype),
        **(extra_settings or {}),
    }
    if plan is not None:
        settings["eigenbasis"] = plan.settings(budget, factors_fingerprint(ekfac))
    lengths = np.array([len(ex.input_ids) for ex in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]) if attribute_tokens else None
    num_rows = int(offsets[-1]) if attribute_tokens else len(examples)
    manifest = {
        "format_version": FORMAT_VERSION,
        "settings_version": SETTINGS_VERSION,
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
    # errors here leave no DIR.part
    if plan is not None:
        collector = GradientCollector(model, report, projector=plan.projector, recompute=recompute)
    else:
        collector = make_collector(
            model, report, projection_dim, seed, optimizer_state, projection, recompute, target_dims
        )
    if dist.is_main:
        writer = IndexWriter(
            index, manifest, resume=resume, token_offsets=offsets, overwrite=overwrite, index_dtype=index_dtype, **shape
        )
        if plan is not None:
            plan.save(writer.dir)
        if keep_factors and not (writer.dir / "ekfac.json").exists():  # a resumed build has them already
            ekfac.save(writer.dir)
    dist.barrier()
    if not dist.is_main:
        writer = IndexWriter(index, manifest, create=False, index_dtype=index_dtype, **shape)

    loop = CollectionLoop(examples, batches, dist, pad_id=pad_id, done=writer.is_done)

    def store(b: int, members: np.ndarray, rows: np.ndarray, copy: HostCopy, counts_shape: tuple) -> None:
        grads, meta = copy.numpy()  # waits for this batch's device-to-host copy (writer thread)
        n = len(members)
        check_finite(meta[n : 2 * n] > 0, [examples[i].index for i in members], index)
        writer.write(b, members, rows, grads, meta[:n], meta[2 * n :].reshape(counts_shape))

    def write(step: Step, out) -> None:
        """Form a batch's rows and flags on the device, start their copy to the host, queue the write."""
        members = np.asarray(step.positions)
        grads = rows_of(out, report, blocks, expert_blocks, attribute_tokens, plan)
        n = len(members)
        finite = torch.isfinite(grads.view(n, -1)).all(dim=1) & torch.isfinite(out.losses)
        if attribute_tokens:
            width_s = grads.shape[1]
            take = np.concatenate([k * width_s + np.arange(lengths[i]) for k, i in enumerate(members)])
            grads = grads.view(-1, grads.shape[-1]).index_select(0, torch.from_numpy(take).to(grads.device))
            rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members])
        else:
            rows = members
        counts = out.expert_counts if layers else out.losses.new_zeros(n, 0, 0)
        meta = torch.cat([out.losses.float(), finite.float(), counts.float().reshape(-1)])
        copy = HostCopy([grads, meta])  # overlaps the next batch's forward
        b, shape = step.number, tuple(counts.shape)
        background.submit(lambda: store(b, members, rows, copy, shape))

    with collector, BackgroundWriter() as background:
        loop.run(
            collector,
            write,
            progress=Progress("build", tokens=True) if progress else None,
            graph_min_batches=graph_min_batches,
            fused_experts=True,
            attribute_tokens=attribute_tokens,
            expert_blocks=expert_blocks,
        )
    dist.barrier()
    final = Path(index)
    if dist.is_main:
        final = writer.finish()
    dist.barrier()
    return final


def check_eigenbasis(ekfac: EKFAC, weights: str, expert_blocks: str, optimizer_state: str | None) -> None:
    """An eigenbasis build that cannot run as asked: a clear error before any work."""
    if expert_blocks != "separate":
        raise ValueError("an eigenbasis index keeps every expert's directions apart: use --expert_blocks separate.")
    if optimizer_state:
        raise ValueError("--optimizer_state cannot be combined with an eigenbasis index (--ekfac); leave one out.")
    fitted = ekfac.settings.get("model_fingerprint")
    if fitted and fitted != weights:
        raise ValueError(
            f"the EK-FAC factors were fitted on other model weights ({fitted[:12]} vs {weights[:12]}); fit them "
            "with the model the index is built from."
        )


def check_finite(finite: np.ndarray, example_ids: list[int], index: str | Path) -> None:
    """Raise `NonFiniteGradientError` naming the examples whose `finite` flag (loss and gradient row) is False."""
    if finite.all():
        return
    bad = [example_ids[n] for n in np.flatnonzero(~finite)]
    raise NonFiniteGradientError(
        f"example(s) {bad[:10]} (row numbers of the data) have a non-finite loss or gradient (NaN/inf), which "
        "would rank first or poison scores. Drop those rows or load the model in --precision fp32, then delete "
        f"{part_dir(index)} and build again."
    )
