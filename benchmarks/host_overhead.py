"""Host overhead of a collection step at small batches, on the CPU (issue 15): aten ops and wall time per step.

At 1k tokens on an H200 both a plain training step and a collection step are bound by the host
(Python, the dispatcher, kernel launches), so every op a collection step adds per layer costs host
time. At tiny widths a CPU step is dominated by the same per-op cost, so this benchmark measures on
the CPU, for a tiny Qwen3-MoE-shaped model (hidden 64, 4 layers, 128 experts top-8, expert width 32):

- a plain step: forward + backward of the summed token cross-entropy with weight gradients
  (`experts_implementation="grouped_mm"`, as `benchmarks/e2e.py`'s `plain_step`);
- a collection step at `build_index`'s defaults (projection 32, `rademacher-hash-v2`, experts tracked,
  `fused_experts=True`), plus the per-batch tail `build_index` runs on the result (`flatten_rows`, the
  finiteness flags and the metadata row).

Op counts: every aten op that reaches a kernel (a `TorchDispatchMode`, after autograd and composite
decomposition), attributed to the innermost moe-attrib function on the Python stack (`capture`,
`layouts/routed`, `Kernels`, formation, packaging, flatten), else to the model's own forward
(transformers) or to the autograd engine's backward of a model op. Wall time: medians of per-step
`perf_counter` over interleaved rounds (plain, collect, plain, ...), and of the thread's CPU time
(`thread_time`: what the step used, less sensitive to other processes on a shared machine than wall
time), `OMP_NUM_THREADS=1` recommended.

CUDA differs (the counts here are the CPU's): `--cuda_segments` forces `Kernels.segment_mm` to the
tiled fallback that float32 rows take on CUDA (CUDA's grouped GEMM takes bf16 only), which is what the
H200 runs for the per-example formation; `--dtype bf16` adds the float32 conversions a bf16 model pays
(on CUDA `grouped_mm(out_dtype=)` / `mm(out_dtype=)` write float32 directly, one conversion less per
projected side than the CPU). `RoutedCombine` is a `bmm` on CUDA and a multiply + sum on the CPU: the
same number of ops (3 forward, 3 backward).

    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py --out benchmarks/results/issue15/host-overhead-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import moe_attrib as ma
from moe_attrib.collect.collector import GradientCollector, example_losses
from moe_attrib.indexing.index import column_plan, flatten_rows
from moe_attrib.model.layouts import Kernels
from moe_attrib.model.layouts.kernels import tiled_segment_mm
from moe_attrib.model.zoo import tiny_config

PACKAGE = str(Path(ma.__file__).parent)
THIS = str(Path(__file__).resolve())


def make_model(experts: int, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    config = tiny_config(
        "qwen3_moe",
        hidden_size=64,
        num_hidden_layers=layers,
        num_experts=experts,
        num_local_experts=experts,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        moe_intermediate_size=32,
        intermediate_size=128,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="grouped_mm")
    return model.eval()


class CudaSegments(Kernels):
    """`segment_mm` as CUDA runs it for float32 rows: `tiled_segment_mm` (benchmark only)."""

    def segment_mm(self, left: torch.Tensor, right: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return tiled_segment_mm(left, right, ends)


def plain_step(model, ids, mask, labels) -> None:
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    example_losses(out.logits, labels).sum().backward()
    for p in model.parameters():
        p.grad = None


def build_tail(out, report, blocks, n: int) -> torch.Tensor:
    """What `build_index` runs on each batch's result before the copy to the host."""
    grads = flatten_rows(out, report, blocks, "separate")
    finite = torch.isfinite(grads.view(n, -1)).all(dim=1) & torch.isfinite(out.losses)
    return torch.cat([out.losses.float(), finite.float(), out.expert_counts.float().reshape(-1)])


