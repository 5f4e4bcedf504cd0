"""Matmuls of the hot path with per-instance fallbacks: grouped (one GEMM per call for all experts) and fp32-output.

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
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(
            (s * size) % 16 for s, d in zip(t.stride(), t.shape, strict=True) if d > 1 and s != 1
        ):
            return False
    return True


class Kernels:
    """`grouped_matmul` and `matmul_fp32` with fallbacks recorded in `fallbacks` (`{kernel key: reason}`)."""

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

    def matmul_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`(x @ w)` as float32; on CUDA with bf16/fp16 inputs one GEMM writes fp32 directly."""
        key = f"mm(out_dtype=float32)[{x.dtype}]"
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and key not in self.fallbacks:
            try:
                flat = torch.mm(x.reshape(-1, x.shape[-1]), w, out_dtype=torch.float32)
                return flat.view(*x.shape[:-1], w.shape[-1])
            except (RuntimeError, TypeError) as err:
                self._fall_back(key, err, "mm with a float32 conversion after it")
        return (x @ w).float()
