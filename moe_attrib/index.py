"""The on-disk gradient index: a memory-mapped `[rows, dim]` matrix plus manifest, losses and counts.

A build writes under `DIR.part` and renames it to `DIR` only when every batch is written, so a
directory named `DIR` is always complete. `done.npy` records finished batches; an interrupted
build resumes from it and ends with the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_attrib.discovery import CoverageReport, iter_entries

FORMAT_VERSION = 1
DEFAULT_PROJECTION_DIM = 32  # per side: a p x p block per weight (docs/quality.md)
INDEX_FILES = (
    "manifest.json",
    "manifest.tmp",
    "gradients.npy",
    "losses.npy",
    "expert_counts.npy",
    "token_offsets.npy",
    "done.npy",
)


class IndexFileError(RuntimeError):
    """A missing, incomplete or corrupt index, or a build that cannot continue as asked."""


@dataclass
class Block:
    """Columns `[start, stop)` of the index holding one projected gradient block."""

    name: str
    start: int
    stop: int
    shape: tuple[int, ...]


def _entries(report: CoverageReport):
    """(key in a fused `collect` result, experts layout or None, projection, weight|bias, one slice's shape),
    in plan order."""
    for e in iter_entries(report.targets):
        shape = e.param.shape[1:] if e.layout is not None else e.param.shape
        yield e.key, e.layout, e.proj, e.kind, tuple(shape)


def column_plan(report: CoverageReport, projection_dim: int | None, expert_blocks: str) -> list[Block]:
    """Column blocks in target order: each weight is p*p columns, each bias p; with
    `projection_dim=None` (exact rows) each block has its parameter's (one expert's) shape.

    `expert_blocks="separate"` gives every expert its own blocks
    (`<experts>.expert_<i>.<proj>.weight`); `"sum"` sums a layer's independently projected
    experts into one block per projection (`<experts>.<proj>.weight`).
    """
    if expert_blocks not in ("separate", "sum"):
        raise ValueError(f"expert_blocks must be 'separate' or 'sum', not {expert_blocks!r}")
    p = projection_dim
    blocks: list[Block] = []
    col = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal col
        size = int(np.prod(shape))
        blocks.append(Block(name, col, col + size, shape))
        col += size

    for grads_key, lay, proj, key, exact in _entries(report):
        shape = exact if p is None else (p, p) if key == "weight" else (p,)
        if lay is not None and expert_blocks == "separate":
            for i in range(lay.num_experts):
                add(f"{lay.expert_name(i, proj)}.{key}", shape)
        else:
            add(grads_key, shape)
    return blocks


def flatten_rows(grads: dict, report: CoverageReport, blocks: list[Block], expert_blocks: str, per_token: bool = False):
    """`flatten_batch` on the result's device: float32 `torch.Tensor` rows from one `torch.cat`, no host sync."""
    import torch

    lead = 2 if per_token else 1
    parts = []
    for grads_key, lay, _proj, _key, _shape in _entries(report):
        value = grads[grads_key]  # experts: [N, (S,) E, ...]
        if lay is not None and expert_blocks == "sum" and not per_token:
            value = value.sum(dim=1)
        parts.append(value.float().reshape(*value.shape[:lead], -1))
    rows = torch.cat(parts, dim=-1)
    if rows.shape[-1] != blocks[-1].stop:
        raise IndexFileError(f"internal: batch has {rows.shape[-1]} columns, the plan {blocks[-1].stop}")
    return rows


def flatten_batch(
    grads: dict, report: CoverageReport, blocks: list[Block], expert_blocks: str, per_token: bool = False
) -> np.ndarray:
    """Rows in plan order from a `collect(..., fused_experts=True)` result: `[N, dim]`, or
    `[N, S, dim]` for a `per_token=True` result (whose experts are already summed for "sum")."""
    return flatten_rows(grads, report, blocks, expert_blocks, per_token).cpu().numpy()


def part_dir(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".part")


