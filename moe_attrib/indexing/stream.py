"""Streaming an index's rows to a device, block by block, at the speed of the host-to-device copy.

Row blocks are sized in bytes of stored rows. Several threads read the next block into a host
buffer (pinned when the device is CUDA) while the current one is used: double buffering. On CUDA
the host-to-device copy runs `non_blocking` on a side stream, ordered by events (copy after the
consumer's kernels of the block that last used the device buffer; the consumer after the copy;
a host buffer refilled only after its copy), so the host never waits for the GPU's arithmetic.
On CPU the same code runs with plain buffers. Rows reach the consumer as float32 whatever the
index's storage dtype (`moe_attrib.indexing.index.INDEX_DTYPES`). Memory: two blocks on the host, two on
the device.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from tqdm.auto import tqdm

from moe_attrib.indexing.index import Index, IndexFileError
from moe_attrib.settings import DEFAULT_BLOCK_BYTES, DEFAULT_READER, READERS

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_BUFFERS = 2


def default_threads() -> int:
    """Reader threads: one per core, at most 16 (numpy copies and preadv release the GIL)."""
    return max(1, min(16, os.cpu_count() or 1))


def rows_per_block(index: Index, block_bytes: int) -> int:
    """How many stored rows fit `block_bytes` (at least one)."""
    return max(1, block_bytes // max(1, index.gradients.shape[1] * index.gradients.itemsize))


class _Source:
    """Reads stored rows `[start, start + n)` into a host buffer as `parts` independent tasks."""

    def __init__(self, gradients: np.ndarray, reader: str, path: object):
        if reader not in READERS:
            raise ValueError(f"reader must be one of {', '.join(READERS)}, not {reader!r}")
        self.path = path
        self.array = gradients if gradients.flags.c_contiguous else np.ascontiguousarray(gradients)
        self.flat = self.array.reshape(-1)
        self.dim = self.array.shape[1]
        self.fd = None
        if reader == "pread" and hasattr(os, "preadv") and _whole_file(gradients):
            self.fd = os.open(gradients.filename, os.O_RDONLY)
            self.offset = gradients.offset

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def tasks(self, host: np.ndarray, start: int, n: int, parts: int) -> list[Callable[[], None]]:
        """Callables that together fill `host[:n]` with rows `start..start+n` (split in elements)."""
        count = n * self.dim
        bounds = np.linspace(0, count, min(parts, count) + 1).astype(np.int64) if count else np.zeros(1, np.int64)
        dst = host.reshape(-1)
        first = start * self.dim
        out = []
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            if self.fd is None:
                out.append(lambda a=a, b=b: np.copyto(dst[a:b], self.flat[first + a : first + b]))
            else:
                out.append(lambda a=a, b=b: self._pread(dst[a:b], self.offset + (first + a) * dst.itemsize))
        return out

    def _pread(self, dst: np.ndarray, offset: int) -> None:
        view = memoryview(dst.view(np.uint8))
        while len(view):
            got = os.preadv(self.fd, [view], offset)
            if got <= 0:
                raise IndexFileError(f"{self.path}: gradients.npy ends at byte {offset}, before its last row.")
            view, offset = view[got:], offset + got


def _whole_file(array: np.ndarray) -> bool:
    """A C-contiguous memmap that covers its file to the end (what `np.load(mmap_mode="r")` gives):
    its rows can be read from the file at `offset + row * row_bytes`."""
    name = getattr(array, "filename", None)
    if not isinstance(array, np.memmap) or not name or not array.flags.c_contiguous:
        return False
    try:
        return array.offset + array.nbytes == os.path.getsize(name)
    except OSError:
        return False


def _host_buffer(rows: int, dim: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """A `[rows, dim]` host tensor of the stored dtype and a numpy view of its bytes in the stored numpy dtype."""
    buf = torch.empty((rows, dim), dtype=dtype, pin_memory=pin)
    raw = buf.view(torch.uint8).numpy()
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}[dtype]
    return buf, raw.view(np_dtype)


def stream_rows(
    index: Index,
    device: torch.device,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_rows: int | None = None,
    threads: int | None = None,
    reader: str = DEFAULT_READER,
    progress: bool = False,
    desc: str = "score",
) -> Iterator[tuple[int, torch.Tensor]]:
    """`(start, rows)` over the whole index: rows `[n, dim]` float32 on `device`, `block_rows` rows
    or `block_bytes` stored bytes at a time.

    A block's rows are valid until the next one is asked for: use them (enqueue the kernels on the
    current stream, on CUDA) before advancing. Reads run ahead by one block.
    """
    total, dim = index.gradients.shape
    step = block_rows or rows_per_block(index, block_bytes)
    starts = list(range(0, total, step))
    if not starts:
        return
    cuda = device.type == "cuda"
    dtype = TORCH_DTYPES[index.dtype]
    parts = threads or default_threads()
    host = [_host_buffer(min(step, total), dim, dtype, cuda) for _ in range(min(_BUFFERS, len(starts)))]
    source = _Source(index.gradients, reader, index.path)
    pool = ThreadPoolExecutor(parts, thread_name_prefix="moe-attrib-read")
    if cuda:
        copy_stream = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        dev = [torch.empty_like(buf, device=device) for buf, _ in host]
        copied = [torch.cuda.Event() for _ in host]  # host buffer j free again
        used = [torch.cuda.Event() for _ in host]  # device buffer j free again

    def fill(i: int) -> list[Future]:
        j = i % len(host)
        n = min(step, total - starts[i])
        ready = copied[j] if cuda and i >= len(host) else None

        def run(task: Callable[[], None]) -> None:
            if ready is not None:
                ready.synchronize()  # the copy out of this host buffer (block i - 2) has finished
            task()

        return [pool.submit(run, task) for task in source.tasks(host[j][1], starts[i], n, parts)]

    bar = tqdm(total=total, unit="row", unit_scale=True, desc=desc, disable=not progress)
    began, done_bytes = time.perf_counter(), 0
    try:
        pending = fill(0)
        for i, start in enumerate(starts):
            for f in pending:
                f.result()
            if i + 1 < len(starts):
                pending = fill(i + 1)  # read the next block while this one is copied and used
            j, n = i % len(host), min(step, total - start)
            if cuda:
                with torch.cuda.stream(copy_stream):
                    copy_stream.wait_event(used[j])
                    dev[j][:n].copy_(host[j][0][:n], non_blocking=True)
                    copied[j].record(copy_stream)
                compute.wait_event(copied[j])
                rows = dev[j][:n]
            else:
                rows = host[j][0][:n].to(device)
            yield start, rows.float()
            if cuda:
                used[j].record(compute)
            done_bytes += n * dim * index.gradients.itemsize
            bar.update(n)
            if progress:
                bar.set_postfix(GB_s=f"{done_bytes / 1e9 / max(time.perf_counter() - began, 1e-9):.1f}")
    finally:
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)
        source.close()
        if cuda:
            compute.wait_stream(copy_stream)


class ToHost:
    """Device results copied to the host without waiting for them: on CUDA `push` starts a
    `non_blocking` copy into a pinned buffer and hands back the previous push's result, complete
    (an array valid until the next `push`); `drain` gives the last one. On CPU every push is
    handed back at once."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.pending: tuple[object, int, tuple[int, ...]] | None = None
        self.count = 0

    def push(self, key: object, values: torch.Tensor) -> list[tuple[object, np.ndarray]]:
        if not self.cuda:
            return [(key, values.cpu().numpy())]
        ready = self.drain()
        j = self.count % 2
        buf = self.buffers[j]
        if buf is None or buf.numel() < values.numel():
            buf = self.buffers[j] = torch.empty(values.numel(), dtype=values.dtype, pin_memory=True)
        buf[: values.numel()].view(values.shape).copy_(values, non_blocking=True)
        self.events[j].record()
        self.pending, self.count = (key, j, tuple(values.shape)), self.count + 1
        return ready

    def drain(self) -> list[tuple[object, np.ndarray]]:
        if self.pending is None:
            return []
        key, j, shape = self.pending
        self.pending = None
        self.events[j].synchronize()
        return [(key, self.buffers[j][: int(np.prod(shape))].view(shape).numpy())]
