"""LDS of the refined inverse-Hessian-vector product (`moe_attrib.curvature.ihvp`) on the cached LDS configurations.

For each configuration it scores, side by side on the same queries and retrained subsets:

- today's default (`build` p=32, `ekfac`, `score`: EK-FAC, coupling, output balance, cosine);
- exact rows + EK-FAC, with the default scoring and without coupling and balance;
- the refined query `P (G + damping m I)^-1 q` (exact GGN products over every training row, CG
  preconditioned by unprojected EK-FAC, cosine against the rows, no coupling or balance) after
  each of several iteration counts (one solve per damping gives them all), against the exact rows
  and against the default p=32 index,

with each variant's paired bootstrap CI against the default, and the refinement's runtime per query.
It reads the caches `lds.py` left (`python benchmarks/lds.py --config NAME` first):

    nice -n 10 python benchmarks/lds_solver.py cpu cpu-shared \
        --out benchmarks/results/lds_solver.json
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.curvature import ihvp  # noqa: E402


def cosine(q: np.ndarray, rows: np.ndarray) -> np.ndarray:
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-30)  # noqa: E731
    return unit(q.astype(np.float64)) @ unit(rows.astype(np.float64)).T


def run(name: str, root: Path, iterations: list[int], dampings: list[float], examples: int | None) -> dict:
    cached = lds.load_cached(name, root)
    model, train, queries = cached.model(), cached.examples, cached.queries
    out: dict[str, np.ndarray] = {}
    timing: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ma.build_index(model, train, Path(tmp) / "p32", progress=False)
        ma.build_index(model, train, Path(tmp) / "exact", projection_dim=None, progress=False)
        p32, exact = ma.load_index(Path(tmp) / "p32"), ma.load_index(Path(tmp) / "exact")
        ek32 = ma.fit_ekfac(model, train, progress=False)
        ekx = ma.fit_ekfac(model, train, projection_dim=None, progress=False)
        start = time.perf_counter()
        q32 = ma.query_gradients(model, queries, p32)
        out["default (p=32, EK-FAC, coupling, balance)"] = ma.score_matrix(p32, q32, ekfac=ek32, device="cpu")
        timing["default: query gradients + scoring, s per query"] = (time.perf_counter() - start) / len(queries)
        qx = ma.query_gradients(model, queries, exact)
        out["exact rows, EK-FAC, default scoring"] = ma.score_matrix(exact, qx, ekfac=ekx, device="cpu")
        out["exact rows, EK-FAC, no coupling/balance"] = ma.score_matrix(
            exact, qx, ekfac=ekx, coupling=None, balance=None, device="cpu"
        )
        out["exact rows, EK-FAC, inner product, no coupling/balance"] = ma.score_matrix(
            exact, qx, ekfac=ekx, unit_normalize=False, coupling=None, balance=None, device="cpu"
        )
        out["p=32, EK-FAC, no coupling/balance"] = ma.score_matrix(
            p32, q32, ekfac=ek32, coupling=None, balance=None, device="cpu"
        )
        rows_x, rows_32 = np.asarray(exact.gradients), np.asarray(p32.gradients)
        report = ma.discover(model, warn=False)
        entries = ihvp.tracked_entries(model, report)
        for damping in dampings:
            snaps: dict[int, dict[str, list]] = {k: {"exact": [], "p32": []} for k in iterations}

            def keep(at: int, k: int, x, snaps=snaps) -> None:
                if k in snaps:
                    snaps[k]["exact"].append(ihvp.to_index_columns(exact, report, entries, x).numpy())
                    snaps[k]["p32"].append(ihvp.to_index_columns(p32, report, entries, x).numpy())

            start = time.perf_counter()
            refined = ma.refine_queries(
                model, train, queries, exact, ekfac=ekx, iterations=max(iterations), damping=damping, callback=keep,
                query_batch=len(queries), examples=examples,
            )  # fmt: skip
            seconds = time.perf_counter() - start
            timing[f"refine damping {damping:g}: s per query per iteration"] = seconds / len(queries) / max(iterations)
            residual = refined.residuals[-1]
            print(f"  damping {damping:g}: {seconds:.0f} s for {max(iterations)} iterations x {len(queries)} queries; "
                  f"final relative residual median {np.median(residual):.3g}", flush=True)  # fmt: skip
            for k in iterations:
                # scored through the library: RefinedQueries as `score_matrix` takes them
                got = ma.RefinedQueries(torch.from_numpy(np.concatenate(snaps[k]["exact"])), str(exact.path),
                                        refined.residuals, k)  # fmt: skip
                matrix = ma.score_matrix(exact, got, device="cpu")
                assert np.allclose(matrix, cosine(got.rows.numpy(), rows_x), atol=1e-4)
                out[f"refined, exact rows, damping {damping:g}, {k} it"] = matrix
                dot = got.rows.numpy().astype(np.float64) @ rows_x.T.astype(np.float64)
                out[f"refined, exact rows, damping {damping:g}, {k} it, inner product"] = dot
                projected = np.concatenate(snaps[k]["p32"])
                out[f"refined, p=32 rows, damping {damping:g}, {k} it"] = cosine(projected, rows_32)
    values = {label: lds.per_query_lds(s, cached.subsets, cached.losses) for label, s in out.items()}
    lds.print_variants(cached.title, values, cached.domains, "default", 48)
    base = next(iter(values.values()))
    result = {"config": name, "title": cached.title, "timing": timing, "variants": {}}
    for label, v in values.items():
        result["variants"][label] = {
            "lds": float(v.mean()),
            "ci95": lds.bootstrap(v),
            "minus_default_ci95": lds.bootstrap(v - base),
            "minus_default": float((v - base).mean()),
            "per_domain": {d: float(np.mean(v[np.array(cached.domains) == d])) for d in sorted(set(cached.domains))},
        }
    return result


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--iterations", default="1,2,4,8")
    parser.add_argument("--dampings", default="0.01,0.1,1.0")
    parser.add_argument("--examples", type=int, default=None, help="training rows the GGN averages over (seeded)")
    parser.add_argument("--out", default=None, help="JSON results (rewritten after each configuration)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    iterations = [int(k) for k in args.iterations.split(",")]
    dampings = [float(d) for d in args.dampings.split(",")]
    results = []
    for name in args.configs:
        results.append(run(name, Path(args.cache), iterations, dampings, args.examples))
        results[-1]["ggn_examples"] = args.examples
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
