"""Scoring: which training rows of an index most influenced each query.

A score is the inner product of a query's projected gradient with a training row, optionally
after EK-FAC preconditioning of the query (`g_q^T (F + damping)^-1 g_train`) and/or unit
normalisation (cosine). The index is read in row blocks, so it never has to fit in memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from moe_attrib.data import Example, collate, labels_for, token_batches
from moe_attrib.discovery import discover
from moe_attrib.ekfac import EKFAC
from moe_attrib.fingerprint import check_model, check_settings_match
from moe_attrib.index import Block, Index, column_plan, flatten_batch

UNDEFINED = torch.finfo(torch.float32).min  # rank of a non-finite score; reported as NaN
_EXPERT = re.compile(r"^(?P<layer>.+)\.expert_(?P<i>\d+)\.(?P<proj>[^.]+)\.(?P<key>weight|bias)$")


class ScoreError(ValueError):
    """Queries, index and factors that do not belong together."""


@dataclass
class Scores:
    """Top-k rows per query: `values [Q, k]`, `rows [Q, k]`, and optional per-block parts `[Q, k, blocks]`."""

    values: np.ndarray
    rows: np.ndarray
    parts: np.ndarray | None = None


def precondition_queries(
    queries: torch.Tensor, blocks: list[Block], ekfac: EKFAC, index_settings: dict
) -> torch.Tensor:
    """Apply EK-FAC (fitted in the index's projected space) to query rows `[Q, dim]`, block by block.

    Weight blocks are preconditioned with their module's factors (an expert block with its
    expert's slice); bias blocks are left as they are.
    """
    if ekfac.projection_dim != index_settings["projection_dim"] or ekfac.seed != index_settings["seed"]:
        raise ScoreError(
            f"EK-FAC factors were fitted with projection_dim={ekfac.projection_dim}, seed={ekfac.seed} but the index "
            f"uses projection_dim={index_settings['projection_dim']}, seed={index_settings['seed']}; refit with "
            "`moe-attrib ekfac --projection_dim P --seed S` matching the index."
        )
    out = queries.clone().double()
    for b in blocks:
        if not b.name.endswith(".weight"):
            continue
        m = _EXPERT.match(b.name)
        factor, expert = (f"{m['layer']}.{m['proj']}", int(m["i"])) if m else (b.name[: -len(".weight")], None)
        if factor not in ekfac.factors:
            raise ScoreError(f"no EK-FAC factor for {b.name}: fit EK-FAC with the index's modules and settings.")
        f = ekfac.factors[factor]
        if f.experts and expert is None:
            raise ScoreError(
                f"{b.name} sums a layer's experts (--expert_blocks sum), which cannot be preconditioned per "
                "expert: build the index with --expert_blocks separate to use EK-FAC."
            )
        grad = out[:, b.start : b.stop].reshape(-1, *b.shape)
        if expert is not None:
            qr, qc = (q[expert] for q in f.rows_cols)
            lam, damp = f.lam[expert], f.damping[expert]
        else:
            (qr, qc), lam, damp = f.rows_cols, f.lam, f.damping
        qr, qc, lam = qr.to(grad.device), qc.to(grad.device), lam.to(grad.device)
        rotated = qr.T @ grad @ qc
        out[:, b.start : b.stop] = (qr @ (rotated / (lam + damp.to(grad.device))) @ qc.T).reshape(grad.shape[0], -1)
    return out.float()


def score(
    index: Index,
    queries: torch.Tensor | np.ndarray,
    *,
    ekfac: EKFAC | None = None,
    unit_normalize: bool = False,
    top_k: int = 10,
    per_module: bool = False,
    block_rows: int = 65536,
    device: str | torch.device | None = None,
) -> Scores:
    """Top-k training rows for each query row (`[Q, dim]`, in the index's column layout)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    q = torch.as_tensor(np.asarray(queries), dtype=torch.float32)
    if q.ndim != 2 or q.shape[1] != index.gradients.shape[1]:
        raise ScoreError(f"queries have shape {tuple(q.shape)}, the index has {index.gradients.shape[1]} columns.")
    blocks = index.blocks
    if ekfac is not None:
        check_settings_match(index.manifest["settings"], ekfac.settings, a_name=f"index {index.path}", b_name="EK-FAC")
        q = precondition_queries(q, blocks, ekfac, index.manifest["settings"])
    if unit_normalize:
        q = q / q.norm(dim=1, keepdim=True).clamp_min(1e-30)
    q = q.to(device)
    k = min(top_k, index.gradients.shape[0])
    best_v = torch.full((q.shape[0], k), -torch.inf, device=device)
    best_i = torch.zeros((q.shape[0], k), dtype=torch.long, device=device)
    for start in range(0, index.gradients.shape[0], block_rows):
        rows = torch.from_numpy(np.array(index.gradients[start : start + block_rows])).to(device)
        if unit_normalize:
            rows = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
        s = q @ rows.T
        s = s.masked_fill(~s.isfinite(), UNDEFINED)  # a NaN/inf row never ranks first (but above the -inf fill)
        v, i = torch.cat([best_v, s], dim=1).topk(k, dim=1)
        idx = torch.cat([best_i, torch.arange(start, start + rows.shape[0], device=device).expand(q.shape[0], -1)], 1)
        best_v, best_i = v, idx.gather(1, i)
    best_v = best_v.masked_fill(best_v == UNDEFINED, torch.nan)
    parts = None
    if per_module:
        hits = torch.from_numpy(np.array(index.gradients[np.sort(np.unique(best_i.cpu().numpy()))])).to(device)
        lookup = {int(r): n for n, r in enumerate(np.sort(np.unique(best_i.cpu().numpy())))}
        rows = hits[[lookup[int(r)] for r in best_i.reshape(-1)]].view(*best_i.shape, -1)
        if unit_normalize:
            rows = rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        prod = rows * q.unsqueeze(1)
        parts = torch.stack([prod[..., b.start : b.stop].sum(-1) for b in blocks], dim=-1).cpu().numpy()
    return Scores(best_v.cpu().numpy(), best_i.cpu().numpy(), parts)


def group_parts(parts: np.ndarray, blocks: list[Block]) -> dict[str, dict[str, float]]:
    """Per-layer and per-expert totals of one score's per-block parts."""
    layers: dict[str, float] = {}
    experts: dict[str, float] = {}
    for value, b in zip(parts, blocks, strict=True):
        m = _EXPERT.match(b.name)
        if m:
            key = f"{m['layer']}.expert_{m['i']}"
            experts[key] = experts.get(key, 0.0) + float(value)
        layer = re.sub(r"(layers\.\d+).*", r"\1", b.name)
        layers[layer] = layers.get(layer, 0.0) + float(value)
    return {"layers": layers, "experts": experts}


def query_gradients(
    model: torch.nn.Module, examples: list[Example], index: Index, *, pad_id: int = 0, token_batch_size: int = 8192
) -> torch.Tensor:
    """Query rows `[Q, dim]` computed with exactly the index's settings (projection, seed, modules, blocks).

    The model must be the one the index was built from (weights fingerprint, `FingerprintError`);
    a query whose gradient is not finite is a `ScoreError` naming it."""
    st = index.manifest["settings"]
    check_model(st, model, what=f"index {index.path}")
    report = discover(model, track_moe_experts=st["track_moe_experts"], filter_modules=st["filter_modules"], warn=False)
    blocks = column_plan(report, st["projection_dim"], st["expert_blocks"])
    if [(b.name, b.start, b.stop) for b in blocks] != [(b.name, b.start, b.stop) for b in index.blocks]:
        raise ScoreError(
            f"the model's tracked modules do not match the index {index.path} (built from {st.get('model')!r}); "
            "score with the model the index was built from."
        )
    device = next(model.parameters()).device
    out = torch.zeros(len(examples), blocks[-1].stop)
    from moe_attrib.build import make_collector

    with make_collector(model, report, st["projection_dim"], st["seed"], st.get("optimizer_state")) as collector:
        for positions in token_batches(examples, token_batch_size):
            ids, mask = collate(examples, positions, pad_id)
            labels = labels_for(examples, positions, ids, mask).to(device)
            grads = collector.collect(ids.to(device), mask.to(device), labels, fused_experts=True)
            out[positions] = torch.from_numpy(flatten_batch(grads, report, blocks, st["expert_blocks"]))
    bad = [examples[n].index for n in torch.nonzero(~out.isfinite().all(dim=1)).flatten().tolist()]
    if bad:
        raise ScoreError(f"queries {bad[:10]} (row numbers) have a non-finite gradient (NaN/inf); drop or fix them.")
    return out
