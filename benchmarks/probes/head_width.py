"""Would a wider projection of the output layer close the gap to exact rows?

On the Python-docs configurations the default (p=32) is far below exact rows and exact `lm_head` alone.
This scores, on a cached LDS configuration: the default; the default's whole-model scores (without the
output-layer balance) plus the output layer's scores from an index of wider projection, each standardised
per query over the training rows (the balance's equal vote, approximated: with the p=32 output layer it
reproduces the default within 0.005); the output layer alone at that width; and the whole default pipeline
at that width. Sides no wider than p stay exact, so on these small models p=128 and p=512 project only the
vocabulary side:

    python benchmarks/probes/head_width.py text-pydoc > benchmarks/results/head-width-text-pydoc.txt

Per-query LDS go to `benchmarks/results/head-width.npz` (`--out`); after the configurations it prints each
variant's mean over the tuning and the held-out configurations with a paired CI against the default
(`lds_damping.mean_over`); `--summary NAMES` reprints those means from the `.npz` alone.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
import lds  # noqa: E402
from lds_damping import means_by_set  # noqa: E402


def standardised(scores) -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64)
    return (s - s.mean(1, keepdims=True)) / s.std(1, keepdims=True).clip(1e-30)


DEFAULT = "default (p=32)"


def run(name: str, root: Path) -> dict[str, np.ndarray]:
    """Per-query LDS of every variant on configuration `name`."""
    cached = lds.load_cached(name, root)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        att = lds.Attribution(cached.model(), cached.examples, cached.queries, Path(tmp), "cpu", None)
        ek32 = att.ekfac(32)
        out[DEFAULT] = att.scores(32, ekfac=ek32, unit=True)
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
    lds.print_variants(cached.title, per_query, cached.domains, DEFAULT, 44)
    return per_query


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(lds.ROOT / "benchmarks" / "results" / "head-width.npz"))
    parser.add_argument("--summary", action="store_true", help="only the means, from --out")
    args = parser.parse_args()
    torch.set_num_threads(2)
    configs = [] if args.summary else args.configs
    per_config = lds.accumulate(Path(args.out), configs, lambda name: run(name, Path(args.cache)))
    means_by_set(per_config, args.configs, (("tuning", lds.TUNING), ("held out", lds.HELDOUT)), DEFAULT)


if __name__ == "__main__":
    main()
