"""`moe-attrib info DIR`: what an index or EK-FAC directory holds, read from its manifest alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

from moe_attrib.errors import MoeAttribError

_EXPERT_INDEX = re.compile(r"\.expert_(\d+)\.")


class InfoError(MoeAttribError, ValueError):
    """A directory that is neither an index nor EK-FAC factors (nor an interrupted build of one)."""


def disk_size(path: Path) -> int:
    """Bytes of every file under `path`."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _fingerprints(*dicts: dict) -> list[tuple[str, str]]:
    return [(k, str(v)) for d in dicts for k, v in d.items() if "fingerprint" in k and v is not None]


def summarize(path: str | Path) -> list[tuple[str, str]]:
    """(label, value) lines describing an index, an interrupted build (`DIR.part`) or an EK-FAC directory."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return _index_summary(path, json.loads((path / "manifest.json").read_text()))
    if (path / "ekfac.json").is_file():
        return _ekfac_summary(path, json.loads((path / "ekfac.json").read_text()))
    part = path.with_name(path.name + ".part")
    if (part / "manifest.json").is_file():
        return _index_summary(part, json.loads((part / "manifest.json").read_text()))
    raise InfoError(
        f"{path}: neither an index (manifest.json) nor EK-FAC factors (ekfac.json); "
        "give the directory written by `moe-attrib build --index` or `moe-attrib ekfac --out`."
    )


def _index_summary(path: Path, m: dict) -> list[tuple[str, str]]:
    s = m.get("settings", {})
    kind = "token index (--attribute_tokens)" if s.get("attribute_tokens") else "example index"
    status = "complete" if m.get("complete") else "INCOMPLETE (interrupted build: `moe-attrib build ... --resume`)"
    if not m.get("complete"):
        try:
            import numpy as np

            done = np.load(path / "done.npy", mmap_mode="r")
            status += f", {int(done.sum())}/{len(done)} batches written"
        except (OSError, ValueError):
            pass
    blocks = m.get("blocks", [])
    experts = sum(".expert_" in b["name"] for b in blocks)
    layers = m.get("expert_layers", [])
    per_layer = {int(e) for b in blocks for e in _EXPERT_INDEX.findall(b["name"])}
    tracked = (
        f"{len(layers)} fused experts modules" + (f", {len(per_layer)} experts each" if per_layer else ", summed")
        if layers
        else "none tracked (built without --track_moe_experts)"
    )
    lines = [
        ("path", str(path)),
        ("kind", f"{kind}, {status}"),
        ("model", str(s.get("model"))),
        ("data", str(s.get("data", "(not recorded)"))),
        ("rows", f"{m.get('rows'):,} rows for {m.get('examples'):,} examples"),
        ("columns", f"{m.get('dim'):,} in {len(blocks)} blocks ({experts} of them one expert's)"),
        ("coverage", f"{m['coverage']:.2%} of trainable parameters" if "coverage" in m else "(not recorded)"),
        ("experts", tracked),
    ]
    shown = (
        "projection_dim",
        "output_projection_dim",
        "projection",
        "seed",
        "expert_blocks",
        "track_moe_experts",
        "filter_modules",
        "optimizer_state",
    )
    lines += [("settings", ", ".join(f"{k}={s[k]}" for k in shown if k in s))]
    lines += [("index_dtype", f"{s.get('index_dtype', 'float32')} (rows as stored; read as float32)")]
    lines += [(k, str(s[k])) for k in ("dtype", "max_length", "truncate", "token_batch_size") if k in s]
    lines += _fingerprints(m, s)
    lines += [("version", f"moe-attrib {m.get('moe_attrib_version')}, format {m.get('format_version')}")]
    lines += [("size on disk", human_bytes(disk_size(path)))]
    return lines


def _ekfac_summary(path: Path, info: dict) -> list[tuple[str, str]]:
    factors = info.get("factors", {})
    s = info.get("settings", {})
    experts = [k for k, f in factors.items() if isinstance(f, dict) and f.get("experts")]
    modules = {k.rsplit(".", 1)[0] for k in experts}  # `<experts module>.<projection>`
    counts = sorted({int(factors[k]["experts"]) for k in experts if isinstance(factors[k]["experts"], int)})
    each = f", {'/'.join(map(str, counts))} experts each" if counts else ""
    lines = [
        ("path", str(path)),
        ("kind", "EK-FAC factors"),
        (
            "projection",
            f"projection_dim={info.get('projection_dim')}, seed={info.get('seed')}"
            + (f", output_projection_dim={s['output_projection_dim']}" if s.get("output_projection_dim") else ""),
        ),
        (
            "factors",
            f"{len(factors)} weights, {len(experts)} of them fused experts projections (one factor per expert)",
        ),
        ("experts", f"{len(modules)} fused experts modules{each}" if modules else "none (fitted without experts)"),
    ]
    lines += [(k, str(v)) for k, v in s.items() if "fingerprint" not in k]
    lines += _fingerprints(info, s)
    lines += [("size on disk", human_bytes(disk_size(path)))]
    return lines


def format_summary(lines: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)
