"""Whether a 48-layer build leaves GPU memory allocated for the next one (issue 15): e2e.py's memory48
order (without recompute, then with), printing the memory allocated before each build, its peak
above that, and the same after `gc.collect()`.

    python benchmarks/memory48_order.py
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from e2e import GiB, build_once, examples_for, make_model  # noqa: E402


def main() -> None:
    model = make_model("qwen3-30b-a3b-shaped", num_hidden_layers=48)
    weights = sum(q.numel() * q.element_size() for q in model.parameters())
    exs = examples_for(model, 64)
    path = Path("/tmp/e2e-index48o")
    for recompute, collect in ((False, False), (True, False), (False, True), (True, True)):
        if collect:
            gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        build_once(model, exs, path, 32, "sum", 8192, recompute)
        peak = torch.cuda.max_memory_allocated()
        shutil.rmtree(path, ignore_errors=True)
        row = {"recompute": recompute, "gc_before": collect, "allocated_before_gib": before / GiB}
        row |= {"peak_over_weights": peak / weights, "peak_above_before_over_weights": (peak - before) / weights}
        row["allocated_after_gib"] = torch.cuda.memory_allocated() / GiB
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
