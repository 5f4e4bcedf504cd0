"""Families whose experts receive `(hidden, top_k_index, top_k_weights)`: transformers' experts contract
(decorated modules and undecorated look-alikes) and longcat's zero-compute (identity) experts.

The collection forward sorts tokens by expert once (`route_rows`), runs each projection as one
grouped matmul, and hands every projection's routed rows to the sink.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_attrib.model.layouts.base import ExpertsLayout, LayoutFamily, RoutedRows, RowSink, register_layout
from moe_attrib.model.layouts.kernels import Kernels


def route_rows(top_k_index: torch.Tensor, num_tokens: int, num_experts: int) -> tuple[RoutedRows, torch.Tensor]:
    """Sort (token, slot) pairs expert-major then token-major; returns rows and the slot permutation.

    One stable sort of the expert ids: ties keep the (token, slot) order, so the rows of an expert
    come token by token (what sorting `expert * tokens + token` gives, in six fewer ops per layer).
    """
    k = top_k_index.shape[-1]
    expert, perm = torch.sort(top_k_index.reshape(-1).long(), stable=True)
    # searchsorted on the sorted ids, not bincount: bincount's output size needs a device sync
    bounds = torch.arange(1, num_experts + 1, device=expert.device)
    offsets = torch.searchsorted(expert, bounds, out_int32=True)
    return RoutedRows(expert, perm // k, offsets, num_tokens, num_experts, perm, k), perm


class RoutedGather(torch.autograd.Function):
    """`x[token]`: each token's row once per routed slot (rows sorted by expert).

    The backward sums each token's k slot gradients through the inverse permutation (a gather and a
    sum): advanced indexing's backward is a sorting `index_put`, an atomic `index_add_` is slow in
    bf16 and not deterministic, and a recomputed forward (`moe_attrib.model.recompute`) must be bitwise the first.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.shape = (x.shape[0], k)
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        tokens, k = ctx.shape
        return grad.index_select(0, inverse).view(tokens, k, -1).sum(dim=1), None, None, None