class IndexWriter:
    """Writes rows of a build into `DIR.part`; several processes may write disjoint rows."""

    def __init__(
        self,
        path: str | Path,
        manifest: dict,
        rows: int,
        dim: int,
        layers: int,
        experts: int,
        num_batches: int,
        resume: bool = False,
        create: bool = True,
        examples: int | None = None,
        token_offsets: np.ndarray | None = None,
        overwrite: bool = False,
    ):
        self.examples = rows if examples is None else examples
        self.final = Path(path)
        self.dir = part_dir(path)
        self.overwrite = overwrite
        if create:
            self._prepare(manifest, rows, dim, layers, experts, num_batches, resume, token_offsets)
        self._open()

    def _prepare(self, manifest, rows, dim, layers, experts, num_batches, resume, token_offsets) -> None:
        check_index_target(self.final, self.overwrite)
        if self.dir.exists():
            if not resume:
                raise IndexFileError(
                    f"{self.dir} holds an interrupted build; pass --resume to continue it or delete it to start over."
                )
            old = json.loads((self.dir / "manifest.json").read_text())
            diff = sorted(
                k
                for k in set(old["settings"]) | set(manifest["settings"])
                if old["settings"].get(k) != manifest["settings"].get(k)
            )
            if diff:
                details = "; ".join(
                    f"{k}: index {old['settings'].get(k)!r} vs now {manifest['settings'].get(k)!r}" for k in diff
                )
                raise IndexFileError(f"cannot resume {self.dir}: settings differ ({details}).")
            return
        self.dir.mkdir(parents=True)
        np.lib.format.open_memmap(self.dir / "gradients.npy", mode="w+", dtype=np.float32, shape=(rows, dim)).flush()
        examples = self.examples
        np.lib.format.open_memmap(self.dir / "losses.npy", mode="w+", dtype=np.float32, shape=(examples,)).flush()
        np.lib.format.open_memmap(
            self.dir / "expert_counts.npy", mode="w+", dtype=np.float32, shape=(examples, layers, experts)
        ).flush()
        if token_offsets is not None:
            np.save(self.dir / "token_offsets.npy", token_offsets)
        np.lib.format.open_memmap(self.dir / "done.npy", mode="w+", dtype=np.uint8, shape=(num_batches,)).flush()
        _write_json(self.dir / "manifest.json", manifest)

    def _open(self) -> None:
        self.gradients = np.load(self.dir / "gradients.npy", mmap_mode="r+")
        self.losses = np.load(self.dir / "losses.npy", mmap_mode="r+")
        self.counts = np.load(self.dir / "expert_counts.npy", mmap_mode="r+")
        self.done = np.load(self.dir / "done.npy", mmap_mode="r+")

    def is_done(self, batch: int) -> bool:
        return bool(self.done[batch])

    def write(
        self,
        batch: int,
        examples: np.ndarray,
        rows: np.ndarray,
        gradients: np.ndarray,
        losses: np.ndarray,
        counts: np.ndarray,
    ):
        """Write one batch (gradient `rows`, per-example `losses`/`counts` of `examples`), flush,
        and only then mark the batch done."""
        order = np.argsort(rows)
        self.gradients[rows[order]] = gradients[order]
        order = np.argsort(examples)
        self.losses[examples[order]] = losses[order]
        self.counts[examples[order], : counts.shape[1], : counts.shape[2]] = counts[order]
        for arr in (self.gradients, self.losses, self.counts):
            arr.flush()
        self.done[batch] = 1
        self.done.flush()

    def finish(self) -> Path:
        """Check every batch is written, mark the manifest complete and move `DIR.part` to `DIR`."""
        if not self.done.all():
            missing = np.flatnonzero(self.done == 0)
            raise IndexFileError(
                f"{self.dir}: batches {missing[:10].tolist()} were never written; rerun with --resume."
            )
        manifest = json.loads((self.dir / "manifest.json").read_text())
        manifest["complete"] = True
        _write_json(self.dir / "manifest.json", manifest)
        del self.gradients, self.losses, self.counts, self.done
        if self.final.exists():
            check_index_target(self.final, self.overwrite)
            for name in INDEX_FILES:
                (self.final / name).unlink(missing_ok=True)
            self.final.rmdir()
        os.replace(self.dir, self.final)
        return self.final


