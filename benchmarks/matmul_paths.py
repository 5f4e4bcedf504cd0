"""Host and GPU cost of the projection matmul's float32-output paths, at 1k-token shapes (H200).

A collection step projects every tracked module's inputs and output gradients to p columns with
`Kernels.matmul_fp32` (bf16 rows, float32 result). At 1k tokens a step is bound by the host, so
the host cost of each call matters. This times, per call, for the Qwen3-30B-A3B shapes of one
1,024-token batch at p=32:

- `out_dtype`: `torch.mm(x, w, out_dtype=torch.float32)` (what `matmul_fp32` does on CUDA);
- `cast`: `torch.mm(x.float(), w32)` with the projection kept in float32 (products of bf16 values
  are exact in float32, so this is the same sum up to order);
- `bf16`: `torch.mm(x, w).float()` (bf16 output rounding; speed reference only, not exact);

"host us" is the time to enqueue 200 calls without waiting (the host's cost while the GPU keeps
up), "gpu us" the time per call with a sync at the end; "max rel diff" is against a float64 product.

    python benchmarks/matmul_paths.py --out benchmarks/results/issue15/matmul-paths-s6.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SHAPES = {  # (rows, in) of the projected sides of one layer and the output layer, 1,024 tokens
    "hidden 2048 (q/k/v/router inputs, o/down outputs)": (1024, 2048),
    "q_proj output / o_proj input 4096": (1024, 4096),
    "k/v output 512": (1024, 512),
    "lm_head output 151936": (1024, 151936),
}


def paths(w: torch.Tensor) -> dict:
    w32 = w.float()
    return {
        "out_dtype": lambda x: torch.mm(x, w, out_dtype=torch.float32),
        "cast": lambda x: torch.mm(x.float(), w32),
        "bf16": lambda x: torch.mm(x, w).float(),
    }


def time_path(fn, x: torch.Tensor, calls: int = 200, rounds: int = 5) -> tuple[float, float]:
    for _ in range(10):
        fn(x)
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        total.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "p": args.p, "rows": []}
    print(f"{'shape':<52}{'path':<11}{'host us':>9}{'gpu us':>9}{'max rel diff':>14}")
    for name, (rows, width) in SHAPES.items():
        x = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
        w = torch.randn(width, args.p, device="cuda", generator=gen).bfloat16()
        exact = x.double() @ w.double()
        for path, fn in paths(w).items():
            try:
                host, total = time_path(fn, x)
                diff = float((fn(x).double() - exact).abs().max() / exact.abs().max())
            except (RuntimeError, TypeError) as err:
                print(f"{name:<52}{path:<11} unavailable: {err}")
                continue
            result["rows"].append({"shape": name, "path": path, "host_us": host, "gpu_us": total, "max_rel_diff": diff})
            print(f"{name:<52}{path:<11}{host:>9.1f}{total:>9.1f}{diff:>14.2e}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
