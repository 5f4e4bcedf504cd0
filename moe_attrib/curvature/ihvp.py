"""A refined inverse-Hessian-vector product: `(G + damping I)^-1 q` by preconditioned conjugate gradients.

EK-FAC inverts a block-diagonal, Kronecker-factored approximation of the Gauss-Newton matrix `G`;
it ignores every cross-module term and the error of the factorisation. This module solves with
the exact `G` instead, iteratively, with EK-FAC as the preconditioner (the recipe of ASTRA and of
preconditioned CG): each iteration is one exact GGN-vector product over the training batches.

- **Parameter space**: every tracked parameter (attention, each expert's slice of the fused experts,
  routers, `lm_head`, biases as the index keeps them), full size, unprojected. The query is its
  exact per-example gradient (`GradientCollector` without projection); the solution `u` is projected
  with the index's own projection (the linear map that takes a per-example gradient to its index
  columns) and scored against the stored rows as they are.
- **GGN-vector product**: `G v = 1/N sum_n J_n^T H_n J_n v` over the N training examples, `J_n` the
  Jacobian of example n's logits at its loss tokens, `H_n = diag(p) - p p^T` per token (the Hessian of
  the project's summed token cross-entropy; the loss tokens are those `moe_attrib.data.labels_for`
  gives). This is the true Fisher that EK-FAC estimates with sampled labels, on the same scale (a
  mean over examples), so a damping means the same for both. `J v` comes from the double-backward
  trick: `w(u) = J^T u` is built once per batch with `create_graph=True` and `J v = d<w(u), v>/du`;
  `J^T (H J v)` is a plain backward. No forward-mode AD is needed, so it runs through transformers'
  grouped-matmul experts (whose backward is again grouped matmuls). Attention runs with the
  math SDPA backend during these products: the fused attention kernels have no double backward.
- **Preconditioner**: EK-FAC factors fitted *without* projection (`fit_ekfac(..., projection_dim=None)`):
  factors fitted in an index's projected space cannot precondition a full-size vector. A block
  with no factor (a bias not folded into its weight, a module left out of the fit) gets the scaled
  identity `1 / (m + damping)`, `m` the mean corrected eigenvalue over all factors. Without factors
  the preconditioner is that scaled identity everywhere (plain CG).
- **Damping** is relative, as EK-FAC's: `damping x m`, `m` the mean eigenvalue of `G` (the mean
  corrected eigenvalue of the factors, which is `trace(G) / D` over the blocks they cover; without
  factors a Hutchinson estimate from one extra sweep).
- **Iterations**: CG starts from 0, so iteration 1 gives `alpha M^-1 q`, EK-FAC's answer up to a scale
  (the same cosine ranking); every further iteration adds one GGN product per query.

Cost per query: `iterations` GGN products, each a sweep over the training batches of a double
backward and a backward (the forward and the `J^T u` graph of a batch are shared by all queries).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from moe_attrib.collect.collector import GradientCollector
from moe_attrib.collect.projection import Projections, projection_kind
from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.curvature.precondition import ScoreError
from moe_attrib.data import Example, collate, labels_for, token_batches
from moe_attrib.fingerprint import check_model
from moe_attrib.indexing.index import Index, column_plan, flatten_rows
from moe_attrib.model.discovery import CoverageReport, Entry, discover, iter_entries
from moe_attrib.settings import DEFAULT_REFINE_DAMPING as DEFAULT_DAMPING  # noqa: F401 (re-exported)
from moe_attrib.settings import DEFAULT_REFINE_ITERATIONS as DEFAULT_ITERATIONS  # noqa: F401 (re-exported)
from moe_attrib.settings import RefineSettings, resolve

Vectors = list[torch.Tensor]  # one tensor per tracked parameter, each `[Q, *parameter shape]`


class RefineError(ScoreError):
    """A refinement that cannot run as asked (model, index or factors that do not fit it)."""


# -- the parameter space ---------------------------------------------------------------------------
def tracked_entries(model: nn.Module, report: CoverageReport) -> list[Entry]:
    """The tracked parameters in the index's plan order, checked for what the refinement supports."""
    entries = list(iter_entries(report.targets))
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding = getattr(embed, "weight", None)
    for e in entries:
        if e.target.kind == "grouped_linear":
            raise RefineError(f"{e.key}: grouped linears (deepseek_v4) are not supported by the refinement.")
        if embedding is not None and e.param is embedding:
            raise RefineError(
                f"{e.key} is tied to the input embeddings: its GGN would include the embedding's use, which the "
                "index's rows leave out; refinement needs untied output weights."
            )
    return entries


