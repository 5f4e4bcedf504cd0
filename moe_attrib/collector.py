"""Per-example gradients from one forward and one activation-only backward.

For a linear map `y = x W^T` the gradient of example n's loss is `sum_t dy_t x_t^T` over its
tokens. Hooks capture each target's input rows in the forward and its output gradients in the
backward; with a projection both sides are projected first (`P_out dy`, `P_in x`), so the
per-example block is `projection_dim^2` and nothing of size `out x in` is ever formed.

Fused experts run through `experts.grouped_experts_forward` (tokens sorted by expert once,
one grouped matmul per projection). Their routed rows are projected with one grouped matmul
per side, scattered into the per-(expert, example) grid `[E * N, L, p]`, and every expert's
per-example gradients come from one batched matmul. No parameter gradient is computed:
parameters are frozen during collection and only activation gradients flow.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from moe_attrib.discovery import CoverageReport, Target, discover
from moe_attrib.experts import (
    ExpertsLayout,
    LayoutError,
    RoutedRows,
    collection_forward,
    grouped_matmul,
    matmul_fp32,
)
from moe_attrib.families import grouped_linear_groups
from moe_attrib.projection import Projections


class PerExampleGradients(dict):
    """`{"<module>.weight" | "<module>.bias": Tensor [N, ...]}` plus batch metadata.

    `losses`: `[N]` summed token cross-entropy per example. `expert_counts`: `[N, layers, E]`
    real (non-padding) tokens of each example routed to each expert, one row per experts
    module in `expert_layers` order (layers with fewer experts are zero-padded).
    """

    losses: torch.Tensor
    expert_counts: torch.Tensor
    expert_layers: list[str]


@dataclass
class _Batch:
    n: int
    seq_len: int
    mask: torch.Tensor | None  # [N * S] float, 1 for real tokens


@dataclass
class _Capture:
    """Rows captured for one target call: inputs `x` (forward) and output gradients `g` (backward)."""

    name: str
    x: torch.Tensor
    transposed: bool
    has_bias: bool
    g: torch.Tensor | None = None
    grid: dict | None = None
    layout: ExpertsLayout | None = None


def example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of each example (`labels` -100 are ignored)."""
    shifted = logits[:, :-1].float()
    target = labels[:, 1:]
    loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target.reshape(-1), reduction="none")
    return loss.view(target.shape).sum(dim=1)


def default_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    labels = input_ids.clone()
    if attention_mask is not None:
        labels[attention_mask == 0] = -100
    return labels


