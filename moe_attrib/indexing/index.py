"""The on-disk gradient index: a memory-mapped `[rows, dim]` matrix plus manifest, losses and counts.

Rows are stored in the index's dtype (`index_dtype` in the manifest settings; float32 when absent):
float32, float16, or bfloat16 kept as its raw bits in a uint16 `.npy` (numpy has no bfloat16).
Readers widen them to float32 (`Index.read_rows`, `moe_attrib.indexing.stream`).

A build writes under `DIR.part` and renames it to `DIR` only when every batch is written, so a
directory named `DIR` is always complete. `done.npy` records finished batches; an interrupted
build resumes from it and ends with the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

from moe_attrib.collect.projection import PROJECTION, side_width
from moe_attrib.errors import MoeAttribError
from moe_attrib.model.discovery import CoverageReport, iter_entries
from moe_attrib.settings import (  # noqa: F401 (DEFAULT_PROJECTION_DIM: re-exported)
    DEFAULT_INDEX_DTYPE,
    DEFAULT_PROJECTION_DIM,
    IndexSettings,
    check_version,
)

FORMAT_VERSION = 1
INDEX_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # stored numpy dtype
DTYPE_MAX = {"float32": 3.4028234663852886e38, "float16": 65504.0, "bfloat16": 3.3895313892515355e38}
INDEX_FILES = (
    "manifest.json",
    "manifest.tmp",
    "gradients.npy",
    "losses.npy",
    "expert_counts.npy",
    "token_offsets.npy",
    "done.npy",
    "owner.json",
    "eigenbasis.safetensors",  # an eigenbasis index's kept eigenvectors (moe_attrib.curvature.eigenbasis)
    "factors.safetensors",  # the EK-FAC factors a default build fitted for its rows (EKFAC.save's files)
    "ekfac.json",
)
OWNER_FILE = "owner.json"  # in DIR.part: the build writing it (pid, host, start time)


class IndexFileError(MoeAttribError, RuntimeError):
    """A missing, incomplete or corrupt index, or a build that cannot continue as asked."""


class IndexDtypeError(MoeAttribError, ValueError):
    """Rows that do not fit the index's storage dtype (a float16 overflow), or an unknown dtype."""


def check_index_dtype(index_dtype: str) -> str:
    """`index_dtype` itself when it is one of `INDEX_DTYPES`, else an `IndexDtypeError`."""
    if index_dtype not in INDEX_DTYPES:
        raise IndexDtypeError(f"index_dtype must be one of {', '.join(INDEX_DTYPES)}, not {index_dtype!r}.")
    return index_dtype


def to_stored(rows: np.ndarray, index_dtype: str) -> np.ndarray:
    """float32 rows in the storage dtype: float16 rounded to nearest, bfloat16 rounded to nearest
    even and returned as its uint16 bits."""
    if index_dtype == "float32":
        return np.asarray(rows, dtype=np.float32)
    if index_dtype == "float16":
        with np.errstate(over="ignore"):  # an overflow is the writer's error, naming the example
            return np.asarray(rows, dtype=np.float32).astype(np.float16)
    import torch

    bf16 = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(torch.bfloat16)
    return bf16.view(torch.int16).numpy().view(np.uint16)