def _dot(a: Vectors, b: Vectors) -> torch.Tensor:
    """Per-query inner products `[Q]` of two vector lists."""
    return sum((x * y).flatten(1).sum(1) for x, y in zip(a, b, strict=True))


def _axpy(alpha: torch.Tensor, x: Vectors, y: Vectors) -> Vectors:
    """`y + alpha x` with a per-query `alpha` `[Q]`."""
    return [b + alpha.view(-1, *[1] * (a.dim() - 1)) * a for a, b in zip(x, y, strict=True)]


# -- Gauss-Newton-vector products ------------------------------------------------------------------
@contextlib.contextmanager
def _differentiable(model: nn.Module, params: list[nn.Parameter]):
    """Only `params` require grad, attention on the math SDPA backend (double-differentiable); restored on exit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        with sdpa_kernel([SDPBackend.MATH]), torch.enable_grad():
            yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class GaussNewton:
    """Exact GGN-vector products `G v` over training examples, `G = 1/N sum_n J_n^T H_n J_n` (module docstring).

    `examples` are the training rows the products average over (all of them, or a seeded subset
    from the caller); batches hold at most `token_batch_size` tokens (rows x longest length), and
    `vector_batch` vectors share one vmapped backward (their `[vectors, tokens, vocab]` products
    are held at once).
    """

    def __init__(
        self,
        model: nn.Module,
        entries: list[Entry],
        examples: list[Example],
        *,
        token_batch_size: int = 4096,
        pad_id: int = 0,
        vector_batch: int = 8,
        progress: bool = False,
    ):
        if not examples:
            raise RefineError("the Gauss-Newton products need at least one training example.")
        self.model, self.entries, self.examples = model, entries, examples
        self.params = [e.param for e in entries]
        self.batches = token_batches(examples, token_batch_size)
        self.pad_id, self.progress = pad_id, progress
        self.device = next(model.parameters()).device
        self.products = 0  # GGN products computed so far (one per vector per sweep)
        self.vector_batch = vector_batch
        self.batched = True  # vectors of a chunk in one vmapped backward; False after a failed try (warned)

    def _products(self, logits, dummy, jt, used, chunk, probs, dt) -> list[torch.Tensor]:
        """`J^T H J v` for one batch and a chunk of vectors `[C, *shape]`: one vmapped double backward and
        one vmapped backward for the chunk (`is_grads_batched`), or a loop over its vectors."""
        params = [self.params[j] for j in used]
        if self.batched:
            try:
                (jv,) = torch.autograd.grad([jt[j] for j in used], dummy, chunk, retain_graph=True,
                                            is_grads_batched=True)  # fmt: skip
                jv = jv.to(dt)
                hjv = probs * jv - probs * (probs * jv).sum(-1, keepdim=True)
                return list(torch.autograd.grad(logits, params, hjv.to(logits.dtype), retain_graph=True,
                                                is_grads_batched=True))  # fmt: skip
            except RuntimeError as err:  # an op without a batching rule: the same products one vector at a time
                warnings.warn(f"moe-attrib: GGN products one vector at a time ({err})", UserWarning, stacklevel=3)
                self.batched = False
        outs = [torch.zeros_like(c) for c in chunk]
        for i in range(chunk[0].shape[0]):
            (jv,) = torch.autograd.grad([jt[j] for j in used], dummy, [c[i] for c in chunk], retain_graph=True)
            jv = jv.to(dt)
            hjv = probs * jv - probs * (probs * jv).sum(-1, keepdim=True)
            for o, g in zip(outs, torch.autograd.grad(logits, params, hjv.to(logits.dtype), retain_graph=True),
                            strict=True):  # fmt: skip
                o[i] = g
        return outs

    def __call__(self, vectors: Vectors) -> Vectors:
        """`G v` for each of the Q vectors (`[Q, *shape]` per parameter), in the vectors' dtype."""
        q = vectors[0].shape[0]
        out = [torch.zeros_like(v) for v in vectors]
        with _differentiable(self.model, self.params):
            for positions in tqdm(self.batches, desc="GGN products", disable=not self.progress, leave=False):
                ids, mask = collate(self.examples, positions, self.pad_id)
                labels = labels_for(self.examples, positions, ids, mask).to(self.device)
                ids, mask = ids.to(self.device), mask.to(self.device)
                logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
                loss_tokens = (labels[:, 1:] != -100).unsqueeze(-1)
                dt = torch.promote_types(logits.dtype, torch.float32)  # H in float32 at least (float64 stays)
                probs = torch.softmax(logits.detach().to(dt), dim=-1) * loss_tokens
                dummy = torch.zeros_like(logits, requires_grad=True)
                jt = torch.autograd.grad(logits, self.params, dummy, create_graph=True, allow_unused=True)
                used = [i for i, g in enumerate(jt) if g is not None]
                for at in range(0, q, self.vector_batch):
                    chunk = [vectors[j][at : at + self.vector_batch].to(self.params[j].dtype) for j in used]
                    for j, g in zip(used, self._products(logits, dummy, jt, used, chunk, probs, dt), strict=True):
                        out[j][at : at + self.vector_batch] += g.to(out[j].dtype)
                del logits, jt, dummy
        self.products += q
        return [o / len(self.examples) for o in out]


