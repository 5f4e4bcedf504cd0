"""One Markdown table over every configuration's `benchmarks/results/lds-<config>.json` (what docs/quality.md shows).

    python benchmarks/lds_summary.py            # every result file present, tuning then held-out configurations
    python benchmarks/lds_summary.py --eigenbasis   # the same with the eigenbasis index as the default

Per configuration: the test-retest ceiling, the default pipeline, and the rows `lds.py --core` computes
(untracked, exact rows, each module group alone through the default index, exact `lm_head` alone), each with
the paired 95% CI of default - this (positive: the default is ahead). Two columns come from other result files
scored on the same caches, and are shown only where that file's own default pipeline equals this file's query
for query (so the pairing is real): Kronfluence 1.0.1 (`lds-peers-output-width.npz`, `lds_peers.py`) and the
eigenbasis index at 1 MiB with floors (`issue32/lds-budget-<config>-s16floors.json`, `lds_budget.py`). Then,
over the configurations with per-query LDS, each row's mean over the tuning and the held-out configurations with
the paired CI of this - default (queries resampled within each configuration).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402
import numpy as np  # noqa: E402
from lds_damping import mean_over  # noqa: E402

ROWS = [
    ("untracked", "default pipeline, not tracked (p=32)"),
    ("exact rows", "exact rows, otherwise default"),
    ("attention alone", "p=32, attention alone, EK-FAC (the default index, --modules)"),
    ("experts alone", "p=32, experts alone, EK-FAC (the default index, --modules)"),
    ("routers alone", "p=32, routers alone, EK-FAC (the default index, --modules)"),
    ("`lm_head` alone", "p=32, lm_head alone, EK-FAC (the default index, --modules)"),
    ("exact `lm_head` alone", "exact, lm_head alone, EK-FAC"),
]
DEFAULT = "default pipeline (p=32, experts tracked, EK-FAC)"
CEILING = "test-retest (same subsets, another data order)"
KRONFLUENCE = "Kronfluence 1.0.1"
EIGEN = "eigenbasis 1 MiB, floors"
COLUMNS = [label for label, _ in ROWS] + [KRONFLUENCE, EIGEN]
PEERS = "lds-peers-output-width.npz"  # lds_peers.py on the caches of these result files
EIGEN_FILES = ("issue32/lds-budget-{}-s16floors.json", "issue32/lds-budget-{}-s17floors.json")
KRONFLUENCE_LABELS = (  # lds_peers.py's: its defaults, else (where they fail) attention + lm_head only, marked *
    "Kronfluence 1.0.1 EK-FAC, its defaults",
    "Kronfluence 1.0.1 EK-FAC, its defaults but attention + lm_head only (its defaults fail)",
)
EIGEN_VARIANT = (  # its label in lds_budget.py's files, the budget in bytes left out
    "eigenbasis, (as 1024 KiB on Qwen3-30B-A3B), bfloat16, output sketch 512, dense floor 32, "
    "output floor V/8 in [dense, 256]"
)


def variants(name: str, results: Path) -> dict:
    """The variants of configuration `name`'s result file (none without one)."""
    path = results / f"lds-{name}.json"
    return json.loads(path.read_text())["variants"] if path.exists() else {}


def per_query(name: str, results: Path, v: dict | None = None) -> dict[str, np.ndarray]:
    """`{column: per-query LDS}` of configuration `name` (with "default" and "ceiling"), where kept; `v`: its
    variants, if already read."""
    v = variants(name, results) if v is None else v
    if DEFAULT not in v or "per_query" not in v[DEFAULT]:
        return {}
    out = {"default": np.array(v[DEFAULT]["per_query"]), "ceiling": np.array(v[CEILING]["per_query"])}
    out.update({label: np.array(v[key]["per_query"]) for label, key in ROWS if key in v})
    base = out["default"]
    if (results / PEERS).exists():
        peers = np.load(results / PEERS)
        if f"{name}|moe-attrib default" in peers and np.allclose(peers[f"{name}|moe-attrib default"], base):
            for label in KRONFLUENCE_LABELS:
                if f"{name}|{label}" in peers:
                    out[KRONFLUENCE] = peers[f"{name}|{label}"]
    for eigen in (results / f.format(name) for f in EIGEN_FILES):
        if not eigen.exists():
            continue
        got = json.loads(eigen.read_text())["variants"]
        mine = next((r for label, r in got.items() if label.startswith("default:")), None)
        for label, r in got.items():
            if mine and np.allclose(mine["per_query"], base) and re.sub(r"budget \d+ B ", "", label) == EIGEN_VARIANT:
                out[EIGEN] = np.array(r["per_query"])
    return out


