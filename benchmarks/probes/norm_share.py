"""Probe: each module group's share of the training rows' preconditioned norm, by output floor shape.

Why: on `gpu` the cross-shaped output floor ranked 0.042 below the greedy-shaped one in the whole pipeline while the
output layer alone tied (docs/build.md, the output floor's shape: hidden and cross). A score's whole-model vote weighs
each block by its part of `g . P g` (P: the elementwise EK-FAC preconditioning, the training row cosine-normalised in
that metric), so the floor's shape also sets the output layer's weight. Prints, per shape, the mean over training
rows of each group's share of `g . P g` in the default index built with that shape.
Usage: `python benchmarks/probes/norm_share.py gpu text-deep --shapes area cross square`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lds  # noqa: E402
import lds_budget  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.curvature.precondition import precondition_eigen  # noqa: E402


def group_of(name: str) -> str:
    if name.startswith("lm_head"):
        return "output layer"
    if ".experts." in name:
        return "experts"
    if "self_attn" in name:
        return "attention"
    return "routers"


def run(name: str, cache: Path, shapes: list[str]) -> None:
    c = lds.load_cached(name, cache)
    model = c.model()
    ek = None
    for shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            ek = lds_budget.build_default_index(model, c.examples, tmp, ekfac=ek, shape=shape)
            index = ma.load_index(tmp)
            rows = torch.from_numpy(np.asarray(index.read_rows(slice(None)), dtype=np.float32))
            energy = rows.double() * precondition_eigen(rows, index.blocks, ek, index.manifest["settings"]).double()
            total = energy.sum(1)
            shares: dict[str, torch.Tensor] = {}
            for b in index.blocks:
                g = group_of(b.name)
                shares[g] = shares.get(g, 0) + energy[:, b.start : b.stop].sum(1)
            head = next(b for b in index.blocks if b.name.startswith("lm_head"))
            parts = ", ".join(f"{g} {float((v / total).mean()):.3f}" for g, v in shares.items())
            print(f"{name}: {shape:6s} output layer {head.shape}: share of g . P g: {parts}", flush=True)


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["area", "cross", "square"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        run(name, Path(args.cache), args.shapes)


if __name__ == "__main__":
    main()
