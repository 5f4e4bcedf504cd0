"""Capture: hooks, router taps and experts collection forwards that record every target's rows.

A `Capture` installed on a model records, for each target call of a batch, a `CaptureRecord`:
the input rows `x` (forward) and the output-gradient rows `g` (backward), projected on the way
in when a projector is given, and for fused experts the routed grid: the (expert, example)
segment of each routed row. What is done with the records (per-example or per-token gradients,
EK-FAC covariances) is the consumer's business.

Dense targets with a plain forward are captured by forward hooks; weights used elsewhere (routers
computing logits from a bare parameter, a parent reading a child's `.weight`) by the run-time
taps of `moe_attrib.model.taps`; grouped linears as dense rows of (token, group) pairs. Experts modules
run the collection forward of their layout family in place of their innermost forward (composing
with accelerate's hooks), each checked against its own forward on its first call.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moe_attrib.model.discovery import Target, grouped_linear_groups
from moe_attrib.model.layouts import (
    ExpertsLayout,
    Kernels,
    LayoutError,
    RoutedRows,
    is_out_of_memory,
    null_sink,
)
from moe_attrib.model.taps import WeightTaps

# experts modules whose collection forward was checked against their own forward in this process,
# with the (layout family, class) it was checked for: later captures (another build, the queries) skip the
# check, which runs the module's eager forward (a loop over experts: seconds on a full-size model)
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()

Projector = Callable[[str, str, int, torch.Tensor, "int | None"], "torch.Tensor | None"]


@dataclass
class BatchInfo:
    """The batch being captured: `n` examples of `seq_len` tokens; `mask` `[N * S]` float (1 = real token)."""

    n: int
    seq_len: int
    mask: torch.Tensor | None


@dataclass
class RoutedGrid:
    """The (expert, example) segments of one experts call's routed rows.

    Rows are sorted expert-major then by token, so segment `s = expert * N + example` is a
    contiguous run of rows: `ends[s]` (int32 `[segments]`) is one past its last row, and
    `seg[r]` (long) is row r's segment, `segments` (= `E * N`) for rows of zero-compute experts
    (`trash` set), which sit after every real segment. `bounds` (int32 `[segments + 1]`) is `ends`
    followed by the number of rows, so the rows past the last segment form one more (dropped) segment.
    Consumers form per-segment sums sized by the routed rows (`Kernels.segment_mm`), never a padded
    per-example grid.
    """

    rows: RoutedRows
    seg: torch.Tensor
    ends: torch.Tensor
    segments: int
    trash: bool
    bounds: torch.Tensor


@dataclass
class CaptureRecord:
    """Rows of one target call. Dense: `x` `[N, R, a]`, `g` `[N, R, b]` (`R` = tokens * `groups`);
    experts (`grid` set): `x` `[rows, a]`, `g` `[rows, b]`, routed expert-major. `g` stays None
    until the backward reaches the call (it never does for calls off the loss path)."""

    name: str
    x: torch.Tensor
    transposed: bool
    has_bias: bool
    g: torch.Tensor | None = None
    grid: RoutedGrid | None = None
    layout: ExpertsLayout | None = None
    groups: int = 1

    def row_mask(self, batch: BatchInfo) -> torch.Tensor | None:
        """`[rows]` float, 1 for rows of real tokens (None: every row is real)."""
        if batch.mask is None:
            return None
        if self.grid is not None:
            rows = self.grid.rows
            return batch.mask[rows.token] if rows.num_tokens == batch.mask.numel() else None
        if self.x.shape[0] * self.x.shape[1] != batch.mask.numel() * self.groups:
            return None
        return batch.mask.repeat_interleave(self.groups) if self.groups > 1 else batch.mask


class Capture:
    """Installs capture on a model's targets; a context manager that removes everything on exit.

    `projector(name, side, features, like, batch)` gives the matrix rows are multiplied by on
    capture, or None for a side kept exact (no projector: every side is kept as it is).
    """

    def __init__(
        self,
        model: nn.Module,
        targets: list[Target],
        *,
        projector: Projector | None = None,
        kernels: Kernels | None = None,
    ):
        self.model = model
        self.targets = targets
        self.projector = projector
        self.kernels = kernels or Kernels()
        self.batch: BatchInfo | None = None
        self.records: list[CaptureRecord] = []
        self.counts: dict[str, torch.Tensor] = {}
        self._handles: list = []
        self._target_handles: dict[str, list] = {}
        self._restore: list[tuple[nn.Module, str, bool, object]] = []
        self._requires_grad: dict[nn.Parameter, bool] = {}
        self._paused = 0
        tapped = weakref.WeakMethod(self._tapped)  # the taps outlive no capture: no cycle holding its records
        self.taps = WeightTaps(model, [t for t in targets if t.kind in ("linear", "router")], lambda *a: tapped()(*a))

    # -- installation -------------------------------------------------------------------------
    def __enter__(self) -> Capture:
        try:
            for p in self.model.parameters():
                self._requires_grad[p] = p.requires_grad
                p.requires_grad_(False)
            embed = self.model.get_input_embeddings()
            self._handles.append(embed.register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
            for target in self.targets:
                if target.kind == "experts":
                    self._install_experts(target.layout)
                elif target.kind == "grouped_linear":
                    hook = target.module.register_forward_hook(lambda m, a, out, t=target: self._grouped(t, a[0], out))
                    self._target_handles[target.name] = [hook]
                elif target.scope is None:
                    hook = target.module.register_forward_hook(
                        lambda m, a, out, t=target: self._dense(t, a[0], out, t.transposed)
                    )
                    self._target_handles[target.name] = [hook]
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.taps.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for hooks in self._target_handles.values():
            for h in hooks:
                h.remove()
        self._target_handles.clear()
        for module, attr, had, previous in reversed(self._restore):
            if had:
                module.__dict__[attr] = previous
            else:
                del module.__dict__[attr]
        self._restore.clear()
        for p, flag in self._requires_grad.items():
            p.requires_grad_(flag)
        self._requires_grad.clear()

    def _install_experts(self, layout: ExpertsLayout) -> None:
        """Run the layout's collection forward in place of the module's innermost forward.

        A plain module gets an instance `forward`; a module dispatched with accelerate keeps its hook
        (`forward` wrapping `_old_forward`) and only `_old_forward` is replaced, so device placement
        and offloading still happen around the collection forward. Exit restores exactly what was there.
        """
        module = layout.module
        if "forward" in module.__dict__:
            if "_old_forward" in module.__dict__ and hasattr(module, "_hf_hook"):
                attr = "_old_forward"
            else:
                raise LayoutError(
                    f"{layout.name} ({type(module).__name__}) has an instance-level `forward` "
                    f"({module.__dict__['forward']!r}) that moe-attrib cannot compose with. Remove it before "
                    "collecting, or wrap the module with hooks (register_forward_hook) instead."
                )
        else:
            attr = "forward"
        inner = getattr(module, attr)
        wrapped = getattr(type(module).forward, "__wrapped__", None)
        # decorated modules: check against the eager forward the layout declares, not a dispatch of it
        reference = wrapped.__get__(module) if layout.decorated and wrapped is not None else inner
        grouped = layout.collection_forward(self.kernels, self._experts_sink)

        def forward(*args, **kwargs):
            if _VERIFIED.get(module) != (layout.family, type(module)):
                self._verify(layout, reference, args, kwargs)
            return grouped(*args, **kwargs)

        self._restore.append((module, attr, attr in module.__dict__, module.__dict__.get(attr)))
        module.__dict__[attr] = forward

    def _verify(self, layout: ExpertsLayout, reference: Callable, args, kwargs) -> None:
        """Check the collection forward against the module's own forward, once per module and process."""
        with torch.no_grad():
            ref = reference(*args, **kwargs)
            try:
                got = layout.collection_forward(self.kernels, null_sink)(*args, **kwargs)
            except (RuntimeError, ValueError, IndexError, TypeError) as err:
                if is_out_of_memory(err):
                    raise
                raise LayoutError(
                    f"{layout.name} ({type(layout.module).__name__}): moe-attrib's '{layout.family}' collection "
                    f"forward fails on this module's inputs ({type(err).__name__}: {err}). Its layout is not the "
                    "one declared or assumed; register a layout family in moe_attrib/model/layouts/."
                ) from err
        ref = ref[0] if isinstance(ref, tuple) else ref
        err = (got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        tol = (1e-3 if ref.is_cuda else 1e-4) if ref.dtype == torch.float32 else 2e-2  # CUDA fp32 may use TF32
        if got.shape != ref.shape or not torch.isfinite(err) or err > tol:
            raise LayoutError(
                f"{layout.name} ({type(layout.module).__name__}): moe-attrib's '{layout.family}' collection forward "
                f"differs from the module's own forward (relative error {float(err):.2e}). Its layout is not the "
                "one declared or assumed; register a layout family in moe_attrib/model/layouts/."
            )
        _VERIFIED[layout.module] = (layout.family, type(layout.module))

    # -- one batch -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, batch: BatchInfo) -> Iterator[None]:
        """Wrap the model's forward: records of this batch accumulate in `records` until `reset()`."""
        self.batch = batch
        self.records, self.counts = [], {}
        if not self.taps.pending:
            yield
            return
        with self.taps.first_batch():
            yield
        for name in self.taps.moved:  # now tapped in the module whose forward uses the weight
            for h in self._target_handles.pop(name, []):
                h.remove()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing while inside: a decoder layer's forward run again for its backward
        (`moe_attrib.model.recompute`) must not record its rows a second time."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    def reset(self) -> None:
        self.batch = None
        self.records, self.counts = [], {}

    # -- dense targets -----------------------------------------------------------------------------
    def _project(self, name: str, side: str, features: int, like: torch.Tensor, batch: int | None = None):
        """The matrix one side's rows are multiplied by, or None where they are kept as they are."""
        if self.projector is None:
            return None
        return self.projector(name, side, features, like, batch)

    def _per_example(self, rows: torch.Tensor) -> torch.Tensor:
        n = self.batch.n
        if rows.shape[0] % n:
            raise RuntimeError(
                f"{rows.shape[0]} rows cannot be split into {n} examples; packed or reshaped batches are "
                "not supported by this target."
            )
        return rows.view(n, rows.shape[0] // n, *rows.shape[1:])

    def _tapped(self, target: Target, x: torch.Tensor, y: torch.Tensor, out_transposed: bool) -> None:
        self._dense(target, x, y, False, out_transposed)

    def _dense(
        self, target: Target, x: torch.Tensor, y: torch.Tensor, transposed: bool, out_transposed: bool = False
    ) -> None:
        if not isinstance(y, torch.Tensor) or not y.requires_grad or self._paused:
            return
        record = self.dense_record(target, x, transposed)

        def backward(g: torch.Tensor) -> None:
            if out_transposed:
                g = g.transpose(-1, -2)
            self.set_out_rows(record, self.out_rows(record, g.reshape(-1, g.shape[-1])))

        y.register_hook(backward)

    def hooked_target(self, module: nn.Module) -> Target | None:
        """The dense target `module` is, if it is captured by its forward hook (not tapped elsewhere)."""
        for target in self.targets:
            if target.module is module and target.kind == "linear" and target.name in self._target_handles:
                return target
        return None

    def dense_record(self, target: Target, x: torch.Tensor, transposed: bool = False) -> CaptureRecord:
        """Record a dense target's input rows `x` (`[..., in]`, projected as one 2D matmul, then split
        into examples); its `g` is set by the caller (a hook, or `moe_attrib.collect.head`) from `out_rows`."""
        x = x.detach().reshape(-1, x.shape[-1])
        p_in = self._project(target.name, "in", x.shape[-1], x)
        x = self._per_example(self.kernels.matmul_fp32(x, p_in) if p_in is not None else x.float())
        record = CaptureRecord(target.name, x, transposed, target.module._parameters.get("bias") is not None)
        self.records.append(record)
        return record

    def out_rows(self, record: CaptureRecord, g: torch.Tensor) -> torch.Tensor:
        """Output-gradient rows `g` (`[rows, out]`) of a dense record as it keeps them: projected, float32."""
        p_out = self._project(record.name, "out", g.shape[-1], g)
        return self.kernels.matmul_fp32(g, p_out) if p_out is not None else g.float()

    def set_out_rows(self, record: CaptureRecord, rows: torch.Tensor) -> None:
        """Set a dense record's `g` from its `out_rows` of the whole batch (`[N * R, b]`)."""
        record.g = self._per_example(rows)

    def _grouped(self, target: Target, x: torch.Tensor, y: torch.Tensor) -> None:
        """A grouped linear as a dense capture whose rows are (token, group) pairs.

        Group g's output gradient enters the rows as the full-width vector that is zero outside
        block g, so `sum_rows g x^T` is the gradient of the `[out, in_per_group]` weight.
        """
        if not y.requires_grad or self._paused:
            return
        name, groups = target.name, grouped_linear_groups(target.module)
        out = target.module.weight.shape[0]
        x = self._per_example(x.detach().reshape(-1, x.shape[-1]))  # [N, S * G, in]
        p_in = self._project(name, "in", x.shape[-1], x)
        x = (x @ p_in).float() if p_in is not None else x.float()
        record = CaptureRecord(name, x, False, target.module._parameters.get("bias") is not None, groups=groups)
        self.records.append(record)

        def backward(g: torch.Tensor) -> None:
            g = g.reshape(-1, groups, g.shape[-1])  # [T, G, out / G]
            p_out = self._project(name, "out", out, g)
            if p_out is not None:
                rows = torch.einsum("tgo,gop->tgp", g, p_out.view(groups, out // groups, -1))
            else:
                rows = torch.einsum("tgo,gh->tgho", g, torch.eye(groups, dtype=g.dtype, device=g.device))
            record.g = self._per_example(rows.reshape(-1, rows.shape[-1] if p_out is not None else out))
            record.g = record.g.float()

        y.register_hook(backward)

    # -- experts -----------------------------------------------------------------------------------
    def _routing_grid(self, layout: ExpertsLayout, rows: RoutedRows) -> RoutedGrid:
        """The (expert, example) segments of the routed rows (computed once per experts call).

        Rows are sorted expert-major then by token, so the rows of one (expert, example) pair
        are contiguous, however many there are (a token that picks one expert twice gives two
        rows of its segment): no length bound, no device sync.
        """
        cached = rows.cache.get("grid")
        grid = cached() if cached is not None else None
        if grid is not None:
            return grid
        batch = self.batch
        n, e = batch.n, layout.num_experts
        if rows.num_tokens % n:
            raise RuntimeError(f"{layout.name}: {rows.num_tokens} tokens cannot be split into {n} examples.")
        per_example = rows.num_tokens // n
        seg = torch.add(rows.token // per_example, rows.expert, alpha=n)  # expert * N + example, in two ops
        trash = rows.num_experts > e  # rows of zero-compute (identity) experts sit past the real ones
        if trash:
            valid = rows.expert < e
            seg = torch.where(valid, seg, e * n)
        # the ends of the E * N segments and of one more holding the remaining rows (every seg is <= E * N)
        bounds = torch.searchsorted(seg, torch.arange(1, e * n + 2, device=seg.device), out_int32=True)
        ends = bounds[:-1]
        real = batch.mask[rows.token] if batch.mask is not None and rows.num_tokens == batch.mask.numel() else None
        if real is None:
            real = torch.ones(seg.shape, device=seg.device)
        if trash:
            real = real * valid
        routed = torch.zeros(e * n + 1, device=seg.device).index_add_(0, seg, real)[:-1]
        self.counts[layout.name] = routed.view(e, n).t()
        grid = RoutedGrid(rows, seg, ends, e * n, trash, bounds)
        rows.cache["grid"] = weakref.ref(grid)  # the grid holds the rows: a strong reference would be a cycle
        return grid

    def _experts_sink(
        self, layout: ExpertsLayout, proj: str, x: torch.Tensor, y: torch.Tensor, rows: RoutedRows
    ) -> None:
        if not y.requires_grad or self._paused:
            return
        grid = self._routing_grid(layout, rows)
        e = layout.num_experts
        offsets = rows.offsets if rows.offsets.shape[0] == e else rows.offsets[:e]
        pname = f"{layout.name}.{proj}"
        in_features, out_features = layout.features(proj)
        x = x.detach()
        p_in = self._project(pname, "in", in_features, x, e)
        if p_in is not None:
            x = self.kernels.grouped_matmul(x, p_in, offsets, fp32_out=True)
        record = CaptureRecord(pname, x.float(), layout.transposed, layout.bias(proj) is not None, grid=grid)
        record.layout = layout
        self.records.append(record)

        def backward(g: torch.Tensor) -> None:
            p_out = self._project(pname, "out", out_features, g, e)
            if p_out is not None:
                g = self.kernels.grouped_matmul(g, p_out, offsets, fp32_out=True)
            record.g = g.float()

        y.register_hook(backward)
