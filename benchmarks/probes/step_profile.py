"""Where a collection step's time goes on the GPU: kernels at 8k tokens, host Python at 1k.

- GPU: torch.profiler over a few collection steps and floor steps (the model's forward and activation
  backward, nothing captured) of the 4-layer Qwen3-30B-A3B shape at `--tokens` (2 x 4096), kernels
  sorted by their GPU time per step;
- host: cProfile over collection steps and plain training steps at 2 x 512 tokens, where both wait
  on the host (Python functions sorted by their own time, and moe-attrib's by cumulative time), and
  the self CPU time of each aten op under torch.profiler, collection beside plain.

    python benchmarks/probes/step_profile.py > benchmarks/results/issue15/step-profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from e2e import floor_step, frozen, make_model, plain_step, token_ids  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.collect.collector import GradientCollector  # noqa: E402


def profiled(fn, steps: int, activity: str, warmup: int = 2):
    """torch.profiler over `steps` calls of `fn` (after `warmup` calls), one activity ("CPU" or "CUDA")."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof


def kernels(title: str, fn, steps: int, rows: int) -> None:
    events = [e for e in profiled(fn, steps, "CUDA").key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"== {title}: {total:.1f} ms of kernels per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"{e.self_device_time_total / steps / 1e3:8.3f} ms {e.count // steps:5d}x  {e.key[:150]}")


def host(title: str, fn, steps: int, rows: int) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats(key)
        stats.print_stats(rows if key == "tottime" else "moe_attrib", rows)
        print(f"== {title}, by {key} ({steps} steps)\n{out.getvalue()}")


def op_times(fn, steps: int) -> dict[str, float]:
    """Self CPU ms per step of each aten op (and autograd node) under torch.profiler, with "total"."""
    events = profiled(fn, steps, "CPU", warmup=3).key_averages()
    times = {e.key: e.self_cpu_time_total / steps / 1e3 for e in events}
    times["total"] = sum(times.values())
    return times


def print_op_times(columns: dict[str, dict[str, float]], rows: int) -> None:
    """The ops whose self CPU time differs most between the first two columns."""
    titles = list(columns)
    first, second = columns[titles[0]], columns[titles[1]]
    keys = sorted(set(first) | set(second), key=lambda k: -abs(first.get(k, 0.0) - second.get(k, 0.0)))
    print("== self CPU ms per step under torch.profiler, largest differences first")
    print("".join(f"{t[:12]:>13s}" for t in titles) + "   op")
    for key in keys[:rows]:
        print("".join(f"{columns[t].get(key, 0.0):13.3f}" for t in titles) + f"   {key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs=2, default=[2, 4096])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=45)
    args = parser.parse_args()
    model = make_model("qwen3-30b-a3b-shaped")
    report = ma.discover(model, track_moe_experts=True, warn=False)
    for n, s, what in ((*args.tokens, "gpu"), (2, 512, "host")):
        ids = token_ids(model, n, s).cuda()
        mask, labels = torch.ones_like(ids), ids.clone()
        with GradientCollector(model, report, projection_dim=32) as c:
            step = lambda c=c, ids=ids, mask=mask, labels=labels: c.collect(ids, mask, labels, fused_experts=True)  # noqa: E731
            if what == "gpu":
                kernels(f"collection step {n}x{s}", step, args.steps, args.rows)
            else:
                host(f"collection step {n}x{s}", step, 20, args.rows)
                collect_ops = op_times(step, 10)
        if what == "gpu":
            with frozen(model):
                floor = lambda ids=ids, mask=mask, labels=labels: floor_step(model, ids, mask, labels)  # noqa: E731
                kernels(f"floor step {n}x{s}", floor, args.steps, args.rows)
        else:
            plain = lambda ids=ids, mask=mask, labels=labels: plain_step(model, ids, mask, labels)  # noqa: E731
            host(f"plain step {n}x{s}", plain, 20, args.rows)
            print_op_times({"collection": collect_ops, "plain": op_times(plain, 10)}, args.rows)


if __name__ == "__main__":
    main()
