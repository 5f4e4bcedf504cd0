"""`score` throughput against the host-to-device ceiling, side by side in one process.

Writes a synthetic index of `--gb` gigabytes (random float32 rows of `--dim` columns, a valid
manifest, written through `IndexWriter`; plus the same rows as a bfloat16 index), reads both once
so they are in the page cache, then times in interleaved rounds (median of `--rounds`):

- `score`: `moe_attrib.scoring.score`, `--queries` queries, top-k `--top_k` (reader "copy", and "pread");
- `score bf16`: the same over the bfloat16 index (half the bytes);
- `page-cache baseline`: the issue's reference loop, hand-written: each block of the float32
  index copied from the page cache (the memmap) into one of two pinned buffers with torch's own
  (multi-threaded) `copy_`, sent to the GPU `non_blocking`, matmul, running top-k; a buffer is
  refilled only once its previous copy to the GPU has finished;
- `pinned baseline`: the same loop over the same number of bytes from one preallocated pinned
  host buffer, never refilled: the host-to-device ceiling, no page-cache read at all;
- `old path`: what `score` did before streaming: `np.array(memmap slice)` + `.to(device)` in 1 GiB
  blocks, then matmul + top-k.

`score` runs without the cross-module coupling and the output-layer balance (`coupling=None`,
`balance=None`): their fits are a fixed cost per run, timed by `benchmarks/e2e.py --parts coupling`,
and fitted ones change only the queries.
GB/s counts stored bytes. The JSON (`--out`) holds every round, the medians and the ratios of
`score`'s GB/s to both baselines'. On the H200:

    python benchmarks/score_speed.py --gb 20 --out benchmarks/results/score_speed-h200.json

CPU smoke check (no pinning): `python benchmarks/score_speed.py --gb 0.2 --rounds 3`.

`--budget 256KiB` sets the columns to what an eigenbasis index of that budget stores per example
(float32: budget / 4), the index size whose `score` bytes/s is compared with the pinned baseline's; its
elementwise preconditioning runs once on the queries (`prepare_queries`), before the streamed product timed here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import moe_attrib as ma
from moe_attrib.indexing.index import IndexWriter, load_index
from moe_attrib.indexing.stream import DEFAULT_BLOCK_BYTES, default_threads

OLD_BLOCK_BYTES = 1 << 30


def write_synthetic(path: Path, rows: int, dim: int, index_dtype: str, device: torch.device, seed: int = 0) -> Path:
    """An index of `rows` random float32 rows (drawn on `device`, in ~256 MiB batches), as `build` writes it."""
    batch = max(1, (256 << 20) // (4 * dim))
    starts = list(range(0, rows, batch))
    manifest = {
        "format_version": 1,
        "complete": False,
        "rows": rows,
        "examples": rows,
        "dim": dim,
        "settings": {"model": "synthetic", "projection_dim": None, "seed": 0, "attribute_tokens": False},
        "blocks": [{"name": "synthetic.weight", "start": 0, "stop": dim, "shape": [dim]}],
        "expert_layers": [],
        "example_ids": list(range(rows)),
        "num_batches": len(starts),
    }
    writer = IndexWriter(path, manifest, rows=rows, dim=dim, layers=0, experts=0, num_batches=len(starts),
                         index_dtype=index_dtype, overwrite=True)  # fmt: skip
    gen = torch.Generator(device).manual_seed(seed)
    for b, start in enumerate(starts):
        n = min(batch, rows - start)
        grads = torch.randn((n, dim), generator=gen, device=device).cpu().numpy()
        members = np.arange(start, start + n)
        writer.write(b, members, members, grads, np.zeros(n, np.float32), np.zeros((n, 0, 0), np.float32))
    return writer.finish()


def warm_page_cache(path: Path) -> float:
    """Read the file once (so that every timed round reads from memory); returns GB/s of that read."""
    began, buf = time.perf_counter(), bytearray(64 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return os.path.getsize(path) / 1e9 / (time.perf_counter() - began)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def topk_loop(blocks, q: torch.Tensor, k: int) -> torch.Tensor:
    """Running top-k over `(start, rows)` blocks, as `score` keeps it."""
    best_v = torch.full((q.shape[0], k), -torch.inf, device=q.device)
    best_i = torch.zeros((q.shape[0], k), dtype=torch.long, device=q.device)
    for start, rows in blocks:
        v, i = torch.cat([best_v, q @ rows.T], dim=1).topk(k, dim=1)
        idx = torch.cat([best_i, torch.arange(start, start + rows.shape[0], device=q.device).expand(q.shape[0], -1)], 1)
        best_v, best_i = v, idx.gather(1, i)
    return best_i.cpu()


def baseline(total_bytes: int, dim: int, q: torch.Tensor, k: int, pinned: torch.Tensor) -> torch.Tensor:
    """The ceiling: the same bytes from one pinned buffer (never refilled), copy + matmul + top-k."""
    step, total = pinned.shape[0], total_bytes // (4 * dim)

    def blocks():
        for start in range(0, total, step):
            yield start, pinned[: min(step, total - start)].to(q.device, non_blocking=True)

    return topk_loop(blocks(), q, k)


def page_cache_baseline(index, q: torch.Tensor, k: int, block_rows: int, cuda: bool) -> torch.Tensor:
    """The issue's reference: memmap block -> pinned buffer (torch `copy_`, two buffers) -> GPU -> matmul + top-k."""
    total, dim = index.gradients.shape
    buffers = [torch.empty((block_rows, dim), pin_memory=cuda) for _ in range(2)]
    sent: list = [None, None]

    def blocks():
        for b, start in enumerate(range(0, total, block_rows)):
            n, slot = min(block_rows, total - start), b % 2
            if sent[slot] is not None:
                sent[slot].synchronize()  # its last copy to the GPU has read the buffer
            buffers[slot][:n].copy_(torch.from_numpy(index.gradients[start : start + n]))
            rows = buffers[slot][:n].to(q.device, non_blocking=True)
            if cuda:
                sent[slot] = torch.cuda.Event()
                sent[slot].record()
            yield start, rows

    return topk_loop(blocks(), q, k)


