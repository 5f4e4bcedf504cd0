"""Scoring: which training rows of an index most influenced each query.

A score is the inner product of a query's projected gradient with a training row, optionally
after EK-FAC preconditioning of the query (`g_q^T (F + damping)^-1 g_train`), the cross-module
coupling (`moe_attrib.scoring.coupling`, on by default), unit normalisation (cosine) and the output-layer
balance (`moe_attrib.scoring.balance`, on by default). The index is streamed in row blocks
(`moe_attrib.indexing.stream`: threaded reads, pinned double buffers, copies overlapped with the
arithmetic), so it never has to fit in memory; the running top-k stays on the device and is read
back once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_attrib.collect.collector import GradientCollector, make_collector
from moe_attrib.collect.loop import CollectionLoop, Step
from moe_attrib.collect.projection import projection_kind
from moe_attrib.curvature.eigenbasis import index_plan
from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.curvature.ihvp import RefinedQueries
from moe_attrib.curvature.precondition import (
    EXPERT_BLOCK,
    ScoreError,
    module_blocks,
    module_columns,
    precondition_queries,
)
from moe_attrib.data import Example, token_batches
from moe_attrib.fingerprint import check_model, check_settings_match
from moe_attrib.indexing.index import Block, Index, column_plan, rows_of
from moe_attrib.indexing.stream import DEFAULT_READER, ToHost, stream_rows
from moe_attrib.model.discovery import discover
from moe_attrib.model.distributed import Dist
from moe_attrib.scoring.balance import Balance, resolve_balance
from moe_attrib.scoring.coupling import Coupling, resolve_coupling
from moe_attrib.settings import DEFAULT_BALANCE, DEFAULT_COUPLING, DEFAULT_UNIT_NORMALIZE, ScoreSettings, resolve

__all__ = [
    "Balance",
    "Coupling",
    "RefinedQueries",
    "ScoreError",
    "Scores",
    "precondition_queries",
    "prepare_queries",
    "query_gradients",
    "score",
    "score_matrix",
]
UNDEFINED = torch.finfo(torch.float32).min  # rank of a non-finite score; reported as NaN


@dataclass
class Scores:
    """Top-k rows per query: `values [Q, k]`, `rows [Q, k]`, and optional per-block parts `[Q, k, blocks]`."""

    values: np.ndarray
    rows: np.ndarray
    parts: np.ndarray | None = None


def prepare_queries(
    index: Index,
    queries: torch.Tensor | np.ndarray | RefinedQueries,
    *,
    ekfac: EKFAC | None = None,
    unit_normalize: bool = False,
    modules: str | None = None,
    coupling: Coupling | str | None = None,
    balance: Balance | str | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """Query rows as they are multiplied with the index: EK-FAC preconditioned, restricted to the
    blocks matching `modules` (other columns zero), coupled across modules (`coupling`: a fitted
    `Coupling`, "auto" to fit one here on `device`, None for none), unit-normalised, and with the
    output layer's vote balanced against the whole model's (`balance`: a fitted `Balance`, "auto",
    None; never with `modules`); on the CPU. `RefinedQueries` (`moe_attrib.curvature.ihvp.refine_queries`) are
    already preconditioned: they are only restricted and unit-normalised (no EK-FAC, coupling or
    balance: "auto" means none for them, anything else is a `ScoreError`)."""
    if isinstance(queries, RefinedQueries):
        queries = _refined_rows(index, queries, ekfac, coupling, balance)
        ekfac, coupling, balance = None, None, None
    q = (
        queries.detach().float().cpu()
        if isinstance(queries, torch.Tensor)
        else torch.as_tensor(np.asarray(queries), dtype=torch.float32)
    )
    if q.ndim != 2 or q.shape[1] != index.gradients.shape[1]:
        raise ScoreError(f"queries have shape {tuple(q.shape)}, the index has {index.gradients.shape[1]} columns.")
    mask = module_columns(index.blocks, modules)
    if ekfac is not None:
        check_settings_match(index.manifest["settings"], ekfac.settings, a_name=f"index {index.path}", b_name="EK-FAC")
        q = precondition_queries(q, module_blocks(index.blocks, modules), ekfac, index.manifest["settings"])
    preconditioned = q
    if mask is not None:
        q = q * mask
    coupling = resolve_coupling(
        index, coupling, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, device=device, progress=progress
    )
    balance = resolve_balance(
        index, balance, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, coupling=coupling, device=device,
        progress=progress,
    )  # fmt: skip
    if coupling is not None:
        q = coupling.apply(q)
    if unit_normalize:
        q = q / q.norm(dim=1, keepdim=True).clamp_min(1e-30)
    if balance is not None:
        q = balance.apply(q, preconditioned)
    return q


def _refined_rows(index: Index, refined: RefinedQueries, ekfac, coupling, balance) -> torch.Tensor:
    """The rows of refined queries, refused with anything that would precondition them again."""
    if str(index.path) != refined.index_path:
        raise ScoreError(f"these refined queries were projected for the index {refined.index_path}, not {index.path}.")
    if ekfac is not None:
        raise ScoreError("refined queries already hold (G + damping)^-1 q: score them with ekfac=None.")
    for name, value in (("coupling", coupling), ("balance", balance)):
        if value is not None and not (isinstance(value, str) and value == "auto"):
            raise ScoreError(f"refined queries take no {name} (the solve already includes cross-module curvature).")
    return refined.rows


def row_blocks(
    index: Index,
    device: torch.device,
    block_bytes: int,
    unit_normalize: bool,
    progress: bool = False,
    modules: str | None = None,
    *,
    block_rows: int | None = None,
    threads: int | None = None,
    reader: str = DEFAULT_READER,
):
    """`(start, rows)` over the index in blocks of at most `block_bytes` stored bytes (or `block_rows`
    rows), float32 rows on `device` (restricted to the `modules` blocks and unit-normalised over
    them when asked). A block is valid until the next is asked for (`moe_attrib.indexing.stream`)."""
    mask = module_columns(index.blocks, modules)
    mask = None if mask is None else mask.to(device)
    stream = stream_rows(
        index, device, block_bytes=block_bytes, block_rows=block_rows, threads=threads, reader=reader, progress=progress
    )
    for start, rows in stream:
        yield start, _as_scored(rows, mask, unit_normalize)


def _as_scored(rows: torch.Tensor, mask: torch.Tensor | None, unit_normalize: bool) -> torch.Tensor:
    """Index rows as they are multiplied with the queries: restricted to `mask`, unit-normalised."""
    if mask is not None:
        rows = rows * mask
    if unit_normalize:
        rows = rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return rows


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _redamped(ekfac: EKFAC | None, st: ScoreSettings) -> EKFAC | None:
    """`ekfac` re-damped as `st` says (`damping`, `damping_scope`); refused without factors to damp."""
    if st.damping is None and st.damping_scope is None:
        return ekfac
    if ekfac is None:
        raise ScoreError(
            f"damping={st.damping} / damping_scope={st.damping_scope} re-damp EK-FAC factors: pass ekfac= too "
            "(without factors there is nothing to damp)."
        )
    return ekfac.redamped(st.damping, st.damping_scope)


def score(
    index: Index,
    queries: torch.Tensor | np.ndarray | RefinedQueries,
    settings: ScoreSettings | None = None,
    *,
    ekfac: EKFAC | None = None,
    coupling: Coupling | str | None = DEFAULT_COUPLING,
    balance: Balance | str | None = DEFAULT_BALANCE,
    device: str | torch.device | None = None,
    progress: bool = False,
    **overrides: Any,
) -> Scores:
    """Top-k training rows for each query row (`[Q, dim]`, in the index's column layout).

    The index is streamed in blocks of `block_bytes` stored bytes (or `block_rows` rows) with a
    running top-k on the device, so memory stays bounded whatever the index size; `threads` and
    `reader` tune the reads (`moe_attrib.indexing.stream`). `modules` (a glob over block names) scores
    through those blocks only. `coupling` ("auto": fitted here from the index's rows; a `Coupling`
    from `fit_coupling` to reuse one; None: off) adds the cross-module correction, `balance`
    ("auto", a `Balance` from `fit_balance`, None) the output-layer balance. `queries` may be
    `RefinedQueries` (`moe_attrib.curvature.ihvp.refine_queries`), scored as they are (`ekfac=None`).

    `settings` (`moe_attrib.settings.ScoreSettings`) gives `unit_normalize`, `modules`, `top_k`,
    `per_module` and the streaming (`block_bytes`, `block_rows`, `threads`, `reader`); each may also be
    given as a keyword shortcut (`top_k=5`). Its coupling fields are `score_queries`' (this function
    takes a fitted `coupling`).
    """
    (st,) = resolve("score", overrides, settings, kinds=(ScoreSettings,))
    ekfac = _redamped(ekfac, st)
    unit_normalize, modules, top_k, per_module = st.unit_normalize, st.modules, st.top_k, st.per_module
    block_bytes, block_rows, threads, reader = st.block_bytes, st.block_rows, st.threads, st.reader
    device = _device(device)
    q = prepare_queries(
        index, queries, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, coupling=coupling, balance=balance,
        device=device, progress=progress,
    ).to(device)  # fmt: skip
    k = min(top_k, index.gradients.shape[0])
    best_v = torch.full((q.shape[0], k), -torch.inf, device=device)
    best_i = torch.zeros((q.shape[0], k), dtype=torch.long, device=device)
    opts = dict(block_rows=block_rows, threads=threads, reader=reader)
    for start, rows in row_blocks(index, device, block_bytes, unit_normalize, progress, modules, **opts):
        s = q @ rows.T
        s = s.masked_fill(~s.isfinite(), UNDEFINED)  # a NaN/inf row never ranks first (but above the -inf fill)
        v, i = torch.cat([best_v, s], dim=1).topk(k, dim=1)
        idx = torch.cat([best_i, torch.arange(start, start + rows.shape[0], device=device).expand(q.shape[0], -1)], 1)
        best_v, best_i = v, idx.gather(1, i)
    best_v = best_v.masked_fill(best_v == UNDEFINED, torch.nan)
    parts = _parts(index, q, best_i, unit_normalize, modules, device) if per_module else None
    return Scores(best_v.cpu().numpy(), best_i.cpu().numpy(), parts)


def _parts(index: Index, q: torch.Tensor, hit: torch.Tensor, unit_normalize: bool, modules: str | None, device):
    """Per-block parts `[Q, k, blocks]` of prepared queries `q` against index rows `hit` `[Q, k]`."""
    hit_rows = np.sort(np.unique(hit.cpu().numpy()))
    hits = torch.from_numpy(index.read_rows(hit_rows)).to(device)
    lookup = {int(r): n for n, r in enumerate(hit_rows)}
    rows = hits[[lookup[int(r)] for r in hit.reshape(-1)]].view(*hit.shape, -1)
    mask = module_columns(index.blocks, modules)
    rows = _as_scored(rows, None if mask is None else mask.to(device), unit_normalize)
    prod = rows * q.unsqueeze(1)
    return torch.stack([prod[..., b.start : b.stop].sum(-1) for b in index.blocks], dim=-1).cpu().numpy()


def hit_parts(
    index: Index,
    queries: torch.Tensor | np.ndarray,
    rows: np.ndarray,
    *,
    ekfac: EKFAC | None = None,
    unit_normalize: bool = DEFAULT_UNIT_NORMALIZE,
    modules: str | None = None,
    coupling: Coupling | str | None = DEFAULT_COUPLING,
    balance: Balance | str | None = DEFAULT_BALANCE,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> np.ndarray:
    """Per-block parts `[Q, k, blocks]` of each query's score against the index rows `rows` `[Q, k]`
    (what `score(per_module=True)` gives for its own top-k rows), e.g. for rows ranked elsewhere."""
    device = _device(device)
    q = prepare_queries(
        index, queries, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, coupling=coupling, balance=balance,
        device=device, progress=progress,
    ).to(device)  # fmt: skip
    return _parts(index, q, torch.as_tensor(np.asarray(rows), device=device), unit_normalize, modules, device)


def score_matrix(
    index: Index,
    queries: torch.Tensor | np.ndarray | RefinedQueries,
    settings: ScoreSettings | None = None,
    *,
    ekfac: EKFAC | None = None,
    coupling: Coupling | str | None = DEFAULT_COUPLING,
    balance: Balance | str | None = DEFAULT_BALANCE,
    out: str | Path | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
    **overrides: Any,
) -> np.ndarray:
    """Every score: `[Q, rows]` float32, streamed over the index in blocks of `block_bytes` stored
    bytes (or `block_rows` rows), as `score` streams it.

    With `out` (a `.npy` path) the matrix is written to a memory-mapped file as it is computed
    and returned memory-mapped, so neither the index nor the scores need to fit in memory. On
    CUDA each block's scores come back through a pinned buffer while the next block is scored.
    `settings` and keyword shortcuts as for `score` (`top_k` and `per_module` do not apply).
    """
    (st,) = resolve("score_matrix", overrides, settings, kinds=(ScoreSettings,))
    ekfac = _redamped(ekfac, st)
    unit_normalize, modules = st.unit_normalize, st.modules
    block_bytes, block_rows, threads, reader = st.block_bytes, st.block_rows, st.threads, st.reader
    device = _device(device)
    q = prepare_queries(
        index, queries, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, coupling=coupling, balance=balance,
        device=device, progress=progress,
    ).to(device)  # fmt: skip
    shape = (q.shape[0], index.gradients.shape[0])
    if out is None:
        result = np.empty(shape, dtype=np.float32)
    else:
        result = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=shape)
    back = ToHost(device)
    opts = dict(block_rows=block_rows, threads=threads, reader=reader)
    for start, rows in row_blocks(index, device, block_bytes, unit_normalize, progress, modules, **opts):
        for at, values in back.push(start, q @ rows.T):
            result[:, at : at + values.shape[1]] = values
    for at, values in back.drain():
        result[:, at : at + values.shape[1]] = values
    if out is not None:
        result.flush()
    return result


def group_parts(parts: np.ndarray, blocks: list[Block]) -> dict[str, dict[str, float]]:
    """Per-layer and per-expert totals of one score's per-block parts."""
    layers: dict[str, float] = {}
    experts: dict[str, float] = {}
    for value, b in zip(parts, blocks, strict=True):
        m = EXPERT_BLOCK.match(b.name)
        if m:
            key = f"{m['layer']}.expert_{m['i']}"
            experts[key] = experts.get(key, 0.0) + float(value)
        layer = re.sub(r"(layers\.\d+).*", r"\1", b.name)
        layers[layer] = layers.get(layer, 0.0) + float(value)
    return {"layers": layers, "experts": experts}


