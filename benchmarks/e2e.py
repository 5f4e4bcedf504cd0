"""End to end at hardware speed (issue 15): collection steps, `build_index`, peak memory at full depth.

Every row is measured side by side with its reference in one process, in interleaved rounds,
and reported as a ratio of medians:

- collect: the collection step vs a plain training step (forward + backward with weight
  gradients, `experts_implementation="grouped_mm"`) on 4-layer Qwen3-30B-A3B / OLMoE-1B-7B
  shapes at 1k-8k tokens per batch, and with a skewed router;
- build: `build_index` tokens/s over 128 x 512 tokens of a 24-layer Qwen3-30B-A3B shape
  (`--expert_blocks sum`, the default projection) vs plain training steps over the same batches;
- memory48: the peak GPU memory of a 48-layer Qwen3-30B-A3B-shaped build vs its weights.

`--collect_graph` also times `GraphedCollector` (the step replayed from a CUDA graph, with its copies
in and out) in the same rounds, and its largest difference to an eager step; `--collect_rows` keeps
only the named rows.
`--build_graphs` also times `build_index(cuda_graphs=True)` in the build rounds (its rows against the
eager build's, beside two eager builds' own difference); `--build_tokens` sets the build's token batch.
`--build_eigen 256KiB` also times, in the same rounds, the seeded build (`--expert_blocks separate`,
p=`--projection_dim`) and an eigenbasis build (`build_index(ekfac=, budget=)`, factors fitted once before
the rounds with `--eigen_sketch` and `--eigen_output_sketch`, rows stored as `--eigen_dtype`: `build`'s
default) of the same model and batches: the eigenbasis build's tokens/s over the seeded build's, and what it collects
per example (`eigen_collected`: each target's widest expert rectangle, padded, times its experts, against the
columns it stores).

    python benchmarks/e2e.py --out benchmarks/results/e2e-h200.json [--parts collect phases build memory48]

Scoring is measured by `benchmarks/score_speed.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from collect_speed import SHAPES, timed  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.collect.collector import GradientCollector, example_losses  # noqa: E402
from moe_attrib.collect.graphs import GraphedCollector  # noqa: E402
from moe_attrib.data import Example  # noqa: E402
from moe_attrib.settings import EIGENBASIS_OUTPUT_SKETCH  # noqa: E402

GiB = 1 << 30


def make_model(shape: str, **overrides) -> torch.nn.Module:
    family, base = SHAPES[shape]
    config = AutoConfig.for_model(family, **{**base, **overrides})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="grouped_mm")
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
    return model.eval()


def plain_step(model, ids, mask, labels) -> None:
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    example_losses(out.logits, labels).sum().backward()
    for p in model.parameters():
        p.grad = None


def floor_step(model, ids, mask, labels) -> None:
    """The least any collection must run: the model's forward and the backward of its activations
    down to the input embeddings, with no weight gradient (the parameters are frozen by the caller)."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
    example_losses(out.logits, labels).sum().backward()


