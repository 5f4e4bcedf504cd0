"""Matmuls of the hot path with per-instance fallbacks: grouped (one GEMM per call for all experts),
segment sums of row outer products (per-example expert gradients) and fp32-output.

A kernel that is not available for a (device, dtype) falls back for that instance only, and the
first fallback of each kind is announced with a warning that gives the reason. Out-of-memory
errors are never a reason to fall back: they propagate.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def is_out_of_memory(err: BaseException) -> bool:
    """True for CUDA/accelerator OOMs, which must propagate instead of selecting a slower kernel."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _aligned(*tensors: torch.Tensor) -> bool:
    """16-byte aligned data and strides (what grouped_mm needs), checked on every call: plain loops, no generators."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        size = t.element_size()
        for s, d in zip(t.stride(), t.shape, strict=True):
            if d > 1 and s != 1 and (s * size) % 16:
                return False
    return True


# rows of one tile of the fallback segment grid: a power of two in this range, near the mean segment length
TILE_ROWS = (8, 128)
# bytes of tile products formed at once by the fallback (the tile grid itself is sized by the rows)
TILE_PRODUCT_BYTES = 256 * 2**20
# dtypes whose segment sums go to grouped_mm, per device type: on CUDA (torch 2.9 to 2.13) only bf16 in and
# out has a grouped kernel; any other dtype loops over the groups on the host (a device sync, one mm per segment)
SEGMENT_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
# groups one CUDA grouped_mm call takes (torch 2.11 on an H200: "Can't process more than 1024 groups")
CUDA_MAX_GROUPS = 1024


def segment_of_rows(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """`[rows]` long: the segment of each row, for contiguous segments ending at `ends` (no host sync)."""
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device, dtype=ends.dtype), right=True)


def tiled_segment_mm(left: torch.Tensor, right: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`segment_mm` from batched matmuls: any device and dtype, exact, memory sized by the rows.

    Each segment's rows are cut into tiles of `C` consecutive rows (its last tile zero-padded),
    so the `[tiles, C, .]` grid holds at most `rows + segments * C` rows with `C` <= the mean
    segment length (when above 8), whatever the routing's skew; its tiles are multiplied in
    batches of at most `TILE_PRODUCT_BYTES` and summed into their segments (in float32 for
    bf16/fp16 rows, returned in the rows' dtype). No host sync.
    """
    rows, segments = left.shape[0], ends.shape[0]
    mean = max(rows // max(segments, 1), 1)
    tile = min(max(1 << (mean.bit_length() - 1), TILE_ROWS[0]), TILE_ROWS[1])
    ends = torch.cat([ends.long(), ends.new_full((1,), rows, dtype=torch.long)])  # rows past the last end: dropped
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles_of = (ends - starts + tile - 1) // tile  # tiles per segment
    first = torch.cumsum(tiles_of, 0) - tiles_of  # first tile of each segment
    total = (rows + tile - 1) // tile + segments + 1  # a static bound on sum(tiles_of)
    seg = segment_of_rows(ends, rows)
    pos = torch.arange(rows, device=left.device) - starts[seg]
    place = (first[seg] + pos // tile) * tile + pos % tile
    grids = []
    for values in (left, right):
        grid = values.new_zeros(total * tile, values.shape[-1]).index_copy_(0, place, values)
        grids.append(grid.view(total, tile, values.shape[-1]))
    # tiles past the last used one belong to no segment: they go to a dropped extra slot
    owner = torch.searchsorted(first + tiles_of, torch.arange(total, device=left.device), right=True)
    a, b = left.shape[-1], right.shape[-1]
    acc = torch.float32 if left.dtype in (torch.bfloat16, torch.float16) else left.dtype
    out = left.new_zeros(segments + 2, a, b, dtype=acc)
    step = max(TILE_PRODUCT_BYTES // max(a * b * 4, 1), 1)
    for t0 in range(0, total, step):
        part = torch.bmm(grids[0][t0 : t0 + step].transpose(1, 2), grids[1][t0 : t0 + step])
        out.index_add_(0, owner[t0 : t0 + step], part.to(acc))
    return out[:segments].to(left.dtype)


class Kernels:
    """`grouped_matmul`, `segment_mm` and `matmul_fp32`; fallbacks recorded in `fallbacks` (`{kernel key: reason}`)."""

    def __init__(self) -> None:
        self.fallbacks: dict[str, str] = {}

    def _fall_back(self, key: str, err: BaseException, instead: str) -> None:
        if is_out_of_memory(err):
            raise err
        self.fallbacks[key] = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"moe-attrib: {key} is not available ({type(err).__name__}: {str(err)[:200]}); this collector uses "
            f"{instead} instead from now on.",
            UserWarning,
            stacklevel=3,
        )

    def grouped_matmul(
        self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fp32_out: bool = False
    ) -> torch.Tensor:
        """`x[rows of expert e] @ w[e]` for all experts in one call (`w`: `[E, in, out]`).

        Uses `torch.nn.functional.grouped_mm` where the device, dtype and strides allow it, else
        transformers' grouped_mm fallback (one mm per expert, the same numerics as its eager path).
        `fp32_out=True` returns float32 (accumulated in fp32, written once) for low-precision inputs.
        """
        w = w.to(x.dtype)
        key = f"grouped_mm[{x.device.type}, {x.dtype}]"
        if key not in self.fallbacks and hasattr(nn.functional, "grouped_mm") and _aligned(x, w):
            fp32_key = f"grouped_mm(out_dtype=float32)[{x.device.type}, {x.dtype}]"
            if fp32_out and x.is_cuda and x.dtype != torch.float32 and fp32_key not in self.fallbacks:
                try:
                    return nn.functional.grouped_mm(x, w, offs=offsets, out_dtype=torch.float32)
                except (RuntimeError, NotImplementedError, TypeError) as err:
                    self._fall_back(fp32_key, err, "grouped_mm with a float32 conversion after it")
            try:
                out = nn.functional.grouped_mm(x, w, offs=offsets)
                return out.float() if fp32_out else out
            except (RuntimeError, NotImplementedError) as err:
                self._fall_back(key, err, "transformers' per-expert grouped_mm fallback")
        import transformers.integrations.moe  # noqa: F401  (registers the fallback op)

        out = torch.ops.transformers.grouped_mm_fallback(x, w, offs=offsets)
        return out.float() if fp32_out else out

    def segment_mm(self, left: torch.Tensor, right: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """`out[s] = left[rows of s]^T @ right[rows of s]`, `[segments, a, b]`, for contiguous segments.

        Segment s is rows `ends[s-1]:ends[s]` (`ends`: `[segments]` int32, nondecreasing, the last one
        at most `rows`; rows past it are ignored; an empty segment gives zeros). One grouped GEMM
        whose offsets partition the contracted (row) dimension (`grouped_mm(left.T, right, offs=ends)`)
        for the devices and dtypes of `SEGMENT_DTYPES` (CPU: fp32/bf16/fp16; CUDA: bf16, the output
        in bf16 too, at most `CUDA_MAX_GROUPS` segments) when the strides allow it; otherwise
        `tiled_segment_mm`, exact in the rows' dtype (float32 rows on CUDA, float64 anywhere).
        Temporary memory is sized by the rows, never by a padded per-segment length, and nothing
        waits for the device.
        """
        key = f"grouped_mm(segments)[{left.device.type}, {left.dtype}]"
        usable = left.dtype in SEGMENT_DTYPES.get(left.device.type, ()) and key not in self.fallbacks
        usable = usable and hasattr(nn.functional, "grouped_mm")
        usable = usable and not (left.is_cuda and ends.shape[0] > CUDA_MAX_GROUPS)
        if usable and _aligned(left.T, right):
            try:
                return nn.functional.grouped_mm(left.T, right, offs=ends.to(torch.int32))
            except (RuntimeError, NotImplementedError) as err:
                self._fall_back(key, err, "tiled batched matmuls (tiled_segment_mm)")
        return tiled_segment_mm(left, right, ends)

    def matmul_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`(x @ w)` as float32; on CUDA with bf16/fp16 inputs one GEMM writes fp32 directly.
        2D rows take one op (no reshapes around the GEMM)."""
        key = f"mm(out_dtype=float32)[{x.dtype}]"
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and key not in self.fallbacks:
            try:
                if x.dim() == 2:
                    return torch.mm(x, w, out_dtype=torch.float32)
                flat = torch.mm(x.reshape(-1, x.shape[-1]), w, out_dtype=torch.float32)
                return flat.view(*x.shape[:-1], w.shape[-1])
            except (RuntimeError, TypeError) as err:
                self._fall_back(key, err, "mm with a float32 conversion after it")
        return (x @ w).float()