def old_path(index, q: torch.Tensor, k: int) -> torch.Tensor:
    """Before streaming: `np.array` of 1 GiB memmap slices, then a blocking `.to(device)`."""
    total, dim = index.gradients.shape
    step = max(1, OLD_BLOCK_BYTES // (4 * dim))

    def blocks():
        for start in range(0, total, step):
            yield start, torch.from_numpy(np.array(index.gradients[start : start + step])).to(q.device)

    return topk_loop(blocks(), q, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=20.0, help="size of the float32 index, in GB (1e9 bytes)")
    parser.add_argument("--dim", type=int, default=32768, help="columns per row")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--top_k", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--block_mb",
        type=float,
        nargs="+",
        default=[DEFAULT_BLOCK_BYTES / (1 << 20)],
        help="score's block size in MiB; more than one adds a `score <MiB>` row for each further size",
    )
    parser.add_argument("--threads", type=int, default=None, help=f"reader threads (default {default_threads()})")
    parser.add_argument("--dir", default=None, help="where to write the indexes (default: a temporary directory)")
    parser.add_argument("--skip_old", action="store_true", help="leave out the (slow) old path")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--budget", default=None, help="columns of an eigenbasis index of this budget (e.g. 256KiB)")
    args = parser.parse_args()
    if args.budget:
        from moe_attrib.curvature.eigenbasis import budget_columns, parse_bytes

        args.dim = budget_columns(parse_bytes(args.budget), "float32")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    rows = max(1, int(args.gb * 1e9) // (4 * args.dim))
    root = Path(args.dir or tempfile.mkdtemp(prefix="moe-attrib-score-speed-"))
    block_bytes = int(args.block_mb[0] * (1 << 20))
    try:
        began = time.perf_counter()
        paths = {dt: write_synthetic(root / dt, rows, args.dim, dt, device) for dt in ("float32", "bfloat16")}
        written_s = time.perf_counter() - began
        cache_gbs = {dt: warm_page_cache(p / "gradients.npy") for dt, p in paths.items()}
        index = {dt: load_index(p) for dt, p in paths.items()}
        fp32_bytes = index["float32"].gradients.nbytes
        q = torch.randn((args.queries, args.dim), generator=torch.Generator().manual_seed(1)).to(device)
        pinned = torch.randn((max(1, block_bytes // (4 * args.dim)), args.dim))
        pinned = pinned.pin_memory() if cuda else pinned
        opts = dict(top_k=args.top_k, unit_normalize=False, coupling=None, balance=None, device=device,
                    block_bytes=block_bytes,
                    threads=args.threads)  # fmt: skip
        methods = {
            "score": (fp32_bytes, lambda: torch.from_numpy(ma.score(index["float32"], q, **opts).rows)),
            "score pread": (
                fp32_bytes,
                lambda: torch.from_numpy(ma.score(index["float32"], q, reader="pread", **opts).rows),
            ),
            "score bf16": (fp32_bytes // 2, lambda: torch.from_numpy(ma.score(index["bfloat16"], q, **opts).rows)),
            "page-cache baseline": (
                fp32_bytes,
                lambda: page_cache_baseline(index["float32"], q, args.top_k, pinned.shape[0], cuda),
            ),
            "pinned baseline": (fp32_bytes, lambda: baseline(fp32_bytes, args.dim, q, args.top_k, pinned)),
        }
        for mb in args.block_mb[1:]:
            more = {**opts, "block_bytes": int(mb * (1 << 20))}
            methods[f"score {mb:g} MiB"] = (
                fp32_bytes,
                lambda more=more: torch.from_numpy(ma.score(index["float32"], q, **more).rows),
            )
            methods[f"score pread {mb:g} MiB"] = (
                fp32_bytes,
                lambda more=more: torch.from_numpy(ma.score(index["float32"], q, reader="pread", **more).rows),
            )
        if not args.skip_old:
            methods["old path"] = (fp32_bytes, lambda: old_path(index["float32"], q, args.top_k))
        times: dict[str, list[float]] = {m: [] for m in methods}
        hits: dict[str, torch.Tensor] = {}
        for name, (_, fn) in methods.items():  # warm-up: kernels, pinned host cache, threads
            hits[name] = fn()
        for _ in range(args.rounds):
            for name, (_, fn) in methods.items():
                sync(device)
                t = time.perf_counter()
                fn()
                sync(device)
                times[name].append(time.perf_counter() - t)
        med = {m: statistics.median(ts) for m, ts in times.items()}
        gbs = {m: methods[m][0] / 1e9 / med[m] for m in methods}
        result = {
            "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "rows": rows,
            "dim": args.dim,
            "budget": args.budget,
            "index_gb": fp32_bytes / 1e9,
            "queries": args.queries,
            "top_k": args.top_k,
            "block_bytes": block_bytes,
            "threads": args.threads or default_threads(),
            "rounds": args.rounds,
            "write_s": written_s,
            "page_cache_read_gb_s": cache_gbs,
            "seconds": times,
            "median_s": med,
            "gb_s": gbs,
            "ratio_to_baseline": {m: gbs[m] / gbs["pinned baseline"] for m in methods},
            "ratio_score_to_baseline": gbs["score"] / gbs["pinned baseline"],
            "ratio_score_pread_to_baseline": gbs["score pread"] / gbs["pinned baseline"],
            "ratio_to_page_cache_baseline": {m: gbs[m] / gbs["page-cache baseline"] for m in methods},
            "ratio_score_to_page_cache_baseline": gbs["score"] / gbs["page-cache baseline"],
            "ratio_score_bf16_time_to_score": med["score bf16"] / med["score"],
            "old_path_to_score_time": med["old path"] / med["score"] if "old path" in med else None,
            "same_top_k_as_old_path": None if args.skip_old else bool(torch.equal(hits["score"], hits["old path"])),
            "same_top_k_pread": bool(torch.equal(hits["score"], hits["score pread"])),
            "same_top_k_page_cache_baseline": bool(torch.equal(hits["score"], hits["page-cache baseline"])),
        }
        print(f"{fp32_bytes / 1e9:.2f} GB index, {rows:,} x {args.dim:,} fp32, {args.queries} queries, "
              f"top-{args.top_k}, {device}, median of {args.rounds} interleaved rounds")  # fmt: skip
        print(f"{'method':<22}{'median s':>10}{'GB/s':>9}{'/ page-cache':>14}{'/ pinned':>10}")
        for m in methods:
            ratios = f"{gbs[m] / gbs['page-cache baseline']:>14.3f}{gbs[m] / gbs['pinned baseline']:>10.3f}"
            print(f"{m:<22}{med[m]:>10.3f}{gbs[m]:>9.2f}{ratios}")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
            print(f"written to {args.out}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