def kronfluence_fallback(name: str, results: Path) -> bool:
    """Whether configuration `name`'s Kronfluence column is the attention + lm_head fallback (its defaults fail)."""
    return (results / PEERS).exists() and f"{name}|{KRONFLUENCE_LABELS[1]}" in np.load(results / PEERS)


def cell(values: dict[str, np.ndarray], label: str, marked: bool) -> str:
    """Column `label`'s LDS and the paired 95% CI of default - it; `marked`: a `*` after a fallback Kronfluence."""
    lo, hi = lds.bootstrap(values["default"] - values[label])
    mark = "*" if label == KRONFLUENCE and marked else ""
    return f"{values[label].mean():.3f}{mark} [{lo:+.3f}, {hi:+.3f}]"


def print_means(sets: list[tuple[str, list[str]]], per_config, title: str) -> None:
    """For each `(name, configurations)` of `sets`, every column's mean with its paired CI (`mean_over`) over the
    configurations `per_config` has per-query LDS for; the ceiling too where every one of them has it."""
    for name, configs in sets:
        values = {c: v for c in configs if (v := per_config(c))}
        if values:
            print(f"\nMeans over the {name} configurations{title} ({', '.join(values)}):")
            mean_over(values, list(values), "default")


def table(names: list[str], results: Path) -> str:
    head = "| configuration | ceiling | default | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|---" * (3 + len(COLUMNS)) + "|"]
    for name in names:
        v = variants(name, results)
        if not v:
            continue
        values = per_query(name, results, v)
        cells = [f"{v[CEILING]['lds']:.3f}", f"**{v[DEFAULT]['lds']:.3f}**"]
        for label in COLUMNS:
            key = dict(ROWS).get(label)
            if label in values:
                cells.append(cell(values, label, kronfluence_fallback(name, results)))
            elif key in v:  # a result file from before per-query LDS were kept: its own CI
                lo, hi = v[key]["default_minus_this_ci95"]
                cells.append(f"{v[key]['lds']:.3f} [{lo:+.3f}, {hi:+.3f}]")
            else:
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


GROUPS_FILE = "issue32/lds-budget-{}-s19groups.json"  # lds_budget.py --groups: the eigenbasis default's rows
DEFAULT_VARIANT = (  # the eigenbasis default's label there (the output floor's cells shaped by the greedy, sketch 1024)
    "eigenbasis, (as 1024 KiB on Qwen3-30B-A3B), bfloat16, output sketch 1024, dense floor 32, "
    "output floor V/8 in [dense, 256], area"
)
# the same label in session 18's files: the eigenbasis default then (experts' weight 1, damping 0.01 x model-wide)
BEFORE_FILE = "issue32/lds-budget-{}-s18groups.json"
BEFORE_VARIANTS = "issue32/score-variants-{}-s19.json"  # benchmarks/probes/score_variants.py: its "default" is it too
SEEDED = "seeded p=32 (the default before)"
BEFORE = "eigenbasis default before (experts x1, damping 0.01 x model)"
EIGEN_COLUMNS = [
    "untracked",
    "exact rows",
    "attention alone",
    "experts alone",
    "routers alone",
    "`lm_head` alone",
    BEFORE,
    SEEDED,
    KRONFLUENCE,
]


