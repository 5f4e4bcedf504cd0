"""FSDP2 path vs plain path on one device (`--fsdp` with one rank): same index, step time ratio.

Saves a qwen3_moe-shaped bf16 model (safetensors, experts stored per expert as transformers saves
them), builds an index of random token data with the plain model and with the model loaded shard by
shard and wrapped by `fully_shard` (one rank), compares the rows, and times collection steps of
each side by side (median of repeated steps, the same batch, the two sides' steps alternating). Run
under torchrun:

    torchrun --nproc_per_node 1 benchmarks/fsdp_step_time.py --out fsdp_step_time.json
    torchrun --nproc_per_node 1 benchmarks/fsdp_step_time.py --shape qwen3-30b --profile 25 --out X.json
    torchrun --nproc_per_node 1 benchmarks/fsdp_step_time.py --small --device cpu --dtype fp32  # CPU smoke run

`--keep_gathered N` / `--no_prefetch` set `moe_attrib.model.sharding.shard_model`'s options (docs/distributed.md).

Prints and writes {"step_ratio": fsdp / plain, "row_rel_err": {...}, ...}; tests/test_gpu.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moe_attrib.collect.collector import make_collector
from moe_attrib.data import Example
from moe_attrib.indexing.index import load_index
from moe_attrib.model.discovery import discover
from moe_attrib.model.distributed import Dist, setup, teardown
from moe_attrib.model.sharding import load_sharded
from moe_attrib.model.zoo import tiny_model
from moe_attrib.workflows.build import build_index
from moe_attrib.workflows.loading import load_model

sys.path.insert(0, str(Path(__file__).parent))
from collect_speed import SHAPES as COLLECT_SHAPES  # noqa: E402

SHAPE = dict(
    hidden_size=1024,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    intermediate_size=2048,
    num_hidden_layers=4,
    vocab_size=8192,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
)
# `--shape`: config overrides of the zoo's tiny qwen3_moe ("tiny": none). "h200" is the first shape,
# "qwen3-30b" a real layer's (Qwen3-30B-A3B: hidden 2048, 128 experts top-8), "cpu" one whose fp32 CPU step
# takes a few tenths of a second (where FSDP2's fixed per-layer cost shows as it does on a GPU).
SHAPES = {
    "tiny": {},
    "cpu": dict(
        hidden_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        vocab_size=2048,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "h200": SHAPE,
    "qwen3-30b": COLLECT_SHAPES["qwen3-30b-a3b-shaped"][1],  # what collect_speed.py and e2e.py time
}


def examples(n: int, length: int, vocab: int) -> list[Example]:
    gen = torch.Generator().manual_seed(0)
    return [Example(i, torch.randint(3, vocab, (length,), generator=gen).tolist()) for i in range(n)]


def step_times(models: dict, exs: list[Example], device: torch.device, steps: int, batch: int) -> dict:
    """Wall time of `steps` collection steps of each model (after 2 warm-up steps), as `build` runs them.

    The models' steps alternate (one of each per round), so a load that comes and goes on the machine
    (other processes on a shared CPU) weighs on both sides alike."""
    cuda = device.type == "cuda"
    ids = torch.tensor([ex.input_ids for ex in exs[:batch]], device=device)
    mask = torch.ones_like(ids)
    times = {name: [] for name in models}
    with contextlib.ExitStack() as stack:
        collectors = {}
        for name, model in models.items():
            report = discover(model, track_moe_experts=True, warn=False)
            collectors[name] = stack.enter_context(make_collector(model, report, 16, 0, None))
        for i in range(steps + 2):
            for name, collector in collectors.items():
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                collector.collect(ids, mask, fused_experts=True)
                if cuda:
                    torch.cuda.synchronize()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
    return times


def profile_steps(name: str, model, exs: list[Example], device: torch.device, batch: int, rows: int) -> None:
    """Print the top `rows` ops of 2 profiled collection steps and, for the sharded model, FSDP2's own regions."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    ids = torch.tensor([ex.input_ids for ex in exs[:batch]], device=device)
    mask = torch.ones_like(ids)
    with make_collector(model, discover(model, track_moe_experts=True, warn=False), 16, 0, None) as collector:
        collector.collect(ids, mask, fused_experts=True)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(2):
                collector.collect(ids, mask, fused_experts=True)
            if cuda:
                torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"--- {name}: 2 collection steps, top {rows} ops by {sort}", flush=True)
    print(prof.key_averages().table(sort_by=sort, row_limit=rows), flush=True)
    fsdp = sorted((e for e in prof.key_averages() if e.key.startswith("FSDP::")), key=lambda e: -e.cpu_time_total)
    if fsdp:
        print(f"--- {name}: FSDP2's own regions (host time, inclusive, 2 steps)")
        for e in fsdp:
            print(f"  {e.key:<56s} {e.count:>5d} calls {e.cpu_time_total / 1e3:>9.2f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fsdp_step_time.json")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="the zoo's tiny shape (a CPU smoke run): --shape tiny")
    parser.add_argument("--shape", default="h200", choices=sorted(SHAPES), help="model shape (see SHAPES)")
    parser.add_argument("--layers", type=int, default=None, help="number of decoder layers (default: the shape's)")
    parser.add_argument("--profile", type=int, default=0, help="print the top N ops of 2 profiled steps per path")
    parser.add_argument("--keep_gathered", type=int, default=1, help="layers not resharded after forward")
    parser.add_argument("--no_prefetch", action="store_true", help="no explicit forward prefetch of the next layer")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    shape = dict(SHAPES["tiny" if args.small else args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    dist = setup(args.device, fsdp=True)
    plain_dist = Dist(dist.rank, 1, dist.device)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "model"
            tiny_model("qwen3_moe", dtype=dtype, **shape).save_pretrained(model_dir)
            vocab = shape.get("vocab_size", 128)
            exs = examples(args.examples, args.length, vocab)
            budget = args.batch * args.length
            common = dict(track_moe_experts=True, projection_dim=16, token_batch_size=budget, progress=False)
            plain = load_model(str(model_dir), dtype).to(dist.device)
            build_index(plain, exs, Path(tmp) / "plain", dist=plain_dist, **common)
            sharded = load_sharded(str(model_dir), dtype, dist, args.keep_gathered, not args.no_prefetch)
            build_index(sharded, exs, Path(tmp) / "fsdp", dist=dist, **common)
            times = step_times({"plain": plain, "fsdp": sharded}, exs, dist.device, args.steps, args.batch)
            plain_times, fsdp_times = times["plain"], times["fsdp"]
            if args.profile:
                profile_steps("plain", plain, exs, dist.device, args.batch, args.profile)
                profile_steps("FSDP2", sharded, exs, dist.device, args.batch, args.profile)
            del plain, sharded
            a, b = load_index(Path(tmp) / "plain").gradients, load_index(Path(tmp) / "fsdp").gradients
            rel = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(a, axis=1), 1e-30)
            result = {
                "device": torch.cuda.get_device_name() if dist.device.type == "cuda" else "cpu",
                "dtype": args.dtype,
                "shape": {"name": "tiny" if args.small else args.shape, **shape},
                "tokens_per_step": budget,
                "keep_gathered": args.keep_gathered,
                "prefetch": not args.no_prefetch,
                "plain_step_s": statistics.median(plain_times),
                "fsdp_step_s": statistics.median(fsdp_times),
                "step_ratio": statistics.median(fsdp_times) / statistics.median(plain_times),
                "row_rel_err": {"median": float(np.median(rel)), "max": float(rel.max())},
                "fingerprints_equal": load_index(Path(tmp) / "plain").manifest["settings"]["model_fingerprint"]
                == load_index(Path(tmp) / "fsdp").manifest["settings"]["model_fingerprint"],
            }
        print(json.dumps(result, indent=1))
        Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        teardown()


if __name__ == "__main__":
    main()
