"""LDS of module-group combinations and damping choices, on the cached LDS configurations.

`benchmarks/lds.py` scores each module group alone; this asks which *combinations* rank best and
whether a different damping would make the whole model win everywhere. It reads the caches
`lds.py` left (subset losses and the full model; run `python benchmarks/lds.py --config NAME`
first), builds exact rows and EK-FAC factors with the library's defaults, and prints, per
configuration, each variant's LDS with the paired bootstrap CI of its difference to the whole
model ("this - all": positive means the variant is better) and the per-domain LDS:

    python benchmarks/lds_groups.py cpu cpu-gpt_oss cpu-shared cpu-deep

A combination is scored as the cosine over the concatenated blocks of its groups (what
`score --modules` does for one group), after EK-FAC preconditioning.
"""

from __future__ import annotations

import fnmatch
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402

COMBOS = [
    ("lm_head",),
    ("experts",),
    ("attention",),
    ("experts", "lm_head"),
    ("experts", "routers", "lm_head"),
    ("attention", "lm_head"),
]
DAMPINGS = [(0.1, "module"), (1.0, "module"), (0.01, "model"), (0.1, "model")]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-30)


def run(name: str, root: Path) -> dict[str, np.ndarray]:
    cached = lds.load_cached(name, root)
    subsets, losses, examples, queries = cached.subsets, cached.losses, cached.examples, cached.queries
    model = cached.model()
    groups = lds.groups(model)
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ma.build_index(model, examples, Path(tmp) / "index", projection_dim=None, progress=False)
        index = ma.load_index(Path(tmp) / "index")
        q = ma.query_gradients(model, queries, index)
        ek = ma.fit_ekfac(model, examples, projection_dim=None, progress=False)
        rows = np.asarray(index.gradients).astype(np.float64)

        def cosine(pre: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
            globs = [groups[g] for g in names] if names else ["*"]
            cols = [np.arange(b.start, b.stop) for b in index.blocks if any(fnmatch.fnmatch(b.name, g) for g in globs)]
            cols = np.concatenate(cols)
            return unit(pre[:, cols]) @ unit(rows[:, cols]).T

        pre = ma.prepare_queries(index, q, ekfac=ek).double().numpy()
        whole = np.abs(pre @ rows.T).sum()
        for group, glob in groups.items():  # where the whole model's (preconditioned) score comes from
            cols = [np.arange(b.start, b.stop) for b in index.blocks if fnmatch.fnmatch(b.name, glob)]
            cols = np.concatenate(cols)
            share = np.abs(pre[:, cols] @ rows[:, cols].T).sum() / whole
            print(f"  {name}: {group} carries {share:.2f} of the absolute preconditioned score")
        out["all (the default, exact rows)"] = lds.per_query_lds(cosine(pre, ()), subsets, losses)
        for names in COMBOS:
            out[" + ".join(names)] = lds.per_query_lds(cosine(pre, names), subsets, losses)
        # RelatIF (Barshan et al., 2020): each training row divided by its own influence norm
        # sqrt(g H^-1 g) instead of its plain norm (the default cosine), i.e. a cosine in the H^-1 metric
        pre_rows = ma.prepare_queries(index, torch.from_numpy(rows).float(), ekfac=ek, unit_normalize=False)
        pre_rows = pre_rows.double().numpy()
        for names in ((), ("lm_head",)):
            globs = [groups[g] for g in names] if names else ["*"]
            cols = np.concatenate(
                [np.arange(b.start, b.stop) for b in index.blocks if any(fnmatch.fnmatch(b.name, g) for g in globs)]
            )
            self_influence = np.einsum("nd,nd->n", rows[:, cols], pre_rows[:, cols]).clip(1e-30)
            raw = pre[:, cols] @ rows[:, cols].T
            label = f"{' + '.join(names) or 'all'}, RelatIF (rows / sqrt(g H^-1 g))"
            out[label] = lds.per_query_lds(raw / np.sqrt(self_influence), subsets, losses)
        for damping, scope in DAMPINGS:
            pre = ma.prepare_queries(index, q, ekfac=ek.with_damping(damping, scope)).double().numpy()
            for names in ((), ("lm_head",)):
                label = f"{' + '.join(names) or 'all'}, damping {damping:g} x mean over {scope}"
                out[label] = lds.per_query_lds(cosine(pre, names), subsets, losses)
    lds.print_variants(cached.title, out, cached.domains, "all", 44)
    return out


def main() -> None:
    args = lds.cached_configs_parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        run(name, Path(args.cache))


if __name__ == "__main__":
    main()
