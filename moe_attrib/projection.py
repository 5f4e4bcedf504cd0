"""Seeded random projections that are identical on every device.

Matrices are drawn on the CPU from a generator seeded by a hash of the target's name and the
user's seed, then moved to the compute device. The same (name, seed, shape) therefore gives
bitwise the same matrix on CPU and GPU, in every process and on every rank.
"""

from __future__ import annotations

import hashlib

import torch


def name_seed(name: str, seed: int = 0) -> int:
    """A 63-bit generator seed derived from a target name and the user seed."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def projection_matrix(name: str, rows: int, cols: int, seed: int = 0, batch: int | None = None) -> torch.Tensor:
    """Gaussian matrix `[rows, cols]` (or `[batch, rows, cols]`), entries N(0, 1/rows), on the CPU.

    The 1/rows variance makes `<P a, P b>` an unbiased estimate of `<a, b>`. For fused experts
    one call draws all experts' matrices at once (`batch` = number of experts); expert i uses
    slice i, so experts are projected independently of each other.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(name_seed(name, seed))
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    return torch.randn(shape, generator=gen, dtype=torch.float32) / rows**0.5


class Projections:
    """Cache of projection matrices on one device and dtype, keyed by (name, side)."""

    def __init__(self, dim: int, seed: int = 0, device: torch.device | str = "cpu", dtype=torch.float32):
        self.dim = dim
        self.seed = seed
        self.device = torch.device(device)
        self.dtype = dtype
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, name: str, side: str, features: int, batch: int | None = None) -> torch.Tensor:
        """Projection for one side ("in" or "out") of target `name`, transposed for right-multiplication.

        Returns `[features, dim]` (or `[batch, features, dim]`) so that `rows @ P` projects rows.
        """
        key = (name, side)
        mat = self._cache.get(key)
        if mat is None:
            mat = projection_matrix(f"{name}/{side}", self.dim, features, self.seed, batch)
            mat = mat.transpose(-1, -2).contiguous().to(self.device, self.dtype)
            self._cache[key] = mat
        return mat
