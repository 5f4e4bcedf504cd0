"""Checks of a command line before any work starts: argument types, devices, model specs, output
paths and EK-FAC directories. Each failure is a `UsageError` naming the flag and what to do."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moe_attrib.data import looks_like_hub_id
from moe_attrib.errors import MoeAttribError
from moe_attrib.settings import (  # noqa: F401 (the argument types, re-exported)
    MAX_PROJECTION_DIM,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    projection_size,
)


class UsageError(MoeAttribError, ValueError):
    """A command line that cannot work as given; found before any directory is created or compute starts."""


def check_device(spec: str | None, flag: str = "--device") -> None:
    """A device string that this machine has (a CUDA device index that exists)."""
    if spec is None:
        return
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError) as err:
        raise UsageError(f"{flag} {spec!r}: not a device ({err}); use cpu, cuda or cuda:N.") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {spec}: no CUDA device is available here; use --device cpu.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {spec}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise UsageError(f"{flag} {spec}: unsupported device type {dev.type!r}; use cpu or cuda.")


def check_model_spec(spec: str) -> None:
    """`tiny:<family>`, an existing model directory, or a hub id (`org/name`); anything else is a
    mistyped path and says so instead of asking the hub."""
    if spec.startswith("tiny:"):
        from moe_attrib.model.zoo import FAMILY_OVERRIDES

        if spec[5:] not in FAMILY_OVERRIDES:
            raise UsageError(f"{spec}: unknown tiny family; known: {', '.join(sorted(FAMILY_OVERRIDES))}.")
        return
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UsageError(f"{spec}: not a save_pretrained model directory (no config.json in it).")
        return
    if path.exists():
        raise UsageError(f"{spec}: is a file; MODEL must be a save_pretrained model directory or a hub id.")
    if not looks_like_hub_id(spec):
        raise UsageError(f"{spec}: no such model directory.")


def check_out_dir(path: str, overwrite: bool, flag: str) -> None:
    """An output directory is absent, empty, or (with --overwrite) replaced file by file; its parent is writable."""
    out = Path(path)
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"{flag} {path}: is a file, not a directory.")
        if any(out.iterdir()) and not overwrite:
            raise UsageError(
                f"{flag} {path}: the directory is not empty; pass --overwrite to replace the files moe-attrib "
                "writes there (nothing else is touched), or choose another directory."
            )
        if not os.access(out, os.W_OK):
            raise UsageError(f"{flag} {path}: the directory is not writable.")
        return
    check_parent_writable(out, flag)


def check_parent_writable(path: Path, flag: str) -> None:
    parent = path.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot create it ({parent} is not a writable directory).")


def check_ekfac_dirs(dirs: list[str], settings: dict, index_path: str) -> None:
    """Each `--ekfac DIR` is an EK-FAC directory made for this index (model, tokenizer, projection)."""
    import json

    from moe_attrib.collect.projection import projection_kind
    from moe_attrib.fingerprint import check_settings_match

    for d in dirs:
        try:
            info = json.loads((Path(d) / "ekfac.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UsageError(f"--ekfac {d}: not an EK-FAC directory (no readable ekfac.json: {err}).") from err
        if (info["projection_dim"], info["seed"]) != (settings["projection_dim"], settings["seed"]):
            raise UsageError(
                f"--ekfac {d}: fitted with projection_dim={info['projection_dim']}, seed={info['seed']} but the index "
                f"{index_path} uses projection_dim={settings['projection_dim']}, seed={settings['seed']}; refit with "
                f"`moe-attrib ekfac ... --index {index_path}`."
            )
        outputs = (settings.get("output_projection_dim"), info.get("settings", {}).get("output_projection_dim"))
        if settings["projection_dim"] is not None and outputs[0] != outputs[1]:
            raise UsageError(
                f"--ekfac {d}: fitted with output_projection_dim={outputs[1]} but the index {index_path} uses "
                f"{outputs[0]} (None: the output layer projected like every block); refit with "
                f"`moe-attrib ekfac ... --index {index_path}`."
            )
        kinds = (projection_kind(settings), projection_kind(info.get("settings", {})))
        if settings["projection_dim"] is not None and kinds[0] != kinds[1]:
            raise UsageError(
                f"--ekfac {d}: fitted with projection {kinds[1]!r} but the index {index_path} uses {kinds[0]!r}; "
                f"refit with `moe-attrib ekfac ... --index {index_path}` (it takes the index's)."
            )
        check_settings_match(settings, info.get("settings", {}), a_name=f"index {index_path}", b_name=f"--ekfac {d}")
