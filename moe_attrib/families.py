"""Adapters for experts and linear modules outside transformers' experts contract.

Most transformers 5.x MoE families decorate their experts class with
`use_experts_implementation`, which declares the layout. The rest are recognised here by
structure (forward signature and attributes), and anything unrecognised is an error.
"""

from __future__ import annotations

from torch import nn

from moe_attrib.experts import LayoutError


def undecorated_family(name: str, module: nn.Module, forward_arity: int) -> str:
    """Which collection forward fits an experts module that does not declare its layout.

    - "zero_experts": longcat_flash style; ids past the routed experts are identity experts.
    - "prerouted": llama4 style; `forward(hidden)` receives expert-major rows `[E * T, H]`.
    - "contract": `forward(hidden, top_k_index, top_k_weights)` with `_apply_gate` or a
      concatenated `[gate; up]` SwiGLU; checked numerically against the module's own forward
      on the first collected batch.
    """
    if hasattr(module, "zero_expert_num") or hasattr(module, "identity_expert"):
        return "zero_experts"
    if forward_arity == 1 and hasattr(module, "gate_up_proj"):
        return "prerouted"
    if forward_arity == 3 and (hasattr(module, "_apply_gate") or hasattr(module, "act_fn")):
        return "contract"
    raise LayoutError(
        f"{name} ({type(module).__name__}) stores fused experts but neither declares its layout with "
        "@use_experts_implementation nor matches a known family (forward(hidden, top_k_index, "
        "top_k_weights), llama4's pre-routed forward(hidden), longcat's zero experts). Add an "
        "adapter in moe_attrib/families.py."
    )


def grouped_linear_groups(module: nn.Module) -> int | None:
    """Number of groups of a block-diagonal grouped linear (deepseek_v4 `o_a_proj`), else None.

    Such a module is an `nn.Linear` whose weight `[out, in_per_group]` is applied group-wise:
    input `[..., G, in_per_group]`, output `[..., G, out / G]`.
    """
    groups = getattr(module, "n_groups", None)
    if isinstance(module, nn.Linear) and isinstance(groups, int) and type(module).forward is not nn.Linear.forward:
        return groups
    return None