def frozen(model):
    """Context: every parameter without requires_grad, restored after."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        flags = [(p, p.requires_grad) for p in model.parameters()]
        for p, _ in flags:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p, flag in flags:
                p.requires_grad_(flag)

    return cm()


def token_ids(model, n: int, seq_len: int, repeat: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Random ids; with `repeat` > 0 that fraction of positions holds one token (a skewed router's load)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, seq_len), generator=gen)
    if repeat:
        ids[torch.rand(ids.shape, generator=gen) < repeat] = 5
    return ids


def expert_share(counts: torch.Tensor, top: int = 8) -> float:
    """Share of routed rows taken by the `top` busiest experts, averaged over layers."""
    per_layer = counts.sum(dim=0)  # [layers, E]
    share = per_layer.topk(top, dim=1).values.sum(1) / per_layer.sum(1)
    return float(share.mean())


def cast_matmul(kernels) -> None:
    """`kernels.matmul_fp32` as `mm(x.float(), w32)`, each projection cast to float32 once (a variant
    timed beside the library's `mm(out_dtype=float32)`, `--collect_cast`)."""
    cast: dict = {}

    def matmul_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), tuple(w.shape))
        if key not in cast:
            cast[key] = w.float()
        flat = torch.mm(x.reshape(-1, x.shape[-1]).float(), cast[key])
        return flat if x.dim() == 2 else flat.view(*x.shape[:-1], w.shape[-1])

    kernels.matmul_fp32 = matmul_fp32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def capture_graph(fn, warmup: int = 3) -> tuple:
    """`fn` captured in a CUDA graph after `warmup` eager calls on a side stream (one-time checks,
    cached projections and allocations happen there); returns `(graph, fn's static result)`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


def collect_row(
    name: str,
    model,
    ids: torch.Tensor,
    p: int,
    steps: int,
    rounds: int,
    profile: bool = False,
    cast: bool = False,
    graph: bool = False,
) -> dict:
    ids = ids.cuda()
    mask = torch.ones_like(ids)
    labels = ids.clone()
    report = ma.discover(model, track_moe_experts=True, warn=False)
    times: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}

    def measure(key: str, fn) -> None:
        _, t, m = timed(fn, 2, steps)
        times.setdefault(key, []).extend(t)
        peaks[key] = max(peaks.get(key, 0), m)

    share = None
    graph_diff, graph_unsupported = None, None
    for _ in range(rounds):
        measure("plain", lambda: plain_step(model, ids, mask, labels))
        with frozen(model):
            measure("floor", lambda: floor_step(model, ids, mask, labels))
        with GradientCollector(model, report, projection_dim=p) as c:
            out = c.collect(ids, mask, labels, fused_experts=True)
            share = expert_share(out.expert_counts.float().cpu())
            del out
            measure("collect", lambda c=c: c.collect(ids, mask, labels, fused_experts=True))
            fused = c.collect(ids, mask, labels, fused_experts=True)
        with GradientCollector(model, report, projection_dim=p, fused_head=False, fused_norms=False) as c:
            eager = c.collect(ids, mask, labels, fused_experts=True)
            head_diff = max(rel(fused[k], eager[k]) for k in eager)
            loss_diff = rel(fused.losses, eager.losses)
            del fused, eager
            measure("collect_eager", lambda c=c: c.collect(ids, mask, labels, fused_experts=True))
        with GradientCollector(model, report, projection_dim=p, fused_norms=False) as c:
            c.collect(ids, mask, labels, fused_experts=True)
            measure("collect_eager_norms", lambda c=c: c.collect(ids, mask, labels, fused_experts=True))
        if cast:
            with GradientCollector(model, report, projection_dim=p) as c:
                cast_matmul(c.kernels)
                c.collect(ids, mask, labels, fused_experts=True)
                measure("collect_cast", lambda c=c: c.collect(ids, mask, labels, fused_experts=True))
        if graph:
            with GradientCollector(model, report, projection_dim=p) as c:
                graphed = GraphedCollector(c)
                graphed.collect(ids, labels)  # eager on the first batch, then captured
                graph_unsupported = graphed.unsupported  # set: every "graphed" step ran eagerly
                measure("collect_graph", lambda g=graphed: g.collect(ids, labels))
                if graph_diff is None:
                    eager = c.collect(ids, None, labels, fused_experts=True)
                    got = graphed.collect(ids, labels)
                    graph_diff = max(rel(got[k], eager[k]) for k in eager)
                    del eager, got
                del graphed
    if profile:
        from collect_speed import profile_steps

        with GradientCollector(model, report, projection_dim=p) as c:
            profile_steps(f"collection step {name}", lambda: c.collect(ids, mask, labels, fused_experts=True))
        profile_steps(f"plain step {name}", lambda: plain_step(model, ids, mask, labels))
    plain, collect = statistics.median(times["plain"]), statistics.median(times["collect"])

    def against_plain(key: str) -> dict:
        ms = statistics.median(times[key])
        return {f"{key}_ms": ms * 1e3, f"{key}_ratio": ms / plain, f"{key}_memory_ratio": peaks[key] / peaks["plain"]}

    row = {
        "row": name,
        "tokens": ids.numel(),
        "batch": list(ids.shape),
        "projection_dim": p,
        "top8_expert_share": share,
        "plain_ms": plain * 1e3,
        "collect_ms": collect * 1e3,
        "time_ratio": collect / plain,
        "plain_ms_iqr": iqr(times["plain"]),
        "collect_ms_iqr": iqr(times["collect"]),
        "plain_peak_gib": peaks["plain"] / GiB,
        "collect_peak_gib": peaks["collect"] / GiB,
        "memory_ratio": peaks["collect"] / peaks["plain"],
        **against_plain("floor"),
        **against_plain("collect_eager"),
        **against_plain("collect_eager_norms"),
        "max_rel_diff_to_eager_head_and_norms": head_diff,
        "fused_head_loss_rel_diff": loss_diff,
        "rounds": rounds,
        "steps_per_round": steps,
    }
    if cast:
        row.update(against_plain("collect_cast"))
    if graph:
        row.update(against_plain("collect_graph"))
        row["collect_graph_max_rel_diff_to_eager"] = graph_diff
        row["collect_graph_not_captured_because"] = graph_unsupported
    print(json.dumps(row), flush=True)
    return row


def iqr(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4)
    return [q[0] * 1e3, q[2] * 1e3]


def collect_part(
    p: int,
    steps: int,
    rounds: int,
    profile: bool = False,
    cast: bool = False,
    graph: bool = False,
    only: list[str] | None = None,
) -> list[dict]:
    rows = []

    def wanted(name: str) -> bool:
        return not only or name in only

    model = make_model("qwen3-30b-a3b-shaped")
    for name, n, s, repeat in (
        ("qwen3 2x512", 2, 512, 0.0),
        ("qwen3 8x512", 8, 512, 0.0),
        ("qwen3 8x512 skewed router", 8, 512, 0.34),
        ("qwen3 2x4096", 2, 4096, 0.0),
        ("qwen3 4x4096", 4, 4096, 0.0),
    ):
        if not wanted(name):
            continue
        small = profile and n * s <= 1024
        rows.append(collect_row(name, model, token_ids(model, n, s, repeat), p, steps, rounds, small, cast, graph))
    del model
    torch.cuda.empty_cache()
    model = make_model("qwen3-30b-a3b-shaped", vocab_size=151936)  # the real model's vocabulary
    for name, n, s in (("qwen3 vocab 151936 2x512", 2, 512), ("qwen3 vocab 151936 2x4096", 2, 4096)):
        if not wanted(name):
            continue
        rows.append(collect_row(name, model, token_ids(model, n, s), p, steps, rounds, cast=cast, graph=graph))
    del model
    torch.cuda.empty_cache()
    if not wanted("olmoe 8x512"):
        return rows
    model = make_model("olmoe-1b-7b-shaped")
    rows.append(collect_row("olmoe 8x512", model, token_ids(model, 8, 512), p, steps, rounds, cast=cast, graph=graph))
    del model
    torch.cuda.empty_cache()
    return rows


def examples_for(model, count: int, seq_len: int = 512) -> list[Example]:
    ids = token_ids(model, count, seq_len, seed=1)
    return [Example(i, ids[i].tolist()) for i in range(count)]


def build_once(
    model,
    exs,
    path: Path,
    p: int | None,
    blocks: str,
    token_batch_size: int,
    recompute: bool = False,
    cuda_graphs: bool = False,
    **eigen,
) -> float:
    """Seconds of one `build_index` (`eigen`: `ekfac=` and `budget=` for an eigenbasis build)."""
    shutil.rmtree(path, ignore_errors=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    ma.build_index(
        model,
        exs,
        path,
        track_moe_experts=True,
        projection_dim=p,
        token_batch_size=token_batch_size,
        expert_blocks=blocks,
        progress=False,
        recompute=recompute,
        cuda_graphs=cuda_graphs,
        **eigen,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - start


def index_rows(path: Path) -> torch.Tensor:
    """An index's rows as a float32 tensor (to compare two builds)."""
    return torch.tensor(np.array(ma.load_index(path).gradients, dtype=np.float32))


