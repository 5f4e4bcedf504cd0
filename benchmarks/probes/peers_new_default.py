"""Kronfluence 1.0.1 against today's default damping (0.01 x the model-wide mean) on every configuration.

`lds_peers.py` scored Kronfluence beside the moe-attrib default of its time (damping 1 x the mean) on
caches of which only some are kept; `lds_damping.py` scored both dampings on the same caches. Both
keep per-query LDS, so this pairs Kronfluence's values (`lds-peers.npz`) with the 0.01 x rule's
(`lds-damping.npz`). It first checks that the two files agree where they overlap, i.e. that the moe-attrib
default in `lds-peers.npz` equals one of the two dampings' rows query for query. It prints per configuration and the
means over the tuning and held-out configurations (`lds_damping.mean_over`), with paired bootstrap CIs
(Kronfluence - default):

    python benchmarks/probes/peers_new_default.py > benchmarks/results/lds-peers-new-default.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))
import lds  # noqa: E402
from lds_damping import mean_over  # noqa: E402

RESULTS = lds.ROOT / "benchmarks" / "results"
OLD, NEW = "1 x mean, model", "0.01 x mean, model"
PEERS = {"Kronfluence, its defaults": "Kronfluence 1.0.1 EK-FAC, its defaults",
         "Kronfluence, damping 0.1 x mean": "Kronfluence, damping 0.1 x mean eigenvalue"}  # fmt: skip


def main() -> None:
    damping = dict(np.load(RESULTS / "lds-damping.npz").items())
    peers = dict(np.load(RESULTS / "lds-peers.npz").items())
    names = [n for n in lds.TUNING + lds.HELDOUT if f"{n}|{NEW}" in damping and f"{n}|moe-attrib default" in peers]
    per: dict[str, dict[str, np.ndarray]] = {}
    print(
        "| configuration | default (0.01 x mean) | 1 x mean | "
        + " | ".join(f"{k} | {k} - default" for k in PEERS)
        + " |"
    )
    print("|---|---|---|" + "---|---|" * len(PEERS))
    for n in names:
        ours = peers[f"{n}|moe-attrib default"]
        assert any(np.array_equal(ours, damping[f"{n}|{r}"]) for r in (OLD, NEW)), f"{n}: the two files disagree"
        per[n] = {"default": damping[f"{n}|{NEW}"], **{k: peers[f"{n}|{v}"] for k, v in PEERS.items()}}
        cells = [f"{per[n]['default'].mean():.3f}", f"{damping[f'{n}|{OLD}'].mean():.3f}"]
        for k in PEERS:
            lo, hi = lds.bootstrap(per[n][k] - per[n]["default"])
            cells += [
                f"{per[n][k].mean():.3f}",
                f"{per[n][k].mean() - per[n]['default'].mean():+.3f} [{lo:+.3f}, {hi:+.3f}]",
            ]
        held = " (held out)" if n in lds.HELDOUT else ""
        print(f"| {n}{held} | " + " | ".join(cells) + " |")
    for title, group in (("tuning", lds.TUNING), ("held-out", lds.HELDOUT)):
        have = [n for n in names if n in group]
        print(f"== mean over the {title} configurations ({', '.join(have)})")
        mean_over(per, have, "default")


if __name__ == "__main__":
    main()
