"""Scores averaged over several checkpoints of one training run (`score --average_with`).

Averaging attribution scores over checkpoints along training (TracIn-CP) or over several models
(TRAK's ensembles) is the largest quality gain the literature reports, and on this project's LDS
benchmark averaging over 5 checkpoints raised the default pipeline by 0.05-0.10 on every
configuration (`benchmarks/lds_checkpoints.py`, docs/quality.md).

Each checkpoint is scored on its own (`score --all_scores S.npy`, with its own index and EK-FAC
factors), which writes the `[queries, rows]` matrix and, beside it, `S.npy.json`: what the matrix
belongs to (the training data's and the queries' fingerprints, the model's, how it was scored).
`score --average_with S1.npy ...` then ranks by the mean of its own matrix and those, after
checking that they score the same rows for the same queries the same way, from different models.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_attrib.errors import MoeAttribError
from moe_attrib.indexing.index import Index, load_index
from moe_attrib.scoring.score import Scores
from moe_attrib.settings import IndexSettings, ScoreSettings, resolve

FORMAT = "moe-attrib all-scores"
VERSION = 1


class EnsembleError(MoeAttribError, ValueError):
    """Score matrices that cannot be averaged (other data, other queries, the same model twice)."""


UNRECORDED = {"output_balance": False}  # what a matrix written before the key existed was scored with


def matrix_info(
    index: Index,
    queries_fingerprint: str,
    queries: int,
    unit_normalize: bool,
    modules: str | None,
    ekfac: bool,
    coupling: dict | None = None,
    balance: bool = False,
) -> dict:
    """What a `[queries, rows]` score matrix of `index` belongs to (written beside it as `<file>.json`)."""
    settings = index.settings
    return {
        "format": FORMAT,
        "version": VERSION,
        "shape": [queries, int(index.gradients.shape[0])],
        "data_fingerprint": settings.data_fingerprint,
        "queries_fingerprint": queries_fingerprint,
        "model_fingerprint": settings.model_fingerprint,
        "attribute_tokens": bool(settings.collect.attribute_tokens),
        "unit_normalize": bool(unit_normalize),
        "modules": modules,
        "ekfac": bool(ekfac),
        "coupling": coupling,
        "output_balance": bool(balance),
        "index": str(Path(index.path).resolve()),
    }


def info_path(matrix: str | Path) -> Path:
    return Path(str(matrix) + ".json")


def write_info(matrix: str | Path, info: dict) -> Path:
    path = info_path(matrix)
    path.write_text(json.dumps(info, indent=2))
    return path


def _load(path: str | Path) -> tuple[np.ndarray, dict]:
    meta = info_path(path)
    if not Path(path).exists():
        raise EnsembleError(f"--average_with {path}: no such file.")
    if not meta.exists():
        raise EnsembleError(
            f"--average_with {path}: no {meta.name} beside it, so nothing says which data, queries and model "
            "it scores; write it with `moe-attrib score ... --all_scores FILE` (which writes both)."
        )
    info = json.loads(meta.read_text())
    if info.get("format") != FORMAT:
        raise EnsembleError(f"--average_with {path}: {meta.name} is not a moe-attrib all-scores description.")
    matrix = np.load(path, mmap_mode="r")
    if list(matrix.shape) != info["shape"] or matrix.dtype != np.float32:
        raise EnsembleError(f"--average_with {path}: holds {matrix.shape} {matrix.dtype}, its {meta.name} says "
                            f"{tuple(info['shape'])} float32; the two files do not belong together.")  # fmt: skip
    return matrix, info


COMPARED = (
    ("data_fingerprint", "training data"),
    ("attribute_tokens", "kind of index (per example / per token)"),
    ("queries_fingerprint", "queries"),
    ("shape", "[queries, rows] shape"),
    ("unit_normalize", "--unit_normalize setting"),
    ("modules", "--modules"),
    ("ekfac", "use of --ekfac"),
    ("coupling", "cross-module coupling (--coupling_*)"),
    ("output_balance", "output-layer balance (--output_balance)"),
)


def mismatch(info: dict, own: dict) -> str | None:
    """Why a score matrix described by `info` cannot be averaged with one described by `own` (None: it can):
    the same training rows (data fingerprint) and queries, scored the same way."""
    for key, what in COMPARED:
        if info.get(key, UNRECORDED.get(key)) != own.get(key, UNRECORDED.get(key)):
            return f"scores another {what} ({key} {info.get(key)!r} vs {own.get(key)!r})"
    return None


def load_matrices(paths: list[str], own: dict) -> list[np.ndarray]:
    """The score matrices of `paths`, checked against this run's own description `own`: the same
    training rows (data fingerprint) and queries, scored the same way, each from another model."""
    out, models = [], {own["model_fingerprint"]: "this run's model"}
    for path in paths:
        matrix, info = _load(path)
        why = mismatch(info, own)
        if why is not None:
            raise EnsembleError(
                f"--average_with {path}: {why} than this run; average only matrices of the same data and queries, "
                "scored the same way."
            )
        seen = models.get(info.get("model_fingerprint"))
        if seen is not None:
            raise EnsembleError(
                f"--average_with {path}: scores the same model weights as {seen}; average checkpoints (or models) "
                "that differ, each once."
            )
        models[info.get("model_fingerprint")] = str(path)
        out.append(matrix)
    return out


def mean_top_k(matrices: list[np.ndarray], top_k: int, block: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows per query of the mean of `matrices` (each `[Q, rows]`, e.g. memory-mapped), read
    `block` columns at a time; returns `(values [Q, k], rows [Q, k])`, best first. Non-finite
    means rank last and are reported as NaN."""
    queries, total = matrices[0].shape
    k = min(top_k, total)
    best_v = np.full((queries, 0), -np.inf, dtype=np.float64)
    best_i = np.zeros((queries, 0), dtype=np.int64)
    for start in range(0, total, block):
        stop = min(start + block, total)
        mean = sum(np.asarray(m[:, start:stop], dtype=np.float64) for m in matrices) / len(matrices)
        mean[~np.isfinite(mean)] = -np.inf
        values = np.concatenate([best_v, mean], axis=1)
        rows = np.concatenate([best_i, np.broadcast_to(np.arange(start, stop), mean.shape)], axis=1)
        keep = np.argpartition(-values, k - 1, axis=1)[:, :k] if values.shape[1] > k else np.argsort(-values, 1)
        best_v, best_i = np.take_along_axis(values, keep, 1), np.take_along_axis(rows, keep, 1)
    order = np.argsort(-best_v, axis=1, kind="stable")
    best_v, best_i = np.take_along_axis(best_v, order, 1), np.take_along_axis(best_i, order, 1)
    best_v[~np.isfinite(best_v)] = np.nan
    return best_v.astype(np.float32), best_i


