"""Score matrices of the default eigenbasis index per module part, saved for an offline look at the output balance.

For each cached LDS configuration: the default index (1 MiB as on Qwen3-30B-A3B, bfloat16, the library's floors
and output sketch), scored balanced (the default), without the balance, and through each module group alone;
saved as `OUT/NAME.npz` (`[queries, train]` float32 each) with the per-query LDS of each:

    python benchmarks/probes/balance_scores.py NAMES --cache CACHE --out DIR
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import lds  # noqa: E402
import lds_budget  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.scoring.balance import Balance  # noqa: E402


def output_part(self: Balance, whole: torch.Tensor, preconditioned: torch.Tensor) -> torch.Tensor:
    """The balance's output-layer query `o` alone (its columns, EK-FAC, its own coupling)."""
    output = preconditioned.to(whole.device) * self.columns.to(whole.device)
    return output if self.coupling is None else self.coupling.apply(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeded", action="store_true", help="the seeded p=32 index instead (saved as NAME-seeded)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.configs:
        cached = lds.load_cached(name, Path(args.cache))
        model = cached.model()
        with tempfile.TemporaryDirectory() as tmp:
            if args.seeded:
                ek = ma.fit_ekfac(model, cached.examples, projection_dim=32, progress=False)
                ma.build_index(model, cached.examples, tmp, progress=False, projection_dim=32)
            else:
                ek = lds_budget.build_default_index(model, cached.examples, tmp, shape="area")
            index = ma.load_index(tmp)
            q = ma.query_gradients(model, cached.queries, index)
            how = {"balanced": {}, "unbalanced": {"balance": None}, "outpart": {}}
            how.update({g: {"modules": glob} for g, glob in lds.groups(model).items()})
            saved = {}
            for key, kw in how.items():
                apply = Balance.apply
                if key == "outpart":  # the balance's output-layer query alone, scored against whole rows
                    Balance.apply = output_part
                try:
                    s = ma.score_matrix(index, q, ekfac=ek, device="cpu", **kw)
                finally:
                    Balance.apply = apply
                s = np.asarray(s.scores if hasattr(s, "scores") else s, dtype=np.float32)
                saved[key] = s
                saved[f"lds_{key}"] = lds.per_query_lds(s, cached.subsets, cached.losses)
                print(f"{name}: {key} LDS {saved[f'lds_{key}'].mean():.3f}", flush=True)
        np.savez(out / f"{name}{'-seeded' if args.seeded else ''}.npz", **saved)


if __name__ == "__main__":
    main()
