"""Collection step vs plain training step, side by side in one process (run on a GPU).

For each model shape: median wall time of a plain forward + backward training step
(`experts_implementation="grouped_mm"`, weight gradients computed) and of a moe-attrib
collection step (every expert, router, attention and lm_head module tracked, projected
per-example gradients), plus peak GPU memory of each. Reported as ratios.

    python benchmarks/collect_speed.py --out benchmarks/results/collect_speed-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import moe_attrib as ma
from moe_attrib.collect.collector import GradientCollector, example_losses

SHAPES = {
    "qwen3-30b-a3b-shaped": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            num_hidden_layers=4,
            vocab_size=32000,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "olmoe-1b-7b-shaped": (
        "olmoe",
        dict(
            hidden_size=2048,
            num_experts=64,
            num_experts_per_tok=8,
            intermediate_size=1024,
            num_hidden_layers=4,
            vocab_size=50304,
            num_attention_heads=16,
            num_key_value_heads=16,
        ),
    ),
}


def build(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    family, overrides = SHAPES[shape]
    config = AutoConfig.for_model(family, **overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="grouped_mm")
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
    return model.eval()


def timed(fn, warmup: int, steps: int) -> tuple[float, list[float], int]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, torch.cuda.max_memory_allocated()


def profile_steps(title: str, fn, steps: int = 3, sort_by: str = "self_cpu_time_total") -> None:
    """Print where CPU and GPU time go (torch.profiler), per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    gpu = sum(e.self_device_time_total for e in events) / steps / 1e3
    calls = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    print(f"== {title}: per step self CPU {cpu:.1f} ms, self GPU {gpu:.1f} ms, aten calls {calls:.0f}")
    print(events.table(sort_by=sort_by, row_limit=args_rows(), max_name_column_width=50))


def args_rows() -> int:
    return 22


def run_shape(shape: str, args) -> dict:
    model = build(shape, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq_len), generator=gen).cuda()
    mask = torch.ones_like(ids)
    labels = ids.clone()

    def plain_step():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        example_losses(out.logits, labels).sum().backward()
        for p in model.parameters():
            p.grad = None

    report = ma.discover(model, track_moe_experts=True)
    plain_times, collect_times, plain_peak, collect_peak = [], [], 0, 0
    finite = True
    fallbacks: dict[str, str] = {}
    for _ in range(args.rounds):  # alternate, so drift in clocks or load hits both alike
        _, times, peak = timed(plain_step, args.warmup, args.steps)
        plain_times += times
        plain_peak = max(plain_peak, peak)
        with GradientCollector(model, report, projection_dim=args.projection_dim) as collector:
            grads = collector.collect(ids, mask, labels, fused_experts=True)  # one untimed call, for sanity
            finite = finite and all(bool(torch.isfinite(v).all()) for v in grads.values())
            del grads
            _, times, peak = timed(
                lambda c=collector: c.collect(ids, mask, labels, fused_experts=True), args.warmup, args.steps
            )
            collect_times += times
            collect_peak = max(collect_peak, peak)
        fallbacks.update(collector.fallbacks)
    plain, collect = statistics.median(plain_times), statistics.median(collect_times)
    if args.profile:
        with GradientCollector(model, report, projection_dim=args.projection_dim) as collector:
            profile_steps(f"{shape} collection", lambda: collector.collect(ids, mask, labels, fused_experts=True))
        profile_steps(f"{shape} plain step", plain_step)
    params = sum(p.numel() for p in model.parameters())
    result = {
        "shape": shape,
        "family": SHAPES[shape][0],
        "config": SHAPES[shape][1],
        "params": params,
        "tokens": args.batch * args.seq_len,
        "batch": [args.batch, args.seq_len],
        "projection_dim": args.projection_dim,
        "coverage": report.coverage,
        "tracked_modules": len(report.tracked),
        "plain_step_median_s": plain,
        "collect_step_median_s": collect,
        "time_ratio": collect / plain,
        "plain_peak_bytes": plain_peak,
        "collect_peak_bytes": collect_peak,
        "memory_ratio": collect_peak / plain_peak,
        "collect_outputs_finite": finite,
        "rounds": args.rounds,
        "plain_times_s": plain_times,
        "collect_times_s": collect_times,
        "kernel_fallbacks": fallbacks,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--projection_dim", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3, help="alternating plain/collection rounds")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of collection")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("collect_speed.py needs a CUDA GPU")
    results = []
    for shape in args.shapes:
        results.append(run_shape(shape, args))
        torch.cuda.empty_cache()
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "moe_attrib": ma.__version__,
        "grouped_mm_fallbacks": sorted({k for r in results for k in r["kernel_fallbacks"] if "out_dtype" not in k}),
        "grouped_mm_fp32_out_unsupported": sorted(
            {k for r in results for k in r["kernel_fallbacks"] if "out_dtype" in k}
        ),
    }
    print(env)
    print(f"{'shape':24s} {'plain ms':>9s} {'collect ms':>11s} {'time ratio':>11s} {'mem ratio':>10s}")
    for r in results:
        print(
            f"{r['shape']:24s} {r['plain_step_median_s'] * 1e3:9.1f} {r['collect_step_median_s'] * 1e3:11.1f} "
            f"{r['time_ratio']:11.3f} {r['memory_ratio']:10.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
