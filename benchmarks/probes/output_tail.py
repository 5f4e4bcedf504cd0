"""Probe: the output layer alone, truncated to its leading eigen-directions or sketched, at the same numbers.

Why: on the small-vocabulary plain-text configurations the default index keeps 1,024 of the output layer's
6,400-8,000 cells (its leading direction pairs) and ranks below the seeded p=32 index, whose output layer is a
1,024-number random sketch; given every cell, it reaches exact rows (docs/quality.md, "Where the plain-text gap
is"). This scores the output layer alone from its exact per-example gradients and exact EK-FAC factors (today's
damping), so the only difference between rows is what `m` numbers per example keep:

- `exact`: every cell, preconditioned (checked against `score_matrix(..., modules=<output layer>)`);
- `leading m, greedy-shaped`: the output floor's cells in the shape the allocation's greedy gives them
  (`eigenbasis.allocate` on the layer's direction weights, as `fit_floors` shaped the floor under "area"), m = the
  floor's cells;
- `sketch m`: a seeded Gaussian sketch to m numbers of the preconditioned rotated gradient
  `(Lambda + d)^-1/2 Q^T G Q` (its inner products estimate the preconditioned scores);
- `leading m, square`: the r x r leading cells (the square floor);
- `leading m/2 + sketch m/2`: the leading half exactly, the other directions sketched.

Each is scored raw and with training rows unit-normalised in the preconditioned metric (the default's cosine).
Usage: `python benchmarks/probes/output_tail.py text-plain text-deep heldout-hunyuan text-pydoc`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.curvature import eigenbasis  # noqa: E402


def sketch(x: torch.Tensor, m: int, seed: int) -> torch.Tensor:
    """`x` `[N, cells]` times a seeded Gaussian `[cells, m] / sqrt(m)`."""
    g = torch.Generator().manual_seed(seed)
    return x @ (torch.randn(x.shape[1], m, generator=g, dtype=x.dtype) / m**0.5)


SKETCH_MAX = 2 * 10**8  # cells x m of the Gaussian sketch formed at most (a larger output layer: no sketch rows)


def variants(qr: torch.Tensor, tr: torch.Tensor, keep: torch.Tensor, square: torch.Tensor, m: int) -> dict:
    """`{label: (query part, train part)}` whose inner products are the scores; `qr`, `tr` the preconditioned-metric
    rows `scale * rotated` flattened, `keep` the leading cells' flat positions (greedy-shaped), `square` the r x r
    leading cells'."""
    rest = torch.ones(qr.shape[1], dtype=torch.bool)
    half = keep[: m // 2]
    rest[half] = False
    both = torch.cat([qr, tr])
    out = {"exact": (qr, tr), f"leading {m}, greedy-shaped": (qr[:, keep], tr[:, keep])}
    out[f"leading {len(square)}, square"] = (qr[:, square], tr[:, square])
    if qr.shape[1] * m > SKETCH_MAX:
        return out
    s = sketch(both, m, 0)
    out[f"sketch {m}"] = (s[: len(qr)], s[len(qr) :])
    s = torch.cat([both[:, half], sketch(both[:, rest], m - len(half), 1)], 1)
    out[f"leading {len(half)} + sketch {m - len(half)}"] = (s[: len(qr)], s[len(qr) :])
    return out


def run(name: str, cache: Path) -> None:
    c = lds.load_cached(name, cache)
    model = c.model()
    report = ma.discover(model, track_moe_experts=True, warn=False)
    head = report.output_layer
    ek = ma.fit_ekfac(model, c.examples, projection_dim=None, progress=False)
    f = ek.factors[head]
    with tempfile.TemporaryDirectory() as tmp:
        ma.build_index(model, c.examples, tmp, projection_dim=None, progress=False)
        index = ma.load_index(tmp)
        q = ma.query_gradients(model, c.queries, index)
        check = ma.score_matrix(index, q, ekfac=ek, device="cpu", modules=f"{head}.*", balance=None, coupling=None,
                                unit_normalize=False)  # fmt: skip
        blk = next(b for b in index.blocks if b.name == f"{head}.weight")
        train = torch.from_numpy(np.asarray(index.gradients[:, blk.start : blk.stop], dtype=np.float64))
        query = torch.as_tensor(np.asarray(q)[:, blk.start : blk.stop], dtype=torch.float64)
    qrows, qcols = (t.double() for t in f.rows_cols)
    lam = f.lam.double()
    shape = lam.shape
    scale = (lam + f.damping.double()) ** -0.5

    def rotated(g: torch.Tensor) -> torch.Tensor:
        return ((qrows.T @ g.view(-1, *shape) @ qcols) * scale).flatten(1)

    qr, tr = rotated(query), rotated(train)
    exact = (qr @ tr.T).numpy()
    err = np.abs(exact - check).max() / np.abs(exact).max()
    # the leading cells: the output floor's r * r cells shaped by the greedy on the allocation's weights
    allocation = ek.with_damping(eigenbasis.ALLOCATION_DAMPING, eigenbasis.ALLOCATION_SCOPE).factors[head]
    (weights,) = eigenbasis.weights_of(allocation)
    r = eigenbasis.output_floor(shape[0] if not f.transposed else shape[1], eigenbasis.DENSE_DIRECTIONS)
    ((kr, kc),) = eigenbasis.allocate([weights], r * r)
    rows, cols = eigenbasis.direction_order(f)
    keep = (rows[:kr, None] * shape[1] + cols[None, :kc]).flatten()
    square = (rows[:r, None] * shape[1] + cols[None, :r]).flatten()
    m = kr * kc
    print(f"== {name}: output layer {tuple(shape)} ({shape[0] * shape[1]} cells), leading {kr} x {kc} = {m}; "
          f"exact scores against score_matrix: max rel. diff {err:.1e}", flush=True)  # fmt: skip
    for label, (a, b) in variants(qr, tr, keep, square, m).items():
        for cosine in (False, True):
            bn = b / b.norm(dim=1, keepdim=True) if cosine else b
            values = lds.per_query_lds((a @ bn.T).numpy(), c.subsets, c.losses)
            lo, hi = lds.bootstrap(values)
            print(f"  {label:32s} {'cosine' if cosine else 'raw   '} LDS {values.mean():.3f} [{lo:.3f}, {hi:.3f}]",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        run(name, Path(args.cache))


if __name__ == "__main__":
    main()
