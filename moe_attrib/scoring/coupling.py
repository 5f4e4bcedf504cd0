"""Cross-module coupling: the training rows' own curvature, across every module, at low rank.

EK-FAC is block-diagonal: each module's (each expert's) curvature is inverted on its own, so
directions that many modules share (the same signal reaching every layer) are counted once per
module, and the modules with the most blocks (attention in a deep model) drown the rest. The
coupling adds the empirical Fisher of the index's own rows to the preconditioner, over all modules
at once, in the metric the scores already use:

    H = B + gamma * G^T G / (s * m)

where `B` is EK-FAC (or the identity without it), `G` holds `s` sampled index rows as they are
scored (restricted to `modules`, unit-normalised with `unit_normalize`), and `m` is their mean
self-influence `g B^-1 g`, so that `gamma` is scale-free: a direction carrying a fraction `f` of
the rows' whitened variance is shrunk by `1 / (1 + gamma * f)`. By the Woodbury identity the
inverse only needs the `s x s` kernel `K = G B^-1 G^T`; its top `rank` eigenpairs `(U, w)` give
two `[columns, rank]` matrices `L = G^T U D` and `R = (B^-1 G^T) U D`, `D = sqrt(c / w)`,
`c = e / (1 + e)`, `e = gamma * w / (s * m)`, and a prepared query `q` (already preconditioned)
becomes `q - (q L) R^T`. Only the queries change; the index is read as it is.

On the LDS benchmark (docs/quality.md) `gamma = 30` raised the mean LDS on all five configurations
(+0.003 to +0.053, a held-out one included) and lowered it on none; 128 sampled rows of 256 kept
most of the gain.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.curvature.precondition import (
    ScoreError,
    check_fitted,
    module_blocks,
    module_columns,
    precondition_queries,
)
from moe_attrib.indexing.index import Index
from moe_attrib.settings import DEFAULT_GAMMA, DEFAULT_RANK, DEFAULT_SAMPLE

CHUNK_ROWS = 64


@dataclass
class Coupling:
    """The low-rank cross-module correction of one index's scores (`left`, `right`: `[columns, r]`).

    `settings` says what it was fitted for (index rows and columns, `unit_normalize`, `modules`,
    the EK-FAC factors' weights, data and damping or none, gamma, rank, sample); `resolve_coupling`
    refuses queries prepared any other way."""

    left: torch.Tensor
    right: torch.Tensor
    settings: dict

    def apply(self, prepared: torch.Tensor) -> torch.Tensor:
        """Coupled query rows from rows already preconditioned and restricted (before unit norm)."""
        left, right = self.left.to(prepared.device), self.right.to(prepared.device)
        return prepared - (prepared @ left) @ right.T


def memory_needed(index: Index, sample: int, rank: int = DEFAULT_RANK) -> int:
    """Bytes a fit holds at its peak: the sampled rows, one preconditioned chunk and the result."""
    rows, columns = index.gradients.shape
    s = min(int(rows), int(sample))
    return columns * (4 * s + 8 * 2 * CHUNK_ROWS + 2 * 4 * min(rank, s))


def memory_available(device: torch.device) -> int:
    """Half the free device memory on CUDA, a quarter of the host's memory on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def check_memory(index: Index, sample: int, device: torch.device, rank: int = DEFAULT_RANK) -> None:
    """Refuse, before any work, a coupling fit that would not fit in memory, saying what fits."""
    need, have = memory_needed(index, sample, rank), memory_available(device)
    if need <= have:
        return
    columns = index.gradients.shape[1]
    fits = max(int(have // (columns * (4 + 8 * min(rank, sample) / max(sample, 1)))) - 2 * CHUNK_ROWS, 0)
    raise ScoreError(
        f"the cross-module coupling of index {index.path} needs {need / 2**30:.1f} GiB for {sample} sampled rows of "
        f"{columns:,} columns, more than the {have / 2**30:.1f} GiB it may use on {device}: pass "
        f"--coupling_sample {max(fits, 1)} (fewer rows, a noisier estimate) or --coupling_gamma 0 (no coupling)."
    )


EKFAC_IDENTITY = (
    "model_fingerprint", "examples", "damping", "damping_scope", "sampled_labels", "fold_bias", "projection",
)  # fmt: skip


def ekfac_identity(ekfac: EKFAC | None) -> dict | None:
    """What a coupling records of the factors it was fitted with (weights, examples, damping, Fisher):
    queries preconditioned with other factors would be corrected by the wrong `B^-1`."""
    if ekfac is None:
        return None
    return {key: ekfac.settings.get(key) for key in EKFAC_IDENTITY}


def sample_rows(rows: int, sample: int, seed: int) -> np.ndarray:
    """The sorted row numbers a fit reads: all rows up to `sample`, else a seeded draw."""
    if rows <= sample:
        return np.arange(rows)
    return np.sort(np.random.default_rng(seed).choice(rows, size=sample, replace=False))


def sampled_rows(
    index: Index, sample: int, seed: int, *, mask: torch.Tensor | None, unit_normalize: bool, device: torch.device
) -> torch.Tensor:
    """The finite rows of a seeded sample (`sample_rows`) on `device`, as they are scored: restricted
    to `mask` and unit-normalised with `unit_normalize` (what the coupling and the balance fit on)."""
    g = torch.from_numpy(index.read_rows(sample_rows(int(index.gradients.shape[0]), sample, seed))).to(device)
    g = g[g.isfinite().all(dim=1)]
    if mask is not None:
        g = g * mask.to(device)
    if unit_normalize:
        g = g / g.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return g


def fit_coupling(
    index: Index,
    *,
    ekfac: EKFAC | None = None,
    unit_normalize: bool = True,
    modules: str | None = None,
    gamma: float = DEFAULT_GAMMA,
    rank: int = DEFAULT_RANK,
    sample: int = DEFAULT_SAMPLE,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> Coupling | None:
    """Fit the coupling of `index` for queries prepared with `ekfac`, `modules` and `unit_normalize`
    (module docstring); None when `gamma` is 0 or no sampled row is finite."""
    if gamma < 0 or rank < 1 or sample < 1:
        raise ScoreError(f"coupling needs gamma >= 0, rank >= 1 and sample >= 1 (got {gamma}, {rank}, {sample}).")
    if gamma == 0:
        return None
    device = torch.device(device)
    check_memory(index, sample, device, rank)
    n, columns = index.gradients.shape
    mask = module_columns(index.blocks, modules)
    g = sampled_rows(index, sample, seed, mask=mask, unit_normalize=unit_normalize, device=device)
    if g.shape[0] == 0:
        return None
    settings_of_index = index.manifest["settings"]
    blocks = module_blocks(index.blocks, modules)  # only what the restriction keeps

    def preconditioned(chunk: torch.Tensor) -> torch.Tensor:
        if ekfac is None:
            return chunk
        p = precondition_queries(chunk, blocks, ekfac, settings_of_index)  # on the rows' device
        return p if mask is None else p * mask.to(device)

    s = g.shape[0]
    chunks = range(0, s, CHUNK_ROWS)
    kernel = torch.empty(s, s, dtype=torch.float64, device=device)
    keep_chunks = memory_needed(index, sample, rank) + 4 * s * columns <= memory_available(device)
    kept: dict[int, torch.Tensor] = {}  # preconditioned chunks, reused by the second pass when they fit
    for at in tqdm(chunks, desc="coupling", unit="chunk", disable=not progress, leave=False):
        p = preconditioned(g[at : at + CHUNK_ROWS])
        kernel[at : at + CHUNK_ROWS] = (p @ g.T).double()
        if keep_chunks:
            kept[at] = p
    kernel = (kernel + kernel.T) / 2
    mean_self = float(kernel.diagonal().mean())
    w, u = torch.linalg.eigh(kernel)
    w, u = w.flip(0)[:rank], u.flip(1)[:, :rank]
    if mean_self <= 0 or float(w[0]) <= 0:
        return None
    keep = w > float(w[0]) * 1e-6  # below: float32 noise of a rank-deficient kernel
    w, u = w[keep], u[:, keep]
    e = gamma * w / (s * mean_self)
    scale = u * torch.sqrt(e / (1 + e) / w)  # U D
    scale32 = scale.float()
    left = g.T @ scale32
    right = torch.zeros_like(left)
    for at in chunks:
        p = kept.pop(at) if at in kept else preconditioned(g[at : at + CHUNK_ROWS])
        right += p.T @ scale32[at : at + CHUNK_ROWS]
    settings = {
        "gamma": float(gamma),
        "rank": int(w.shape[0]),
        "sample": int(s),
        "requested": {"rank": int(rank), "sample": int(sample)},  # before non-finite rows and null directions
        "seed": int(seed),
        "rows": int(n),
        "data_fingerprint": index.manifest["settings"].get("data_fingerprint"),
        "columns": int(columns),
        "unit_normalize": bool(unit_normalize),
        "modules": modules,
        "ekfac": ekfac_identity(ekfac),
    }
    return Coupling(left.cpu(), right.cpu(), settings)


def resolve_coupling(
    index: Index,
    coupling: Coupling | str | None,
    *,
    ekfac: EKFAC | None,
    unit_normalize: bool,
    modules: str | None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> Coupling | None:
    """`"auto"`: fit with the defaults; None: no coupling; a `Coupling`: checked against how the
    queries are prepared (a coupling fitted for other rows or another scoring is a `ScoreError`)."""
    if coupling is None:
        return None
    if isinstance(coupling, str):
        if coupling != "auto":
            raise ScoreError(f"coupling={coupling!r}: pass 'auto', None or a Coupling from fit_coupling.")
        return fit_coupling(
            index, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, device=device, progress=progress
        )
    want = {  # rows of one index (by its data), not a row count: a view of some rows scores with its index's
        "data_fingerprint": index.manifest["settings"].get("data_fingerprint"),
        "columns": int(index.gradients.shape[1]),
        "unit_normalize": bool(unit_normalize),
        "modules": modules,
        "ekfac": ekfac_identity(ekfac),
    }
    check_fitted("the coupling", coupling.settings, want, "fit_coupling(index, ...)")
    return coupling