# -- every checkpoint of a training run (`score --run RUN_DIR`, `score_run`) ----------------------
ATTRIBUTION_INDEX = Path("attribution") / "index"  # what `moe_attrib.workflows.trainer` writes into each checkpoint
ATTRIBUTION_EKFAC = Path("attribution") / "ekfac"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class RunCheckpoint:
    """One checkpoint of a run, as planned before any scoring: its index, factors and matrix description."""

    path: Path
    step: int
    index: Index
    ekfac: Path | None
    info: dict


@dataclass
class RunScores:
    """`score_run`'s result: the top-k of the mean over `checkpoints` (`scores`), each checkpoint's `[Q, rows]`
    matrix (`matrices`: `.npy` files with their `.json` beside, when `out` was given), the last checkpoint's
    index (whose rows the scores refer to; every checkpoint has the same rows) and its routing of the queries."""

    scores: Scores
    checkpoints: list[Path]
    matrices: list[Path]
    index: Index
    query_counts: np.ndarray | None


def run_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """`(step, directory)` of every `checkpoint-N` of `run_dir` with collected attribution, by step."""
    root = Path(run_dir)
    if not root.is_dir():
        raise EnsembleError(f"--run {run_dir}: no such directory.")
    found = sorted(
        (int(m[1]), d) for d in root.iterdir() if (m := CHECKPOINT.match(d.name)) and (d / ATTRIBUTION_INDEX).exists()
    )
    if not found:
        raise EnsembleError(
            f"--run {run_dir}: no checkpoint-N/{ATTRIBUTION_INDEX} inside; train with moe_attrib.AttributionCallback "
            "(or AttributionCheckpointer) writing into this directory first."
        )
    return found


def plan_run(
    run_dir: str | Path,
    queries_fingerprint: str,
    queries: int,
    *,
    ekfac: bool,
    unit_normalize: bool,
    modules: str | None,
    coupling: dict | None,
    balance: bool,
    tokenizer=None,
) -> list[RunCheckpoint]:
    """Every checkpoint of the run, checked before any work as `--average_with` checks matrices: complete
    indexes of one training set, the same kind of index, factors fitted for each index (model, tokenizer,
    projection), the tokenizer the indexes were made with, and weights that differ between checkpoints."""
    from moe_attrib.fingerprint import check_model
    from moe_attrib.workflows.checks import check_ekfac_dirs

    plan, models = [], {}
    for step, path in run_checkpoints(run_dir):
        index = load_index(path / ATTRIBUTION_INDEX)
        settings = index.manifest["settings"]
        factors = path / ATTRIBUTION_EKFAC
        if ekfac:
            if not factors.exists():
                raise EnsembleError(
                    f"--run {run_dir}: {path.name} has no {ATTRIBUTION_EKFAC} (collected with ekfac=False?); score "
                    "without EK-FAC (ekfac=False) or collect factors at every checkpoint."
                )
            check_ekfac_dirs([str(factors)], settings, str(path / ATTRIBUTION_INDEX))
        check_model(settings, None, tokenizer, what=f"index {path / ATTRIBUTION_INDEX}")
        info = matrix_info(index, queries_fingerprint, queries, unit_normalize, modules, ekfac, coupling, balance)
        if plan:
            why = mismatch(info, plan[0].info)
            if why is not None:
                raise EnsembleError(
                    f"--run {run_dir}: {path.name} {why} than {plan[0].path.name}; a run's checkpoints must index "
                    "the same training rows, collected the same way."
                )
        seen = models.get(info["model_fingerprint"])
        if seen is not None:
            raise EnsembleError(
                f"--run {run_dir}: {path.name} was collected from the same weights as {seen}; average checkpoints "
                "that differ, each once (remove the duplicate)."
            )
        models[info["model_fingerprint"]] = path.name
        plan.append(RunCheckpoint(path, step, index, factors if ekfac else None, info))
    return plan


