"""Peak GPU memory of a 48-layer Qwen3-30B-A3B-shaped build with the collector's own
replacements of model computation switched off one at a time: the fused output layer (`fused_head`)
and the RMSNorms' one-pass backward (`fused_norms`), with and without `recompute`. One model, one
process; peaks relative to the weights.

    python benchmarks/probes/memory48_variants.py --out benchmarks/results/issue15/memory48-variants.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from e2e import GiB, build_once, examples_for, make_model  # noqa: E402

from moe_attrib.collect import collector  # noqa: E402

VARIANTS = {
    "default": {},
    "eager norms": {"fused_norms": False},
    "eager head": {"fused_head": False},
    "eager head and norms": {"fused_head": False, "fused_norms": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    model = make_model("qwen3-30b-a3b-shaped", num_hidden_layers=args.layers)
    weights = sum(q.numel() * q.element_size() for q in model.parameters())
    exs = examples_for(model, 64)
    path = Path("/tmp/e2e-index48v")
    original = collector.GradientCollector.__init__
    rows = []
    for recompute in (True, False):
        for name, flags in VARIANTS.items():

            def init(self, *a, _flags=flags, **k):
                original(self, *a, **{**k, **_flags})

            collector.GradientCollector.__init__ = init
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            seconds = build_once(model, exs, path, 32, "sum", args.tokens, recompute)
            peak = torch.cuda.max_memory_allocated()
            shutil.rmtree(path, ignore_errors=True)
            row = {"variant": name, "recompute": recompute, "peak_gib": peak / GiB, "weights_gib": weights / GiB}
            row |= {"peak_over_weights": peak / weights, "tok_s": 64 * 512 / seconds}
            print(json.dumps(row), flush=True)
            rows.append(row)
    collector.GradientCollector.__init__ = original
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
