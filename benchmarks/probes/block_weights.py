"""Probe: how much each module group's blocks are truncated in the default eigenbasis index, as truncation weights.

Why: rule heldout_s22 weighs each block's preconditioned query columns by `r = sum_all lambda/(lambda+d) /
sum_kept lambda/(lambda+d)` (`precondition.block_weight`), the factor that restores the block's expected part of
`g' P g` to the exact rows'. Prints, per configuration and module group, the blocks' weights (min, median, max): a
weight near 1 means the block is kept almost whole in the metric that scores, and weighting it can change little.
Usage: `python benchmarks/probes/block_weights.py text-deep heldout-hunyuan text-pydoc`.
"""

from __future__ import annotations

import fnmatch
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lds  # noqa: E402
import lds_budget  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.curvature.precondition import block_weight  # noqa: E402


def main() -> int:
    parser = lds.cached_configs_parser(__doc__)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        cached = lds.load_cached(name, Path(args.cache))
        model = cached.model()
        with tempfile.TemporaryDirectory() as tmp:
            ek = lds_budget.build_default_index(model, cached.examples, Path(tmp) / "ix")
            index = ma.load_index(Path(tmp) / "ix")
            globs, by_group = lds.groups(model), {}  # the benchmark's module groups (`score --modules`)
            for b in index.blocks:
                group = next((g for g, glob in globs.items() if fnmatch.fnmatchcase(b.name, glob)), "in no group")
                by_group.setdefault(group, []).append(block_weight(b, ek, "all"))
        for group, weights in sorted(by_group.items()):
            w = np.asarray(weights)
            print(f"{name}: {group:12s} {len(w):4d} blocks, weight min {w.min():.3f} median {np.median(w):.3f} "
                  f"max {w.max():.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
