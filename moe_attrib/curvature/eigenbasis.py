"""Index rows in the EK-FAC eigenbasis, with columns allocated from one model-wide byte budget.

Fitted EK-FAC factors give every block (a dense module, or one expert of an experts projection)
the eigenbases of its two sides, `Q_rows` and `Q_cols` in the stored orientation, and the
corrected eigenvalues `Lambda[i, j]` of each direction pair. An eigenbasis index stores, for
every block, the rotated gradient `Q_rows^T W Q_cols` restricted to a leading `kr x kc`
rectangle of its directions, each side's directions sorted by the corrected eigenvalue mass they
carry (`direction_order`). A stored column is then one direction pair (i, j) of one block, and
EK-FAC preconditioning is an elementwise division by `Lambda[i, j] + damping`
(`precondition_eigen`): no factor products at query time.

The rows are formed by the collector's `projector=` hook: each side's rows are multiplied by
`P Q_top` (the factors' seeded sketch `P` for a side wider than the factors' projection dimension,
the kept eigenvectors `Q_top` of the factor fitted in that space), so nothing wider than the kept
directions is formed. An experts projection is collected with the widest rectangle of its experts
and each expert's own rectangle is taken out of it (`EigenPlan.flatten`); collected sides are padded with
zero directions to a multiple of `COLLECT_MULTIPLE` (`padded`), never stored. A folded bias (EK-FAC's
default) is part of its weight's block: the rotated bias gradient times the ones row of the input
side's eigenvectors, as `moe_attrib.curvature.ekfac` rotates it.

The budget (bytes per example, `parse_bytes`) first gives every dense block (not an expert) its
leading `DENSE_DIRECTIONS x DENSE_DIRECTIONS` directions, every expert its leading pair (`EXPERT_DIRECTIONS`,
so no tracked expert is left without a part) and the output layer `output_floor`^2 cells, in
the shape the greedy gives them on its own directions (`OUTPUT_FLOOR_SHAPE`, `fit_floors`), then is spent
greedily (`allocate`): a block grows by one
row or one column of directions at a time, whichever adds the most `Lambda / (Lambda + d)` (the share
of a direction in the effective dimension of the damped curvature; an expert's counted `EXPERT_WEIGHT`
as much) per stored column, `d` being
`ALLOCATION_DAMPING` x the mean of `Lambda` over `ALLOCATION_SCOPE` (the model) whatever damping the factors
carry: the allocation measured on the LDS benchmark (docs/build.md) does not move with the scoring damping.
The kept eigenvectors are written next to the index (`eigenbasis.safetensors`) so queries are
collected with the index alone; the factors' fingerprint is recorded in the index settings and
scoring refuses other factors (`check_factors`).
"""

from __future__ import annotations

import hashlib
import heapq
import re
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_attrib.collect.projection import Projections
from moe_attrib.curvature.ekfac import EKFAC, Factor, factor_dims
from moe_attrib.errors import MoeAttribError
from moe_attrib.indexing.index import INDEX_DTYPES, Block
from moe_attrib.model.discovery import CoverageReport, iter_entries
from moe_attrib.settings import DEFAULT_BUDGET, EIGENBASIS_OUTPUT_SKETCH, EIGENBASIS_SKETCH, output_dims

EIGENBASIS = "ekfac-eigen-v1"  # recorded as settings["eigenbasis"]["kind"]
BASIS_FILE = "eigenbasis.safetensors"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ALLOCATION_DAMPING = 1.0  # x the mean Lambda over ALLOCATION_SCOPE: how the budget is spent, whatever the damping
ALLOCATION_SCOPE = "model"  # the mean the allocation's damping is relative to (EKFAC.with_damping's scopes)
DENSE_DIRECTIONS = 32  # each dense (not expert) block starts with this many directions a side (`fit_floors`)
EXPERT_DIRECTIONS = 1  # each expert block with this many (its leading pair): every tracked expert keeps a part
OUTPUT_DIRECTIONS_MAX = 256  # the output layer's floor: its vocabulary / OUTPUT_VOCAB_FRACTION, within
OUTPUT_VOCAB_FRACTION = 8  # [DENSE_DIRECTIONS, OUTPUT_DIRECTIONS_MAX] (`output_floor`)
OUTPUT_FLOOR_SHAPES = ("square", "area", "fill", "hidden", "cross")
# r * r cells shaped by `allocate` ("area"), the r x r rectangle ("square"), the square where the block holds it,
# else the short side whole and the long side filled to r * r cells ("fill", `filled`), the input (hidden) side
# whole and the vocabulary side filled to r * r cells ("hidden", `hidden_whole`), or an L of each side's leading
# r/4 directions over 2r of the other's ("cross", `crossed`)
OUTPUT_FLOOR_SHAPE = "area"  # "fill" passed its rule and lost 0.051 on the gpu configuration (docs/build.md)
EXPERT_WEIGHT = 0.25  # an expert's directions count this much in the greedy (docs/build.md: The experts' weight)
COLLECT_MULTIPLE = 8  # collected sides padded with zero directions to a multiple of this: grouped_mm needs
# 16-byte strides (8 bfloat16 values), else the collector falls back to one matmul per expert (4.6x slower build)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class EigenbasisError(MoeAttribError, ValueError):
    """Factors, budget and model that cannot make (or score) an eigenbasis index."""


