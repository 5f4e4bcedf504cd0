"""Exploration (session 18, not a default): the eigenbasis default with the experts' direction weights scaled in the
allocation's greedy (`lds_budget.py --expert_weights 0.5 0.25 0.1 --tag=-s18ew`), beside the untracked index at the same
bytes (`-s18groups`), per configuration and as means with paired CIs against the default.

    python benchmarks/probes/expert_weight_summary.py > benchmarks/results/issue32/lds-expert-weight-s18.txt
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lds  # noqa: E402
from lds_damping import mean_over  # noqa: E402

OUT = lds.ROOT / "benchmarks" / "results" / "issue32"

names = list(lds.TUNING) + list(lds.HELDOUT) + list(lds.HELDOUT_HEAD) + list(lds.HELDOUT_NEXT) + list(lds.HELDOUT_S18)
per = {}
for n in names:
    v = json.load(open(OUT / f"lds-budget-{n}-s18ew.json"))["variants"]
    d = {}
    for label, r in v.items():
        k = "default" if "experts x" not in label else "experts " + label.split("experts ")[1]
        d[k] = np.array(r["per_query"])
    g = json.load(open(OUT / f"lds-budget-{n}-s18groups.json"))["variants"]
    d["untracked"] = np.array(next(r["per_query"] for label, r in g.items() if label.endswith("untracked")))
    per[n] = d
    print(n, " ".join(f"{k}:{x.mean():.3f}" for k, x in d.items()))
for title, group in [("all 15", names), ("13", names[:13])]:
    print(title)
    mean_over(per, group, "default")