def eigen_per_query(name: str, results: Path) -> dict[str, np.ndarray]:
    """`{column: per-query LDS}` with the eigenbasis default (the index at what 1 MiB buys on Qwen3-30B-A3B,
    floors) as "default": its module groups alone and untracked (`GROUPS_FILE`), the seeded p=32 pipeline, and
    exact rows, the ceiling and Kronfluence from `per_query` where that file's default is the seeded one here."""
    path = results / GROUPS_FILE.format(name)
    if not path.exists():
        return {}
    got = {label: np.array(r["per_query"]) for label, r in json.loads(path.read_text())["variants"].items()}
    eig = next(label for label in got if re.sub(r"budget \d+ B ", "", label) == DEFAULT_VARIANT)
    out = {"default": got[eig], SEEDED: got["default: projected p=32, float32"], "untracked": got[f"{eig}, untracked"]}
    before = results / BEFORE_FILE.format(name)
    if before.exists():
        earlier = json.loads(before.read_text())["variants"]
        out[BEFORE] = next(np.array(r["per_query"]) for label, r in earlier.items()
                           if re.sub(r"budget \d+ B ", "", label) == DEFAULT_VARIANT)  # fmt: skip
    elif (results / BEFORE_VARIANTS.format(name)).exists():  # the configurations frozen after session 18
        out[BEFORE] = np.array(json.loads((results / BEFORE_VARIANTS.format(name)).read_text())["variants"]["default"]
                               ["per_query"])  # fmt: skip
    columns = ["attention alone", "experts alone", "routers alone", "`lm_head` alone"]
    for group, column in zip(lds.GROUPS, columns, strict=True):
        out[column] = got[f"{eig}, {group} alone"]
    seeded = per_query(name, results)
    # the same cache (so the same queries and subset models) if a pipeline both files scored agrees: the seeded
    # default (files written before the damping changed) or exact rows (both at today's damping)
    same = seeded and (
        np.allclose(seeded["default"], out[SEEDED])
        or ("exact rows" in got and "exact rows" in seeded and np.allclose(seeded["exact rows"], got["exact rows"]))
    )
    if same:
        out.update({k: seeded[k] for k in ("ceiling", "exact rows", KRONFLUENCE) if k in seeded})
    if "exact rows" in got:  # scored with the default damping beside the default (lds_budget.py without --no_exact)
        out["exact rows"] = got["exact rows"]
    return out


def eigen_table(names: list[str], results: Path) -> str:
    lines = ["| configuration | ceiling | default (eigenbasis) | " + " | ".join(EIGEN_COLUMNS) + " |"]
    lines.append("|---" * (3 + len(EIGEN_COLUMNS)) + "|")
    for name in names:
        values = eigen_per_query(name, results)
        if not values:
            continue
        ceiling = f"{values['ceiling'].mean():.3f}" if "ceiling" in values else "-"
        cells = [ceiling, f"**{values['default'].mean():.3f}**"]
        marked = kronfluence_fallback(name, results)
        cells += [cell(values, label, marked) if label in values else "-" for label in EIGEN_COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def eigen_main(results: Path, sets: list[tuple[str, list[str]]]) -> None:
    """`--eigenbasis`: every configuration with the eigenbasis index as the default."""
    for title, names in sets:
        print(f"\n{title}\n\n" + eigen_table(names, results))

    def no_ceiling(name: str) -> dict[str, np.ndarray]:
        return {k: x for k, x in eigen_per_query(name, results).items() if k != "ceiling"}

    print_means(sets, no_ceiling, "")


def main() -> None:
    results = lds.ROOT / "benchmarks" / "results"
    if "--eigenbasis" in sys.argv[1:]:
        held = list(lds.HELDOUT) + list(lds.HELDOUT_HEAD)
        sets = [("tuning", list(lds.TUNING)), ("held-out", held), ("HELDOUT_NEXT", list(lds.HELDOUT_NEXT))]
        sets += [("HELDOUT_S18", list(lds.HELDOUT_S18)), ("HELDOUT_S19", list(lds.HELDOUT_S19))]
        sets += [("HELDOUT_S20", list(lds.HELDOUT_S20))]
        eigen_main(results, sets)
        return
    tuning = list(lds.TUNING)
    held = list(lds.HELDOUT) + list(lds.HELDOUT_HEAD) + ["cpu-heldout", "cpu-heldout2"]
    later = list(lds.HELDOUT_NEXT)
    print("Tuning configurations\n\n" + table(tuning, results))
    print("\nHeld-out configurations\n\n" + table(held, results))
    print("\nHeld out for the eigenbasis default (lds.HELDOUT_NEXT)\n\n" + table(later, results))
    print("\nHeld out for its output layer (lds.HELDOUT_S18)\n\n" + table(list(lds.HELDOUT_S18), results))
    print("\n* Kronfluence's defaults fail on this family (an nn.Linear inside the MoE block sees tokens as its "
          "batch); attention + lm_head only, what it tracks on every other family")  # fmt: skip
    sets = [("tuning", tuning), ("held-out", held), ("HELDOUT_NEXT", later), ("HELDOUT_S18", list(lds.HELDOUT_S18))]
    print_means(sets, lambda n: per_query(n, results), " with per-query LDS")


if __name__ == "__main__":
    main()
