"""Files the commands write: checked before any work, never an input of the same run, never an
existing file without `--overwrite`, and never half-written.

`check_output` refuses, before any work starts, an output path that is a directory, lies in a
missing or read-only directory, names an input of the run or a file the index records (training
data, queries, the scores file being read, the index directory itself), names another output of
the same run, or exists while `--overwrite` is not given. `replacing` and `temporary` write under a
temporary name in the same directory and `os.replace` it over the target only once complete, so an
interrupted run (Ctrl-C, kill -9, a full disk) leaves the previous file as it was.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from moe_attrib.errors import MoeAttribError

TEMP_PREFIX = ".moe-attrib-tmp-"


class OutputError(MoeAttribError, ValueError):
    """An output path that cannot or must not be written; the message names the flag and the path."""


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _inside(path: Path, directory: Path) -> bool:
    try:
        return directory.is_dir() and path.resolve().is_relative_to(directory.resolve())
    except OSError:
        return False


def check_output(
    path: str | Path,
    flag: str,
    *,
    overwrite: bool,
    inputs: dict[str, str | Path | None] | None = None,
    outputs: dict[str, str | Path | None] | None = None,
) -> Path:
    """`path` may be written by this run: an `OutputError` naming `flag` otherwise.

    `inputs` maps what a path is (e.g. "the training data the index records") to the path (None:
    none); `path` must be none of them and lie inside none of their directories. `outputs` maps the
    other output flags of the run to their paths, which must differ from `path`. An existing file
    is replaced only with `overwrite`."""
    out = Path(path)
    for what, source in (inputs or {}).items():
        if source is None:
            continue
        source = Path(source)
        if _same(out, source) or _inside(out, source):
            raise OutputError(f"{flag} {path}: refusing to overwrite {what} ({source}); choose another file name.")
    for other, target in (outputs or {}).items():
        if target is not None and _same(out, Path(target)):
            raise OutputError(f"{flag} {path}: {other} writes the same file; give them different names.")
    if out.is_dir():
        raise OutputError(f"{flag} {path}: is a directory; give a file name.")
    parent = out.parent
    if not parent.resolve().is_dir():
        raise OutputError(f"{flag} {path}: no such directory {parent}.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: cannot write in {parent} (read-only or no permission).")
    if out.exists() and not overwrite:
        raise OutputError(f"{flag} {path}: the file exists; pass --overwrite to replace it, or choose another name.")
    return out


def check_outputs(
    outputs: dict[str, str | Path | None], *, overwrite: bool, inputs: dict[str, str | Path | None] | None = None
) -> None:
    """`check_output` for every output of one run (`outputs`: flag -> path, None: not written), each
    also against the others."""
    for flag, path in outputs.items():
        if path is not None:
            others = {k: v for k, v in outputs.items() if k != flag}
            check_output(path, flag, overwrite=overwrite, inputs=inputs, outputs=others)


def temporary_path(path: str | Path) -> Path:
    """A fresh name in `path`'s directory (so the final `os.replace` is a rename on one filesystem)."""
    path = Path(path)
    return path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex[:12]}-{path.name}")


@contextlib.contextmanager
def scratch(path: str | Path | None) -> Iterator[Path | None]:
    """A temporary name for `path` (None: None) that the caller renames into place with `os.replace`
    once the file is complete; deleted on leaving if it is still there (an error, Ctrl-C)."""
    if path is None:
        yield None
        return
    tmp = temporary_path(path)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def temporary(path: str | Path) -> Iterator[Path]:
    """A temporary name for `path`, renamed over `path` when the block completes and deleted when it
    raises (the previous file at `path`, if any, then stays as it was)."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing(path: str | Path, mode: str = "w", **kwargs) -> Iterator[IO]:
    """`open(path, mode)` for writing, through a temporary file renamed into place when complete."""
    with temporary(path) as tmp:
        try:
            f = open(tmp, mode, **kwargs)  # noqa: SIM115 (closed below, errors name the target)
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(path)) from err
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_text(path: str | Path, text: str) -> Path:
    """`path.write_text(text)` (UTF-8), complete or not at all."""
    with replacing(path, encoding="utf-8") as f:
        f.write(text)
    return Path(path)