def collected_cells(directory: Path, settings: dict) -> dict:
    """What an eigenbasis build forms per example: each target's collected rectangle (its experts' widest,
    padded) times its experts, against the columns it stores; the experts' widest rectangles."""
    from moe_attrib.curvature.eigenbasis import load_plan

    plan = load_plan(directory, settings)
    collected, widest = 0, []
    for t in plan.targets:
        kr, kc = t.widths
        collected += kr * kc * len(t.shapes)
        if t.experts:
            widest.append([t.block, kr, kc])
    return {"stored": plan.dim, "collected": collected, "experts_widest": widest}


def build_part(
    layers: int,
    examples: int,
    p: int,
    rounds: int,
    profile: bool,
    recompute: bool = False,
    graphs: bool = False,
    token_batch: int = 8192,
    eigen_budget: str | None = None,
    eigen_sketch: int = 128,
    eigen_output_sketch: int | None = EIGENBASIS_OUTPUT_SKETCH,
    eigen_dtype: str = "bfloat16",
) -> dict:
    """`build_index` vs plain steps over the same `token_batch`-token batches, interleaved; projection drawing
    shows in the first round only if it is one-time per process. `graphs`: also `build_index(cuda_graphs=True)`,
    with its rows compared to the eager build's."""
    model = make_model("qwen3-30b-a3b-shaped", num_hidden_layers=layers)
    exs = examples_for(model, examples)
    path = Path("/tmp/e2e-index")
    per_batch = token_batch // 512
    batches = [torch.tensor([ex.input_ids for ex in exs[i : i + per_batch]]) for i in range(0, examples, per_batch)]
    tokens = examples * 512

    def plain_pass() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for ids in batches:
            ids = ids.cuda()
            plain_step(model, ids, torch.ones_like(ids), ids)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    plain_pass()  # warm-up
    eigen = {}
    if eigen_budget:  # factors of the eigenbasis build, fitted once (not timed) on a quarter of the examples
        factors = ma.fit_ekfac(
            model,
            exs[: max(1, examples // 4)],
            projection_dim=eigen_sketch,
            output_projection_dim=eigen_output_sketch,
            token_batch_size=token_batch,
            factor_device="cuda",
            progress=False,
        ).to("cpu")  # fmt: skip  (as build's own fit)
        eigen = {"ekfac": factors, "budget": eigen_budget, "index_dtype": eigen_dtype}
    separate_s, eigen_s = [], []
    build_s, plain_s, recompute_s, graph_s = [], [], [], []
    graph_path = Path("/tmp/e2e-index-graphs")
    first_rows = None
    torch.cuda.reset_peak_memory_stats()
    for _ in range(rounds):
        build_s.append(build_once(model, exs, path, p, "sum", token_batch))
        if first_rows is None:
            first_rows = index_rows(path)
        plain_s.append(plain_pass())
        if recompute:
            recompute_s.append(build_once(model, exs, path, p, "sum", token_batch, recompute=True))
        if graphs:
            graph_s.append(build_once(model, exs, graph_path, p, "sum", token_batch, cuda_graphs=True))
        if eigen:
            separate_s.append(build_once(model, exs, graph_path, p, "separate", token_batch))
            eigen_s.append(build_once(model, exs, graph_path, None, "separate", token_batch, **eigen))
    if eigen:
        eigen_index = ma.load_index(graph_path)
        eigen_dim = eigen_index.gradients.shape[1]
        eigen_collected = collected_cells(graph_path, eigen_index.manifest["settings"])
        shutil.rmtree(graph_path, ignore_errors=True)
    index = ma.load_index(path)
    row = {
        "row": f"build_index, qwen3 shape, {layers} layers, {examples}x512, {token_batch}-token batches, sum, p={p}",
        "params": sum(q.numel() for q in model.parameters()),
        "index_dim": index.gradients.shape[1],
        "tokens": tokens,
        "build_s": build_s,
        "plain_s": plain_s,
        "build_tok_s_first_round": tokens / build_s[0],
        "build_tok_s": tokens / statistics.median(build_s[1:] or build_s),
        "plain_tok_s": tokens / statistics.median(plain_s),
    }
    row["ratio_of_plain_tok_s"] = row["build_tok_s"] / row["plain_tok_s"]
    row["ratio_first_round"] = row["build_tok_s_first_round"] / row["plain_tok_s"]
    if recompute:
        row["recompute_s"] = recompute_s
        row["recompute_ratio_of_plain_tok_s"] = statistics.median(plain_s) / statistics.median(recompute_s)
    eager_rows = index_rows(path)
    row["eager_repeat_max_rel_diff"] = rel(first_rows, eager_rows)
    if graphs:
        row["graphs_s"] = graph_s
        row["graphs_tok_s"] = tokens / statistics.median(graph_s[1:] or graph_s)
        row["graphs_ratio_of_plain_tok_s"] = row["graphs_tok_s"] / row["plain_tok_s"]
        row["graphs_max_rel_diff_to_eager"] = rel(index_rows(graph_path), eager_rows)
        shutil.rmtree(graph_path, ignore_errors=True)
    if eigen:
        row["separate_s"], row["eigen_s"], row["eigen_budget"], row["eigen_dim"] = (
            separate_s,
            eigen_s,
            eigen_budget,
            eigen_dim,
        )
        row["eigen_factors"] = {"sketch": eigen_sketch, "output_sketch": eigen_output_sketch, "dtype": eigen_dtype}
        row["separate_tok_s"] = tokens / statistics.median(separate_s[1:] or separate_s)
        row["eigen_tok_s"] = tokens / statistics.median(eigen_s[1:] or eigen_s)
        row["eigen_ratio_of_separate_tok_s"] = row["eigen_tok_s"] / row["separate_tok_s"]
        row["eigen_ratio_of_plain_tok_s"] = row["eigen_tok_s"] / row["plain_tok_s"]
        row["eigen_collected"] = eigen_collected
    print(json.dumps(row), flush=True)
    if profile and eigen:
        profile_build(model, exs, graph_path, p, "separate", "(seeded, separate)")
        profile_build(model, exs, graph_path, None, "separate", "(eigenbasis)", **eigen)
        shutil.rmtree(graph_path, ignore_errors=True)
    elif profile:
        profile_build(model, exs[:32], path, p)
    shutil.rmtree(path, ignore_errors=True)
    model = None
    torch.cuda.empty_cache()
    return row


def profile_build(model, exs, path: Path, p: int | None, blocks: str = "sum", label: str = "", **eigen) -> None:
    """Print torch.profiler tables (by self CPU and by self GPU time) of one `build_once` after a warm one."""
    from torch.profiler import ProfilerActivity, profile

    build_once(model, exs, path, p, blocks, 8192, **eigen)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        build_once(model, exs, path, p, blocks, 8192, **eigen)
    events = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events) / 1e6
    gpu = sum(e.self_device_time_total for e in events) / 1e6
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    syncs = sum(e.count for e in events if "item" in e.key or "_local_scalar_dense" in e.key)
    print(f"== profile of a {len(exs)}-example build {label}: self CPU {cpu:.2f} s, self GPU {gpu:.2f} s, "
          f"aten calls {calls}, scalar reads {syncs}")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48))
    print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=48))


