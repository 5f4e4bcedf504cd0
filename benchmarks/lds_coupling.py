"""LDS of the cross-module coupling's settings (gamma, sampled rows), on the cached LDS configurations.

`benchmarks/lds.py` runs the default (gamma 30, every row up to 512) and the pipeline without the
coupling; this sweeps gamma and the number of sampled rows on the default index (p=32, experts
tracked, EK-FAC with the library's defaults), each with the paired bootstrap CI of its difference
to the pipeline without coupling ("this - none": positive means the coupling helps):

    python benchmarks/lds_coupling.py cpu cpu-gpt_oss cpu-shared cpu-deep cpu-heldout

It also fits the coupling from sampled-label rows (the true Fisher's cross-module part): an index
of the same examples whose gradients are taken at labels drawn from the model, as `fit_ekfac`'s
factors are (`build_index` has no such option, so the benchmark routes its collector through
`sample_labels=True`); two draws, gamma 30 and 100.

Every row is scored without the output-layer balance (`balance=None`): this isolates the coupling,
as it was measured before the balance became the default. `--balance` instead sweeps gamma (30
against 10 and 100) with the balance, as `score` now ranks:

    python benchmarks/lds_coupling.py --balance cpu cpu-gpt_oss cpu-shared cpu-deep cpu-heldout cpu-heldout2

It reads the caches `lds.py` left (run `python benchmarks/lds.py --config NAME` first).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.collect.collector import GradientCollector  # noqa: E402

GAMMAS = (10.0, 30.0, 100.0, 300.0, 1000.0)
SAMPLES = ((64, 0), (64, 1), (128, 0), (128, 1))  # (rows, seed) at gamma 30
TRUE_FISHER = ((30.0, 0), (100.0, 0), (30.0, 1), (100.0, 1))  # (gamma, draw)


def sampled_label_index(model, examples, path: Path, draw: int) -> ma.Index:
    """`build_index` of `examples` with every label drawn from the model (seed `1000 + draw`)."""
    collect = GradientCollector.collect

    def sampled(self, *args, **kwargs):
        return collect(self, *args, **{**kwargs, "sample_labels": True})

    torch.manual_seed(1000 + draw)
    GradientCollector.collect = sampled
    try:
        ma.build_index(model, examples, path, progress=False)
    finally:
        GradientCollector.collect = collect
    return ma.load_index(path)


def default_pipeline(model, cached: lds.Cached, path: Path) -> tuple:
    """The default index of the cached training examples at `path`, its query rows and EK-FAC factors."""
    ma.build_index(model, cached.examples, path, progress=False)
    index = ma.load_index(path)
    return index, ma.query_gradients(model, cached.queries, index), ma.fit_ekfac(model, cached.examples, progress=False)


def run_balanced(name: str, root: Path) -> dict[str, np.ndarray]:
    """`--balance`: gamma 30 against 10 and 100 with the output-layer balance (today's default
    scoring; the balance's own coupling takes the same gamma)."""
    cached = lds.load_cached(name, root)
    model = cached.model()
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        index, q, ek = default_pipeline(model, cached, Path(tmp) / "index")
        for gamma in (30.0, 10.0, 100.0):
            coupling = ma.fit_coupling(index, ekfac=ek, gamma=gamma)
            scores = ma.score_matrix(index, q, ekfac=ek, coupling=coupling)
            out[f"balanced, gamma {gamma:g}"] = lds.per_query_lds(scores, cached.subsets, cached.losses)
    lds.print_variants(cached.title, out, cached.domains, "gamma 30", 24)
    return out


def run(name: str, root: Path) -> dict[str, np.ndarray]:
    cached = lds.load_cached(name, root)
    subsets, losses, examples = cached.subsets, cached.losses, cached.examples
    model = cached.model()
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        index, q, ek = default_pipeline(model, cached, Path(tmp) / "index")

        def lds_of(coupling) -> np.ndarray:
            scores = ma.score_matrix(index, q, ekfac=ek, coupling=coupling, balance=None)
            return lds.per_query_lds(scores, subsets, losses)

        out["no coupling (p=32, EK-FAC)"] = lds_of(None)
        for gamma in GAMMAS:
            out[f"gamma {gamma:g}, every row"] = lds_of(ma.fit_coupling(index, ekfac=ek, gamma=gamma))
        for rows, seed in SAMPLES:
            c30 = ma.fit_coupling(index, ekfac=ek, sample=rows, seed=seed)
            out[f"gamma 30, {rows} of {len(examples)} rows (seed {seed})"] = lds_of(c30)
        true_rows = {d: sampled_label_index(model, examples, Path(tmp) / f"sampled-{d}", d) for d in (0, 1)}
        for gamma, draw in TRUE_FISHER:
            fitted = ma.fit_coupling(true_rows[draw], ekfac=ek, gamma=gamma)
            out[f"gamma {gamma:g}, sampled-label rows (draw {draw})"] = lds_of(fitted)
    lds.print_variants(cached.title, out, cached.domains, "none", 44)
    return out


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--balance", action="store_true", help="only the gamma sweep with the output-layer balance")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.configs:
        (run_balanced if args.balance else run)(name, Path(args.cache))


if __name__ == "__main__":
    main()
