"""Sampled host profile of a small-batch step on the GPU: which Python functions hold the
host, per thread (the main thread runs the forward, the autograd engine's device thread the backward
and its hooks), with py-spy sampling the process from outside (no tracer overhead in the step).

    py-spy record -r 250 --threads -f raw -o spy-collect.txt -- python benchmarks/probes/host_profile.py --mode collect
    py-spy record -r 250 --threads -f raw -o spy-plain.txt -- python benchmarks/probes/host_profile.py --mode plain
    python benchmarks/probes/host_profile.py --aggregate spy-collect.txt spy-plain.txt

py-spy (`pip install py-spy`) is not a dependency of moe-attrib. Sampling slows the steps by about
1.6x, so read the shares, not the milliseconds (at 1000 Hz the raw files grew past 100 MB and the
run took minutes). The step runs in a loop for `--seconds` after a warm-up; the aggregate prints,
per file and thread, each function's inclusive share of the samples (a frame counted once per
sample) and its samples per step.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::\d+)?\)$")


def run(mode: str, seconds: float, batch: int, seq_len: int, projection_dim: int) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from e2e import floor_step, frozen, make_model, plain_step, token_ids

    import moe_attrib as ma
    from moe_attrib.collect.collector import GradientCollector

    model = make_model("qwen3-30b-a3b-shaped")
    ids = token_ids(model, batch, seq_len).cuda()
    mask, labels = torch.ones_like(ids), ids.clone()
    report = ma.discover(model, track_moe_experts=True, warn=False)
    with contextlib.ExitStack() as stack:
        if mode == "plain":
            step = lambda: plain_step(model, ids, mask, labels)  # noqa: E731
        elif mode == "floor":
            stack.enter_context(frozen(model))
            step = lambda: floor_step(model, ids, mask, labels)  # noqa: E731
        else:
            c = stack.enter_context(GradientCollector(model, report, projection_dim=projection_dim))
            step = lambda: c.collect(ids, mask, labels, fused_experts=True)  # noqa: E731
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        steps, elapsed = timed_loop(step, seconds, torch.cuda.synchronize)
    print(f"STEPS {steps} {elapsed / steps * 1e3:.2f} ms/step", flush=True)


def timed_loop(step, seconds: float, sync) -> tuple[int, float]:
    """The sampled loop: the aggregate counts the main thread's samples under this function only."""
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step()
        sync()
        steps += 1
    return steps, time.perf_counter() - start


def thread_is_main(frames: list[str]) -> bool:
    return any(f.startswith("<module> ") for f in frames)


def aggregate(path: str, top: int) -> None:
    per_thread: dict[str, Counter] = {}
    totals: Counter = Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
        if frames[0].startswith("process"):
            thread = frames[1] if len(frames) > 1 and frames[1].startswith("thread") else thread
        n = int(count)
        if thread_is_main(frames) and not any(f.startswith("timed_loop ") for f in frames):
            continue  # set-up, warm-up
        totals[thread] += n
        seen = set()
        for f in frames:
            m = FRAME.match(f)
            if m is None:
                continue
            key = f"{m['func']} ({m['file'].split('site-packages/')[-1]})"
            if key not in seen:
                seen.add(key)
                per_thread.setdefault(thread, Counter())[key] += n
    print(f"== {path}: samples per thread {dict(totals)}")
    for thread, counter in per_thread.items():
        print(f"-- {thread} ({totals[thread]} samples)")
        for key, n in counter.most_common(top):
            print(f"{100 * n / totals[thread]:6.1f}%  {n:7d}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["plain", "floor", "collect"], default="collect")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--projection_dim", type=int, default=32)
    parser.add_argument("--aggregate", nargs="+", default=None, help="py-spy raw files to summarise")
    parser.add_argument("--top", type=int, default=70)
    args = parser.parse_args()
    if args.aggregate:
        for path in args.aggregate:
            aggregate(path, args.top)
        return
    run(args.mode, args.seconds, args.batch, args.seq_len, args.projection_dim)


if __name__ == "__main__":
    main()
