"""The output layer's own projection width (`output_projection_dim`), chosen across the LDS configurations.

On each cached configuration (`lds.py --config NAME --train_only` first) this scores the default pipeline
(p=32 index, experts tracked, EK-FAC, coupling, output-layer balance) with the output layer projected like
every block (`output_projection_dim=None`, the default when this was measured) and with its own width
W = 128, 256, 512 (a side no wider than W kept exact, every other block at p=32), through `build_index`,
`fit_ekfac` and `score_matrix` as a user runs them; beside each, the output layer's block alone, and
exact rows (`projection_dim=None`) as the ceiling of the projection:

    python benchmarks/lds_output_width.py cpu text-pydoc ...

The rule the default follows was written into `benchmarks/heldout.json` ("heldout_head") before the
held-out configurations `lds.HELDOUT_HEAD` were trained. Per-query LDS go to
`benchmarks/results/lds-output-width.npz` (`--out`); after the configurations the means over the tuning,
the earlier held-out and the newly held-out configurations are printed with paired CIs against the
output layer at p (`lds_damping.mean_over`); `--summary NAMES` reprints them from the `.npz`, `--table NAMES`
prints docs/quality.md's table from it; `--peers NPZ` adds Kronfluence 1.0.1 from `lds_peers.py`'s per-query
LDS on the same caches (`benchmarks/results/lds-peers-output-width.npz`) to the means and a second table.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402
from lds_damping import means_by_set  # noqa: E402

from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM  # noqa: E402

BEFORE = "output layer at p=32"
WIDTHS = (128, 256, 512)


def run(name: str, root: Path, threads: int) -> dict[str, np.ndarray]:
    """Per-query LDS of every variant on configuration `name`."""
    torch.set_num_threads(threads)
    cached = lds.load_cached(name, root)
    p = DEFAULT_PROJECTION_DIM
    scores = {}
    with tempfile.TemporaryDirectory() as tmp:
        att = lds.Attribution(cached.model(), cached.examples, cached.queries, Path(tmp), "cpu", None)
        for w in (None, *WIDTHS):
            ek = att.ekfac(p, out=w)
            label = BEFORE if w is None else f"output layer W={w}"
            scores[label] = att.scores(p, ekfac=ek, unit=True, out=w)
            scores[f"{label}: lm_head alone"] = att.scores(p, ekfac=ek, unit=True, group="lm_head", out=w)
        scores["exact rows"] = att.scores(None, ekfac=att.ekfac(None, out=None), unit=True, out=None)
    per_query = {k: lds.per_query_lds(v, cached.subsets, cached.losses) for k, v in scores.items()}
    lds.print_variants(cached.title, per_query, cached.domains, BEFORE, 40)
    return per_query


def table(per_config: dict[str, dict[str, np.ndarray]], names: list[str]) -> str:
    """Markdown rows: each configuration's LDS per variant with the paired CI of (variant - output layer at p)
    and, for the output layer alone at 512, of (default at 512 - it)."""
    head = "| configuration | output layer at p=32 | W=128 | W=256 | **W=512** | `lm_head` alone at 512 | exact rows |"
    lines = [head, "|" + "---|" * 7]
    for n in names:
        v = per_config[n]
        base, w512 = v[BEFORE], v["output layer W=512"]
        cells = [f"{base.mean():.3f}"]
        for label in ("output layer W=128", "output layer W=256", "output layer W=512"):
            lo, hi = lds.bootstrap(v[label] - base)
            cells.append(f"{v[label].mean():.3f} [{lo:+.3f}, {hi:+.3f}]")
        for label in ("output layer W=512: lm_head alone", "exact rows"):
            lo, hi = lds.bootstrap(w512 - v[label])
            cells.append(f"{v[label].mean():.3f} (512 - this [{lo:+.3f}, {hi:+.3f}])")
        role = " (held out)" if n in lds.HELDOUT_HEAD else " (earlier held out)" if n in lds.HELDOUT else ""
        lines.append(f"| {n}{role} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


KRONFLUENCE = ("Kronfluence 1.0.1 EK-FAC, its defaults", "Kronfluence, damping 0.1 x mean eigenvalue")


def with_peers(per_config: dict, peers_path: Path) -> dict:
    """`per_config` with Kronfluence's per-query LDS from `lds_peers.py`'s `.npz` merged in, after checking that
    the moe-attrib default there is, query for query, this file's output layer at p=32 (the same caches)."""
    peers = lds.accumulate(peers_path, [], lambda name: {})
    for name, values in peers.items():
        if name not in per_config:
            continue
        if not np.allclose(values["moe-attrib default"], per_config[name][BEFORE], atol=1e-9):
            raise SystemExit(f"{peers_path}: {name}'s default differs from {BEFORE}: not the same cache")
        per_config[name].update({k: values[k] for k in KRONFLUENCE})
    return per_config


def peers_table(per_config: dict, names: list[str]) -> str:
    """Markdown rows: the default, W=512 and Kronfluence (its defaults, and its 0.1 x mean damping), each
    Kronfluence with the paired CI of Kronfluence - the default and Kronfluence - W=512."""
    head = ("| configuration | default (p=32) | W=512 | Kronfluence, its defaults | - default | - W=512 "
            "| Kronfluence, 0.1 x mean | - default | - W=512 |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    for n in names:
        v = per_config[n]
        if KRONFLUENCE[0] not in v:
            continue
        base, w512 = v[BEFORE], v["output layer W=512"]
        cells = [f"{base.mean():.3f}", f"{w512.mean():.3f}"]
        for label in KRONFLUENCE:
            k = v[label]
            cells.append(f"{k.mean():.3f}")
            for ref in (base, w512):
                lo, hi = lds.bootstrap(k - ref)
                cells.append(f"[{lo:+.3f}, {hi:+.3f}]")
        role = " (held out)" if n in lds.HELDOUT_HEAD else " (earlier held out)" if n in lds.HELDOUT else ""
        lines.append(f"| {n}{role} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(lds.ROOT / "benchmarks" / "results" / "lds-output-width.npz"))
    parser.add_argument("--summary", action="store_true", help="only the means, from --out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", action="store_true", help="a Markdown table of the configurations, from --out")
    parser.add_argument("--peers", default=None, help="lds_peers.py's .npz of the same caches: Kronfluence beside")
    args = parser.parse_args()
    configs = [] if args.summary or args.table else args.configs
    per_config = lds.accumulate(Path(args.out), configs, lambda name: run(name, Path(args.cache), args.threads))
    if args.peers:
        per_config = with_peers(per_config, Path(args.peers))
    if args.table:
        names = [n for n in args.configs if n in per_config]
        print(table(per_config, names))
        if args.peers:
            print()
            print(peers_table(per_config, names))
        return
    sets = (("tuning", lds.TUNING), ("earlier held-out", lds.HELDOUT), ("held-out for this choice", lds.HELDOUT_HEAD))
    means_by_set(per_config, args.configs, sets, BEFORE)


if __name__ == "__main__":
    main()