# -- the preconditioner ----------------------------------------------------------------------------
class Preconditioner:
    """`M^-1 v` with EK-FAC factors fitted without projection, damped by an absolute `damping`;
    blocks without a factor (and every block when `ekfac` is None) get `1 / (scale + damping)`."""

    def __init__(self, entries: list[Entry], ekfac: EKFAC | None, damping: float, scale: float, device):
        self.entries, self.damping, self.scale = entries, float(damping), float(scale)
        self.plan: list[tuple] = []  # (factor, weight position, bias position or None)
        covered: set[int] = set()
        if ekfac is not None:
            if ekfac.projection_dim is not None:
                raise RefineError(
                    f"the refinement's preconditioner needs EK-FAC factors fitted without projection "
                    f"(fit_ekfac(..., projection_dim=None), `moe-attrib ekfac --no_projection`), not with "
                    f"projection_dim={ekfac.projection_dim}: projected factors cannot precondition full-size vectors."
                )
            position = {e.key: i for i, e in enumerate(entries)}
            for i, e in enumerate(entries):
                if e.kind != "weight" or e.block not in ekfac.factors:
                    continue
                f = ekfac.factors[e.block]
                bias = position.get(f"{e.block}.bias") if f.bias else None
                if f.bias and bias is None:
                    raise RefineError(f"the EK-FAC factor of {e.key} folds a bias the model's tracked modules lack.")
                qr, qc = f.rows_cols
                want = tuple(e.param.shape[-2:])
                got = (qr.shape[-1], qc.shape[-1] - (1 if f.bias and not f.transposed else 0))
                if f.transposed and f.bias:
                    got = (qr.shape[-1] - 1, qc.shape[-1])
                if got != want:
                    raise RefineError(
                        f"EK-FAC factor {e.block} has sides {got}, the parameter {e.key} {want}: fit the factors "
                        "on this model without projection."
                    )
                qr, qc, lam = (t.to(device, torch.float64) for t in (qr, qc, f.lam))
                self.plan.append((f, qr, qc, lam, i, bias))
                covered.update({i} | ({bias} if bias is not None else set()))
        self.identity = [i for i in range(len(entries)) if i not in covered]

    def __call__(self, vectors: Vectors) -> Vectors:
        out = [v / (self.scale + self.damping) for v in vectors]
        for f, qr, qc, lam, i, bias in self.plan:
            w = vectors[i].double()
            if bias is not None:
                w = f.augment(w, vectors[bias].double())
            rotated = qr.transpose(-1, -2) @ w @ qc
            result = qr @ (rotated / (lam + self.damping)) @ qc.transpose(-1, -2)
            if bias is not None:
                result, b = f.split(result)
                out[bias] = b.to(vectors[bias].dtype)
            out[i] = result.to(vectors[i].dtype)
        return out


