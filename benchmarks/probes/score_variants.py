"""Score-time variants of the default eigenbasis index (damping, its scope, the output balance's weight), per
configuration and as means over configuration sets with paired CIs against the default.

Each configuration's eigenbasis index (1 MiB as on Qwen3-30B-A3B, bfloat16, the library's floors and output sketch)
is built with the experts' direction weight 1 (the default before session 19, labelled "default") and with
`--expert_weight W` a second time with weight W in the allocation's greedy (`lds_budget.allocation_rule`); both are
scored with every variant of `VARIANTS` (the scoring damping given explicitly; "default": 0.01 x the model-wide
mean, the default before session 19). `--seeded`: the seeded p=32 index instead:

    python benchmarks/probes/score_variants.py NAMES --cache CACHE --tag s19
    python benchmarks/probes/score_variants.py NAMES --tag s19 --summary

Writes benchmarks/results/issue32/score-variants-NAME-TAG.json (`{"variants": {label: {"per_query": [...]}}}`).
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lds  # noqa: E402
import lds_budget  # noqa: E402
from lds_damping import mean_over  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.scoring.balance import Balance  # noqa: E402

OUT = lds.ROOT / "benchmarks" / "results" / "issue32"
SETS = (
    ("the fifteen", [*lds.TUNING, *lds.HELDOUT, *lds.HELDOUT_HEAD, *lds.HELDOUT_NEXT, *lds.HELDOUT_S18]),
    ("HELDOUT_S19", list(lds.HELDOUT_S19)),
    ("gpu", ["gpu"]),
)
# label: (score_matrix keywords, the output balance's weight)
VARIANTS = {
    "default": ({"damping": 0.01, "damping_scope": "model"}, 1.0),
    "no balance": ({"balance": None, "damping": 0.01, "damping_scope": "model"}, 1.0),
    "balance x0.5": ({"damping": 0.01, "damping_scope": "model"}, 0.5),
    "damping 0.1": ({"damping": 0.1, "damping_scope": "model"}, 1.0),
    "damping 1": ({"damping": 1.0, "damping_scope": "model"}, 1.0),
    "damping 0.01, module": ({"damping": 0.01, "damping_scope": "module"}, 1.0),
    "damping 0.1, module": ({"damping": 0.1, "damping_scope": "module"}, 1.0),
    "damping 1, module": ({"damping": 1.0, "damping_scope": "module"}, 1.0),
}


@contextmanager
def balance_weight(w: float):
    """The output balance with the output layer's vote scaled by `w` (`w * o / sigma_o`)."""
    apply = Balance.apply
    if w != 1.0:

        def weighted(self, whole, preconditioned):
            return apply(self, whole, preconditioned, w)

        Balance.apply = weighted
    try:
        yield
    finally:
        Balance.apply = apply


def run_seeded(name: str, cache: Path) -> dict:
    """The seeded p=32 index (`build_index`'s Python default) with its factors (`ekfac --index`'s p), scored with
    the damping variants."""
    cached = lds.load_cached(name, cache)
    model = cached.model()
    ek = ma.fit_ekfac(model, cached.examples, projection_dim=32, progress=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ma.build_index(model, cached.examples, tmp, progress=False, projection_dim=32)
        index = ma.load_index(tmp)
        q = ma.query_gradients(model, cached.queries, index)
        for label, (kw, w) in VARIANTS.items():
            if w == 1.0 and "balance" not in kw and "x0" not in label:
                s = ma.score_matrix(index, q, ekfac=ek, device="cpu", **kw)
                values = lds.per_query_lds(np.asarray(s), cached.subsets, cached.losses)
                results[label] = {"per_query": values.tolist()}
                print(f"  {name}: seeded, {label}: LDS {values.mean():.3f}", flush=True)
    return {"config": name, "variants": results}


def run(name: str, cache: Path, expert_weight: float | None) -> dict:
    cached = lds.load_cached(name, cache)
    model = cached.model()
    ek = None
    results = {}
    for ew in (1.0,) if expert_weight is None else (1.0, expert_weight):
        with tempfile.TemporaryDirectory() as tmp:
            ek = lds_budget.build_default_index(model, cached.examples, tmp, ekfac=ek, shape="area", expert_weight=ew)
            index = ma.load_index(tmp)
            q = ma.query_gradients(model, cached.queries, index)
            for label, (kw, w) in VARIANTS.items():
                with balance_weight(w):
                    s = ma.score_matrix(index, q, ekfac=ek, device="cpu", **kw)
                values = lds.per_query_lds(np.asarray(s), cached.subsets, cached.losses)
                full = label if ew == 1.0 else f"experts x{ew:g}, {label}"
                results[full] = {"per_query": values.tolist()}
                print(f"  {name}: {full}: LDS {values.mean():.3f}", flush=True)
    return {"config": name, "variants": results}


def summary(names: list[str], tag: str) -> None:
    per = {}
    for name in names:
        path = OUT / f"score-variants-{name}-{tag}.json"
        if path.exists():
            per[name] = {k: np.array(v["per_query"]) for k, v in json.loads(path.read_text())["variants"].items()}
            print(name, " ".join(f"{k}: {x.mean():.3f}" for k, x in per[name].items()))
    for title, group in SETS:
        have = [n for n in group if n in per]
        if have:
            print(f"\nmeans over {title} ({len(have)})")
            mean_over(per, have, "default")


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True)
    parser.add_argument("--expert_weight", type=float, default=None)
    parser.add_argument("--summary", action="store_true")
    parser.add_argument("--seeded", action="store_true", help="the seeded p=32 index instead of the eigenbasis ones")
    args = parser.parse_args()
    if args.summary:
        summary(args.configs, args.tag)
        return
    torch.set_num_threads(2)
    for name in args.configs:
        result = run_seeded(name, Path(args.cache)) if args.seeded else run(name, Path(args.cache), args.expert_weight)
        (OUT / f"score-variants-{name}-{args.tag}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