class RoutedCombine(torch.autograd.Function):
    """Each token's routed rows weighted by its routing weights and summed: `sum_j w[t, j] rows[slot(t, j)]`.

    On CUDA one gather of the rows into slot order and one batched `[1, k] @ [k, H]` product per token,
    where a multiply, a gather and a sum each read the rows once more; the backward is two batched
    products and a gather back to expert order. On the CPU the products are a multiply and a sum
    over the k slots: the same per-token order whatever the batch (a CPU `bmm` sums in an order that
    depends on the number of tokens), as transformers' own forward. No atomics, so the forward is
    deterministic (recomputation relies on it). The adjoint of `RoutedGather`'s row placement.
    """

    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, perm: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = weights.shape
        dtype = rows.dtype if rows.dtype == weights.dtype else torch.promote_types(rows.dtype, weights.dtype)
        slots = rows.index_select(0, inverse).to(dtype).view(tokens, k, rows.shape[-1])
        w = weights.to(dtype)
        ctx.save_for_backward(slots, w, perm)
        ctx.dtypes = (rows.dtype, weights.dtype)
        if slots.is_cuda:
            return torch.bmm(w.unsqueeze(1), slots).squeeze(1)
        return (slots * w.unsqueeze(-1)).sum(dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slots, w, perm = ctx.saved_tensors
        rows_dtype, weights_dtype = ctx.dtypes
        grad = grad.to(slots.dtype)
        if slots.is_cuda:
            grad_weights = torch.bmm(slots, grad.unsqueeze(-1)).squeeze(-1)
        else:
            grad_weights = (slots * grad.unsqueeze(1)).sum(dim=-1)
        grad_weights = grad_weights.to(weights_dtype)
        grad_slots = (w.unsqueeze(-1) * grad.unsqueeze(1)).view(-1, slots.shape[-1])
        return grad_slots.index_select(0, perm).to(rows_dtype), grad_weights, None, None


def _linear_rows(
    kernels: Kernels, layout: ExpertsLayout, proj: str, x: torch.Tensor, rows: RoutedRows, used: int
) -> torch.Tensor:
    # a slice of the whole is one more op: slice only where it cuts
    weight = layout.param(proj)
    weight = weight if weight.shape[0] == used else weight[:used]
    offsets = rows.offsets if rows.offsets.shape[0] == used else rows.offsets[:used]
    w = weight if layout.transposed else weight.transpose(-1, -2)
    out = kernels.grouped_matmul(x, w, offsets)
    bias = layout.bias(proj)
    if bias is not None:
        out = out + bias[rows.expert.clamp(max=used - 1)].to(out.dtype)
    return out


class SiluGate(torch.autograd.Function):
    """`silu(gate) * up` of the concatenated `[rows, 2I]` gate_up rows, keeping only gate_up for the
    backward: eager autograd also keeps `silu(gate)` (`[rows, I]` more per layer). The same kernels in
    the same order (`silu`, `mul`, `silu_backward`), so the same bits, for one more `silu` in the backward."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


def _default_silu_gate(module: nn.Module) -> bool:
    """transformers' default gate (`act_fn(gate) * up` on chunked halves) with a SiLU activation."""
    gate = getattr(type(module), "_apply_gate", None)
    act = type(getattr(module, "act_fn", None)).__name__
    return (gate is None or gate.__name__ == "_default_apply_gate") and act in ("SiLUActivation", "SiLU")


def _apply_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    if _default_silu_gate(module):
        return SiluGate.apply(gate_up)
    if hasattr(module, "_apply_gate"):
        return module._apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def grouped_experts_forward(
    kernels: Kernels,
    layout: ExpertsLayout,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    sink: RowSink,
    zero_experts: bool = False,
) -> torch.Tensor:
    """The experts contract's forward, one grouped matmul per projection, rows sent to `sink`."""
    module = layout.module
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    num_tokens, k = x.shape[0], top_k_index.shape[-1]
    if top_k_weights.numel() != num_tokens * k:
        raise ValueError(
            f"{layout.name}: top_k_weights has {tuple(top_k_weights.shape)} entries for top_k_index "
            f"{tuple(top_k_index.shape)}; expected one weight per (token, slot)."
        )
    total = layout.num_experts + (1 if zero_experts else 0)
    index = top_k_index.reshape(num_tokens, k)
    if zero_experts:
        index = index.clamp(max=layout.num_experts)
    rows, perm = route_rows(index, num_tokens, total)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    xs = RoutedGather.apply(x, rows.token, inverse, k)
    used = layout.num_experts
    up_name, down_name = layout.projections
    identity = (rows.expert >= used).unsqueeze(-1) if zero_experts else None
    # grouped_mm leaves rows past the last offset unwritten, in the forward and in d_input:
    # zero-expert rows are masked on the way in (so their input gradient is zero) and out.
    routed_in = xs if identity is None else xs.masked_fill(identity, 0.0)
    h = _linear_rows(kernels, layout, up_name, routed_in, rows, used)
    sink(layout, up_name, routed_in, h, rows)
    if identity is not None:
        h = h.masked_fill(identity, 0.0)
    h = _apply_gate(module, h) if layout.has_gate else module.act_fn(h)
    out = _linear_rows(kernels, layout, down_name, h, rows, used)
    sink(layout, down_name, h, out, rows)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    if identity is not None:
        out = torch.where(identity, xs.to(out.dtype), out.masked_fill(identity, 0.0))
    final = RoutedCombine.apply(out, top_k_weights.reshape(num_tokens, k), inverse, perm)
    return final.to(hidden_states.dtype).reshape(*shape[:-1], final.shape[-1])


def _routed_call(layout: ExpertsLayout, kernels: Kernels, sink: RowSink, zero_experts: bool) -> Callable:
    def forward(hidden_states, *args, **kwargs):
        index = args[0] if len(args) > 0 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        weights = args[1] if len(args) > 1 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
        if index is None or weights is None:
            raise TypeError(
                f"{layout.name}: expected forward(hidden_states, top_k_index, top_k_weights), "
                f"got {len(args)} positional and keywords {sorted(kwargs)}"
            )
        return grouped_experts_forward(kernels, layout, hidden_states, index, weights, sink, zero_experts)

    return forward


@register_layout
class ContractFamily(LayoutFamily):
    """`forward(hidden, top_k_index, top_k_weights)` with `_apply_gate` or a concatenated `[gate; up]`
    SwiGLU: every `@use_experts_implementation` module, and undecorated modules of that shape."""

    name = "contract"
    priority = 0

    def matches(self, module: nn.Module, decorated: bool, forward_arity: int) -> bool:
        return decorated or (forward_arity == 3 and (hasattr(module, "_apply_gate") or hasattr(module, "act_fn")))

    def collection_forward(self, layout: ExpertsLayout, kernels: Kernels, sink: RowSink) -> Callable:
        return _routed_call(layout, kernels, sink, zero_experts=False)


@register_layout
class ZeroExpertsFamily(LayoutFamily):
    """longcat_flash style: ids past the routed experts are identity (zero-compute) experts."""

    name = "zero_experts"
    priority = 20
    allows_unused_slots = True

    def matches(self, module: nn.Module, decorated: bool, forward_arity: int) -> bool:
        return hasattr(module, "zero_expert_num") or hasattr(module, "identity_expert")

    def collection_forward(self, layout: ExpertsLayout, kernels: Kernels, sink: RowSink) -> Callable:
        return _routed_call(layout, kernels, sink, zero_experts=True)