def parse_bytes(text: str | int) -> int:
    """Bytes from `256KiB`, `1MiB`, `1.5MB`, `65536` (binary and decimal units, case-insensitive)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m and m[2].lower()
        if not m or unit not in _UNITS:
            raise EigenbasisError(f"budget {text!r}: give bytes as a number and an optional unit, e.g. 256KiB, 1MiB.")
        value = int(float(m[1]) * _UNITS[unit])
    if value <= 0:
        raise EigenbasisError(f"budget {text!r} must be positive.")
    return value


def budget_columns(budget: int, index_dtype: str) -> int:
    """Columns per example a budget of `budget` bytes buys in the storage dtype."""
    if index_dtype not in DTYPE_BYTES:
        raise EigenbasisError(f"index_dtype must be one of {', '.join(INDEX_DTYPES)}, not {index_dtype!r}.")
    return budget // DTYPE_BYTES[index_dtype]


# derived values of a factor (fingerprint, direction orders), computed once per corrected-eigenvalue tensor:
# id(tensor) -> (weak reference to it, {key: value}); an entry whose tensor is gone is replaced
_DERIVED: dict[int, tuple[weakref.ref, dict]] = {}


def _derived(lam: torch.Tensor, key: str, make):
    ident = id(lam)
    held = _DERIVED.get(ident)
    if held is None or held[0]() is not lam:
        held = _DERIVED[ident] = (weakref.ref(lam, lambda _: _DERIVED.pop(ident, None)), {})
    cache = held[1]
    if key not in cache:
        cache[key] = make()
    return cache[key]


def direction_order(f: Factor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row and column eigen-directions (stored orientation) of a factor, most corrected-eigenvalue
    mass first: `[(E,) rows]`, `[(E,) cols]` int64 on the CPU (a stable sort: the same factors give the
    same order at build and at query time)."""

    def make():
        lam = f.lam.detach().double().cpu()
        rows = torch.argsort(lam.sum(-1), dim=-1, descending=True, stable=True)
        cols = torch.argsort(lam.sum(-2), dim=-1, descending=True, stable=True)
        return rows, cols

    return _derived(f.lam, "order", make)


def factors_fingerprint(ekfac: EKFAC) -> str:
    """sha256 of every factor's name, bias folding and corrected eigenvalues (float64): what the
    eigen-directions and their order are derived from. Damping is not part of it (re-damping is allowed)."""
    h = hashlib.sha256()
    for name in sorted(ekfac.factors):
        f = ekfac.factors[name]
        h.update(f"{name}:{f.bias}:{tuple(f.lam.shape)};".encode())
        h.update(_derived(f.lam, "bytes-hash", lambda f=f: hashlib.sha256(_float64_bytes(f.lam)).digest()))
    return h.hexdigest()


def _float64_bytes(lam: torch.Tensor) -> bytes:
    return lam.detach().double().cpu().contiguous().numpy().tobytes()


