"""Which EK-FAC damping holds across configurations: LDS of the default pipeline under damping rules.

Every rule damps each factor with `c x mean(Lambda)` (the corrected eigenvalues), the mean taken
over the whole model (the library's `model` scope) or over each module (`module`). The default
pipeline is otherwise unchanged (p=32 index, experts tracked, coupling and output-layer balance
fitted for each rule). Per configuration it prints each rule's LDS with the paired bootstrap CI
of its difference to the first rule; then the mean over the tuning configurations and, apart,
over the held-out ones (`lds.HELDOUT`), each with a paired CI (queries resampled within each
configuration, configurations weighted equally):

    python benchmarks/lds_damping.py cpu cpu-gpt_oss cpu-shared cpu-deep text-plain text-pydoc text-deep \\
        heldout-plain heldout-pydoc

Per-query LDS go to `benchmarks/results/lds-damping.npz` (`--out`), read back with `--summary`, so a
configuration is scored once.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM  # noqa: E402
from moe_attrib.scoring.score import DEFAULT_UNIT_NORMALIZE  # noqa: E402

# (label, multiplier, scope): `multiplier x mean(Lambda)` over the scope; the first (the default before 0.01 x) is the
# baseline every rule is compared with, the second is the library default (DEFAULT_DAMPING)
RULES = [
    ("1 x mean, model", 1.0, "model"),
    ("0.01 x mean, model", 0.01, "model"),
    ("0.1 x mean, module", 0.1, "module"),
    ("1 x mean, module", 1.0, "module"),
]


def damped(ek, c: float, scope: str):
    """A copy of `ek` with every factor damped by `c x mean(Lambda)` over `scope` (`model` or `module`), a zero
    module mean falling back to the model-wide one (`set_damping`'s rule, computed here independently)."""
    whole = float(torch.cat([f.lam.flatten() for f in ek.factors.values()]).double().mean())
    out = ma.EKFAC(dict(ek.factors), ek.projection_dim, ek.seed, {**ek.settings})
    for name, f in ek.factors.items():
        ref = whole if scope == "model" else float(f.lam.double().mean())
        value = c * (ref if ref > 0 else whole)
        out.factors[name] = dataclasses.replace(f, damping=torch.full(f.lam.shape[:-2], value, dtype=f.lam.dtype))
    return out


def spectrum(ek) -> str:
    """How heavy-tailed the corrected eigenvalues are: mean / median and the top 1%'s share of the sum."""
    lam = torch.cat([f.lam.flatten() for f in ek.factors.values()]).double()
    top = lam.sort(descending=True).values[: max(1, lam.numel() // 100)].sum() / lam.sum()
    return (
        f"{lam.numel()} eigenvalues, mean/median {float(lam.mean() / lam.median()):.1f}, top 1% hold {float(top):.2f}"
    )


def run(name: str, root: Path, only: set[str] | None = None) -> dict[str, np.ndarray]:
    cached = lds.load_cached(name, root)
    model = cached.model()
    p = DEFAULT_PROJECTION_DIM
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ma.build_index(model, cached.examples, Path(tmp) / "index", projection_dim=p, progress=False)
        index = ma.load_index(Path(tmp) / "index")
        q = ma.query_gradients(model, cached.queries, index)
        ek = ma.fit_ekfac(model, cached.examples, projection_dim=p, progress=False)
        print(f"  {name}: {spectrum(ek)}", flush=True)
        for label, c, scope in RULES:
            if only and label not in only and label != RULES[0][0]:
                continue
            scores = ma.score_matrix(index, q, ekfac=damped(ek, c, scope), unit_normalize=DEFAULT_UNIT_NORMALIZE)
            out[label] = lds.per_query_lds(scores, cached.subsets, cached.losses)
            print(f"  {name}: {label} {out[label].mean():.3f}", flush=True)
    lds.print_variants(cached.title, out, cached.domains, RULES[0][0], 24)
    return out


def mean_over(
    per_config: dict[str, dict[str, np.ndarray]], names: list[str], base: str = RULES[0][0], reps: int = 2000
) -> None:
    """Each variant's mean LDS over `names` (configurations weighted equally) and the paired bootstrap CI of its
    difference to `base`, resampling queries within each configuration."""
    rng = np.random.default_rng(0)
    sizes = {n: len(per_config[n][base]) for n in names}
    draws = {n: rng.integers(0, sizes[n], (reps, sizes[n])) for n in names}
    for label in [k for k in per_config[names[0]] if all(k in per_config[n] for n in names)]:
        mean = np.mean([per_config[n][label].mean() for n in names])
        diff = np.mean([(per_config[n][label] - per_config[n][base])[draws[n]].mean(1) for n in names], axis=0)
        lo, hi = np.quantile(diff, [0.025, 0.975])
        worst = min(per_config[n][label].mean() - per_config[n][base].mean() for n in names)
        print(f"  {label:24s} {mean:.3f}  this - {base} [{lo:+.3f}, {hi:+.3f}]  worst configuration {worst:+.3f}")


def means_by_set(
    per_config: dict[str, dict[str, np.ndarray]], asked: list[str], sets: tuple, base: str = RULES[0][0]
) -> None:
    """`mean_over` for each `(title, names)` of `sets`, over the names that were asked for and are in the file."""
    for title, names in sets:
        have = [n for n in names if n in per_config and n in asked]
        if have:
            print(f"== mean over the {title} configurations ({', '.join(have)})")
            mean_over(per_config, have, base)


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(lds.ROOT / "benchmarks" / "results" / "lds-damping.npz"))
    parser.add_argument("--summary", action="store_true", help="only the means, from --out")
    parser.add_argument(
        "--rules", default=None, help="labels to score, separated by ; (the first rule is always scored)"
    )
    args = parser.parse_args()
    only = set(args.rules.split(";")) if args.rules else None
    torch.set_num_threads(2)
    configs = [] if args.summary else args.configs
    per_config = lds.accumulate(Path(args.out), configs, lambda name: run(name, Path(args.cache), only))
    means_by_set(per_config, args.configs, (("tuning", lds.TUNING), ("held out", lds.HELDOUT)))


if __name__ == "__main__":
    main()