def mean_eigenvalue(ekfac: EKFAC | None, ggn: GaussNewton, like: Vectors, seed: int = 0, probes: int = 4) -> float:
    """The mean eigenvalue of G, `trace(G) / D`: from the factors' corrected eigenvalues when given
    (their mean is the trace of G's diagonal blocks over their size), else Hutchinson's estimate from
    `probes` Rademacher vectors (one GGN sweep)."""
    if ekfac is not None and ekfac.factors:
        total = sum(float(f.lam.sum()) for f in ekfac.factors.values())
        size = sum(f.lam.numel() for f in ekfac.factors.values())
        return total / max(size, 1)
    gen = torch.Generator().manual_seed(seed)
    z = [(torch.randint(0, 2, (probes, *v.shape[1:]), generator=gen) * 2 - 1).to(v.device, v.dtype) for v in like]
    size = sum(v[0].numel() for v in like)
    return float(_dot(z, ggn(z)).mean()) / size


# -- the solver ------------------------------------------------------------------------------------
@dataclass
class Solve:
    """`solution` `[Q, *shape]` per parameter; `residuals` `[iterations + 1, Q]`: `|q - (G + damping I) x|
    / |q|` after each iteration (CG's own recurrence)."""

    solution: Vectors
    residuals: np.ndarray


def conjugate_gradients(
    apply: Callable[[Vectors], Vectors],
    rhs: Vectors,
    precondition: Callable[[Vectors], Vectors],
    iterations: int,
    callback: Callable[[int, Vectors], None] | None = None,
) -> Solve:
    """Preconditioned CG for `A x = rhs`, each of the Q right-hand sides with its own step sizes,
    from `x = 0`; `apply` is `A` (SPD), `precondition` approximates `A^-1`. `iterations=0` returns
    `precondition(rhs)` (no product). `callback(k, x)` sees the solution after each iteration k."""
    norm = _dot(rhs, rhs).sqrt().clamp_min(1e-300)
    z = precondition(rhs)
    if iterations == 0:
        return Solve(z, np.ones((1, rhs[0].shape[0])))
    x = [torch.zeros_like(v) for v in rhs]
    r, p = rhs, z
    rz = _dot(r, z)
    history = [torch.ones_like(norm)]
    for k in range(iterations):
        ap = apply(p)
        alpha = rz / _dot(p, ap).clamp_min(1e-300)
        x = _axpy(alpha, p, x)
        r = _axpy(-alpha, ap, r)
        history.append(_dot(r, r).sqrt() / norm)
        if callback is not None:
            callback(k + 1, x)
        if k == iterations - 1:
            break
        z = precondition(r)
        rz_new = _dot(r, z)
        p = _axpy(rz_new / rz.clamp_min(1e-300), p, z)
        rz = rz_new
    return Solve(x, torch.stack(history).double().cpu().numpy())