def memory_part(layers: int, examples: int, p: int, token_batches: list[int]) -> list[dict]:
    """Peak GPU memory of 48-layer builds, with and without `recompute` (decoder layers run again in
    the backward instead of keeping their activations), at each token batch size, vs the weights."""
    model = make_model("qwen3-30b-a3b-shaped", num_hidden_layers=layers)
    weights = sum(q.numel() * q.element_size() for q in model.parameters())
    exs = examples_for(model, examples)
    path = Path("/tmp/e2e-index48")
    rows = []
    for tokens in token_batches:
        for recompute in (False, True):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            seconds = build_once(model, exs, path, p, "sum", tokens, recompute)
            peak = torch.cuda.max_memory_allocated()
            index = ma.load_index(path)
            digest = float(np.abs(np.asarray(index.gradients[:8], dtype=np.float64)).sum())
            row = {
                "row": f"build_index peak memory, qwen3 shape, {layers} layers, {tokens}-token batches, sum blocks, "
                f"p={p}, recompute={recompute}",
                "weights_gib": weights / GiB,
                "build_peak_gib": peak / GiB,
                "peak_over_weights": peak / weights,
                "build_tok_s": examples * 512 / seconds,
                "rows_abs_sum_first8": digest,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            shutil.rmtree(path, ignore_errors=True)
    plain_peak = None
    try:  # last: an out-of-memory error's traceback keeps the step's tensors alive for a while
        ids = torch.tensor([ex.input_ids for ex in exs[:16]]).cuda()
        torch.cuda.reset_peak_memory_stats()
        plain_step(model, ids, torch.ones_like(ids), ids)
        torch.cuda.synchronize()
        plain_peak = torch.cuda.max_memory_allocated() / GiB
    except torch.OutOfMemoryError as err:
        plain_peak = f"out of memory: {str(err)[:120]}"
    for row in rows:
        row["plain_step_peak_gib_16x512"] = plain_peak
    print(json.dumps({"plain_step_peak_gib_16x512": plain_peak}), flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def phases_part(layers: int, p: int, steps: int, profile: bool = False) -> dict:
    """Where a build's time goes on the full-depth model: the fixed costs of one `build_index` call
    and, per 8192-token batch, the collection step with and without the host copy, vs a plain step."""
    from moe_attrib.fingerprint import model_fingerprint
    from moe_attrib.indexing.index import column_plan, flatten_batch

    model = make_model("qwen3-30b-a3b-shaped", num_hidden_layers=layers)
    ids = token_ids(model, 16, 512, seed=2).cuda()
    mask = torch.ones_like(ids)

    def clock(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    row: dict = {"row": f"phases, qwen3 shape, {layers} layers, 16x512, p={p}"}
    plain_ms = []
    for _ in range(steps + 2):  # before the collector's hooks are installed; the first two warm up
        plain_ms.append(clock(lambda: plain_step(model, ids, mask, ids)))
    row["fingerprint_s"] = clock(lambda: model_fingerprint(model))
    report = ma.discover(model, track_moe_experts=True, warn=False)
    row["discover_s"] = clock(lambda: ma.discover(model, track_moe_experts=True, warn=False))
    blocks = column_plan(report, p, "sum")
    collector = GradientCollector(model, report, projection_dim=p)
    row["enter_s"] = clock(collector.__enter__)
    row["first_collect_s"] = clock(lambda: collector.collect(ids, mask, ids, fused_experts=True, expert_blocks="sum"))
    row["second_collect_s"] = clock(lambda: collector.collect(ids, mask, ids, fused_experts=True, expert_blocks="sum"))
    times: dict[str, list[float]] = {"plain": plain_ms[2:], "collect": [], "collect_flatten": []}
    for _ in range(steps):
        times["collect"].append(
            clock(lambda: collector.collect(ids, mask, ids, fused_experts=True, expert_blocks="sum"))
        )
        times["collect_flatten"].append(
            clock(
                lambda: flatten_batch(
                    collector.collect(ids, mask, ids, fused_experts=True, expert_blocks="sum"), report, blocks, "sum"
                )
            )
        )
    if profile:
        from collect_speed import profile_steps

        for sort_by in ("self_cpu_time_total", "self_device_time_total"):
            profile_steps(
                "collection step",
                lambda: collector.collect(ids, mask, ids, fused_experts=True, expert_blocks="sum"),
                sort_by=sort_by,
            )
    collector.__exit__(None, None, None)
    if profile:
        for sort_by in ("self_cpu_time_total", "self_device_time_total"):
            profile_steps("plain step", lambda: plain_step(model, ids, mask, ids), sort_by=sort_by)
    for key, values in times.items():
        row[f"{key}_ms"] = statistics.median(values) * 1e3
    row["collect_ratio"] = row["collect_ms"] / row["plain_ms"]
    row["collect_flatten_ratio"] = row["collect_flatten_ms"] / row["plain_ms"]
    print(json.dumps(row), flush=True)
    model = None
    torch.cuda.empty_cache()
    return row


def coupling_part(layers: int, examples: int, p: int) -> dict:
    """The coupling's and the output-layer balance's cost at full depth: `fit_coupling` (every index
    row, EK-FAC) and `fit_balance` (with the output layer's coupling) against a `score_matrix` pass
    over the same index, on the Qwen3-30B-A3B shape with `layers` layers."""
    model = make_model("qwen3-30b-a3b-shaped", num_hidden_layers=layers)
    exs = examples_for(model, examples)
    path = Path("/tmp/e2e-coupling-index")
    build_once(model, exs, path, p, "separate", 8192)
    index = ma.load_index(path)
    ek = ma.fit_ekfac(model, exs, projection_dim=p, token_batch_size=8192, progress=False, factor_device="cuda")
    q = ma.query_gradients(model, exs[:8], index)

    def clock(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - start

    coupling, fit_s = clock(lambda: ma.fit_coupling(index, ekfac=ek, device="cuda"))
    coupling, fit2_s = clock(lambda: ma.fit_coupling(index, ekfac=ek, device="cuda"))
    balance, balance_s = clock(lambda: ma.fit_balance(index, ekfac=ek, coupling={}, device="cuda"))
    opts = dict(ekfac=ek, device="cuda")
    _, plain_s = clock(lambda: ma.score_matrix(index, q, coupling=None, balance=None, **opts))
    _, coupled_s = clock(lambda: ma.score_matrix(index, q, coupling=coupling, balance=None, **opts))
    _, balanced_s = clock(lambda: ma.score_matrix(index, q, coupling=coupling, balance=balance, **opts))
    row = {
        "row": f"coupling, qwen3 shape, {layers} layers, {examples} rows, p={p}",
        "columns": int(index.gradients.shape[1]),
        "rows": int(index.gradients.shape[0]),
        "coupling": coupling.settings,
        "fit_s": fit_s,
        "fit_second_s": fit2_s,
        "score_matrix_s": plain_s,
        "score_matrix_coupled_s": coupled_s,
        "balance": balance.settings,
        "balance_fit_s": balance_s,
        "score_matrix_coupled_balanced_s": balanced_s,
    }
    print(json.dumps(row), flush=True)
    shutil.rmtree(path, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", nargs="+", default=["collect", "phases", "build", "memory48"])
    parser.add_argument("--projection_dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--build_layers", type=int, default=24)
    parser.add_argument("--build_examples", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of a build")
    parser.add_argument("--memory_tokens", type=int, nargs="+", default=[8192], help="memory48: token batch sizes")
    parser.add_argument("--build_recompute", action="store_true", help="build: also time builds with recompute")
    parser.add_argument("--build_tokens", type=int, default=8192, help="build: tokens per batch (512 per example)")
    parser.add_argument("--build_graphs", action="store_true", help="build: also time builds with cuda_graphs")
    parser.add_argument("--build_eigen", default=None, metavar="BUDGET", help="build: also time default vs eigenbasis")
    parser.add_argument("--eigen_sketch", type=int, default=128, help="build: the eigenbasis factors' projection_dim")
    parser.add_argument("--eigen_output_sketch", type=int, default=EIGENBASIS_OUTPUT_SKETCH,
                        help="build: the factors' output-layer sketch")  # fmt: skip
    parser.add_argument("--eigen_dtype", default="bfloat16", help="build: the eigenbasis index's dtype")
    parser.add_argument("--collect_cast", action="store_true", help="collect: also time the cast-matmul variant")
    parser.add_argument("--collect_graph", action="store_true", help="collect: also time GraphedCollector")
    parser.add_argument("--collect_rows", nargs="+", default=None, help="collect: only these rows (by name)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("e2e.py needs a CUDA GPU")
    results: dict = {
        "env": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "moe_attrib": ma.__version__,
            "moe_attrib_path": str(Path(ma.__file__).parent),
        },
        "args": vars(args),
    }

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))

    if "collect" in args.parts:
        results["collect"] = collect_part(
            args.projection_dim,
            args.steps,
            args.rounds,
            args.profile,
            args.collect_cast,
            args.collect_graph,
            args.collect_rows,
        )
        save()
    if "phases" in args.parts:
        results["phases"] = phases_part(args.build_layers, args.projection_dim, args.steps, args.profile)
        save()
    if "build" in args.parts:
        results["build"] = build_part(
            args.build_layers,
            args.build_examples,
            args.projection_dim,
            args.rounds,
            args.profile,
            args.build_recompute,
            args.build_graphs,
            args.build_tokens,
            args.build_eigen,
            args.eigen_sketch,
            args.eigen_output_sketch,
            args.eigen_dtype,
        )
        save()
    if "coupling" in args.parts:
        results["coupling"] = coupling_part(args.build_layers, args.build_examples, args.projection_dim)
        save()
    if "memory48" in args.parts:
        results["memory48"] = memory_part(48, 64, args.projection_dim, args.memory_tokens)
        save()


if __name__ == "__main__":
    main()