class _LinearTap(TorchFunctionMode):
    """Catches `F.linear` / matmul calls that use one module's own weight, inside its forward.

    Routers often compute logits from a bare parameter (`F.linear(h, self.weight)`, with casts
    or a transpose on the way); the tap follows such derived tensors and reports the call's
    input and output to `on_linear`.
    """

    _DERIVE = {
        torch.Tensor.to,
        torch.Tensor.type,
        torch.Tensor.float,
        torch.Tensor.half,
        torch.Tensor.bfloat16,
        torch.Tensor.contiguous,
    }
    _FLIP = {torch.Tensor.t, torch.t, torch.Tensor.T.__get__}
    _MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm}

    def __init__(self, weights: dict[int, tuple[torch.Tensor, Target]], on_linear: Callable):
        super().__init__()
        self.tracked: dict[int, tuple[torch.Tensor, Target, bool]] = {k: (w, t, False) for k, (w, t) in weights.items()}
        self.on_linear = on_linear
        self.hit: set[str] = set()

    def _capture(self, entry, x, out, weight_left: bool = False) -> None:
        target = entry[1]
        self.hit.add(target.name)
        if weight_left:  # W @ X with X [..., in, S]: rows are the last axis
            self.on_linear(target, x.transpose(-1, -2), out, False, out_transposed=True)
        else:
            self.on_linear(target, x, out, False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            entry = self.tracked.get(id(weight))
            if entry is not None and not entry[2]:
                self._capture(entry, args[0], out)
        elif func in self._MATMUL and len(args) == 2:
            entry = self.tracked.get(id(args[1]))
            if entry is not None and entry[2]:
                self._capture(entry, args[0], out)
            entry = self.tracked.get(id(args[0]))
            if entry is not None and not entry[2]:
                self._capture(entry, args[1], out, weight_left=True)
        elif func in self._DERIVE or func in self._FLIP:
            entry = self.tracked.get(id(args[0])) if args else None
            if entry is not None and isinstance(out, torch.Tensor):
                self.tracked[id(out)] = (out, entry[1], entry[2] ^ (func in self._FLIP))
        return out


class GradientCollector:
    """Installs collection hooks on a model; `collect(batch)` returns per-example gradients.

    Use as a context manager: on exit every hook and forward override is removed and the
    parameters' `requires_grad` flags are restored.
    """

    def __init__(
        self,
        model: nn.Module,
        report: CoverageReport | None = None,
        *,
        track_moe_experts: bool = True,
        projection_dim: int | None = None,
        seed: int = 0,
        projector: Callable | None = None,
        row_sink: Callable | None = None,
    ):
        """`projector(name, side, features, like, batch)` replaces the seeded random projections
        (EK-FAC uses it to rotate rows into its eigenbases); `row_sink(captures, batch)` receives
        the captured rows instead of forming per-example gradients (EK-FAC's covariances)."""
        self.model = model
        self.projector = projector
        self.row_sink = row_sink
        self.report = report if report is not None else discover(model, track_moe_experts=track_moe_experts)
        self.projection_dim = projection_dim
        self.seed = seed
        self._handles: list = []
        self._overrides: list[nn.Module] = []
        self._requires_grad: dict[nn.Parameter, bool] = {}
        self._proj: Projections | None = None
        self._batch: _Batch | None = None
        self._results: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._verified: set[int] = set()
        self._exact_lengths = False
        self.expert_blocks = "separate"
        self._tokens = 0
        self._overflow: list[torch.Tensor] = []
        self._captures: list[_Capture] = []

    # -- installation ---------------------------------------------------------------------
    def __enter__(self) -> GradientCollector:
        for p in self.model.parameters():
            self._requires_grad[p] = p.requires_grad
            p.requires_grad_(False)
        embed = self.model.get_input_embeddings()
        self._handles.append(embed.register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
        self._taps: dict[nn.Module, list[Target]] = {}
        for target in self.report.targets:
            self._install(target)
        self._install_taps()
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._overrides:
            del module.forward
        self._overrides.clear()
        for p, flag in self._requires_grad.items():
            p.requires_grad_(flag)
        self._requires_grad.clear()

    def _install(self, target: Target) -> None:
        module = target.module
        if target.kind == "experts":
            module.forward = self._experts_forward(target.layout)
            self._overrides.append(module)
        elif target.kind in ("linear", "conv1d") and target.scope is None:
            self._handles.append(
                module.register_forward_hook(lambda m, a, out, t=target: self._dense(t, a[0], out, t.transposed))
            )
        elif target.kind == "grouped_linear":
            self._handles.append(module.register_forward_hook(lambda m, a, out, t=target: self._grouped(t, a[0], out)))
        else:
            self._taps.setdefault(target.scope or module, []).append(target)

    def _install_taps(self) -> None:
        for scope, targets in self._taps.items():
            self._handles.append(scope.register_forward_pre_hook(lambda m, a, ts=targets: self._tap_enter(m, ts)))
            self._handles.append(scope.register_forward_hook(lambda m, a, out, ts=targets: self._tap_exit(m, ts)))

    def _tap_enter(self, scope: nn.Module, targets: list[Target]) -> None:
        tap = _LinearTap({id(t.module.weight): (t.module.weight, t) for t in targets}, self._dense)
        tap.__enter__()
        scope.__dict__.setdefault("_moe_attrib_taps", []).append(tap)

    def _tap_exit(self, scope: nn.Module, targets: list[Target]) -> None:
        tap = scope.__dict__["_moe_attrib_taps"].pop()
        if not scope.__dict__["_moe_attrib_taps"]:
            del scope.__dict__["_moe_attrib_taps"]
        tap.__exit__(None, None, None)
        missed = [t.name for t in targets if t.name not in tap.hit]
        if missed:
            raise LayoutError(
                f"{missed}: weight not used through F.linear or a matmul during {type(scope).__name__}.forward, "
                "so moe-attrib cannot attribute it. Exclude it with a module filter or add an adapter in "
                "moe_attrib/families.py."
            )

    # -- helpers ----------------------------------------------------------------------------
    @property
    def _projecting(self) -> bool:
        return bool(self.projection_dim) or self.projector is not None

    def _projection(self, name: str, side: str, features: int, like: torch.Tensor, batch: int | None = None):
        if self.projector is not None:
            return self.projector(name, side, features, like, batch)
        if self._proj is None or self._proj.device != like.device or self._proj.dtype != like.dtype:
            self._proj = Projections(self.projection_dim, self.seed, like.device, like.dtype)
        return self._proj.get(name, side, features, batch)

    def _per_example(self, rows: torch.Tensor) -> torch.Tensor:
        n = self._batch.n
        if rows.shape[0] % n:
            raise RuntimeError(
                f"{rows.shape[0]} rows cannot be split into {n} examples; packed or reshaped batches are "
                "not supported by this target."
            )
        return rows.view(n, rows.shape[0] // n, *rows.shape[1:])

    def _add(self, key: str, value: torch.Tensor) -> None:
        if key in self._results:
            self._results[key] = self._results[key] + value
        else:
            self._results[key] = value

    # -- dense targets ----------------------------------------------------------------------
    def _dense(
        self, target: Target, x: torch.Tensor, y: torch.Tensor, transposed: bool, out_transposed: bool = False
    ) -> None:
        if not isinstance(y, torch.Tensor) or not y.requires_grad:
            return
        name = target.name
        x = self._per_example(x.detach().reshape(-1, x.shape[-1]))
        x = matmul_fp32(x, self._projection(name, "in", x.shape[-1], x)) if self._projecting else x.float()
        capture = _Capture(name, x, transposed, target.module._parameters.get("bias") is not None)
        self._captures.append(capture)

        def backward(g: torch.Tensor) -> None:
            if out_transposed:
                g = g.transpose(-1, -2)
            g = self._per_example(g.reshape(-1, g.shape[-1]))
            capture.g = matmul_fp32(g, self._projection(name, "out", g.shape[-1], g)) if self._projecting else g.float()

        y.register_hook(backward)

    def _grouped(self, target: Target, x: torch.Tensor, y: torch.Tensor) -> None:
        if not y.requires_grad:
            return
        name, groups = target.name, grouped_linear_groups(target.module)
        x = self._per_example(x.detach().reshape(-1, groups, x.shape[-1]))
        out = target.module.weight.shape[0]
        if self._projecting:
            x = (x @ self._projection(name, "in", x.shape[-1], x)).float()
        else:
            x = x.float()

        def backward(g: torch.Tensor) -> None:
            g = self._per_example(g.reshape(-1, groups, g.shape[-1]))
            if self._projecting:
                p_out = self._projection(name, "out", out, g).view(groups, out // groups, -1)
                g = torch.einsum("nsgo,gop->nsgp", g, p_out).float()
                eq = "nsgp,nsgq->nspq" if self._tokens else "nsgp,nsgq->npq"
                self._add(f"{name}.weight", torch.einsum(eq, g, x))
            else:
                eq = "nsgo,nsgi->nsgoi" if self._tokens else "nsgo,nsgi->ngoi"
                w = torch.einsum(eq, g.float(), x)
                self._add(f"{name}.weight", w.reshape(*w.shape[: 2 if self._tokens else 1], out, -1))

        y.register_hook(backward)

    # -- experts ----------------------------------------------------------------------------
    def _experts_forward(self, layout: ExpertsLayout):
        grouped = collection_forward(layout, self._experts_sink)
        original = type(layout.module).forward

        def forward(*args, **kwargs):
            if not layout.decorated and id(layout.module) not in self._verified:
                self._verify(layout, original, args, kwargs)
            return grouped(*args, **kwargs)

        return forward

    def _verify(self, layout: ExpertsLayout, original, args, kwargs) -> None:
        """Check an undecorated family's grouped forward against the module's own, once."""
        with torch.no_grad():
            ref = original(layout.module, *args, **kwargs)
            got = collection_forward(layout, lambda *a: None)(*args, **kwargs)
        err = (got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        tol = 1e-4 if ref.dtype == torch.float32 else 2e-2
        if not torch.isfinite(err) or err > tol:
            raise LayoutError(
                f"{layout.name} ({type(layout.module).__name__}): moe-attrib's grouped forward for the "
                f"'{layout.family}' layout differs from the module's own forward (relative error {err:.2e}). "
                "Its layout is not the one assumed; add an adapter in moe_attrib/families.py."
            )
        self._verified.add(id(layout.module))

    def _routing_grid(self, layout: ExpertsLayout, rows: RoutedRows) -> dict:
        """Where each routed row goes in the `[E * N, L, .]` grid (computed once per experts call).

        Rows are sorted expert-major then by token, so the rows of one (expert, example) pair
        are contiguous; a row's slot is its rank inside that run. `L` is the example length, a
        bound whenever a token picks an expert at most once, so no device sync is needed; a
        routing that repeats an expert for one token is detected and the batch redone with
        exact lengths.
        """
        cache = getattr(rows, "_grid", None)
        if cache is not None:
            return cache
        batch = self._batch
        n, e = batch.n, layout.num_experts
        if rows.num_tokens % n:
            raise RuntimeError(f"{layout.name}: {rows.num_tokens} tokens cannot be split into {n} examples.")
        per_example = rows.num_tokens // n
        seg = rows.expert * n + rows.token // per_example
        trash = layout.family == "zero_experts"
        if trash:
            valid = rows.expert < e
            seg = torch.where(valid, seg, e * n)
        pos = torch.arange(seg.numel(), device=seg.device) - torch.searchsorted(seg, seg)
        if self._exact_lengths:
            length = max(int(pos.max()) + 1 if pos.numel() else 1, 1)
        else:
            length = per_example
            self._overflow.append(pos.max() - (length - 1) if pos.numel() else pos.new_zeros(()))
        flat = seg * length + pos
        if trash:
            flat = torch.where(valid, flat, -1)
        real = batch.mask[rows.token] if batch.mask is not None and rows.num_tokens == batch.mask.numel() else None
        if real is None:
            real = torch.ones(seg.shape, device=seg.device)
        if trash:
            real = real * valid
        routed = torch.zeros(e * n + 1, device=seg.device).index_add_(0, seg, real)[:-1]
        self._counts[layout.name] = routed.view(e, n).t()
        cache = {"flat": flat, "length": length, "segments": e * n, "trash": trash, "rows": rows}
        rows._grid = cache
        return cache

    def _experts_sink(
        self, layout: ExpertsLayout, proj: str, x: torch.Tensor, y: torch.Tensor, rows: RoutedRows
    ) -> None:
        if not y.requires_grad:
            return
        grid = self._routing_grid(layout, rows)
        e = layout.num_experts
        offsets = rows.offsets[:e]
        pname = f"{layout.name}.{proj}"
        in_features, out_features = layout.features(proj)
        x = x.detach()
        if self._projecting:
            x = grouped_matmul(x, self._projection(pname, "in", in_features, x, batch=e), offsets, fp32_out=True)
        capture = _Capture(pname, x.float(), layout.transposed, layout.bias(proj) is not None, grid=grid, layout=layout)
        self._captures.append(capture)

        def backward(g: torch.Tensor) -> None:
            if self._projecting:
                g = grouped_matmul(g, self._projection(pname, "out", out_features, g, batch=e), offsets, fp32_out=True)
            capture.g = g.float()

        y.register_hook(backward)

    # -- forming per-example gradients ------------------------------------------------------
    def _form_tokens(self) -> None:
        """Per-token rows: token t's share `outer(dy_t, x_t)` of every target, summing to the example's."""
        n, s = self._batch.n, self._batch.seq_len
        for c in self._captures:
            if c.g is None:
                continue
            if c.grid is None:
                left, right = (c.x, c.g) if c.transposed else (c.g, c.x)
                self._add(f"{c.name}.weight", torch.einsum("nsa,nsb->nsab", left, right))
                if c.has_bias:
                    self._add(f"{c.name}.bias", c.g)
                continue
            rows, lay = c.grid["rows"], c.layout
            left, right = (c.x, c.g) if c.transposed else (c.g, c.x)
            outer = torch.einsum("ra,rb->rab", left, right)
            valid = rows.expert < lay.num_experts  # zero-compute expert rows hold no gradient
            outer = torch.where(valid.view(-1, 1, 1), outer, 0.0)
            bias = torch.where(valid.view(-1, 1), c.g, 0.0) if c.has_bias else None
            per_token = rows.num_tokens // n
            if per_token != s:
                raise RuntimeError(f"{lay.name}: per-token attribution needs one row per token position.")
            if self.expert_blocks == "sum":
                slot = rows.slot
                for key, val in (("weight", outer), ("bias", bias)):
                    if val is None:
                        continue
                    full = val.new_zeros(rows.num_tokens * rows.slots, *val.shape[1:]).index_copy_(0, slot, val)
                    self._add(f"{c.name}.{key}", full.view(n, s, rows.slots, *val.shape[1:]).sum(dim=2))
            else:
                e = lay.num_experts
                place = rows.token * e + rows.expert.clamp(max=e - 1)
                for key, val in (("weight", outer), ("bias", bias)):
                    if val is None:
                        continue
                    full = val.new_zeros(rows.num_tokens * e, *val.shape[1:]).index_add_(0, place, val)
                    self._add(f"{c.name}.{key}", full.view(n, s, e, *val.shape[1:]))
        self._captures = []

    def _form(self) -> None:
        """Turn the captured rows into per-example gradients, one batched matmul per group.

        Captures whose rows have the same widths, layout orientation and grid shape are formed
        together: dense targets as `[T * N, S, .]` batches, experts by concatenating every
        layer's routed rows into one `[sum E * N, L, .]` grid.
        """
        groups: dict[tuple, list[_Capture]] = {}
        for c in self._captures:
            if c.g is None:
                continue
            kind = ("experts", c.grid["length"]) if c.grid is not None else ("dense", c.x.shape[1])
            groups.setdefault((*kind, c.transposed, c.x.shape[-1], c.g.shape[-1]), []).append(c)
        for key, caps in groups.items():
            if key[0] == "dense":
                self._form_dense(caps)
            else:
                self._form_experts(caps, key[1])
        self._captures = []

    def _form_dense(self, caps: list[_Capture]) -> None:
        x = torch.cat([c.x for c in caps]) if len(caps) > 1 else caps[0].x
        g = torch.cat([c.g for c in caps]) if len(caps) > 1 else caps[0].g
        left, right = (x, g) if caps[0].transposed else (g, x)
        w = torch.bmm(left.transpose(1, 2), right)
        bias = g.sum(dim=1) if any(c.has_bias for c in caps) else None
        n = self._batch.n
        for i, c in enumerate(caps):
            self._add(f"{c.name}.weight", w[i * n : (i + 1) * n])
            if c.has_bias:
                self._add(f"{c.name}.bias", bias[i * n : (i + 1) * n])

    def _form_experts(self, caps: list[_Capture], length: int) -> None:
        flats, base = [], 0
        total = sum(c.grid["segments"] for c in caps)
        trash = total * length
        for c in caps:
            flat = c.grid["flat"] + base * length
            if c.grid["trash"]:
                flat = torch.where(c.grid["flat"] < 0, trash, flat)
            flats.append(flat)
            base += c.grid["segments"]
        flat = torch.cat(flats) if len(flats) > 1 else flats[0]

        def grid(values: torch.Tensor) -> torch.Tensor:
            out = values.new_zeros(trash + 1, values.shape[-1])
            out.index_copy_(0, flat, values)
            return out[:-1].view(total, length, values.shape[-1])

        gx = grid(torch.cat([c.x for c in caps]) if len(caps) > 1 else caps[0].x)
        gy = grid(torch.cat([c.g for c in caps]) if len(caps) > 1 else caps[0].g)
        left, right = (gx, gy) if caps[0].transposed else (gy, gx)
        w = torch.bmm(left.transpose(1, 2), right)
        bias = gy.sum(dim=1) if any(c.has_bias for c in caps) else None
        n, start = self._batch.n, 0
        for c in caps:
            e, stop = c.layout.num_experts, start + c.grid["segments"]
            self._add(f"{c.name}.weight", w[start:stop].view(e, n, *w.shape[1:]).transpose(0, 1))
            if c.has_bias:
                self._add(f"{c.name}.bias", bias[start:stop].view(e, n, -1).transpose(0, 1))
            start = stop

    # -- one batch --------------------------------------------------------------------------
    def collect(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        fused_experts: bool = False,
        per_token: bool = False,
        expert_blocks: str = "separate",
        sample_labels: bool = False,
    ) -> PerExampleGradients:
        """Forward + activation backward on one batch; per-example gradients of every target.

        With `fused_experts=True` each experts projection comes as one `[N, E, ...]` block keyed
        `<experts>.<proj>.weight` (what the index stores) instead of one key per expert.
        With `per_token=True` (implies fused blocks) every tensor gains a token axis after N:
        token t's share `outer(dy_t, x_t)`, so the tokens of an example sum to its gradient; an
        experts block is `[N, S, E, ...]`, or `[N, S, ...]` summed over the experts the token was
        routed to with `expert_blocks="sum"`. `sample_labels=True` draws next tokens from the
        model's own predictions (the true Fisher's labels) instead of using the data's.
        """
        self.expert_blocks = expert_blocks
        self._tokens = input_ids.shape[1] if per_token else 0
        fused_experts = fused_experts or per_token
        n, s = input_ids.shape
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):  # one sync per batch, before the forward
            mask = attention_mask.reshape(-1).to(torch.float32)
        self._batch = _Batch(n, s, mask)
        self._results, self._counts, self._overflow, self._captures = {}, {}, [], []
        if labels is None:
            labels = default_labels(input_ids, attention_mask)
        try:
            with torch.enable_grad():
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                if sample_labels:
                    probs = torch.softmax(out.logits.detach().float(), dim=-1)
                    drawn = torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(n, s)
                    labels = torch.where(labels == -100, -100, torch.roll(drawn, 1, dims=1))
                losses = example_losses(out.logits, labels)
                del out
                losses.sum().backward()
            if self.row_sink is not None:
                self.row_sink(self._captures, self._batch)
            elif per_token:
                self._form_tokens()
            else:
                self._form()
        finally:
            self._batch = None
            self._captures = []
        if self._overflow and int(torch.stack(self._overflow).max()) > 0:
            self._exact_lengths = True  # a token picked one expert twice: redo with exact grid lengths
            return self.collect(
                input_ids, attention_mask, labels, fused_experts, per_token, expert_blocks, sample_labels
            )
        if self.row_sink is not None:
            result = PerExampleGradients()
            result.losses, result.expert_counts, result.expert_layers = losses.detach(), None, []
            return result
        return self._package(losses.detach(), n, fused_experts)

    def _package(self, losses: torch.Tensor, n: int, fused_experts: bool) -> PerExampleGradients:
        result = PerExampleGradients()
        missing = []
        for target in self.report.targets:
            if target.kind == "experts":
                lay = target.layout
                for proj in lay.projections:
                    keys = ["weight"] + (["bias"] if lay.bias(proj) is not None else [])
                    for key in keys:
                        fused = self._results.get(f"{lay.name}.{proj}.{key}")
                        if fused is None:
                            missing.append(f"{lay.name}.{proj}")
                            fused = self._zeros_like_expert(lay, proj, key, n, losses.device)
                        if fused_experts:
                            result[f"{lay.name}.{proj}.{key}"] = fused
                            continue
                        for i in range(lay.num_experts):
                            result[f"{lay.expert_name(i, proj)}.{key}"] = fused[:, i]
                continue
            for key in ("weight", "bias"):
                param = target.module._parameters.get(key)
                if param is None:
                    continue
                value = self._results.get(f"{target.name}.{key}")
                if value is None:
                    missing.append(target.name)
                    value = self._zeros(param.shape, key, n, losses.device)
                result[f"{target.name}.{key}"] = value
        if missing:
            warnings.warn(
                f"moe-attrib: {len(set(missing))} tracked module(s) received no gradient in this batch "
                f"(zeros recorded), e.g. {sorted(set(missing))[:3]}: they are not on the loss path.",
                UserWarning,
                stacklevel=3,
            )
        result.losses = losses
        layers = [lay.name for lay in self.report.experts if lay.name in self._counts]
        width = max((self._counts[name].shape[1] for name in layers), default=0)
        counts = torch.zeros(n, len(layers), width, device=losses.device)
        for i, name in enumerate(layers):
            c = self._counts[name]
            counts[:, i, : c.shape[1]] = c
        result.expert_counts = counts
        result.expert_layers = layers
        return result

    def _zeros(self, shape, key: str, n: int, device) -> torch.Tensor:
        p = self.projection_dim
        if p:
            shape = (p, p) if key == "weight" else (p,)
        lead = (n, self._tokens) if self._tokens else (n,)
        return torch.zeros(*lead, *shape, device=device)

    def _zeros_like_expert(self, lay: ExpertsLayout, proj: str, key: str, n: int, device) -> torch.Tensor:
        shape = lay.param(proj).shape[1:] if key == "weight" else lay.bias(proj).shape[1:]
        zeros = self._zeros(shape, key, n, device)
        if self._tokens and self.expert_blocks == "sum":
            return zeros
        axis = 2 if self._tokens else 1
        return zeros.unsqueeze(axis).repeat_interleave(lay.num_experts, dim=axis)


def per_example_gradients(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    track_moe_experts: bool = True,
    projection_dim: int | None = None,
    seed: int = 0,
) -> PerExampleGradients:
    """Per-example gradients of every tracked module for one batch.

    Returns `{"<module>.weight" / ".bias": Tensor [N, *shape]}`: the module's weight shape
    (ExpertLinear: the fused slice as stored) when `projection_dim` is None, else
    `[N, projection_dim, projection_dim]` for weights and `[N, projection_dim]` for biases.
    Each example's loss is its summed token cross-entropy (labels = input_ids, padding
    ignored), so entry n equals autograd's gradient of example n's loss alone.
    """
    report = discover(model, track_moe_experts=track_moe_experts)
    with GradientCollector(model, report, projection_dim=projection_dim, seed=seed) as collector:
        return collector.collect(input_ids, attention_mask, labels)
