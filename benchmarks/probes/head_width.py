"""Would a wider projection of the output layer close the gap to exact rows?

On the Python-docs configurations the default (p=32) is far below exact rows and exact `lm_head` alone.
This scores, on a cached LDS configuration: the default; the default's whole-model scores (without the
output-layer balance) plus the output layer's scores from an index of wider projection, each standardised
per query over the training rows (the balance's equal vote, approximated: with the p=32 output layer it
reproduces the default within 0.005); the output layer alone at that width; and the whole default pipeline
at that width. Sides no wider than p stay exact, so on these small models p=128 and p=512 project only the
vocabulary side:

    python benchmarks/probes/head_width.py text-pydoc > benchmarks/results/head-width-text-pydoc.txt
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
import lds  # noqa: E402


def standardised(scores) -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64)
    return (s - s.mean(1, keepdims=True)) / s.std(1, keepdims=True).clip(1e-30)


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        cached = lds.load_cached(name, Path(args.cache))
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            att = lds.Attribution(cached.model(), cached.examples, cached.queries, Path(tmp), "cpu", None)
            ek32 = att.ekfac(32)
            out["default (p=32)"] = att.scores(32, ekfac=ek32, unit=True)
            whole = standardised(att.scores(32, ekfac=ek32, unit=True, balance=None))
            out["whole p=32 + lm_head p=32, standardised"] = whole + standardised(
                att.scores(32, ekfac=ek32, unit=True, group="lm_head")
            )
            for p in (128, 512, None):
                ek = att.ekfac(p)
                head = att.scores(p, ekfac=ek, unit=True, group="lm_head")
                out[f"lm_head alone p={p}"] = head
                out[f"whole p=32 + lm_head p={p}, standardised"] = whole + standardised(head)
                out[f"default pipeline at p={p}"] = att.scores(p, ekfac=ek, unit=True)
        per_query = {k: lds.per_query_lds(v, cached.subsets, cached.losses) for k, v in out.items()}
        lds.print_variants(cached.title, per_query, cached.domains, "default (p=32)", 44)


if __name__ == "__main__":
    main()
