"""Probe: what the default allocation gives the output layer under each output-floor shape.

Why: under "area", "square" and "fill" the floor is a rectangle that the greedy may grow with the rest of the budget;
"cross" is an L the greedy leaves as it is. On the `gpu` configuration "cross" ranked 0.042 below "area" in the whole
pipeline while the output layer alone tied (docs/build.md, the output floor's shape: hidden and cross); this prints,
per shape, the budget `lds_budget.py --scaled 1MiB` gives the model, the output layer's kept shape and the cells of the
dense blocks, from factors fitted as `build` fits them.
Usage: `python benchmarks/probes/head_shapes.py gpu text-deep cpu`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lds  # noqa: E402
import lds_budget  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.curvature import eigenbasis  # noqa: E402
from moe_attrib.settings import EIGENBASIS_OUTPUT_SKETCH, EIGENBASIS_SKETCH  # noqa: E402


def run(name: str, cache: Path) -> None:
    c = lds.load_cached(name, cache)
    model = c.model()
    report = ma.discover(model, track_moe_experts=True, warn=False)
    sketches = {"projection_dim": EIGENBASIS_SKETCH, "output_projection_dim": EIGENBASIS_OUTPUT_SKETCH}
    ek = ma.fit_ekfac(model, c.examples, progress=False, **sketches)
    blocks = lds_budget.weight_blocks(report)
    for shape in eigenbasis.OUTPUT_FLOOR_SHAPES:
        budget = lds_budget.scaled_budget(eigenbasis.parse_bytes("1MiB"), "bfloat16", 32, -8, report, blocks,
                                          EIGENBASIS_SKETCH, EIGENBASIS_OUTPUT_SKETCH, shape)  # fmt: skip
        with lds_budget.allocation_rule(32, -8, shape=shape):
            plan = eigenbasis.plan_eigenbasis(report, ek, budget, "bfloat16")
        (head,) = [t.shapes[0] for t in plan.targets if t.block == report.output_layer]
        dense = sum(eigenbasis.cells_of(s) for t in plan.targets if not t.experts for s in t.shapes)
        print(f"{name}: {shape:6s} budget {budget:,} B, output layer {head} ({eigenbasis.cells_of(head):,} cells) of "
              f"{tuple(ek.factors[report.output_layer].lam.shape)}, dense blocks {dense:,} of {plan.dim:,} columns",
              flush=True)  # fmt: skip


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        run(name, Path(args.cache))


if __name__ == "__main__":
    main()
