"""LDS against index bytes per example: seeded projections, summed experts, bfloat16 storage and
eigenbasis rows at several budgets, on the cached LDS configurations.

Every variant is scored with the library's default pipeline (EK-FAC preconditioning, coupling,
output balance, cosine) except where its name says otherwise, and reported with its bytes per
example (stored columns x bytes per value), its LDS with a bootstrap CI, and the paired bootstrap
CIs of its difference to today's default index (seeded projections, p=32, float32) and to exact
rows. Eigenbasis rows (`build_index(ekfac=, budget=)`) use factors fitted with the sketch
`--sketch` (128: every side of these models is kept exact) and budgets given as fractions of the
default index's bytes, or scaled from the Qwen3-30B-A3B shape (the same columns per weight block as
256 KiB / 1 MiB there), and 1 MiB itself (more than every direction of these small models):

    nice -n 10 python benchmarks/lds_budget.py cpu cpu-shared

Reads the caches `lds.py` left (`lds.load_cached`); writes benchmarks/results/issue32/lds-budget-NAME.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.curvature.eigenbasis import parse_bytes  # noqa: E402
from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM  # noqa: E402
from moe_attrib.model.discovery import iter_entries  # noqa: E402

PS = (8, 16, 32, 64, 128)
FRACTIONS = (1 / 64, 1 / 16, 1 / 4)  # eigenbasis budgets, as fractions of the default index's bytes
# eigenbasis budgets scaled from a large model: the same stored columns per weight block as a budget of
# `bytes` per example on the Qwen3-30B-A3B shape (12,529 weight blocks: `inspect benchmarks/shapes/qwen3-30b-a3b`)
QWEN3_BLOCKS = 12529
SCALED = ("256KiB", "1MiB")  # Qwen3-30B-A3B budgets the eigenbasis budgets are scaled from (--scaled)
OUT = Path(__file__).parent / "results" / "issue32"
DEFAULT = f"default: projected p={DEFAULT_PROJECTION_DIM}, float32"
EXACT = "exact rows"


def bytes_per_example(index) -> int:
    return int(index.gradients.shape[1] * index.gradients.dtype.itemsize)


def run(
    name: str, root: Path, sketch: int, fractions: tuple[float, ...], core: bool = False, scaled: tuple = SCALED
) -> dict:
    """Every variant of configuration `name` (`core`: only the default, exact rows and the eigenbasis
    budgets scaled from Qwen3-30B-A3B and 1 MiB, for the larger configurations)."""
    cached = lds.load_cached(name, root)
    model = cached.model()
    subsets, losses, examples, queries = cached.subsets, cached.losses, cached.examples, cached.queries
    results: dict[str, dict] = {}
    factors: dict = {}

    def ekfac(p):
        if p not in factors:
            factors[p] = ma.fit_ekfac(model, examples, projection_dim=p, progress=False)
        return factors[p]

    with tempfile.TemporaryDirectory() as tmp:

        def add(label: str, ek, **build) -> None:
            t0 = time.perf_counter()
            path = Path(tmp) / f"index-{len(results)}"
            ma.build_index(model, examples, path, progress=False, **build)
            index = ma.load_index(path)
            q = ma.query_gradients(model, queries, index)
            scores = ma.score_matrix(index, q, ekfac=ek, device="cpu")
            values = lds.per_query_lds(scores, subsets, losses)
            results[label] = {"bytes": bytes_per_example(index), "values": values}
            print(f"  {name}: {label}: {results[label]['bytes']} B/example, LDS {values.mean():.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip

        p0 = DEFAULT_PROJECTION_DIM
        add(DEFAULT, ekfac(p0), projection_dim=p0)
        add(EXACT, ekfac(None), projection_dim=None)
        for p in () if core else PS:
            if p != p0:
                add(f"projected p={p}, float32", ekfac(p), projection_dim=p)
        if not core:
            add(f"projected p={p0}, bfloat16", ekfac(p0), projection_dim=p0, index_dtype="bfloat16")
            add("projected p=64, bfloat16", ekfac(64), projection_dim=64, index_dtype="bfloat16")
            # summed experts cannot be preconditioned per expert: scored without EK-FAC
            add(f"projected p={p0}, expert_blocks=sum, no EK-FAC", None, projection_dim=p0, expert_blocks="sum")
        default_bytes = results[DEFAULT]["bytes"]
        for frac in () if core else fractions:
            budget = int(default_bytes * frac)
            for dtype in ("float32", "bfloat16"):
                add(f"eigenbasis, budget {budget} B ({frac:g} x default), {dtype}", ekfac(sketch),
                    ekfac=ekfac(sketch), budget=budget, index_dtype=dtype)  # fmt: skip
        blocks = weight_blocks(model)
        for qwen3_bytes, dtype in ((parse_bytes(b), dt) for b in scaled for dt in ("float32", "bfloat16")):
            budget = qwen3_bytes * blocks // QWEN3_BLOCKS
            label = f"eigenbasis, budget {budget} B (as {qwen3_bytes // 2**10} KiB on Qwen3-30B-A3B), {dtype}"
            add(label, ekfac(sketch), ekfac=ekfac(sketch), budget=budget, index_dtype=dtype)
        add("eigenbasis, budget 1 MiB (every direction here), bfloat16", ekfac(sketch), ekfac=ekfac(sketch),
            budget=2**20, index_dtype="bfloat16")  # fmt: skip
    return summarise(name, cached, results)


def weight_blocks(model) -> int:
    """Weight blocks of an eigenbasis index of the whole model (each expert's its own)."""
    report = ma.discover(model, track_moe_experts=True, warn=False)
    return sum(e.layout.num_experts if e.layout else 1 for e in iter_entries(report.targets) if e.kind == "weight")


def summarise(name: str, cached, results: dict) -> dict:
    base, exact = results[DEFAULT]["values"], results[EXACT]["values"]
    out = {"config": name, "title": cached.title, "variants": {}}
    print(f"== {cached.title}")
    print(f"  {'variant':58s} {'B/example':>10s}  LDS [95% CI]            this - default      this - exact")
    for label, r in results.items():
        v = r["values"]
        ci, d0, d1 = lds.bootstrap(v), lds.bootstrap(v - base), lds.bootstrap(v - exact)
        out["variants"][label] = {
            "bytes_per_example": r["bytes"],
            "lds": float(v.mean()),
            "ci95": ci,
            "minus_default": float((v - base).mean()),
            "minus_default_ci95": d0,
            "minus_exact": float((v - exact).mean()),
            "minus_exact_ci95": d1,
            "per_query": v.tolist(),
        }
        print(f"  {label:58s} {r['bytes']:10d}  {v.mean():.3f} [{ci[0]:.3f}, {ci[1]:.3f}]  "
              f"[{d0[0]:+.3f}, {d0[1]:+.3f}]  [{d1[0]:+.3f}, {d1[1]:+.3f}]", flush=True)  # fmt: skip
    return out


def markdown(result: dict) -> str:
    """One configuration's variants as a Markdown table (docs/build.md)."""
    lines = [
        "| variant | bytes / example | LDS (95% CI) | this - default (95% CI) | this - exact (95% CI) |",
        "|---|---|---|---|---|",
    ]
    for label, r in result["variants"].items():
        (lo, hi), (a, b), (c, d) = r["ci95"], r["minus_default_ci95"], r["minus_exact_ci95"]
        lines.append(
            f"| {label} | {r['bytes_per_example']:,} | {r['lds']:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{r['minus_default']:+.3f} [{a:+.3f}, {b:+.3f}] | {r['minus_exact']:+.3f} [{c:+.3f}, {d:+.3f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--sketch", type=int, default=128, help="EK-FAC projection_dim of the eigenbasis factors")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--markdown", action="store_true", help="print the saved results as Markdown tables")
    parser.add_argument("--core", action="store_true", help="only default, exact and the scaled eigenbasis budgets")
    parser.add_argument("--scaled", nargs="+", default=list(SCALED), help="Qwen3-30B-A3B budgets to scale from")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    args = parser.parse_args()
    if args.markdown:
        for name in args.configs:
            print(f"\n{name}\n\n" + markdown(json.loads((OUT / f"lds-budget-{name}.json").read_text())))
        return
    torch.set_num_threads(2)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.configs:
        result = run(name, Path(args.cache), args.sketch, tuple(args.fractions), args.core, tuple(args.scaled))
        (OUT / f"lds-budget-{name}{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
