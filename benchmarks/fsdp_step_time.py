"""FSDP2 path vs plain path on one device (`--fsdp` with one rank): same index, step time ratio.

Saves a qwen3_moe-shaped bf16 model (safetensors, experts stored per expert as transformers saves
them), builds an index of random token data with the plain model and with the model loaded shard by
shard and wrapped by `fully_shard` (one rank), compares the rows, and times collection steps of
each side by side (median of repeated steps, the same batches). Run under torchrun:

    torchrun --nproc_per_node 1 benchmarks/fsdp_step_time.py --out fsdp_step_time.json

Prints and writes {"step_ratio": fsdp / plain, "row_rel_err": {...}, ...}; tests/test_gpu.py runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moe_attrib.build import build_index, make_collector
from moe_attrib.data import Example
from moe_attrib.discovery import discover
from moe_attrib.distributed import Dist, setup, teardown
from moe_attrib.index import load_index
from moe_attrib.loading import load_model
from moe_attrib.sharding import load_sharded
from moe_attrib.zoo import tiny_model

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


def examples(n: int, length: int, vocab: int) -> list[Example]:
    gen = torch.Generator().manual_seed(0)
    return [Example(i, torch.randint(3, vocab, (length,), generator=gen).tolist()) for i in range(n)]


def step_times(model, exs: list[Example], dist: Dist, steps: int, batch: int) -> list[float]:
    """Wall time of `steps` collection steps (after 2 warm-up steps), as `build` runs them."""
    report = discover(model, track_moe_experts=True, warn=False)
    collector = make_collector(model, report, 16, 0, None)
    ids = torch.tensor([ex.input_ids for ex in exs[:batch]], device=dist.device)
    mask = torch.ones_like(ids)
    times = []
    with collector:
        for i in range(steps + 2):
            if dist.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            collector.collect(ids, mask, fused_experts=True)
            if dist.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fsdp_step_time.json")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="the zoo's tiny shape (a CPU smoke run)")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    dist = setup(args.device, fsdp=True)
    plain_dist = Dist(dist.rank, 1, dist.device)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "model"
            tiny_model("qwen3_moe", dtype=dtype, **({} if args.small else SHAPE)).save_pretrained(model_dir)
            vocab = 128 if args.small else SHAPE["vocab_size"]
            exs = examples(args.examples, args.length, vocab)
            budget = args.batch * args.length
            common = dict(track_moe_experts=True, projection_dim=16, token_batch_size=budget, progress=False)
            plain = load_model(str(model_dir), dtype).to(dist.device)
            build_index(plain, exs, Path(tmp) / "plain", dist=plain_dist, **common)
            plain_times = step_times(plain, exs, plain_dist, args.steps, args.batch)
            del plain
            sharded = load_sharded(str(model_dir), dtype, dist)
            build_index(sharded, exs, Path(tmp) / "fsdp", dist=dist, **common)
            fsdp_times = step_times(sharded, exs, dist, args.steps, args.batch)
            a, b = load_index(Path(tmp) / "plain").gradients, load_index(Path(tmp) / "fsdp").gradients
            rel = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(a, axis=1), 1e-30)
            result = {
                "device": torch.cuda.get_device_name() if dist.device.type == "cuda" else "cpu",
                "dtype": args.dtype,
                "shape": "zoo tiny" if args.small else SHAPE,
                "tokens_per_step": budget,
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
