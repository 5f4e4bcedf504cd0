"""Seeded random projections that are bitwise identical on every device, generated on the device.

The default kind, `rademacher-hash-v2`, projects only the sides wider than the projection
dimension p: a side of `features <= p` (a router's output side, a narrow expert) is kept exact
(`side_width` is `min(features, p)`; `Projections.get` returns None for it), since expanding or
"projecting" it to p columns saves nothing and distorts inner products (`R^T R != I`). A weight
block is then `min(out, p) x min(in, p)`, a bias `min(out, p)`. Wider sides use exactly
`rademacher-hash-v1`'s matrices.

`rademacher-hash-v1` projects every side to p. It derives every entry from a stateless integer hash of
(name seed, element index): a 32-bit mixer applied in three keyed rounds, written with torch
integer ops on values below 2^49 (no overflow, no sign), which are exact on every device. Each
hash gives 32 entries, one per bit: bit 1 is `+1/sqrt(rows)`, bit 0 is `-1/sqrt(rows)`. The
matrix is drawn directly on the compute device, so nothing is drawn on the CPU on the hot path,
and the same (name, shape, seed) gives bitwise the same matrix on CPU and GPU. Rademacher rather
than Gaussian entries: a Gaussian from hash bits needs log/cos (Box-Muller), whose last bits
differ between devices; Rademacher entries keep `<P a, P b>` unbiased with variance no larger
than a Gaussian projection's (the Johnson-Lindenstrauss bound holds for both).

`gaussian-cpu-v0` is the legacy generator (`torch.randn` on the CPU): indexes and EK-FAC
directories written before the kind was recorded (no `projection` key in their settings) were
built with it and keep using it (`projection_kind`).

One block may be given its own dimension: `target_dims` maps a target's name to the p its sides
are projected to instead of the model-wide one. An index may give the output layer (`lm_head`) its own,
`output_projection_dim` (`moe_attrib.settings.output_dims`): on a large vocabulary that side carries the
signal a p=32 sketch loses most of (docs/quality.md#output-layer-width). A target's matrices depend on its
own p alone.

Matrices are cached per (kind, name, shape, seed, device, dtype) across collectors of one
process, bounded by a memory budget (`set_cache_budget`), so `score` after `build`, or repeated
`build_index` calls, never redraw.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

from moe_attrib.settings import LEGACY_PROJECTION, PROJECTION

PROJECTION_V1 = "rademacher-hash-v1"  # every side projected to p, narrow ones too
PROJECTION_KINDS = (PROJECTION, PROJECTION_V1, LEGACY_PROJECTION)
_KEEPS_NARROW = (PROJECTION,)  # kinds that keep a side of width <= p exact
DEFAULT_CACHE_BYTES = 2 * 2**30

_MASK32 = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x846CA68B)  # lowbias32 (C. Wellons): x ^= x>>16; x *= M0; x ^= x>>15; x *= M1; x ^= x>>16


def name_seed(name: str, seed: int = 0) -> int:
    """A 63-bit generator seed derived from a target name and the user seed."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def projection_kind(settings: dict) -> str:
    """The projection kind an index's or EK-FAC directory's settings record (legacy when absent)."""
    kind = settings.get("projection") or LEGACY_PROJECTION
    check_kind(kind)
    return kind


def check_kind(kind: str) -> None:
    if kind not in PROJECTION_KINDS:
        raise ValueError(
            f"unknown projection kind {kind!r} (known: {', '.join(PROJECTION_KINDS)}); "
            "the index or factors were written by a newer moe-attrib: upgrade it."
        )


def keeps_side(kind: str, features: int, dim: int | None) -> bool:
    """Whether a side of `features` stays exact (unprojected) under `kind` with projection dimension `dim`."""
    check_kind(kind)
    return not dim or (kind in _KEEPS_NARROW and features <= dim)


def side_width(kind: str, features: int, dim: int | None) -> int:
    """Columns a side of `features` takes once projected: `features` where it stays exact, else `dim`."""
    return features if keeps_side(kind, features, dim) else dim


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """`x * m mod 2^32` for int64 `x` in [0, 2^32): 16-bit limbs keep every product below 2^49."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX[1])
    return x ^ (x >> 16)


def hash_words(key: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """32-bit hashes (int64 in [0, 2^32)) of words `0..count-1` under the 64-bit `key`.

    word j: `mix(mix(mix(lo(j) ^ k0) ^ k1) ^ hi(j))` with `k0, k1` the key's low and high
    halves; each round is a bijection of 32-bit values, so words of one key never collide.
    """
    j = torch.arange(count, dtype=torch.int64, device=device)
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    h = _mix32((j & _MASK32) ^ k0)
    h = _mix32(h ^ k1)
    return _mix32(h ^ (j >> 32))


def rademacher_matrix(
    name: str, rows: int, cols: int, seed: int = 0, batch: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """float32 `[rows, cols]` (or `[batch, rows, cols]`) with entries `+-1/sqrt(rows)`, on `device`.

    Entry e (row-major over the whole shape) is bit `e % 32` of hash word `e // 32`.
    """
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    count = rows * cols * (batch or 1)
    words = hash_words(name_seed(name, seed), (count + 31) // 32, device)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, half the memory
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
    scale = torch.tensor(1.0 / rows**0.5, dtype=torch.float32, device=words.device)
    return torch.where(bits.reshape(-1)[:count].view(shape).bool(), scale, -scale)


def gaussian_matrix(name: str, rows: int, cols: int, seed: int = 0, batch: int | None = None) -> torch.Tensor:
    """Legacy (`gaussian-cpu-v0`): Gaussian `[(batch,) rows, cols]`, entries N(0, 1/rows), drawn on the CPU."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(name_seed(name, seed))
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    return torch.randn(shape, generator=gen, dtype=torch.float32) / rows**0.5