def query_gradients(
    model: torch.nn.Module,
    examples: list[Example],
    index: Index,
    *,
    pad_id: int = 0,
    token_batch_size: int = 8192,
    with_counts: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, np.ndarray | None]:
    """Query rows `[Q, dim]` computed with exactly the index's settings (projection, seed, modules, blocks).

    The model must be the one the index was built from (weights fingerprint, `FingerprintError`);
    a query whose gradient is not finite is a `ScoreError` naming it. With `with_counts`, also the
    tokens each query routes to each expert, `[Q, layers, E]` in the index's `expert_layers` order
    (what `index.expert_counts` holds for training rows; None for an index without expert layers),
    from the same pass."""
    recorded, st = index.manifest["settings"], index.settings.collect  # raw: for the checks that take either kind
    check_model(recorded, model, what=f"index {index.path}")
    report = discover(model, track_moe_experts=st.track_moe_experts, filter_modules=st.filter_modules, warn=False)
    kind = projection_kind(recorded)
    plan = index_plan(index.path, recorded, report)  # None: seeded projections
    target_dims = st.target_dims(report.output_layer)
    blocks = plan.blocks if plan else column_plan(report, st.projection_dim, st.expert_blocks, kind, target_dims)
    if [(b.name, b.start, b.stop) for b in blocks] != [(b.name, b.start, b.stop) for b in index.blocks]:
        raise ScoreError(
            f"the model's tracked modules do not match the index {index.path} (built from {index.settings.model!r}); "
            "score with the model the index was built from."
        )
    device = next(model.parameters()).device
    out = torch.zeros(len(examples), blocks[-1].stop)
    layers = index.manifest.get("expert_layers") or []
    counts = np.zeros((len(examples), len(layers), index.expert_counts.shape[2]), np.float32) if layers else None
    if plan is not None:
        collector = GradientCollector(model, report, projector=plan.projector)
    else:
        collector = make_collector(
            model, report, st.projection_dim, st.seed, st.optimizer_state, kind, target_dims=target_dims
        )

    def keep(step: Step, grads) -> None:
        positions = step.positions
        out[positions] = rows_of(grads, report, blocks, st.expert_blocks, False, plan).cpu()
        if counts is not None:
            got = grads.expert_counts.float().cpu().numpy()
            for j, name in enumerate(grads.expert_layers):
                if name in layers:
                    counts[positions, layers.index(name), : got.shape[2]] = got[:, j]

    loop = CollectionLoop(examples, token_batches(examples, token_batch_size), Dist(0, 1, device), pad_id=pad_id)
    with collector:
        loop.run(collector, keep, fused_experts=True)
    bad = [examples[n].index for n in torch.nonzero(~out.isfinite().all(dim=1)).flatten().tolist()]
    if bad:
        raise ScoreError(f"queries {bad[:10]} (row numbers) have a non-finite gradient (NaN/inf); drop or fix them.")
    return (out, counts) if with_counts else out