def where(frame) -> str:
    """The innermost moe-attrib function on the stack, else the model's forward or the autograd engine."""
    node = torch._C._current_autograd_node()
    while frame is not None:
        path = frame.f_code.co_filename
        if node is not None and (path.endswith("torch/_tensor.py") or path.endswith("torch/autograd/__init__.py")):
            break  # reached the `.backward()` call: a C++ autograd node of a model or library op
        if path.startswith(PACKAGE):
            rel = path[len(PACKAGE) + 1 :].removesuffix(".py")
            return f"{rel}.{frame.f_code.co_qualname}"
        if path == THIS:
            func = frame.f_code.co_name
            return f"benchmark.{func}" if func in ("build_tail", "plain_step") else "benchmark"
        if "/transformers/" in path:
            return "model forward (transformers)"
        frame = frame.f_back
    return f"backward: {type(node).__name__}" if node is not None else "other"


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched (to a kernel), by op and by where it was called from."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.sites: Counter = Counter()
        self.site_ops: dict[str, Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        site = where(sys._getframe(1))
        if site.startswith("backward: "):
            site = "backward (autograd engine)"
        self.ops[name] += 1
        self.sites[site] += 1
        self.site_ops.setdefault(site, Counter())[name] += 1
        return func(*args, **(kwargs or {}))


def category(site: str) -> str:
    """Group call sites into the phases the report names."""
    if site.startswith("capture."):
        return "capture hooks (capture.py)"
    if site.startswith("layouts/routed."):
        return "routed rows + experts forward (layouts/routed.py)"
    if site.startswith("layouts/kernels."):
        return "Kernels (grouped / segment / fp32 matmuls)"
    if site.startswith("collector.form_") or site.startswith("collector._form"):
        return "formation (collector.form_examples)"
    if site.startswith("collector."):
        return "collector (labels, losses, packaging)"
    if site.startswith("index.") or site == "benchmark.build_tail":
        return "build tail (flatten, finiteness, metadata)"
    return site


def count(fn) -> OpCounter:
    with OpCounter() as counter:
        fn()
    return counter


def profiler_ops(fn) -> int:
    """aten events the profiler records for one step (composite ops and their kernels both counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def measure(args, dtype: torch.dtype, cuda_segments: bool) -> dict:
    torch.manual_seed(0)
    model = make_model(args.experts, args.layers, dtype)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq_len))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    report = ma.discover(model, track_moe_experts=True, warn=False)
    blocks = column_plan(report, args.projection_dim, "separate")
    collector = GradientCollector(model, report, projection_dim=args.projection_dim)
    if cuda_segments:
        collector.kernels = CudaSegments()
    n = ids.shape[0]

    def collect():
        return collector.collect(ids, mask, labels, fused_experts=True)

    def collect_build():
        out = collect()
        return build_tail(out, report, blocks, n)

    def plain():
        plain_step(model, ids, mask, labels)

    steps = {"plain": plain, "collect": collect, "collect+build tail": collect_build}

    def run(name: str, fn):
        """Run `fn` inside an entered collector for the collection steps (the plain step runs without one)."""
        if name == "plain":
            return fn()
        with collector:
            collect()  # the taps' first batch of this capture (and, once per process, the experts check)
            return fn()

    for name, fn in steps.items():  # warm-up: the one-time check, projections drawn
        run(name, fn)
    counts = {name: run(name, lambda fn=fn: count(fn)) for name, fn in steps.items()}
    prof = {name: run(name, lambda fn=fn: profiler_ops(fn)) for name, fn in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}

    cpu: dict[str, list[float]] = {name: [] for name in steps}

    def timed(fn) -> list[tuple[float, float]]:
        out = []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            out.append((time.perf_counter() - t0, time.thread_time() - c0))
        return out

    for _ in range(args.rounds):
        for name, fn in steps.items():
            for wall, used in run(name, lambda fn=fn: timed(fn)):
                times[name].append(wall)
                cpu[name].append(used)
    result = {
        "dtype": str(dtype).removeprefix("torch."),
        "segment_mm": "tiled (CUDA float32 path)" if cuda_segments else "grouped_mm (CPU path)",
        "steps": {},
    }
    for name in steps:
        c = counts[name]
        cats: Counter = Counter()
        for site, k in c.sites.items():
            cats[category(site)] += k
        result["steps"][name] = {
            "ms": statistics.median(times[name]) * 1e3,
            "ms_iqr": [q * 1e3 for q in statistics.quantiles(times[name], n=4)[::2]],
            "cpu_ms": statistics.median(cpu[name]) * 1e3,
            "ops": sum(c.ops.values()),
            "profiler_aten_events": prof[name],
            "by_phase": dict(cats.most_common()),
            "by_site": dict(c.sites.most_common()),
            "by_op": dict(c.ops.most_common()),
        }
    plain_ops = counts["plain"].ops
    for name in ("collect", "collect+build tail"):
        extra = Counter(counts[name].ops)
        extra.subtract(plain_ops)
        result["steps"][name]["extra_by_op"] = {k: v for k, v in extra.most_common() if v}
    return result


def print_row(res: dict, layers: int) -> None:
    steps = res["steps"]
    plain = steps["plain"]
    print(f"\n== {res['dtype']}, segment_mm: {res['segment_mm']}")
    print(
        f"{'step':<22}{'ms':>8}{'ratio':>8}{'cpu ms':>8}{'ratio':>8}{'ops':>8}{'ops/layer':>11}{'extra/layer':>13}"
        f"{'profiler':>10}"
    )
    for name, s in steps.items():
        extra = (s["ops"] - plain["ops"]) / layers
        print(
            f"{name:<22}{s['ms']:8.2f}{s['ms'] / plain['ms']:8.3f}"
            f"{s['cpu_ms']:8.2f}{s['cpu_ms'] / plain['cpu_ms']:8.3f}{s['ops']:8d}{s['ops'] / layers:11.1f}"
            f"{extra:13.1f}{s['profiler_aten_events']:10d}"
        )
    print("collect+build tail ops by phase (plain step for reference):")
    ref = plain["by_phase"]
    for phase, k in steps["collect+build tail"]["by_phase"].items():
        print(f"  {phase:<55}{k:7d}   plain {ref.get(phase, 0):6d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--projection_dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--cuda_segments", action="store_true", help="also count the CUDA float32 segment_mm path")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    runs = []
    for d in args.dtypes:
        runs.append(measure(args, dtypes[d], False))
        print_row(runs[-1], args.layers)
        if args.cuda_segments:
            runs.append(measure(args, dtypes[d], True))
            print_row(runs[-1], args.layers)
    result = {
        "benchmark": "host_overhead (CPU proxy for the host-bound small-batch regime; not an H200 number)",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "model": "qwen3_moe: hidden 64, expert width 32, top-8, vocab 256, fp32/bf16 on the CPU",
        "torch": torch.__version__,
        "runs": runs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