def projection_matrix(
    name: str,
    rows: int,
    cols: int,
    seed: int = 0,
    batch: int | None = None,
    kind: str = PROJECTION,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """float32 `[rows, cols]` (or `[batch, rows, cols]`) projection of `kind`, entries of variance 1/rows.

    The 1/rows variance makes `<P a, P b>` an unbiased estimate of `<a, b>`. For fused experts
    one call draws all experts' matrices at once (`batch` = number of experts); expert i uses
    slice i, so experts are projected independently of each other. The Rademacher kinds share
    their matrices (v2 differs from v1 only in which sides it projects: `keeps_side`).
    """
    check_kind(kind)
    if kind == LEGACY_PROJECTION:
        return gaussian_matrix(name, rows, cols, seed, batch).to(device)
    return rademacher_matrix(name, rows, cols, seed, batch, device)


class _Cache:
    """Process-wide LRU of projection matrices, bounded in bytes."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        self.items: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.lock = threading.Lock()
        self.draws = 0  # matrices generated (not served from the cache): for tests and benchmarks

    def get(self, key: tuple, make) -> torch.Tensor:
        with self.lock:
            mat = self.items.get(key)
            if mat is not None:
                self.items.move_to_end(key)
                return mat
        mat = make()
        size = mat.numel() * mat.element_size()
        with self.lock:
            self.draws += 1
            if size <= self.budget and key not in self.items:
                self.items[key] = mat
                self.used += size
                self._evict()
        return mat

    def _evict(self) -> None:
        while self.used > self.budget and self.items:
            _, old = self.items.popitem(last=False)
            self.used -= old.numel() * old.element_size()


_CACHE = _Cache(DEFAULT_CACHE_BYTES)


def set_cache_budget(nbytes: int) -> None:
    """Bound the process-wide projection cache to `nbytes` (0 disables it; evicts least recently used)."""
    with _CACHE.lock:
        _CACHE.budget = max(int(nbytes), 0)
        _CACHE._evict()


def clear_cache() -> None:
    """Drop every cached projection matrix (frees their device memory)."""
    with _CACHE.lock:
        _CACHE.items.clear()
        _CACHE.used = 0


def cache_draws() -> int:
    """How many matrices were generated so far in this process (cache misses)."""
    return _CACHE.draws


class Projections:
    """Projection matrices of one kind on one device and dtype, keyed by (name, side).

    Each instance keeps the matrices it handed out; they are also shared through the
    process-wide cache, so a new instance with the same settings draws nothing.
    """

    def __init__(
        self,
        dim: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype=torch.float32,
        kind: str = PROJECTION,
        target_dims: dict[str, int] | None = None,
    ):
        check_kind(kind)
        self.dim = dim
        self.target_dims = dict(target_dims or {})
        self.seed = seed
        self.device = torch.device(device)
        self.dtype = dtype
        self.kind = kind
        self._mats: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, name: str, side: str, features: int, batch: int | None = None) -> torch.Tensor | None:
        """Projection for one side ("in" or "out") of target `name`, transposed for right-multiplication.

        Returns `[features, dim]` (or `[batch, features, dim]`) so that `rows @ P` projects rows,
        or None for a side this kind keeps exact (`keeps_side`): its rows are used as they are.
        `dim` is the target's own (`target_dims`) or the model-wide one.
        """
        dim = self.target_dims.get(name, self.dim)
        if keeps_side(self.kind, features, dim):
            return None
        key = (name, side)
        mat = self._mats.get(key)
        if mat is None:
            full = f"{name}/{side}"
            family = LEGACY_PROJECTION if self.kind == LEGACY_PROJECTION else PROJECTION_V1  # v1 and v2 share
            ckey = (family, full, dim, features, batch, self.seed, str(self.device), self.dtype)

            def make() -> torch.Tensor:
                m = projection_matrix(full, dim, features, self.seed, batch, self.kind, self.device)
                return m.transpose(-1, -2).contiguous().to(self.dtype)

            mat = self._mats[key] = _CACHE.get(ckey, make)
        return mat
