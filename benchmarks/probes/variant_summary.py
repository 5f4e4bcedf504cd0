"""Explorations on the eigenbasis default (session 18, not defaults): each variant that `lds_budget.py` wrote under a
tag beside the default index, named by what its label adds to the default's, per configuration and as means over the
configurations with paired CIs against the default; with `--untracked`, also the untracked index at the same bytes
(from the `-s18groups` files).

    python benchmarks/probes/variant_summary.py s18ew --untracked > benchmarks/results/issue32/lds-expert-weight-s18.txt
    python benchmarks/probes/variant_summary.py s18bal > benchmarks/results/issue32/lds-balance-s18.txt
"""

import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lds  # noqa: E402
from lds_damping import mean_over  # noqa: E402

OUT = lds.ROOT / "benchmarks" / "results" / "issue32"
SEEN = [*lds.TUNING, *lds.HELDOUT, *lds.HELDOUT_HEAD, *lds.HELDOUT_NEXT, *lds.HELDOUT_S18]


def variants(path: Path) -> dict[str, np.ndarray]:
    """`{"default" | what a label adds after the default's "area": per-query LDS}` of one result file's eigenbasis
    variants (the seeded index's left out)."""
    out = {}
    for label, r in json.loads(path.read_text())["variants"].items():
        parts = re.split(r", area(?:, |$)", label, maxsplit=1)
        if len(parts) == 2:
            out[parts[1] or "default"] = np.array(r["per_query"])
    return out


def main() -> None:
    tag = "-" + sys.argv[1].lstrip("-")
    per = {}
    for name in [*SEEN, "gpu"]:
        path = OUT / f"lds-budget-{name}{tag}.json"
        if not path.exists():
            continue
        per[name] = variants(path)
        if "--untracked" in sys.argv:
            per[name]["untracked"] = variants(OUT / f"lds-budget-{name}-s18groups.json")["untracked"]
        print(name, " ".join(f"{k}: {x.mean():.3f}" for k, x in per[name].items()))
    for title, group in (("the fifteen", [n for n in SEEN if n in per]), ("gpu", ["gpu"] if "gpu" in per else [])):
        if group:
            print(f"\nmeans over {title}")
            mean_over(per, group, "default")


if __name__ == "__main__":
    main()
