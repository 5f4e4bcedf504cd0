"""Per-expert views of fused experts: `ExpertLinear`, and the reversible `expand_moe` / `restore_moe`.

transformers 5.x stores every expert of an MoE layer in fused 3D parameters. `expand_moe`
exposes each expert's projection as an `ExpertLinear` view (no copy, no new parameter) named
`<experts>.expert_<i>.<proj>`; `restore_moe` removes them exactly. Layout detection lives in
`moe_attrib.model.layouts` (re-exported here for convenience).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from moe_attrib.model.layouts import ExpertsLayout, LayoutError, experts_layout

__all__ = [
    "EXPANDED_ATTR",
    "ExpertLinear",
    "ExpertSlot",
    "ExpertsLayout",
    "LayoutError",
    "expand_moe",
    "experts_layout",
    "find_experts",
    "is_expanded",
    "restore_moe",
    "track_moe_experts",
]

EXPANDED_ATTR = "_moe_attrib_expanded"


def find_experts(model: nn.Module) -> list[ExpertsLayout]:
    """Every fused experts module of `model`, in module order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (ExpertLinear, ExpertSlot)):
            continue
        layout = experts_layout(name, module)
        if layout is not None:
            found.append(layout)
    return found


class ExpertLinear(nn.Module):
    """One expert's projection as a linear module whose weight is a view of the fused parameter.

    Owns no parameter (so `state_dict()` is unchanged); `weight` and `bias` are views of
    `fused[index]`, shaped as stored (`[in, out]` for transposed layouts).
    """

    def __init__(self, owner: nn.Module, proj: str, index: int, transposed: bool, has_bias: bool):
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        self.proj = proj
        self.index = index
        self.transposed = transposed
        self.has_bias = has_bias
        rows, cols = getattr(owner, proj).shape[1:]
        self.in_features, self.out_features = (rows, cols) if transposed else (cols, rows)

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self._owner, self.proj)[self.index]

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self._owner, f"{self.proj}_bias")[self.index] if self.has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        return nn.functional.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        t = ", transposed" if self.transposed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}{t}"


class ExpertSlot(nn.Module):
    """Container `expert_<i>` holding one expert's ExpertLinear views."""


def expand_moe(model: nn.Module) -> list[str]:
    """Attach `ExpertLinear` views (`<experts>.expert_<i>.<proj>`) to every fused experts module.

    Returns the names of the views. Nothing is copied and no parameter is added, so outputs and
    `state_dict()` are unchanged. Expanding an expanded model is a no-op returning the same names.
    """
    existing = getattr(model, EXPANDED_ATTR, None)
    if existing is not None:
        return list(existing["names"])
    added: list[tuple[nn.Module, str]] = []
    names: list[str] = []
    for layout in find_experts(model):
        for i in range(layout.num_experts):
            slot = ExpertSlot()
            for proj in layout.projections:
                slot.add_module(proj, ExpertLinear(layout.module, proj, i, layout.transposed, layout.has_bias))
                names.append(layout.expert_name(i, proj))
            child = f"expert_{i}"
            if child in layout.module._modules:
                raise LayoutError(f"{layout.name} already has a child named {child!r}; cannot expand it.")
            layout.module.add_module(child, slot)
            added.append((layout.module, child))
    object.__setattr__(model, EXPANDED_ATTR, {"added": added, "names": names})
    return names


def restore_moe(model: nn.Module) -> list[str]:
    """Remove every view `expand_moe` attached; exact undo. A no-op (returns []) if not expanded."""
    state = getattr(model, EXPANDED_ATTR, None)
    if state is None:
        return []
    for module, child in state["added"]:
        del module._modules[child]
    object.__delattr__(model, EXPANDED_ATTR)
    return list(state["names"])


def is_expanded(model: nn.Module) -> bool:
    return getattr(model, EXPANDED_ATTR, None) is not None


@contextlib.contextmanager
def track_moe_experts(model: nn.Module) -> Iterator[list[str]]:
    """Expand on enter, restore on exit (also on error). Leaves an already expanded model expanded."""
    was_expanded = is_expanded(model)
    names = expand_moe(model)
    try:
        yield names
    finally:
        if not was_expanded:
            restore_moe(model)
