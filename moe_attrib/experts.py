"""Fused experts: layouts, per-expert views, the grouped forward and the routed-token grid.

transformers 5.x stores every expert of an MoE layer in fused 3D parameters
(`gate_up_proj` or `up_proj`, and `down_proj`, shaped `[E, ., .]`). This module reads the
layout off each experts module, exposes each expert's projection as an `ExpertLinear` view
(no copy, no new parameter), and provides the grouped forward used during collection: tokens
are sorted by expert once, each projection is one grouped matmul, and the routed rows are
handed to a sink (the collector) together with the routing needed to place them in the
per-expert `[N, L, .]` grid.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

FUSED_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
EXPANDED_ATTR = "_moe_attrib_expanded"


class LayoutError(ValueError):
    """An experts-like module whose parameter layout moe-attrib does not understand."""


@dataclass
class ExpertsLayout:
    """How one fused experts module stores and applies its experts.

    `family` selects the forward used during collection: "contract" for modules following
    transformers' `use_experts_implementation` contract (`forward(hidden, top_k_index,
    top_k_weights)`), "prerouted" for llama4-style modules fed expert-major rows, "zero_experts"
    for longcat-style modules whose extra expert ids are identity (zero-compute) experts.
    """

    name: str
    module: nn.Module
    num_experts: int
    projections: tuple[str, ...]
    has_gate: bool
    transposed: bool
    has_bias: bool
    family: str = "contract"
    decorated: bool = True
    unused_slots: dict[str, int] = field(default_factory=dict)

    def param(self, proj: str) -> nn.Parameter:
        return getattr(self.module, proj)

    def bias(self, proj: str) -> nn.Parameter | None:
        return getattr(self.module, f"{proj}_bias", None) if self.has_bias else None

    def features(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert's projection."""
        rows, cols = self.param(proj).shape[1:]
        return (rows, cols) if self.transposed else (cols, rows)

    def expert_name(self, index: int, proj: str) -> str:
        return f"{self.name}.expert_{index}.{proj}"

    def expert_names(self) -> list[str]:
        return [self.expert_name(i, p) for i in range(self.num_experts) for p in self.projections]


def _forward_arity(module: nn.Module) -> int:
    fn = getattr(type(module).forward, "__wrapped__", type(module).forward)
    params = list(inspect.signature(fn).parameters.values())[1:]
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _infer_transposed(name: str, up: torch.Tensor, down: torch.Tensor, gated: bool) -> bool:
    mult = 2 if gated else 1
    plain = down.shape[1] == up.shape[2] and up.shape[1] == mult * down.shape[2]
    transposed = down.shape[2] == up.shape[1] and up.shape[2] == mult * down.shape[1]
    if plain == transposed:
        raise LayoutError(
            f"{name}: cannot tell whether fused experts are stored [E, out, in] or transposed "
            f"[E, in, out] (up {tuple(up.shape)}, down {tuple(down.shape)}). Set `is_transposed` on "
            "the module (as transformers' @use_experts_implementation does) and retry."
        )
    return transposed


def experts_layout(name: str, module: nn.Module) -> ExpertsLayout | None:
    """Layout of `module` if it is a fused experts module, else None.

    Detection is structural: a module owning 3D parameters, or named like an experts module
    and owning parameters of its own. Anything experts-like that does not match a known layout
    raises `LayoutError` naming the module, so no expert is ever skipped silently.
    """
    if isinstance(module, nn.modules.conv._ConvNd):
        return None
    own = dict(module.named_parameters(recurse=False))
    fused = {n: p for n, p in own.items() if p.dim() == 3}
    expertish = "expert" in type(module).__name__.lower()
    if not fused and not (expertish and own):
        return None
    gated = "gate_up_proj" in fused
    up_name = "gate_up_proj" if gated else "up_proj"
    if up_name not in fused or "down_proj" not in fused:
        raise LayoutError(
            f"{name} ({type(module).__name__}) looks like a fused experts module (parameters "
            f"{ {n: tuple(p.shape) for n, p in own.items()} }) but has no `gate_up_proj`/`up_proj` + "
            "`down_proj` pair of [E, ., .] parameters. moe-attrib cannot attribute its experts; "
            "add an adapter in moe_attrib/families.py or exclude it with a module filter."
        )
    up, down = fused[up_name], fused["down_proj"]
    has_bias = f"{up_name}_bias" in own or "down_proj_bias" in own
    decorated = all(hasattr(module, a) for a in ("has_gate", "is_transposed", "has_bias"))
    if decorated:
        transposed = bool(module.is_transposed)
        if bool(module.has_gate) != gated or bool(module.has_bias) != has_bias:
            raise LayoutError(
                f"{name}: declared has_gate={module.has_gate}, has_bias={module.has_bias} but owns "
                f"{sorted(own)}; the module does not follow the experts contract."
            )
    else:
        transposed = _infer_transposed(name, up, down, gated)
    extra = sorted(set(own) - {up_name, "down_proj", f"{up_name}_bias", "down_proj_bias"})
    if extra:
        raise LayoutError(f"{name}: fused experts module owns unexpected parameters {extra}.")

    from moe_attrib.families import undecorated_family

    family = "contract" if decorated else undecorated_family(name, module, _forward_arity(module))
    num_experts = down.shape[0]
    unused = {}
    if up.shape[0] != num_experts:
        if family != "zero_experts" or up.shape[0] < num_experts:
            raise LayoutError(f"{name}: {up_name} has {up.shape[0]} experts but down_proj has {num_experts}.")
        unused[up_name] = up.shape[0] - num_experts
    return ExpertsLayout(
        name=name,
        module=module,
        num_experts=num_experts,
        projections=(up_name, "down_proj"),
        has_gate=gated,
        transposed=transposed,
        has_bias=has_bias,
        family=family,
        decorated=decorated,
        unused_slots=unused,
    )


def find_experts(model: nn.Module) -> list[ExpertsLayout]:
    """Every fused experts module of `model`, in module order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (ExpertLinear, _ExpertSlot)):
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


class _ExpertSlot(nn.Module):
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
            slot = _ExpertSlot()
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


# ---------------------------------------------------------------------------------------------
# Grouped forward used during collection


@dataclass
class RoutedRows:
    """Rows of one experts call, sorted expert-major then by token.

    `expert[r]`, `token[r]`: expert and flat token of row r; `offsets`: cumulative rows per
    expert (int32, as grouped_mm takes them); `num_tokens`: tokens in the call; `slot[r]`: the
    row's position in the unsorted `[tokens * slots]` order; `slots`: routing slots per token.
    """

    expert: torch.Tensor
    token: torch.Tensor
    offsets: torch.Tensor
    num_tokens: int
    num_experts: int
    slot: torch.Tensor | None = None
    slots: int = 1


def _aligned(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(
            (s * size) % 16 for s, d in zip(t.stride(), t.shape, strict=True) if d > 1 and s != 1
        ):
            return False
    return True


_GROUPED_MM_BROKEN: set[tuple[str, torch.dtype]] = set()
_GROUPED_MM_FP32_BROKEN: set[tuple[str, torch.dtype]] = set()


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
    """`x[rows of expert e] @ w[e]` for all experts in one call (`w`: `[E, in, out]`).

    Uses `torch.nn.functional.grouped_mm` where the device, dtype and strides allow it, else
    transformers' grouped_mm fallback (one mm per expert, the same numerics as its eager path).
    `fp32_out=True` returns float32 (accumulated in fp32, written once) for low-precision inputs.
    """
    w = w.to(x.dtype)
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_MM_BROKEN and hasattr(nn.functional, "grouped_mm") and _aligned(x, w):
        if fp32_out and x.is_cuda and x.dtype != torch.float32 and key not in _GROUPED_MM_FP32_BROKEN:
            try:
                return nn.functional.grouped_mm(x, w, offs=offsets, out_dtype=torch.float32)
            except (RuntimeError, NotImplementedError, TypeError):
                _GROUPED_MM_FP32_BROKEN.add(key)  # fp32 output unsupported here: convert after instead
        try:
            out = nn.functional.grouped_mm(x, w, offs=offsets)
            return out.float() if fp32_out else out
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_BROKEN.add(key)
    import transformers.integrations.moe  # noqa: F401  (registers the fallback op)

    out = torch.ops.transformers.grouped_mm_fallback(x, w, offs=offsets)
    return out.float() if fp32_out else out


_MM_FP32_BROKEN: set[torch.dtype] = set()


def matmul_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`(x @ w)` as float32; on CUDA with bf16/fp16 inputs one GEMM writes fp32 directly."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dtype not in _MM_FP32_BROKEN:
        try:
            flat = torch.mm(x.reshape(-1, x.shape[-1]), w, out_dtype=torch.float32)
            return flat.view(*x.shape[:-1], w.shape[-1])
        except (RuntimeError, TypeError):
            _MM_FP32_BROKEN.add(x.dtype)
    return (x @ w).float()


def _linear_rows(layout: ExpertsLayout, proj: str, x: torch.Tensor, rows: RoutedRows, used: int) -> torch.Tensor:
    weight = layout.param(proj)[:used]
    w = weight if layout.transposed else weight.transpose(-1, -2)
    out = grouped_matmul(x, w, rows.offsets[:used])
    bias = layout.bias(proj)
    if bias is not None:
        out = out + bias[rows.expert.clamp(max=used - 1)].to(out.dtype)
    return out


def _apply_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    if hasattr(module, "_apply_gate"):
        return module._apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


RowSink = Callable[[ExpertsLayout, str, torch.Tensor, torch.Tensor, RoutedRows], None]


def route_rows(top_k_index: torch.Tensor, num_tokens: int, num_experts: int) -> tuple[RoutedRows, torch.Tensor]:
    """Sort (token, slot) pairs expert-major then token-major; returns rows and the slot permutation."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).long()
    token = torch.arange(num_tokens * k, device=flat.device) // k
    key, perm = torch.sort(flat * num_tokens + token)
    expert = key // num_tokens
    # searchsorted on the sorted keys, not bincount: bincount's output size needs a device sync
    bounds = torch.arange(1, num_experts + 1, device=flat.device) * num_tokens
    offsets = torch.searchsorted(key, bounds, out_int32=True)
    return RoutedRows(expert, key % num_tokens, offsets, num_tokens, num_experts, perm, k), perm


def grouped_experts_forward(
    layout: ExpertsLayout,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    sink: RowSink,
) -> torch.Tensor:
    """The experts contract's forward, one grouped matmul per projection, rows sent to `sink`."""
    module = layout.module
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    num_tokens, k = x.shape[0], top_k_index.shape[-1]
    total = layout.num_experts + (1 if layout.family == "zero_experts" else 0)
    index = top_k_index.reshape(num_tokens, k)
    if layout.family == "zero_experts":
        index = index.clamp(max=layout.num_experts)
    rows, perm = route_rows(index, num_tokens, total)
    xs = x[rows.token]
    used = layout.num_experts
    up_name, down_name = layout.projections
    identity = (rows.expert >= used).unsqueeze(-1) if layout.family == "zero_experts" else None
    # grouped_mm leaves rows past the last offset unwritten, in the forward and in d_input:
    # zero-expert rows are masked on the way in (so their input gradient is zero) and out.
    routed_in = xs if identity is None else xs.masked_fill(identity, 0.0)
    h = _linear_rows(layout, up_name, routed_in, rows, used)
    sink(layout, up_name, routed_in, h, rows)
    if identity is not None:
        h = h.masked_fill(identity, 0.0)
    h = _apply_gate(module, h) if layout.has_gate else module.act_fn(h)
    out = _linear_rows(layout, down_name, h, rows, used)
    sink(layout, down_name, h, out, rows)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    if identity is not None:
        out = torch.where(identity, xs.to(out.dtype), out.masked_fill(identity, 0.0))
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    final = out[inverse].view(num_tokens, k, -1).sum(dim=1)
    return final.to(hidden_states.dtype).reshape(*shape[:-1], final.shape[-1])


def prerouted_experts_forward(layout: ExpertsLayout, hidden_states: torch.Tensor, sink: RowSink) -> torch.Tensor:
    """llama4-style experts: input rows arrive expert-major (`[E * T, H]`), pre-scaled by the router."""
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


def collection_forward(layout: ExpertsLayout, sink: RowSink) -> Callable[..., torch.Tensor]:
    """A forward for `layout.module` that computes the same outputs and feeds `sink`."""
    if layout.family == "prerouted":

        def forward(hidden_states, *args, **kwargs):
            return prerouted_experts_forward(layout, hidden_states, sink)

    else:

        def forward(hidden_states, *args, **kwargs):
            index = args[0] if len(args) > 0 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            weights = args[1] if len(args) > 1 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
            if index is None or weights is None:
                raise TypeError(
                    f"{layout.name}: expected forward(hidden_states, top_k_index, top_k_weights), "
                    f"got {len(args)} positional and keywords {sorted(kwargs)}"
                )
            return grouped_experts_forward(layout, hidden_states, index, weights, sink)

    return forward