# -- queries in and out of the index's columns -----------------------------------------------------
def full_gradients(
    model: nn.Module, report: CoverageReport, entries: list[Entry], examples: list[Example], *,
    pad_id: int = 0, token_batch_size: int = 4096, dtype: torch.dtype = torch.float32,
) -> Vectors:  # fmt: skip
    """Exact per-example gradients `[Q, *shape]` of every tracked parameter (the summed token
    cross-entropy of each example, labels as `labels_for` gives them), unprojected."""
    device = next(model.parameters()).device
    out = [torch.zeros(len(examples), *e.param.shape, dtype=dtype, device=device) for e in entries]
    with GradientCollector(model, report, projection_dim=None) as collector:
        for positions in token_batches(examples, token_batch_size):
            ids, mask = collate(examples, positions, pad_id)
            labels = labels_for(examples, positions, ids, mask).to(device)
            grads = collector.collect(ids.to(device), mask.to(device), labels, fused_experts=True)
            rows = torch.as_tensor(positions, device=device)
            for o, e in zip(out, entries, strict=True):
                o[rows] = grads[e.key].to(device, dtype)
    bad = [i for i in range(len(examples)) if not all(bool(o[i].isfinite().all()) for o in out)]
    if bad:
        raise RefineError(f"query example(s) {[examples[i].index for i in bad][:10]} have a non-finite gradient.")
    return out


def to_index_columns(index: Index, report: CoverageReport, entries: list[Entry], vectors: Vectors) -> torch.Tensor:
    """Full-size vectors `[Q, *shape]` as index columns `[Q, dim]` float32: each side projected as the
    index projects a per-example gradient (`P_out^T W P_in` in the stored orientation, a bias `b P_out`;
    sides the projection keeps exact stay as they are), experts per expert, in the column plan."""
    st = index.settings.collect
    p, kind = st.projection_dim, projection_kind(index.manifest["settings"])
    device = vectors[0].device
    proj = Projections(p, st.seed, device, torch.float32, kind, st.target_dims(report.output_layer)) if p else None
    grads = {}
    for e, v in zip(entries, vectors, strict=True):
        v = v.float()
        if proj is not None:
            lay = e.layout
            if lay is not None:
                fin, fout = lay.features(e.proj)
                transposed, experts = lay.transposed, lay.num_experts
            else:
                shape = e.target.module.weight.shape
                transposed, experts = e.target.transposed, None
                fin, fout = (shape[0], shape[1]) if transposed else (shape[1], shape[0])
            p_in = proj.get(e.block, "in", fin, experts)
            p_out = proj.get(e.block, "out", fout, experts)
            if e.kind == "bias":
                v = v if p_out is None else (v.unsqueeze(-2) @ p_out).squeeze(-2)
            else:
                left, right = (p_in, p_out) if transposed else (p_out, p_in)
                v = v if left is None else left.transpose(-1, -2) @ v
                v = v if right is None else v @ right
        grads[e.key] = v
    return flatten_rows(grads, report, index.blocks, st.expert_blocks).cpu()


# -- the whole refinement --------------------------------------------------------------------------
@dataclass
class RefinedQueries:
    """Query rows refined by `refine_queries`, in an index's column layout, ready to score as they are
    (`score`, `score_matrix`, `hit_parts` take them in place of query rows: no further EK-FAC,
    coupling or balance). `residuals` `[iterations + 1, Q]`: CG's relative residuals; `products`:
    GGN products per query (mean-eigenvalue sweep included)."""

    rows: torch.Tensor
    index_path: str
    residuals: np.ndarray
    products: int
    settings: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.rows.shape[0]


