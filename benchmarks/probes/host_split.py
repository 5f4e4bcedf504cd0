"""Where the 1k-token collection step's time goes: the step with one kind of target at a
time, against the plain step and the floor, side by side in one process on the GPU.

At 1k tokens a collection step is bound by the host, so its cost above the floor (the model's forward
and activation backward, no weight gradients) is what the capture's Python and launches add. This
measures that cost per kind of target by collecting with `discover(filter_modules=...)` keeping
only the experts, only attention's projections, only the routers or only the output layer, and with
no target at all (the collection forward: fused norms and head, no rows), in interleaved rounds.
Which functions hold the host: `benchmarks/probes/host_profile.py` (py-spy).

    python benchmarks/probes/host_split.py [--batch 2 --seq_len 512 --rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from collect_speed import timed  # noqa: E402
from e2e import floor_step, frozen, make_model, plain_step, token_ids  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.collect.collector import GradientCollector  # noqa: E402

FILTERS = {
    "all": None,
    "experts": "*.mlp.experts",
    "attention": "*.self_attn.*",
    "routers": "*.mlp.gate",
    "lm_head": "lm_head",
    "none": "no target matches this",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--projection_dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model = make_model("qwen3-30b-a3b-shaped")
    ids = token_ids(model, args.batch, args.seq_len).cuda()
    mask, labels = torch.ones_like(ids), ids.clone()
    reports = {k: ma.discover(model, track_moe_experts=True, warn=False, filter_modules=f) for k, f in FILTERS.items()}
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        times["plain"] += timed(lambda: plain_step(model, ids, mask, labels), 2, args.steps)[1]
        with frozen(model):
            times["floor"] += timed(lambda: floor_step(model, ids, mask, labels), 2, args.steps)[1]
        for key, report in reports.items():
            with GradientCollector(model, report, projection_dim=args.projection_dim) as c:
                c.collect(ids, mask, labels, fused_experts=True)
                step = lambda c=c: c.collect(ids, mask, labels, fused_experts=True)  # noqa: E731
                times[f"collect {key}"] += timed(step, 2, args.steps)[1]
    plain = statistics.median(times["plain"])
    none = statistics.median(times["collect none"])
    rows = {
        k: {
            "ms": statistics.median(v) * 1e3,
            "of_plain": statistics.median(v) / plain,
            "above_no_target_ms": (statistics.median(v) - none) * 1e3,
        }
        for k, v in times.items()
    }
    print(json.dumps({"tokens": ids.numel(), "targets": {k: len(r.targets) for k, r in reports.items()}, "rows": rows}))


if __name__ == "__main__":
    main()
