"""Probe: does a configuration's LDS reproduce from the tracked ground truth on a fresh machine?

Why: the caches of session 21 were lost with its machine; session 22 retrained every configuration's subset models
(some on the device machine's CPUs, under another torch build) and kept them in `benchmarks/ground_truth/`. This
prints, per configuration, the default's LDS in the result files of two `lds_budget.py` tags (the same variant label)
and their difference with a bootstrap CI over queries (the per-query LDS paired; what differs is the ground truth's
retrained models and the full model's floats).
Usage: `python benchmarks/probes/repro_check.py --old -s21cross --new -s22check NAMES`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lds_budget import OUT  # noqa: E402


def default_of(path: Path, suffix: str) -> tuple[str, np.ndarray] | None:
    if not path.exists():
        return None
    variants = json.loads(path.read_text())["variants"]
    for label, v in variants.items():
        if label.startswith("eigenbasis") and label.endswith(suffix):
            return label, np.asarray(v["per_query"], dtype=float)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--old", required=True, help="the earlier result files' tag, e.g. -s21cross")
    parser.add_argument("--new", required=True, help="the rerun's tag, e.g. -s22check")
    parser.add_argument("--variant", default=", area", help="the end of the variant's label")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    diffs = []
    print(f"{'configuration':18s} {'old':>6s} {'new':>6s} {'new - old':>10s}  95% CI (queries resampled)")
    for name in args.configs:
        old = default_of(OUT / f"lds-budget-{name}{args.old}.json", args.variant)
        new = default_of(OUT / f"lds-budget-{name}{args.new}.json", args.variant)
        if old is None or new is None:
            print(f"{name:18s} (missing: {'old' if old is None else 'new'})")
            continue
        a, b = old[1], new[1]
        d = b - a
        boot = [d[rng.integers(0, len(d), len(d))].mean() for _ in range(2000)]
        lo, hi = np.percentile(boot, [2.5, 97.5])
        diffs.append(d.mean())
        print(f"{name:18s} {a.mean():6.3f} {b.mean():6.3f} {d.mean():+10.3f}  [{lo:+.3f}, {hi:+.3f}]")
    if diffs:
        mean, worst = float(np.mean(diffs)), float(np.max(np.abs(diffs)))
        print(f"mean over {len(diffs)}: {mean:+.4f}; largest |new - old|: {worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