def _sorted(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`t[..., rows[:, None], cols[None, :]]` for one block (2-D `t`)."""
    return t[rows][:, cols]


def allocate(
    weights: list[torch.Tensor], columns: int, floors: list[tuple[int, ...]] | None = None
) -> list[tuple[int, ...]]:
    """Rectangles `(kr, kc)` of leading directions for blocks whose direction weights (rows and
    columns sorted, most first) are `weights[b]` `[R, C]`, at most `columns` cells in all.

    Blocks start from `floors[b]` (clipped to the block; none: empty), whose cells are spent first; a floor
    `(kr, kc, k)` (an L, `cells_of`) is the block's whole part, kept as it is.
    Greedy: a block opens with its (0, 0) direction; an open block grows by its next row (kc new
    cells) or next column (kr new cells); each step takes the move of highest weight per cell that
    still fits. Ties go to the earlier block, so the allocation is deterministic.
    """
    shapes: list[list[int]] = [[0, 0] for _ in weights]
    fixed = set()
    for b, floor in enumerate(floors or []):
        if len(floor) == 3:
            shapes[b], fixed = list(floor), fixed | {b}
            continue
        fr, fc = min(floor[0], weights[b].shape[0]), min(floor[1], weights[b].shape[1])
        if fr > 0 and fc > 0:
            shapes[b] = [fr, fc]
    left = columns - sum(cells_of(s) for s in shapes)
    if left < 0:
        raise EigenbasisError(
            f"the budget buys {columns} columns, fewer than the {columns - left} the dense blocks' floors take: "
            "give a larger --budget."
        )
    heap: list[tuple[float, int, int, int]] = []  # (-gain per cell, block, move, version)
    version = [0] * len(weights)
    arrays = [w.detach().cpu().double().numpy() for w in weights]  # numpy views: no tensor op per move

    def best(b: int) -> tuple[float, int, int] | None:
        """(gain per cell, move, cost) of block b's best move that fits: 0 open, 1 row, 2 column."""
        if b in fixed:
            return None
        w, (kr, kc) = arrays[b], shapes[b]
        if kr == 0:
            return (float(w[0, 0]), 0, 1) if w.size and left >= 1 else None
        moves = []
        if kr < w.shape[0] and kc <= left:
            moves.append((float(w[kr, :kc].sum()) / kc, 1, kc))
        if kc < w.shape[1] and kr <= left:
            moves.append((float(w[:kr, kc].sum()) / kr, 2, kr))
        return max(moves, key=lambda m: (m[0], -m[1])) if moves else None

    for b in range(len(weights)):
        move = best(b)
        if move is not None:
            heapq.heappush(heap, (-move[0], b, move[1], version[b]))
    while heap and left > 0:
        _, b, move, ver = heapq.heappop(heap)
        if ver != version[b]:
            continue
        kr, kc = shapes[b]
        cost = 1 if move == 0 else kc if move == 1 else kr
        if cost > left:  # the budget shrank since it was pushed: look again
            version[b] += 1
            again = best(b)
            if again is not None:
                heapq.heappush(heap, (-again[0], b, again[1], version[b]))
            continue
        shapes[b] = [1, 1] if move == 0 else [kr + 1, kc] if move == 1 else [kr, kc + 1]
        left -= cost
        version[b] += 1
        move_next = best(b)
        if move_next is not None:
            heapq.heappush(heap, (-move_next[0], b, move_next[1], version[b]))
    return [tuple(s) for s in shapes]


def padded_width(k: int) -> int:
    """`k` rounded up to a multiple of `COLLECT_MULTIPLE`: a collected side's width."""
    return k + -k % COLLECT_MULTIPLE


def padded(basis: torch.Tensor) -> torch.Tensor:
    """`basis` `[..., K]` with zero columns appended up to `padded_width(K)`."""
    extra = padded_width(basis.shape[-1]) - basis.shape[-1]
    return torch.nn.functional.pad(basis, (0, extra)) if extra else basis


@dataclass
class EigenTarget:
    """One factor's part of an eigenbasis index: kept eigenvectors of each side and each block's rectangle.

    `basis_in` `[(E,) a, K_in]` (a includes the folded bias's ones row) and `basis_out` `[(E,) g, K_out]`
    are the kept eigenvectors in the factors' (sketched) space, most mass first; `shapes[e]` is block
    e's `(kr, kc)` in the stored orientation (an expert with `(0, 0)` stores nothing), or `(kr, kc, k)` for an
    L-shaped output floor (`cells_of`)."""

    block: str  # factor name: `<module>` or `<experts>.<proj>`
    names: list[str]  # block names, one per expert (or one)
    transposed: bool
    bias: bool
    shapes: list[tuple[int, ...]]
    basis_in: torch.Tensor
    basis_out: torch.Tensor

    @property
    def experts(self) -> bool:
        return self.basis_in.dim() == 3

    @property
    def widths(self) -> tuple[int, int]:
        """Collected rectangle `(K_rows, K_cols)`: the widest of the blocks' rectangles, each side padded with
        zero directions to a multiple of `COLLECT_MULTIPLE` (`padded`; the padding is never stored)."""
        k_in, k_out = padded_width(self.basis_in.shape[-1]), padded_width(self.basis_out.shape[-1])
        return (k_in, k_out) if self.transposed else (k_out, k_in)

    def take(self, device: torch.device) -> torch.Tensor:
        """Positions of the stored columns in the flattened collected rectangles `[(E,) K_rows, K_cols]`."""
        kr_max, kc_max = self.widths
        if any(len(s) == 3 for s in self.shapes):
            parts = []
            for e, s in enumerate(self.shapes):
                r, c = cell_mask(s).nonzero(as_tuple=True)
                parts.append(r * kc_max + c + e * kr_max * kc_max)
            return torch.cat(parts).to(device)
        kr, kc = torch.tensor(self.shapes, dtype=torch.long).reshape(-1, 2).unbind(1)
        cells = kr * kc
        expert = torch.repeat_interleave(torch.arange(len(self.shapes)), cells)
        local = torch.arange(int(cells.sum())) - torch.repeat_interleave(cells.cumsum(0) - cells, cells)
        width = kc[expert]
        return ((local // width) * kc_max + local % width + expert * kr_max * kc_max).to(device)


class EigenPlan:
    """The eigenbasis column plan of an index: targets in plan order, blocks, the collector's projector
    and the rows' flattening. Built from factors (`plan_eigenbasis`) or read from an index (`load_plan`)."""

    def __init__(
        self,
        targets: list[EigenTarget],
        sketch_dim: int | None,
        seed: int,
        projection: str,
        target_dims: dict[str, int] | None = None,
    ):
        self.targets = targets
        self.sketch_dim = sketch_dim
        self.target_dims = dict(target_dims or {})  # targets the factors sketched at their own dimension
        self.seed = seed
        self.projection = projection
        self.floors = (0, 0, 0)  # the dense, output-layer and expert floors the plan was allocated with (`fit_floors`)
        self._by_block = {t.block: t for t in targets}
        self._mats: dict[tuple, torch.Tensor] = {}
        self._take: dict[tuple, torch.Tensor] = {}
        self._ones: dict[tuple, torch.Tensor] = {}

    @property
    def blocks(self) -> list[Block]:
        """Index blocks: one per block with columns, `(kr, kc)` in the stored orientation."""
        out, col = [], 0
        for t in self.targets:
            for name, shape in zip(t.names, t.shapes, strict=True):
                if cells_of(shape):
                    out.append(Block(name, col, col + cells_of(shape), tuple(shape)))
                    col += cells_of(shape)
        return out

    @property
    def dim(self) -> int:
        return sum(cells_of(s) for t in self.targets for s in t.shapes)

    def projector(self, name: str, side: str, features: int, like: torch.Tensor, batch: int | None):
        """The collector's `projector=`: `[(E,) features, K]` = sketch `P` (when the factors sketched this
        side) times the kept eigenvectors (the folded bias's ones row left out: it enters through `flatten`)."""
        key = (name, side, like.device, like.dtype)
        mat = self._mats.get(key)
        if mat is None:
            t = self._by_block.get(name)
            if t is None:
                raise EigenbasisError(f"internal: no eigenbasis for target {name}")
            q = padded(t.basis_in if side == "in" else t.basis_out).to(like.device, torch.float32)
            if side == "in" and t.bias:
                q = q[..., :-1, :]
            if self.sketch_dim:
                sketch = Projections(
                    self.sketch_dim, self.seed, like.device, torch.float32, self.projection, self.target_dims
                )
                p = sketch.get(name, side, features, batch)
                if p is not None:
                    q = p @ q
            if q.shape[-2] != features:
                raise EigenbasisError(
                    f"{name} ({side} side) has {features} features but its eigenbasis {q.shape[-2]}: the factors "
                    "were fitted on another model or with other settings."
                )
            mat = self._mats[key] = q.to(like.dtype).contiguous()
        return mat

    def flatten(self, grads: dict, attribute_tokens: bool = False) -> torch.Tensor:
        """float32 rows `[N, dim]` (`[N, S, dim]` per token) in plan order from a fused `collect` result
        made with `projector`: each block's rectangle, a folded bias added as its weight's extra input
        direction; targets that received no gradient (`grads.missing`) give zeros."""
        lead = 2 if attribute_tokens else 1
        missing = getattr(grads, "missing", frozenset())
        parts = []
        for t in self.targets:
            value = grads[f"{t.block}.weight"]
            device, shape = value.device, value.shape[:lead]
            tkey = (t.block, device)
            if tkey not in self._take:
                self._take[tkey] = t.take(device)
            take = self._take[tkey]
            if t.block in missing:
                parts.append(torch.zeros(*shape, take.numel(), device=device))
                continue
            value = value.float()
            if t.bias:
                okey = (t.block, device)
                if okey not in self._ones:
                    self._ones[okey] = padded(t.basis_in[..., -1, :]).to(device, torch.float32)
                ones, bias = self._ones[okey], grads[f"{t.block}.bias"].float()
                value = value + (
                    ones.unsqueeze(-1) * bias.unsqueeze(-2) if t.transposed else bias.unsqueeze(-1) * ones.unsqueeze(-2)
                )
            parts.append(value.reshape(*shape, -1).index_select(-1, take))
        return torch.cat(parts, dim=-1)

    def save(self, directory: str | Path) -> None:
        """Write the kept eigenvectors to `directory/eigenbasis.safetensors`."""
        from safetensors.torch import save_file

        tensors = {}
        for t in self.targets:
            tensors[f"{t.block}::in"] = t.basis_in.contiguous().cpu()
            tensors[f"{t.block}::out"] = t.basis_out.contiguous().cpu()
        save_file(tensors, str(Path(directory) / BASIS_FILE))

    def settings(self, budget: int, fingerprint: str) -> dict:
        """What the index settings record (`settings["eigenbasis"]`)."""
        return {
            "kind": EIGENBASIS,
            "budget_bytes": budget,
            "factors_fingerprint": fingerprint,
            "floors": dict(zip(("dense", "output", "experts"), self.floors, strict=True)),
            "allocation": {
                "damping": ALLOCATION_DAMPING,
                "damping_scope": ALLOCATION_SCOPE,
                "expert_weight": EXPERT_WEIGHT,
                "output_floor_shape": OUTPUT_FLOOR_SHAPE,
            },
            "targets": {t.block: [t.transposed, t.bias, [list(s) for s in t.shapes]] for t in self.targets},
        }


def weights_of(f: Factor) -> list[torch.Tensor]:
    """Per block (expert), `Lambda / (Lambda + f.damping)` with rows and columns sorted by `direction_order`,
    times `EXPERT_WEIGHT` for an expert's."""
    rows, cols = direction_order(f)
    lam = f.lam.detach().double().cpu()
    damp = f.damping.detach().double().cpu()
    if lam.dim() == 2:
        return [_sorted(lam / (lam + damp), rows, cols)]
    w = lam / (lam + damp.view(-1, 1, 1))
    w = w.gather(1, rows[:, :, None].expand(-1, -1, w.shape[2])).gather(2, cols[:, None, :].expand(-1, w.shape[1], -1))
    return list((EXPERT_WEIGHT * w).unbind(0))


def plan_eigenbasis(
    report: CoverageReport, ekfac: EKFAC, budget: int | str = DEFAULT_BUDGET, index_dtype: str = "float32"
) -> EigenPlan:
    """The eigenbasis plan for the tracked modules of `report` under `budget` bytes per example.

    Every weight needs a factor (an experts projection one per layer, with its experts' slices) and
    every bias a factor that folds it in (`fit_ekfac(fold_bias=True)`, the default); anything else is
    an `EigenbasisError` naming the module, before any work.
    """
    columns = budget_columns(parse_bytes(budget), index_dtype)
    if ekfac.factors and any(f.lam is None or f.damping is None for f in ekfac.factors.values()):
        raise EigenbasisError("the EK-FAC factors have no corrected eigenvalues or damping: fit them to the end.")
    found: list[tuple[str, list[str], Factor]] = []
    for e in iter_entries(report.targets):
        f = ekfac.factors.get(e.block)
        if e.kind == "bias":
            if f is not None and not f.bias:
                raise EigenbasisError(
                    f"{e.key}: the factors leave this bias out of its weight's (fitted with --no_fold_bias); an "
                    "eigenbasis index needs folded biases: fit them again without --no_fold_bias."
                )
            continue
        if f is None:
            raise EigenbasisError(
                f"no EK-FAC factor for {e.key}: fit the factors with the modules the index tracks "
                "(the same --track_moe_experts and --filter_modules)."
            )
        lay = e.layout
        if lay is not None and not f.experts:
            raise EigenbasisError(f"{e.block}: the factors do not keep its experts apart; fit them again.")
        names = [f"{lay.expert_name(i, e.proj)}.weight" for i in range(lay.num_experts)] if lay else [e.key]
        found.append((e.block, names, f))
    allocation = ekfac.with_damping(ALLOCATION_DAMPING, ALLOCATION_SCOPE).factors
    weights = [w for block, _, _ in found for w in weights_of(allocation[block])]
    kinds = [(f.experts, block == report.output_layer) for block, names, f in found for _ in names]
    head = next((f for block, _, f in found if block == report.output_layer), None)
    dense, output, each, floors = fit_floors(
        kinds, weights, columns, vocabulary(report), head_transposed=bool(head is not None and head.transposed)
    )
    shapes = allocate(weights, columns, floors)
    targets, at = [], 0
    for block, names, f in found:
        mine = shapes[at : at + len(names)]
        at += len(names)
        kr_max, kc_max = max(max(s[0] for s in mine), 1), max(max(s[1] for s in mine), 1)
        rows, cols = direction_order(f)
        k_in, k_out = (kr_max, kc_max) if f.transposed else (kc_max, kr_max)
        order_in, order_out = (rows, cols) if f.transposed else (cols, rows)
        q_in = torch.gather(f.QA.detach().cpu(), -1, _expand(order_in[..., :k_in], f.QA))
        q_out = torch.gather(f.QG.detach().cpu(), -1, _expand(order_out[..., :k_out], f.QG))
        targets.append(EigenTarget(block, names, f.transposed, f.bias, mine, q_in, q_out))
    plan = EigenPlan(targets, ekfac.projection_dim, ekfac.seed, ekfac.projection, ekfac.target_dims(report))
    plan.floors = (dense, output, each)
    return plan


@dataclass
class FloorPlan:
    """What an eigenbasis index's floors take on a model, planned from its shapes alone (`plan_floors`)."""

    dense_blocks: int
    expert_blocks: int
    dense: int  # floor a side of a dense block
    output: int  # floor a side of the output layer
    columns: int  # the floors' cells
    directions: int = 0  # every direction pair of every block at the factors' sketch: the most an index stores

    def per_expert(self, budget: int | str, index_dtype: str) -> float:
        """Columns an expert block gets on average at most: its floor and an equal share of what the floors leave
        of `budget` (the greedy gives part of that to the dense blocks' further directions)."""
        left = budget_columns(parse_bytes(budget), index_dtype) - self.columns
        return EXPERT_DIRECTIONS**2 + max(left, 0) / max(self.expert_blocks, 1)

    def stored(self, budget: int | str, index_dtype: str) -> int:
        """Columns an index of `budget` stores: the budget's, or every direction pair where it buys more."""
        return min(budget_columns(parse_bytes(budget), index_dtype), self.directions)


def plan_floors(
    report: CoverageReport, sketch: int | None = EIGENBASIS_SKETCH, output_sketch: int | None = EIGENBASIS_OUTPUT_SKETCH
) -> FloorPlan:
    """The floors of an eigenbasis index of `report`'s targets for factors fitted with `--projection_dim sketch
    --output_projection_dim output_sketch` (None: unprojected): each dense factor's sides (`factor_dims`, a
    folded bias included) clipped to the dense floor or, for the output layer, `output_floor`."""
    out = output_floor(vocabulary(report), DENSE_DIRECTIONS)
    dims = output_dims(report.output_layer, sketch, output_sketch)
    dense_blocks = expert_blocks = cells = directions = 0
    for name, transposed, experts, a, g, _fold in factor_dims(report, sketch, True, target_dims=dims):
        directions += a * g * (experts or 1)
        if experts:
            expert_blocks += experts
            cells += experts * min(EXPERT_DIRECTIONS, a) * min(EXPERT_DIRECTIONS, g)
            continue
        dense_blocks += 1
        if name == report.output_layer and OUTPUT_FLOOR_SHAPE == "area":
            cells += min(out * out, a * g)  # at most: the greedy may stop a row or column short
            continue
        if name == report.output_layer:
            cells += cells_of(output_floor_shape(out, *((a, g) if transposed else (g, a)), transposed))
            continue
        cells += min(DENSE_DIRECTIONS, a) * min(DENSE_DIRECTIONS, g)
    return FloorPlan(dense_blocks, expert_blocks, DENSE_DIRECTIONS, out, cells, directions)


def vocabulary(report: CoverageReport) -> int:
    """Rows of the output layer's weight (its words), 0 where the model has no output-layer target."""
    head = next((t.module for t in report.targets if t.name == report.output_layer), None)
    return int(head.weight.shape[0]) if head is not None else 0


def output_floor(vocab: int, dense: int) -> int:
    """Directions a side the output layer starts with: an eighth of its `vocab` words, no fewer than a dense
    block's (`dense`) and no more than 256 (the rule chosen on the LDS benchmark, docs/build.md); none without
    dense floors."""
    if dense == 0:
        return 0
    return min(OUTPUT_DIRECTIONS_MAX, max(dense, vocab // OUTPUT_VOCAB_FRACTION))


def filled(r: int, rows: int, cols: int) -> tuple[int, int]:
    """The "fill" shape of `r * r` cells in a `rows x cols` block: `r x r` where both sides hold `r`, else the short
    side whole and the long side filled to at most `r * r` cells (and at most the block)."""
    if rows >= r and cols >= r:
        return r, r
    if rows <= cols:
        return rows, min(cols, r * r // max(rows, 1))
    return min(rows, r * r // max(cols, 1)), cols


def hidden_whole(r: int, inputs: int, outputs: int) -> tuple[int, int]:
    """The "hidden" shape of `r * r` cells in a block of `inputs` input-side (hidden) and `outputs` output-side
    (vocabulary) directions, as `(input directions, output directions)`: the input side whole (at most `r * r`), the
    output side filled to at most `r * r` cells, at least one direction (and at most the block)."""
    k_in = min(inputs, r * r)
    return k_in, min(outputs, max(1, r * r // max(k_in, 1)))


def crossed(r: int, rows: int, cols: int) -> tuple[int, ...]:
    """The "cross" shape of about `r * r` cells in a `rows x cols` block: where both sides hold `2r` directions, the
    L `(2r, 2r, r // 4)` (`cells_of`): the leading `r/4` rows over the leading `2r` columns and the leading `r/4`
    columns over the leading `2r` rows, `15/16 r^2` cells; else the "fill" shape (`filled`).

    Why: which side of the output layer tells training rows apart depends on the queries (their answers' words: the
    vocabulary side where domains answer with their own words, the hidden side where they share them), which the
    build does not see; the L keeps both sides' leading directions against a long stretch of the other
    (docs/build.md)."""
    k = r // 4
    if k and rows >= 2 * r and cols >= 2 * r:
        return 2 * r, 2 * r, k
    return filled(r, rows, cols)


def output_floor_shape(r: int, rows: int, cols: int, transposed: bool = False) -> tuple[int, ...]:
    """The output floor's shape in a `rows x cols` block (stored orientation: `[in, out]` if `transposed`, else
    `[out, in]`) under `OUTPUT_FLOOR_SHAPE` other than "area" (which `allocate` shapes on the block's weights):
    `filled`, `hidden_whole`, `crossed`, or the `r x r` square clipped to the block."""
    if OUTPUT_FLOOR_SHAPE == "fill":
        return filled(r, rows, cols)
    if OUTPUT_FLOOR_SHAPE == "cross":
        return crossed(r, rows, cols)
    if OUTPUT_FLOOR_SHAPE == "hidden":
        k_in, k_out = hidden_whole(r, *((rows, cols) if transposed else (cols, rows)))
        return (k_in, k_out) if transposed else (k_out, k_in)
    return min(r, rows), min(r, cols)


def cells_of(shape: tuple[int, ...]) -> int:
    """Cells of a block's shape: `(kr, kc)`, a rectangle, or `(kr, kc, k)`, the L of the leading `k` rows and the
    leading `k` columns of the `kr x kc` rectangle (`cell_mask`)."""
    if len(shape) == 2:
        return shape[0] * shape[1]
    kr, kc, k = shape
    return k * kc + (kr - k) * k


def cell_mask(shape: tuple[int, ...]) -> torch.Tensor:
    """Which cells of the `kr x kc` rectangle a block's shape keeps (`cells_of`), `[kr, kc]` bool, row-major as the
    block's columns are stored."""
    kr, kc = shape[0], shape[1]
    if len(shape) == 2:
        return torch.ones(kr, kc, dtype=torch.bool)
    k = shape[2]
    i, j = torch.arange(kr)[:, None], torch.arange(kc)[None, :]
    return (i < k) | (j < k)


def fit_floors(
    kinds: list[tuple[bool, bool]],
    weights: list[torch.Tensor],
    columns: int,
    vocab: int = 0,
    head_transposed: bool = False,
) -> tuple[int, int, int, list[tuple[int, ...]]]:
    """The dense, output and expert floors (`DENSE_DIRECTIONS`, `output_floor`, `EXPERT_DIRECTIONS`) and each
    block's floor rectangle, for
    blocks of `kinds` (`(expert, output layer)` each, in plan order) whose direction weights are `weights`, the
    output layer having `vocab` words and its weight stored `[in, out]` if `head_transposed` (else `[out, in]`).

    Why floors: spent by `Lambda / (Lambda + d)` alone, a budget that buys a few dozen columns per block goes
    to the blocks with the largest eigenvalues and leaves the attention blocks and the output layer, which
    rank best, a handful of directions; giving each dense block its leading `r x r` first (there are few of
    them: 241 of 12,529 blocks on Qwen3-30B-A3B) and the experts the rest raised the LDS at 1 MiB from 0.08
    below the seeded default to above it (docs/build.md). Every expert block starts from its
    leading pair (`EXPERT_DIRECTIONS`), so a tracked expert always has a part in the scores. Floors a budget of
    `columns` cannot hold are halved (all three) until it can, with a warning."""
    dense, output, each = DENSE_DIRECTIONS, output_floor(vocab, DENSE_DIRECTIONS), EXPERT_DIRECTIONS
    wanted = dense, output, each

    def rects(d: int, o: int, x: int) -> list[tuple[int, int]]:
        out = []
        for (expert, head), w in zip(kinds, weights, strict=True):
            r = x if expert else o if head else d
            if head and r and OUTPUT_FLOOR_SHAPE == "area":
                out.append(allocate([w], r * r)[0])
            elif head and r:
                out.append(output_floor_shape(r, *w.shape, head_transposed))
            else:
                out.append((min(r, w.shape[0]), min(r, w.shape[1])))
        return out

    floors = rects(dense, output, each)
    head = next((b for b, (_, is_head) in enumerate(kinds) if is_head), None)
    if head is not None and max(weights[head].shape) < vocab:  # the vocabulary side sketched
        kept = weights[head].shape
        short = kept[0] * kept[1] < output * output if OUTPUT_FLOOR_SHAPE != "square" else max(kept) < output
        if short:
            warnings.warn(
                f"moe-attrib: the factors keep {tuple(kept)} directions of the output layer, fewer than its floor "
                f"of {output * output} ({output} x {output}): fit them with --output_projection_dim "
                f"{max(EIGENBASIS_OUTPUT_SKETCH, 2 * output)} (ekfac) for the floor the LDS benchmark measured "
                "(docs/build.md).",
                stacklevel=3,
            )
    while sum(cells_of(f) for f in floors) > columns and (dense or output or each):
        dense, output, each = dense // 2, output // 2, each // 2
        floors = rects(dense, output, each)
    if (dense, output, each) != wanted:
        need = sum(cells_of(f) for f in rects(*wanted))
        warnings.warn(
            f"moe-attrib: the budget buys {columns} columns, fewer than the {need} that the floors of {wanted[0]} "
            f"directions a side for dense blocks (output layer {wanted[1]}, experts {wanted[2]}) take: floors lowered "
            f"to {dense} (output layer {output}, experts {each}). Give a larger --budget (or --index_dtype bfloat16, "
            "twice the columns) for the floors the LDS benchmark measured (docs/build.md).",
            stacklevel=3,
        )
    return dense, output, each, floors


def _expand(order: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Column indices `[(E,) k]` expanded over the rows of `q` `[(E,) n, n]`."""
    return order.unsqueeze(-2).expand(*q.shape[:-1], order.shape[-1])


def load_plan(directory: str | Path, settings: dict) -> EigenPlan:
    """The plan of the eigenbasis index at `directory` (its `eigenbasis.safetensors` and settings)."""
    from safetensors.torch import load_file

    info = settings["eigenbasis"]
    if info.get("kind") != EIGENBASIS:
        raise EigenbasisError(f"{directory}: unknown eigenbasis kind {info.get('kind')!r}; upgrade moe-attrib.")
    try:
        tensors = load_file(str(Path(directory) / BASIS_FILE))
    except OSError as err:
        raise EigenbasisError(f"{directory}: the eigenbasis index has no readable {BASIS_FILE} ({err}).") from err
    targets = []
    for block, (transposed, bias, shapes) in info["targets"].items():
        q_in, q_out = tensors[f"{block}::in"], tensors[f"{block}::out"]
        targets.append(EigenTarget(block, [], transposed, bias, [tuple(s) for s in shapes], q_in, q_out))
    return EigenPlan(targets, settings["projection_dim"], settings["seed"], settings["projection"])


def with_names(plan: EigenPlan, report: CoverageReport) -> EigenPlan:
    """The plan's block names from the model's tracked modules (names are not stored with the basis)."""
    names = {}
    for e in iter_entries(report.targets):
        lay = e.layout
        if e.kind == "weight":
            names[e.block] = (
                [f"{lay.expert_name(i, e.proj)}.weight" for i in range(lay.num_experts)] if lay else [e.key]
            )
    for t in plan.targets:
        if t.block not in names:
            raise EigenbasisError(f"the model has no tracked module {t.block} of the eigenbasis index.")
        t.names = names[t.block]
    return plan


def check_factors(settings: dict, ekfac: EKFAC, where: str = "the index") -> None:
    """Refuse factors other than those an eigenbasis index was built with (their fingerprint)."""
    want = settings["eigenbasis"]["factors_fingerprint"]
    got = factors_fingerprint(ekfac)
    if got != want:
        raise EigenbasisError(
            f"these EK-FAC factors (fingerprint {got[:12]}) are not the ones {where} was built with ({want[:12]}): "
            "score an eigenbasis index with the --ekfac it was built with."
        )


def index_plan(path: str | Path, settings: dict, report: CoverageReport) -> EigenPlan | None:
    """The eigenbasis plan of the index at `path` with its settings, block names from `report`; None for
    an index of seeded projections."""
    if not settings.get("eigenbasis"):
        return None
    plan = with_names(load_plan(path, settings), report)
    plan.target_dims = output_dims(report.output_layer, plan.sketch_dim, settings.get("output_projection_dim"))
    return plan
