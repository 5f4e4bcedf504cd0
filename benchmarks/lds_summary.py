"""One Markdown table over every configuration's `benchmarks/results/lds-<config>.json` (what docs/quality.md shows).

    python benchmarks/lds_summary.py            # every result file present, tuning then held-out configurations

Per configuration: the test-retest ceiling, the default pipeline, and the rows `lds.py --core` computes
(untracked, exact rows, each module group alone through the default index, exact `lm_head` alone),
each with the paired 95% CI of default - this (positive: the default is ahead).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

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


def table(names: list[str], results: Path) -> str:
    head = "| configuration | ceiling | default | " + " | ".join(label for label, _ in ROWS) + " |"
    lines = [head, "|---" * (3 + len(ROWS)) + "|"]
    for name in names:
        path = results / f"lds-{name}.json"
        if not path.exists():
            continue
        v = json.loads(path.read_text())["variants"]
        cells = [f"{v[CEILING]['lds']:.3f}", f"**{v[DEFAULT]['lds']:.3f}**"]
        for _, key in ROWS:
            if key in v:
                lo, hi = v[key]["default_minus_this_ci95"]
                cells.append(f"{v[key]['lds']:.3f} [{lo:+.3f}, {hi:+.3f}]")
            else:
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    results = lds.ROOT / "benchmarks" / "results"
    tuning = list(lds.TUNING)
    held = list(lds.HELDOUT) + ["cpu-heldout", "cpu-heldout2"]
    print("Tuning configurations\n\n" + table(tuning, results))
    print("\nHeld-out configurations\n\n" + table(held, results))


if __name__ == "__main__":
    main()
