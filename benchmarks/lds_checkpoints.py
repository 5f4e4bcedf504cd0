"""LDS of scores averaged over training checkpoints (TracIn-CP / ensemble style), on the cached configurations.

The largest LDS gains in the literature come from averaging attribution scores over several models
(TRAK's ensembles) or over checkpoints along one training run (TracIn-CP, SOURCE). This measures
what averaging over checkpoints of the full-data model does here, for the default pipeline and for
`lm_head` alone: the full model is trained again from the shared initial weights with the same
data order (`lds.train`), keeping the weights after epochs `--epochs`; each checkpoint gets its own
index, EK-FAC factors and query gradients (the library's defaults), and the score matrices (cosines)
are averaged. The pipeline is scored without the output-layer balance (`balance=None`), as the
first results were measured before it became the default, and with it (today's default). Reads
the caches `lds.py` left (run `python benchmarks/lds.py --config NAME` first):

    python benchmarks/lds_checkpoints.py cpu cpu-gpt_oss cpu-shared cpu-deep
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM  # noqa: E402


def checkpoint_scores(model, examples, queries, lm_head: str, root: Path) -> dict[str, np.ndarray]:
    """Score matrices `[Q, N]` of one checkpoint: the default pipeline (and without its coupling), exact rows,
    `lm_head` alone (exact)."""
    out = {}
    for p in (DEFAULT_PROJECTION_DIM, None):
        path = root / f"index-{p}"
        ma.build_index(model, examples, path, projection_dim=p, progress=False, overwrite=True)
        index = ma.load_index(path)
        q = ma.query_gradients(model, queries, index)
        ek = ma.fit_ekfac(model, examples, projection_dim=p, progress=False)
        name = "default pipeline (p=32)" if p else "exact rows"
        out[name] = np.asarray(ma.score_matrix(index, q, ekfac=ek, balance=None, device="cpu"))
        if p:
            out[f"{name}, output balance (today's default)"] = np.asarray(
                ma.score_matrix(index, q, ekfac=ek, device="cpu")
            )
            out[f"{name}, no coupling"] = np.asarray(
                ma.score_matrix(index, q, ekfac=ek, coupling=None, balance=None, device="cpu")
            )
        if p is None:
            alone = ma.score_matrix(index, q, ekfac=ek, modules=lm_head, device="cpu")
            out["lm_head alone (exact)"] = np.asarray(alone)
    return out


def run(name: str, root: Path, epochs: list[int]) -> None:
    cfg = lds.CONFIGS[name]
    cached = lds.load_cached(name, root)
    subsets, losses, tokenizer = cached.subsets, cached.losses, cached.tokenizer
    examples, queries = cached.examples, cached.queries
    kept: dict[int, torch.nn.Module] = {}

    def keep(epoch: int, model: torch.nn.Module) -> None:
        if epoch in epochs:
            kept[epoch] = copy.deepcopy(model).eval()

    torch.manual_seed(cfg.seed)
    lds.train(cfg, examples, np.ones(len(examples), bool), 0, len(tokenizer), "cpu", on_epoch=keep)
    lm_head = lds.groups(kept[epochs[-1]])["lm_head"]
    per_epoch = {}
    with tempfile.TemporaryDirectory() as tmp:
        for epoch in epochs:
            per_epoch[epoch] = checkpoint_scores(kept[epoch], examples, queries, lm_head, Path(tmp))
    variants: dict[str, np.ndarray] = {}
    last = epochs[-1]
    for key in per_epoch[last]:
        variants[f"{key}, last checkpoint (epoch {last})"] = lds.per_query_lds(per_epoch[last][key], subsets, losses)
        mean = np.mean([per_epoch[e][key] for e in epochs], axis=0)
        variants[f"{key}, mean over epochs {epochs}"] = lds.per_query_lds(mean, subsets, losses)
    lds.print_variants(cached.title, variants, cached.domains, "first", 62)
    ens_lm = variants[f"lm_head alone (exact), mean over epochs {epochs}"]
    compared = {
        "default": "default pipeline (p=32)",
        "default with the balance": "default pipeline (p=32), output balance (today's default)",
    }
    for label, key in compared.items():
        ens = variants[f"{key}, mean over epochs {epochs}"]
        lo, hi = lds.bootstrap(ens - ens_lm)
        print(f"  averaged {label} - averaged lm_head alone: {ens.mean() - ens_lm.mean():+.3f} [{lo:+.3f}, {hi:+.3f}]")


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--epochs", default="2,4,6,8,10", help="checkpoints to average (the last is the model)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        run(name, Path(args.cache), [int(e) for e in args.epochs.split(",")])


if __name__ == "__main__":
    main()
