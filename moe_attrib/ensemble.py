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
from pathlib import Path

import numpy as np

from moe_attrib.index import Index

FORMAT = "moe-attrib all-scores"
VERSION = 1


class EnsembleError(ValueError):
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
    settings = index.manifest["settings"]
    return {
        "format": FORMAT,
        "version": VERSION,
        "shape": [queries, int(index.gradients.shape[0])],
        "data_fingerprint": settings["data_fingerprint"],
        "queries_fingerprint": queries_fingerprint,
        "model_fingerprint": settings.get("model_fingerprint"),
        "attribute_tokens": bool(settings.get("attribute_tokens")),
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


def load_matrices(paths: list[str], own: dict) -> list[np.ndarray]:
    """The score matrices of `paths`, checked against this run's own description `own`: the same
    training rows (data fingerprint) and queries, scored the same way, each from another model."""
    out, models = [], {own["model_fingerprint"]: "this run's model"}
    for path in paths:
        matrix, info = _load(path)
        for key, what in (
            ("data_fingerprint", "training data"),
            ("attribute_tokens", "kind of index (per example / per token)"),
            ("queries_fingerprint", "queries"),
            ("shape", "[queries, rows] shape"),
            ("unit_normalize", "--unit_normalize setting"),
            ("modules", "--modules"),
            ("ekfac", "use of --ekfac"),
            ("coupling", "cross-module coupling (--coupling_*)"),
            ("output_balance", "output-layer balance (--output_balance)"),
        ):
            if info.get(key, UNRECORDED.get(key)) != own.get(key):
                raise EnsembleError(
                    f"--average_with {path}: scores another {what} than this run ({key} {info.get(key)!r} vs "
                    f"{own.get(key)!r}); average only matrices of the same data and queries, scored the same way."
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