def refine_queries(
    model: nn.Module,
    train: list[Example],
    queries: list[Example],
    index: Index,
    settings: RefineSettings | None = None,
    *,
    ekfac: EKFAC | None = None,
    pad_id: int = 0,
    dtype: torch.dtype = torch.float32,
    callback: Callable[[int, int, Vectors], None] | None = None,
    progress: bool = False,
    **overrides: Any,
) -> RefinedQueries:
    """Query rows `P (G + damping m I)^-1 q` for `index` (module docstring): `q` each query's exact
    gradient, `G` the exact GGN over `train` (or `examples` of its rows drawn with `seed`), solved
    by `iterations` steps of CG preconditioned with unprojected `ekfac` factors, `m` the mean
    eigenvalue of G, `P` the index's projection. Queries are solved `query_batch` at a time (each
    batch shares the sweeps' forwards), `vector_batch` of them per vmapped backward; `dtype` is the
    solver's vectors' (float64 for tests). The settings (`moe_attrib.settings.RefineSettings`: `iterations`,
    `damping`, `examples`, `seed`, `token_batch_size`, `query_batch`, `vector_batch`) may also be given as
    keyword shortcuts (`iterations=8`)."""
    (rs,) = resolve("refine_queries", overrides, settings, kinds=(RefineSettings,))
    iterations, damping, examples, seed = rs.iterations, rs.damping, rs.examples, rs.seed
    token_batch_size, query_batch, vector_batch = rs.token_batch_size, rs.query_batch, rs.vector_batch
    if iterations < 0 or damping <= 0:
        raise RefineError(f"refinement needs iterations >= 0 and damping > 0, not {iterations} and {damping}.")
    recorded, st = index.manifest["settings"], index.settings.collect
    check_model(recorded, model, what=f"index {index.path}")
    if st.optimizer_state:
        raise RefineError(f"index {index.path} normalises rows by optimizer state; refinement supports plain rows.")
    report = discover(model, track_moe_experts=st.track_moe_experts, filter_modules=st.filter_modules, warn=False)
    kind, target_dims = projection_kind(recorded), st.target_dims(report.output_layer)
    blocks = column_plan(report, st.projection_dim, st.expert_blocks, kind, target_dims)
    if [(b.name, b.start, b.stop) for b in blocks] != [(b.name, b.start, b.stop) for b in index.blocks]:
        raise RefineError(f"the model's tracked modules do not match the index {index.path}; use its model.")
    entries = tracked_entries(model, report)
    subset = train
    if examples is not None and examples < len(train):
        pick = np.sort(np.random.default_rng(seed).choice(len(train), examples, replace=False))
        subset = [train[i] for i in pick]
    ggn = GaussNewton(model, entries, subset, token_batch_size=token_batch_size, pad_id=pad_id,
                      vector_batch=vector_batch, progress=progress)  # fmt: skip
    like = [torch.zeros(1, *e.param.shape, dtype=dtype, device=ggn.device) for e in entries]
    scale = mean_eigenvalue(ekfac, ggn, like, seed)
    if not scale > 0 or not math.isfinite(scale):
        raise RefineError(f"the Gauss-Newton matrix has mean eigenvalue {scale}: nothing to refine with.")
    damp = damping * scale
    precondition = Preconditioner(entries, ekfac, damp, scale, ggn.device)

    def apply(v: Vectors) -> Vectors:
        return _axpy(torch.full((v[0].shape[0],), damp, dtype=v[0].dtype, device=v[0].device), v, ggn(v))

    rows, residuals = [], []
    for start in tqdm(range(0, len(queries), query_batch), desc="refine", disable=not progress):
        q = full_gradients(model, report, entries, queries[start : start + query_batch], pad_id=pad_id,
                           token_batch_size=token_batch_size, dtype=dtype)  # fmt: skip
        seen = None if callback is None else lambda k, x, at=start: callback(at, k, x)
        solved = conjugate_gradients(apply, q, precondition, iterations, seen)
        rows.append(to_index_columns(index, report, entries, solved.solution))
        residuals.append(solved.residuals)
    settings = {"iterations": iterations, "damping": damping, "mean_eigenvalue": scale, "examples": len(subset),
                "seed": seed, "ekfac": ekfac is not None}  # fmt: skip
    return RefinedQueries(
        torch.cat(rows), str(index.path), np.concatenate(residuals, axis=1), ggn.products // max(len(queries), 1),
        settings,
    )  # fmt: skip