def to_float32(stored: np.ndarray, index_dtype: str) -> np.ndarray:
    """Stored rows widened to float32 (exact: every float16 / bfloat16 value is a float32 value)."""
    if index_dtype == "bfloat16":
        return (np.asarray(stored, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(stored, dtype=np.float32)


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


def column_plan(
    report: CoverageReport,
    projection_dim: int | None,
    expert_blocks: str,
    projection: str = PROJECTION,
    target_dims: dict[str, int] | None = None,
) -> list[Block]:
    """Column blocks in target order: each side of a weight (and a bias's one side) takes
    `side_width(projection, features, p)` columns: p for a projected side, its own width for a
    side the kind keeps exact (`rademacher-hash-v2`: a side no wider than p; v1 and legacy
    indexes: none, every weight p*p, every bias p). With `projection_dim=None` (exact rows)
    each block has its parameter's (one expert's) shape. `projection`: the index's kind. `target_dims`:
    targets projected to their own dimension instead of p (the output layer's `output_projection_dim`).

    `expert_blocks="separate"` gives every expert its own blocks
    (`<experts>.expert_<i>.<proj>.weight`); `"sum"` sums a layer's independently projected
    experts into one block per projection (`<experts>.<proj>.weight`).
    """
    if expert_blocks not in ("separate", "sum"):
        raise ValueError(f"expert_blocks must be 'separate' or 'sum', not {expert_blocks!r}")
    p = projection_dim
    dims = target_dims or {}
    blocks: list[Block] = []
    col = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal col
        size = int(np.prod(shape))
        blocks.append(Block(name, col, col + size, shape))
        col += size

    for grads_key, lay, proj, key, exact in _entries(report):
        block = grads_key.rsplit(".", 1)[0]
        shape = exact if p is None else tuple(side_width(projection, d, dims.get(block, p)) for d in exact)
        if lay is not None and expert_blocks == "separate":
            for i in range(lay.num_experts):
                add(f"{lay.expert_name(i, proj)}.{key}", shape)
        else:
            add(grads_key, shape)
    return blocks


def flatten_rows(
    grads: dict, report: CoverageReport, blocks: list[Block], expert_blocks: str, attribute_tokens: bool = False
):
    """`flatten_batch` on the result's device: float32 `torch.Tensor` rows from one `torch.cat`, no host sync."""
    import torch

    lead = 2 if attribute_tokens else 1
    parts = []
    for grads_key, lay, _proj, _key, _shape in _entries(report):
        value = grads[grads_key]  # experts: [N, (S,) E, ...]
        if lay is not None and expert_blocks == "sum" and not attribute_tokens:
            value = value.sum(dim=1)
        parts.append(value.float().reshape(*value.shape[:lead], -1))
    rows = torch.cat(parts, dim=-1)
    if rows.shape[-1] != blocks[-1].stop:
        raise IndexFileError(f"internal: batch has {rows.shape[-1]} columns, the plan {blocks[-1].stop}")
    return rows


class FlattensRows(Protocol):
    """A column plan that forms its own rows (`eigenbasis.EigenPlan`)."""

    def flatten(self, grads: dict, attribute_tokens: bool = False) -> torch.Tensor: ...


def rows_of(
    grads: dict,
    report: CoverageReport,
    blocks: list[Block],
    expert_blocks: str,
    attribute_tokens: bool,
    plan: FlattensRows | None,
) -> torch.Tensor:
    """A batch's float32 rows in an index's column layout, on the batch's device: the seeded projections'
    blocks (`flatten_rows`), or an eigenbasis plan's (`EigenPlan.flatten`)."""
    if plan is not None:
        return plan.flatten(grads, attribute_tokens=attribute_tokens)
    return flatten_rows(grads, report, blocks, expert_blocks, attribute_tokens=attribute_tokens)


def flatten_batch(
    grads: dict, report: CoverageReport, blocks: list[Block], expert_blocks: str, attribute_tokens: bool = False
) -> np.ndarray:
    """Rows in plan order from a `collect(..., fused_experts=True)` result: `[N, dim]`, or
    `[N, S, dim]` for an `attribute_tokens=True` result (whose experts are already summed for "sum")."""
    return flatten_rows(grads, report, blocks, expert_blocks, attribute_tokens).cpu().numpy()


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
        index_dtype: str = DEFAULT_INDEX_DTYPE,
    ):
        self.examples = rows if examples is None else examples
        self.final = Path(path)
        self.dir = part_dir(path)
        self.overwrite = overwrite
        self.index_dtype = check_index_dtype(index_dtype)
        manifest = {**manifest, "settings": {**manifest["settings"], "index_dtype": index_dtype}}
        self.example_ids = manifest.get("example_ids")
        if create:
            self._prepare(manifest, rows, dim, layers, experts, num_batches, resume, token_offsets)
        self._open()

    def _prepare(self, manifest, rows, dim, layers, experts, num_batches, resume, token_offsets) -> None:
        check_index_target(self.final, self.overwrite)
        try:
            self.dir.mkdir(parents=True)
            fresh = True
        except FileExistsError:
            fresh = False
        with _owner_lock(self.dir):  # one build at a time decides who writes DIR.part
            if fresh:
                _claim(self.dir)
            else:
                self._resume(manifest, resume)
                return
        self._create(manifest, rows, dim, layers, experts, num_batches, token_offsets)

    def _resume(self, manifest: dict, resume: bool) -> None:
        """Continue the interrupted build in `DIR.part` (or refuse): never while its owner runs."""
        owner = read_owner(self.dir)
        if owner is not None and owner_alive(owner):
            raise IndexFileError(
                f"{self.dir} is being written by a running build ({describe_owner(owner)}); wait for it to finish "
                f"or stop it. If it is no longer running, delete {self.dir / OWNER_FILE} and pass --resume."
            )
        if not resume:
            raise IndexFileError(
                f"{self.dir} holds an interrupted build; pass --resume to continue it or delete it to start over."
            )
        if not (self.dir / "manifest.json").exists():
            raise IndexFileError(
                f"{self.dir} holds no manifest.json yet: another build is creating it right now, or one stopped "
                "while creating it; if no build is running, delete it and build again."
            )
        old = json.loads((self.dir / "manifest.json").read_text())
        old["settings"].setdefault("index_dtype", DEFAULT_INDEX_DTYPE)  # a build from before the key
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
        if owner is not None:
            warnings.warn(
                f"moe-attrib: resuming {self.dir}: its previous build ({describe_owner(owner)}) is no longer "
                "running; this build takes it over.",
                UserWarning,
                stacklevel=3,
            )
        _claim(self.dir)

    def _create(self, manifest, rows, dim, layers, experts, num_batches, token_offsets) -> None:
        stored = INDEX_DTYPES[self.index_dtype]
        np.lib.format.open_memmap(self.dir / "gradients.npy", mode="w+", dtype=stored, shape=(rows, dim)).flush()
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
        if self.gradients.dtype != INDEX_DTYPES[self.index_dtype]:
            raise IndexFileError(
                f"{self.dir}/gradients.npy holds {self.gradients.dtype} rows, not {self.index_dtype}: resume with the "
                "--index_dtype it was started with, or delete it and build again."
            )
        offsets = self.dir / "token_offsets.npy"
        self.token_offsets = np.load(offsets) if offsets.exists() else None

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
        and only then mark the batch done. Rows are stored in the index dtype; a finite value that
        the dtype cannot hold (float16 beyond +-65504) is an `IndexDtypeError` naming its examples."""
        stored = to_stored(gradients, self.index_dtype)
        if self.index_dtype != "float32":
            self._check_range(rows, gradients, stored)
        order = np.argsort(rows)
        self.gradients[rows[order]] = stored[order]
        order = np.argsort(examples)
        self.losses[examples[order]] = losses[order]
        self.counts[examples[order], : counts.shape[1], : counts.shape[2]] = counts[order]
        for arr in (self.gradients, self.losses, self.counts):
            arr.flush()
        self.done[batch] = 1
        self.done.flush()

    def _check_range(self, rows: np.ndarray, gradients: np.ndarray, stored: np.ndarray) -> None:
        lost = ~np.isfinite(to_float32(stored, self.index_dtype)).all(axis=1) & np.isfinite(gradients).all(axis=1)
        if not lost.any():
            return
        positions = np.asarray(rows)[lost]
        if self.token_offsets is not None:
            positions = np.searchsorted(self.token_offsets, positions, side="right") - 1
        ids = sorted({int(self.example_ids[p]) if self.example_ids else int(p) for p in positions})
        peak = float(np.abs(gradients[lost]).max())
        raise IndexDtypeError(
            f"example(s) {ids[:10]} (row numbers of the data) have gradient values up to {peak:.3g}, beyond "
            f"{self.index_dtype}'s range (max {DTYPE_MAX[self.index_dtype]:.6g}), which would be stored as inf. "
            f"Build with --index_dtype bfloat16 or float32 instead; delete {self.dir} and build again."
        )

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
        (self.dir / OWNER_FILE).unlink(missing_ok=True)
        if self.final.exists():
            check_index_target(self.final, self.overwrite)
            for name in INDEX_FILES:
                (self.final / name).unlink(missing_ok=True)
            self.final.rmdir()
        os.replace(self.dir, self.final)
        return self.final


@contextlib.contextmanager
def _owner_lock(part: Path) -> Iterator[None]:
    """An exclusive `flock` on the `DIR.part` directory while its owner is checked and claimed, so two
    builds starting together cannot both take it (where flock is unavailable: no lock)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(part, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _claim(part: Path) -> None:
    """Record this process as the build writing `part` (replacing a previous, finished owner)."""
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    (part / OWNER_FILE).unlink(missing_ok=True)
    fd = os.open(part / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)


def read_owner(part: str | Path) -> dict | None:
    """The build recorded as writing `DIR.part` (None: none recorded, or unreadable)."""
    try:
        owner = json.loads((Path(part) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def describe_owner(owner: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner['pid']} on host {owner.get('host')}, started {started}"


def owner_alive(owner: dict) -> bool:
    """Whether the recorded build may still be running: its pid is alive on this host and started no
    later than the build did (a pid reused since is not it). On another host it cannot be told, so yes."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner["pid"]
    if pid == os.getpid():  # this process's own earlier attempt, which has returned
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    began = _process_start(pid)
    return began is None or began <= float(owner.get("started", 0)) + 1.0


def _process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), from /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))  # fmt: skip
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


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

    @property
    def settings(self) -> IndexSettings:
        """The manifest's settings, typed (`moe_attrib.settings.IndexSettings`)."""
        return IndexSettings.from_dict(self.manifest["settings"])

    @property
    def dtype(self) -> str:
        """How rows are stored: "float32" (also an index from before the setting), "float16" or
        "bfloat16" (`gradients` then holds its uint16 bits)."""
        return self.settings.collect.index_dtype

    def read_rows(self, rows) -> np.ndarray:
        """Rows `gradients[rows]` (any numpy index) as float32, whatever the storage dtype."""
        return to_float32(self.gradients[rows], self.dtype)


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
    check_version(manifest, f"index {path}")
    try:
        gradients = np.load(path / "gradients.npy", mmap_mode="r")
        losses = np.load(path / "losses.npy", mmap_mode="r")
        counts = np.load(path / "expert_counts.npy", mmap_mode="r")
    except (OSError, ValueError) as err:
        raise IndexFileError(f"{path}: corrupt index file ({err}).") from err
    index_dtype = manifest.get("settings", {}).get("index_dtype", DEFAULT_INDEX_DTYPE)
    if index_dtype not in INDEX_DTYPES or gradients.dtype != INDEX_DTYPES[index_dtype]:
        raise IndexFileError(
            f"{path}: corrupt index: gradients.npy holds {gradients.dtype} but the manifest's index_dtype is "
            f"{index_dtype!r} (known: {', '.join(INDEX_DTYPES)}); rebuild the index."
        )
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