def score_run(
    run_dir: str | Path,
    queries: list,
    settings: ScoreSettings | None = None,
    *,
    load_model: Callable[[Path], torch.nn.Module] | None = None,
    tokenizer=None,
    out: str | Path | None = None,
    ekfac: bool = True,
    pad_id: int = 0,
    device: str | torch.device | None = None,
    progress: bool = False,
    **overrides: Any,
) -> RunScores:
    """Score `queries` (`Example`s) against every checkpoint of a training run and rank by the mean.

    Each `RUN_DIR/checkpoint-N` (written by `AttributionCallback` / `AttributionCheckpointer`) is scored
    as `moe-attrib score --all_scores` scores one index: its own weights (`load_model(checkpoint_dir)`,
    default `AutoModelForCausalLM` in the index's dtype, checked against the index's fingerprint), its own
    EK-FAC factors (`ekfac=False`: none), the coupling and output-layer balance fitted from its own rows
    (`coupling_gamma=0` / `output_balance=False` turn them off). Every checkpoint is checked before any
    scoring (`plan_run`). `settings` (`moe_attrib.settings.ScoreSettings`, or any of its fields as a keyword:
    `top_k`, `unit_normalize`, `modules`, `damping`, `damping_scope`, `coupling_gamma`, `coupling_rank`,
    `coupling_sample`, `output_balance`) as for one index. With `out` (a directory) each matrix is kept as
    `checkpoint-N.npy` with its `.json` description, which `score --average_with` accepts; without it they
    are temporary."""
    from moe_attrib.curvature.ekfac import load_ekfac
    from moe_attrib.data import fingerprint
    from moe_attrib.scoring.coupling import fit_coupling
    from moe_attrib.scoring.score import query_gradients, score_matrix

    (st,) = resolve("score_run", overrides, settings, kinds=(ScoreSettings,))
    unit, modules, top_k, damping, damping_scope = st.unit_normalize, st.modules, st.top_k, st.damping, st.damping_scope
    coupled, balanced = st.coupling, st.balanced
    plan = plan_run(run_dir, fingerprint(queries), len(queries), ekfac=ekfac, unit_normalize=unit, modules=modules,
                    coupling=coupled, balance=balanced, tokenizer=tokenizer)  # fmt: skip
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory(prefix="moe-attrib-run-") as tmp:
        matrices, counts = [], None
        for ckpt in plan:
            made = ckpt.index.settings
            model = (load_model(ckpt.path) if load_model else default_loader(ckpt.path, made)).to(dev).eval()
            q, counts = query_gradients(model, queries, ckpt.index, pad_id=pad_id, with_counts=True)
            del model
            factors = load_ekfac(ckpt.ekfac) if ckpt.ekfac is not None else None
            if factors is not None and (damping is not None or damping_scope is not None):
                factors = factors.with_damping(
                    factors.settings.get("damping") if damping is None else damping,
                    damping_scope or factors.settings.get("damping_scope", "expert"),
                )
            opts = dict(ekfac=factors, unit_normalize=unit, modules=modules, device=dev)
            coupling = fit_coupling(ckpt.index, **opts, **coupled, progress=progress) if coupled else None
            path = Path(out or tmp) / f"{ckpt.path.name}.npy"
            score_matrix(ckpt.index, q, **opts, coupling=coupling, balance="auto" if balanced else None, out=path,
                         progress=progress)  # fmt: skip
            write_info(path, ckpt.info)
            matrices.append(path)
        values, rows = mean_top_k([np.load(p, mmap_mode="r") for p in matrices], top_k)
    last = plan[-1]
    kept = matrices if out is not None else []
    return RunScores(Scores(values, rows), [c.path for c in plan], kept, last.index, counts)


def default_loader(checkpoint: Path, settings: IndexSettings) -> torch.nn.Module:
    """A checkpoint's weights as `from_pretrained` loads them, in the dtype its index was built in."""
    from moe_attrib.workflows.loading import load_model

    return load_model(str(checkpoint), getattr(torch, settings.torch_dtype_name))
