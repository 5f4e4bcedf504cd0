"""llama4-style experts: `forward(hidden)` receives expert-major rows `[E * T, H]`, pre-scaled by the router."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_attrib.model.layouts.base import ExpertsLayout, LayoutFamily, RoutedRows, RowSink, register_layout
from moe_attrib.model.layouts.kernels import Kernels


def prerouted_experts_forward(layout: ExpertsLayout, hidden_states: torch.Tensor, sink: RowSink) -> torch.Tensor:
    """Every expert on every token: two batched matmuls, rows sent to `sink` in the routed-row format."""
    module = layout.module
    num_experts = layout.num_experts
    x = hidden_states.reshape(num_experts, -1, hidden_states.shape[-1])
    num_tokens = x.shape[1]
    device = x.device
    expert = torch.arange(num_experts, device=device).repeat_interleave(num_tokens)
    token = torch.arange(num_tokens, device=device).repeat(num_experts)
    offsets = torch.arange(1, num_experts + 1, device=device, dtype=torch.int32) * num_tokens
    slot = token * num_experts + expert
    rows = RoutedRows(expert, token, offsets, num_tokens, num_experts, slot, num_experts)
    up_name, down_name = layout.projections
    up_w, down_w = layout.param(up_name), layout.param(down_name)
    if not layout.transposed:
        up_w, down_w = up_w.transpose(-1, -2), down_w.transpose(-1, -2)
    h = torch.bmm(x, up_w).view(-1, up_w.shape[-1])
    sink(layout, up_name, x.reshape(-1, x.shape[-1]), h, rows)
    gate, up = h.view(num_experts, num_tokens, -1).chunk(2, dim=-1)
    h = up * module.act_fn(gate)
    out = torch.bmm(h, down_w).view(-1, down_w.shape[-1])
    sink(layout, down_name, h.reshape(-1, h.shape[-1]), out, rows)
    return out


@register_layout
class PreroutedFamily(LayoutFamily):
    """Undecorated `forward(hidden)` with a `gate_up_proj` (llama4)."""

    name = "prerouted"
    priority = 10

    def matches(self, module: nn.Module, decorated: bool, forward_arity: int) -> bool:
        return not decorated and forward_arity == 1 and hasattr(module, "gate_up_proj")

    def collection_forward(self, layout: ExpertsLayout, kernels: Kernels, sink: RowSink) -> Callable:
        def forward(hidden_states, *args, **kwargs):
            return prerouted_experts_forward(layout, hidden_states, sink)

        return forward