def check_index_target(path: str | Path, overwrite: bool) -> None:
    """`build --index DIR` may write to DIR when it is absent or empty, or with `overwrite` when it
    holds only an index's files; anything else there is never deleted: an `IndexFileError`."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise IndexFileError(f"{path} is a file, not a directory; choose another --index.")
    present = sorted(p.name for p in path.iterdir())
    if not present:
        return
    if not overwrite:
        raise IndexFileError(
            f"{path} already exists and is not empty; pass --overwrite to replace it or choose another --index."
        )
    foreign = [name for name in present if name not in INDEX_FILES]
    if foreign:
        raise IndexFileError(
            f"{path} holds files moe-attrib did not write ({', '.join(foreign[:5])}); --overwrite only replaces "
            "an index, so move them or choose another --index."
        )


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


@dataclass
class Index:
    """A finished index: `gradients` is a read-only memmap `[rows, dim]`."""

    path: Path
    manifest: dict
    gradients: np.ndarray
    losses: np.ndarray
    expert_counts: np.ndarray
    token_offsets: np.ndarray | None = None  # --attribute_tokens: rows of example i are [o[i], o[i+1])

    @property
    def blocks(self) -> list[Block]:
        return [Block(b["name"], b["start"], b["stop"], tuple(b["shape"])) for b in self.manifest["blocks"]]


def load_index(path: str | Path) -> Index:
    """Open a finished index; a missing, incomplete or corrupt one is a clear `IndexFileError`."""
    path = Path(path)
    if not path.exists():
        if part_dir(path).exists():
            raise IndexFileError(f"{path} is incomplete ({part_dir(path)} exists): finish the build with --resume.")
        raise IndexFileError(f"{path}: no such index.")
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise IndexFileError(f"{manifest_path}: missing or unreadable manifest ({err}).") from err
    if not manifest.get("complete"):
        raise IndexFileError(f"{path}: the manifest does not mark the build complete.")
    try:
        gradients = np.load(path / "gradients.npy", mmap_mode="r")
        losses = np.load(path / "losses.npy", mmap_mode="r")
        counts = np.load(path / "expert_counts.npy", mmap_mode="r")
    except (OSError, ValueError) as err:
        raise IndexFileError(f"{path}: corrupt index file ({err}).") from err
    rows, dim, examples = manifest["rows"], manifest["dim"], manifest["examples"]
    if gradients.shape != (rows, dim) or losses.shape != (examples,) or counts.shape[0] != examples:
        raise IndexFileError(
            f"{path}: corrupt index: gradients {gradients.shape}, losses {losses.shape} but the manifest says "
            f"{rows} rows x {dim} columns for {examples} examples."
        )
    offsets = None
    if manifest["settings"].get("attribute_tokens"):
        try:
            offsets = np.load(path / "token_offsets.npy")
        except OSError as err:
            raise IndexFileError(f"{path}: corrupt index: token_offsets.npy missing ({err}).") from err
        if offsets.shape != (examples + 1,) or offsets[-1] != rows:
            raise IndexFileError(f"{path}: corrupt index: token_offsets.npy does not match {rows} rows.")
    return Index(path, manifest, gradients, losses, counts, offsets)


def remove_index(path: str | Path) -> None:
    """Delete the index (and interrupted build) at `path`: only an index's files, then the emptied
    directories; a directory holding anything else is an `IndexFileError` and is left as it is."""
    for p in (Path(path), part_dir(path)):
        if p.exists():
            check_index_target(p, overwrite=True)
            for name in INDEX_FILES:
                (p / name).unlink(missing_ok=True)
            p.rmdir()
