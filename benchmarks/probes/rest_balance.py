"""Probe: the output balance's whole-model vote without the output layer, on the greedy-shaped and the cross floors.

Why: the output floor's shape changes the output layer's share of each row's preconditioned norm (on `gpu` 6.5% of it
greedy-shaped, 34% as the cross, 43% as a square), so the shape also sets how much the output layer weighs inside the
whole model's vote, on top of the balance's own output vote. Here the balance's whole-model part `a` is the query with
the output layer's columns zeroed (`a_rest`), so that the output layer votes once, through the balance: `q = a_rest /
sigma + o / sigma_o`. Scored on the default index ("area") and the cross-shaped one, beside the default scoring.
Writes per-query LDS to `--out` (JSON) and prints the means with paired CIs.
Usage: `python benchmarks/probes/rest_balance.py gpu text-deep --out benchmarks/results/issue32/rest-balance-s21.json`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lds  # noqa: E402
import lds_budget  # noqa: E402
from lds_damping import mean_over  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.scoring import balance as balance_module  # noqa: E402

_APPLY = balance_module.Balance.apply


def rest_apply(self, whole: torch.Tensor, preconditioned: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """`Balance.apply` with the whole-model part's output-layer columns zeroed."""
    return _APPLY(self, whole * (~self.columns.to(whole.device)), preconditioned, weight)


def run(name: str, cache: Path) -> dict[str, np.ndarray]:
    c = lds.load_cached(name, cache)
    model = c.model()
    out, ek = {}, None
    for shape in ("area", "cross"):
        with tempfile.TemporaryDirectory() as tmp:
            ek = lds_budget.build_default_index(model, c.examples, tmp, ekfac=ek, shape=shape)
            index = ma.load_index(tmp)
            q = ma.query_gradients(model, c.queries, index)
            for label, apply in (("", _APPLY), (", rest balance", rest_apply)):
                balance_module.Balance.apply = apply
                try:
                    scores = ma.score_matrix(index, q, ekfac=ek, device="cpu")
                finally:
                    balance_module.Balance.apply = _APPLY
                out[f"{shape}{label}"] = lds.per_query_lds(scores, c.subsets, c.losses)
                print(f"  {name}: {shape}{label}: LDS {out[f'{shape}{label}'].mean():.3f}", flush=True)
    return out


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    per_config = {}
    for name in args.configs:
        per_config[name] = run(name, Path(args.cache))
        if args.out:
            kept = {n: {k: v.tolist() for k, v in r.items()} for n, r in per_config.items()}
            Path(args.out).write_text(json.dumps(kept))
    for name in per_config:
        print(f"== {name}")
        mean_over(per_config, [name], "area")
    if len(per_config) > 1:
        print(f"== mean over {', '.join(n for n in per_config if n != 'gpu')}")
        mean_over(per_config, [n for n in per_config if n != "gpu"], "area")


if __name__ == "__main__":
    main()
