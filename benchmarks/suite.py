"""The GPU benchmark suite: one command, results in one JSON file (written after every part).

    python benchmarks/suite.py --out benchmarks/results/suite-h200.json [--parts sweep build ekfac]

1. sweep: collection step / plain fwd+bwd step (grouped_mm) vs experts (8-128, top-8), tokens
   (1k-32k) and projection_dim (8-32), 4 layers, bf16, with peak memory; plus the per-expert
   Python-loop baseline (`loop_baseline.py`) at 4k tokens.
2. build: end-to-end `build_index` tokens/s on a 48-layer Qwen3-30B-A3B-shaped model and a
   16-layer OLMoE-1B-7B-shaped model (random init, bf16).
3. ekfac: fit time and peak memory on the OLMoE-shaped model: projected factors for all layers,
   full factors for layer 0.
Plots: `python benchmarks/plot.py RESULTS.json` (matplotlib) into docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from collect_speed import SHAPES, timed  # noqa: E402
from loop_baseline import LoopCollector  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.collect.collector import GradientCollector, example_losses  # noqa: E402
from moe_attrib.data import Example  # noqa: E402


def model_for(family: str, overrides: dict, **extra) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **{**overrides, **extra})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="grouped_mm")
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
    return model.eval()


def batch(model, tokens: int, seq_len: int = 512):
    n = max(tokens // seq_len, 1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (n, min(seq_len, tokens)), generator=gen).cuda()
    return ids, torch.ones_like(ids)


def one_config(experts: int, tokens: int, p: int, loop: bool, steps: int, rounds: int = 1) -> dict:
    family, base = SHAPES["qwen3-30b-a3b-shaped"]
    model = model_for(family, base, num_experts=experts)
    ids, mask = batch(model, tokens)

    def plain():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        example_losses(out.logits, ids).sum().backward()
        for q in model.parameters():
            q.grad = None

    report = ma.discover(model)
    dense = ma.discover(model, track_moe_experts=False, warn=False)
    times: dict[str, list[float]] = {"plain": [], "collect": [], "loop": []}
    peaks: dict[str, int] = {"plain": 0, "collect": 0, "loop": 0}
    for _ in range(rounds):  # alternate the variants so drift hits all alike
        _, t, m = timed(plain, 2, steps)
        times["plain"] += t
        peaks["plain"] = max(peaks["plain"], m)
        with GradientCollector(model, report, projection_dim=p) as c:
            _, t, m = timed(lambda c=c: c.collect(ids, mask, fused_experts=True), 2, steps)
        times["collect"] += t
        peaks["collect"] = max(peaks["collect"], m)
        if loop:
            with GradientCollector(model, dense, projection_dim=p) as c, LoopCollector(report.experts, p, *ids.shape):
                _, t, m = timed(lambda c=c: c.collect(ids, mask, fused_experts=True), 1, max(steps // 3, 2))
            times["loop"] += t
            peaks["loop"] = max(peaks["loop"], m)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    row = {"experts": experts, "tokens": int(ids.numel()), "projection_dim": p, "rounds": rounds,
           "plain_s": med["plain"], "collect_s": med["collect"], "time_ratio": med["collect"] / med["plain"],
           "plain_peak": peaks["plain"], "collect_peak": peaks["collect"],
           "memory_ratio": peaks["collect"] / peaks["plain"]}  # fmt: skip
    if loop:
        row.update(loop_s=med["loop"], loop_ratio=med["loop"] / med["plain"], loop_peak=peaks["loop"])
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def sweep(steps: int) -> list[dict]:
    configs = [(e, 4096, 16, True) for e in (8, 32, 64, 128)]
    configs += [(128, t, 16, False) for t in (1024, 16384, 32768)]
    configs += [(128, 4096, p, False) for p in (8, 32)]
    rows = []
    for c in configs:
        rows.append(one_config(*c, steps=steps))
        torch.cuda.empty_cache()
    return rows


def build_speed(name: str, family: str, overrides: dict, examples: int, blocks: str) -> dict:
    model = model_for(family, overrides)
    gen = torch.Generator().manual_seed(0)
    exs = [
        Example(i, torch.randint(3, model.config.vocab_size, (512,), generator=gen).tolist()) for i in range(examples)
    ]
    path = Path("/tmp/suite-index")
    shutil.rmtree(path, ignore_errors=True)
    ma.build_index(model, exs[:16], path, track_moe_experts=True, projection_dim=16, token_batch_size=8192,
                   expert_blocks=blocks, progress=False)  # warm-up  # fmt: skip
    shutil.rmtree(path)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ma.build_index(model, exs, path, track_moe_experts=True, projection_dim=16, token_batch_size=8192,
                   expert_blocks=blocks, progress=False)  # fmt: skip
    seconds = time.perf_counter() - start
    index = ma.load_index(path)
    params = sum(p.numel() for p in model.parameters())
    row = {"model": name, "layers": model.config.num_hidden_layers, "params": params,
           "tokens": examples * 512, "seconds": seconds, "tokens_per_s": examples * 512 / seconds,
           "index_dim": index.gradients.shape[1], "expert_blocks": blocks, "coverage": index.manifest["coverage"],
           "peak_bytes": torch.cuda.max_memory_allocated()}  # fmt: skip
    print(json.dumps(row), flush=True)
    shutil.rmtree(path)
    return row


def ekfac_speed(save) -> list[dict]:
    family, base = SHAPES["olmoe-1b-7b-shaped"]
    model = model_for(family, base, num_hidden_layers=16)
    gen = torch.Generator().manual_seed(0)
    exs = [Example(i, torch.randint(3, model.config.vocab_size, (512,), generator=gen).tolist()) for i in range(32)]
    rows = []
    for label, kwargs in (("projected p=16, all layers", dict(projection_dim=16)),
                          ("full, layer 0", dict(filter_modules="model.layers.0.*"))):  # fmt: skip
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        ek = ma.fit_ekfac(model, exs, track_moe_experts=True, token_batch_size=8192, factor_device="cuda",
                          progress=False, **kwargs)  # fmt: skip
        torch.cuda.synchronize()
        row = {"fit": label, "tokens": len(exs) * 512, "seconds": time.perf_counter() - start,
               "factors": len(ek.factors), "peak_bytes": torch.cuda.max_memory_allocated()}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
        save(rows)
        del ek
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", nargs="+", default=["headline", "sweep", "build", "ekfac"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--build_examples", type=int, default=64)
    args = parser.parse_args()
    results: dict = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                             "transformers": __import__("transformers").__version__}}  # fmt: skip

    def save():
        Path(args.out).write_text(json.dumps(results, indent=2))

    if "headline" in args.parts:  # 128 experts, top-8, 8x512, p=16, with the loop baseline, interleaved
        results["headline"] = one_config(128, 4096, 16, True, steps=args.steps, rounds=3)
        save()
    if "sweep" in args.parts:
        results["sweep"] = sweep(args.steps)
        save()
    if "build" in args.parts:
        qwen_family, qwen = SHAPES["qwen3-30b-a3b-shaped"]
        olmoe_family, olmoe = SHAPES["olmoe-1b-7b-shaped"]
        results["build"] = []
        runs = [
            ("Qwen3-30B-A3B-shaped, 48 layers", qwen_family, {**qwen, "num_hidden_layers": 48}, "sum"),
            ("OLMoE-1B-7B-shaped, 16 layers", olmoe_family, {**olmoe, "num_hidden_layers": 16}, "separate"),
        ]
        for name, family, overrides, blocks in runs:
            results["build"].append(build_speed(name, family, overrides, args.build_examples, blocks))
            torch.cuda.empty_cache()
            save()
    if "ekfac" in args.parts:

        def save_rows(rows):
            results["ekfac"] = rows
            save()

        ekfac_speed(save_rows)
    os.sync()
    try:  # plots, where matplotlib is installed
        from plot import main as plot

        if "sweep" in results:
            plot(args.out)
    except ImportError:
        print("matplotlib not installed: run benchmarks/plot.py on the results to draw the plots")


if __name__ == "__main__":
    main()
