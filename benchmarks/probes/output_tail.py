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
- `leading m/2 + sketch m/2`: the leading half exactly, the other directions sketched;
- `leading kr x kc`: the leading rectangles of every power-of-two aspect with r * r cells (`rectangles`);
- `greedy d=k x mean`: the greedy's shape on the layer's own eigenvalues damped by k x their mean;
- `cross k`: an L of the leading k rows and k columns, each as long as r * r / 2k cells allow (`cross`).

Each is scored raw and with training rows unit-normalised in the preconditioned metric (the default's cosine); the
cosine line also prints the training-Gram fidelity (`fidelity`), a criterion a build could compute without queries.
Only the output layer is collected (`filter_modules`), so a wide model's exact rows fit; the greedy's shape comes from
factors fitted as `build` fits them. Usage: `python benchmarks/probes/output_tail.py text-deep text-plain gpu`.
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
from moe_attrib.settings import EIGENBASIS_OUTPUT_SKETCH, EIGENBASIS_SKETCH  # noqa: E402


def sketch(x: torch.Tensor, m: int, seed: int) -> torch.Tensor:
    """`x` `[N, cells]` times a seeded Gaussian `[cells, m] / sqrt(m)`."""
    g = torch.Generator().manual_seed(seed)
    return x @ (torch.randn(x.shape[1], m, generator=g, dtype=x.dtype) / m**0.5)


SKETCH_MAX = 2 * 10**8  # cells x m of the Gaussian sketch formed at most (a larger output layer: no sketch rows)


def rectangles(order: tuple, shape: tuple, m: int) -> list:
    """`(kr, flat cells)` of the leading kr x m/kr rectangles, kr a power of two that both sides hold."""
    rows, cols = order
    out, kr = [], 1
    while kr <= shape[0]:
        if m % kr == 0 and m // kr <= shape[1]:
            out.append((kr, (rows[:kr, None] * shape[1] + cols[None, : m // kr]).flatten()))
        kr *= 2
    return out


def cross(order: tuple, shape: tuple, m: int, k: int) -> torch.Tensor:
    """The flat cells of an L-shaped region: the leading `k` rows with as many columns as `m / 2` cells allow, and
    the leading `k` columns with as many rows (the overlap counted once)."""
    rows, cols = order
    wide, tall = min(shape[1], m // (2 * k)), min(shape[0], m // (2 * k))
    keep = torch.zeros(shape, dtype=torch.bool)
    keep[:k, :wide] = True
    keep[:tall, :k] = True
    r, c = keep.nonzero(as_tuple=True)
    return rows[r] * shape[1] + cols[c]


def variants(qr: torch.Tensor, tr: torch.Tensor, keep: torch.Tensor, square: torch.Tensor, m: int, order: tuple,
             shape: tuple, greedy_shapes: dict) -> dict:  # fmt: skip
    """`{label: (query part, train part)}` whose inner products are the scores; `qr`, `tr` the preconditioned-metric
    rows `scale * rotated` flattened, `keep` the leading cells' flat positions (greedy-shaped), `square` the r x r
    leading cells'."""
    rest = torch.ones(qr.shape[1], dtype=torch.bool)
    half = keep[: m // 2]
    rest[half] = False
    both = torch.cat([qr, tr])
    out = {"exact": (qr, tr), f"leading {m}, greedy-shaped": (qr[:, keep], tr[:, keep])}
    out[f"leading {len(square)}, square"] = (qr[:, square], tr[:, square])
    for kr, cells in rectangles(order, shape, len(square)):
        out[f"leading {kr} x {len(square) // kr}"] = (qr[:, cells], tr[:, cells])
    for label, cells in greedy_shapes.items():
        out[label] = (qr[:, cells], tr[:, cells])
    for k in (4, 8, 16):
        cells = cross(order, shape, len(square), k)
        out[f"cross {k}: {len(cells)} cells"] = (qr[:, cells], tr[:, cells])
    if qr.shape[1] * m > SKETCH_MAX:
        return out
    s = sketch(both, m, 0)
    out[f"sketch {m}"] = (s[: len(qr)], s[len(qr) :])
    s = torch.cat([both[:, half], sketch(both[:, rest], m - len(half), 1)], 1)
    out[f"leading {len(half)} + sketch {m - len(half)}"] = (s[: len(qr)], s[len(qr) :])
    return out


def gram(rows: torch.Tensor) -> torch.Tensor:
    """The cosine Gram matrix of training rows `[N, cells]`."""
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return unit @ unit.T


def fidelity(kept: torch.Tensor, full: torch.Tensor) -> float:
    """Mean over training rows of the Pearson correlation between a row's cosines to the other rows with the kept
    cells and with every cell: a criterion computable at build time from training rows alone."""
    n = len(full)
    off = ~torch.eye(n, dtype=torch.bool)
    a, b = kept[off].view(n, n - 1), full[off].view(n, n - 1)
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return float(((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-300)).mean())


def run(name: str, cache: Path) -> None:
    c = lds.load_cached(name, cache)
    model = c.model()
    report = ma.discover(model, track_moe_experts=True, warn=False)
    head = report.output_layer
    ek = ma.fit_ekfac(model, c.examples, projection_dim=None, filter_modules=head, progress=False)
    f = ek.factors[head]
    # the allocation's weights from factors fitted as `build` fits them (every module, the eigenbasis sketches)
    sketches = {"projection_dim": EIGENBASIS_SKETCH, "output_projection_dim": EIGENBASIS_OUTPUT_SKETCH}
    fitted = ma.fit_ekfac(model, c.examples, progress=False, **sketches)
    with tempfile.TemporaryDirectory() as tmp:
        ma.build_index(model, c.examples, tmp, projection_dim=None, filter_modules=head, progress=False)
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
    allocation = fitted.with_damping(eigenbasis.ALLOCATION_DAMPING, eigenbasis.ALLOCATION_SCOPE).factors[head]
    (weights,) = eigenbasis.weights_of(allocation)
    r = eigenbasis.output_floor(shape[0] if not f.transposed else shape[1], eigenbasis.DENSE_DIRECTIONS)
    ((kr, kc),) = eigenbasis.allocate([weights], r * r)
    rows, cols = eigenbasis.direction_order(f)
    keep = (rows[:kr, None] * shape[1] + cols[None, :kc]).flatten()
    square = (rows[:r, None] * shape[1] + cols[None, :r]).flatten()
    m = kr * kc
    # the greedy's shape on the head's own eigenvalues, damped by k x their mean (k = inf: the eigenvalues' mass)
    greedy_shapes = {}
    sorted_lam = lam[rows][:, cols]
    for k in (0.1, 1.0, 10.0, 100.0, float("inf")):
        w = sorted_lam if k == float("inf") else sorted_lam / (sorted_lam + k * lam.mean())
        ((gr, gc),) = eigenbasis.allocate([w], r * r)
        greedy_shapes[f"greedy d={k:g} x mean: {gr} x {gc}"] = (rows[:gr, None] * shape[1] + cols[None, :gc]).flatten()
    print(f"== {name}: output layer {tuple(shape)} ({shape[0] * shape[1]} cells), leading {kr} x {kc} = {m}; "
          f"exact scores against score_matrix: max rel. diff {err:.1e}", flush=True)  # fmt: skip
    full = gram(tr)
    for label, (a, b) in variants(qr, tr, keep, square, m, (rows, cols), tuple(shape), greedy_shapes).items():
        for cosine in (False, True):
            bn = b / b.norm(dim=1, keepdim=True) if cosine else b
            values = lds.per_query_lds((a @ bn.T).numpy(), c.subsets, c.losses)
            lo, hi = lds.bootstrap(values)
            fid = f"  training-Gram fidelity {fidelity(gram(b), full):.3f}" if cosine else ""
            print(f"  {label:32s} {'cosine' if cosine else 'raw   '} LDS {values.mean():.3f} [{lo:.3f}, {hi:.3f}]{fid}",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        run(name, Path(args.cache))


if __name__ == "__main__":
    main()
