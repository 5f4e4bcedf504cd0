"""The experts-layout registry: what a fused experts module looks like, and how each family is detected.

transformers 5.x stores every expert of an MoE layer in fused 3D parameters (`gate_up_proj` or
`up_proj`, and `down_proj`, shaped `[E, ., .]`). `experts_layout` reads the structure off a
module (which projections, transposed or not, biases) and asks the registered families, in
priority order, which one applies; each family (one `@register_layout` class, in the style of
Opacus' grad-sampler registry) gives the collection forward for its modules. Anything
experts-like that no family matches raises `LayoutError` naming the module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from moe_attrib.model.layouts.errors import LayoutError
from moe_attrib.model.layouts.kernels import Kernels


@dataclass
class RoutedRows:
    """Rows of one experts call, sorted expert-major then by token.

    `expert[r]`, `token[r]`: expert and flat token of row r; `offsets`: cumulative rows per
    expert (int32, as grouped_mm takes them); `num_tokens`: tokens in the call; `slot[r]`: the
    row's position in the unsorted `[tokens * slots]` order; `slots`: routing slots per token.
    `cache`: per-call results a sink derives once and reuses for every projection of the call.
    """

    expert: torch.Tensor
    token: torch.Tensor
    offsets: torch.Tensor
    num_tokens: int
    num_experts: int
    slot: torch.Tensor | None = None
    slots: int = 1
    cache: dict = field(default_factory=dict)


@dataclass
class ExpertsLayout:
    """How one fused experts module stores and applies its experts.

    `family` names the registry entry whose collection forward runs the module (see
    `registered_families()`); `decorated` says the module declares its layout through
    transformers' `@use_experts_implementation`.
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

    def params(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """Every fused parameter: `(projection, "weight" | "bias", parameter)`, projection-major."""
        for proj in self.projections:
            yield proj, "weight", self.param(proj)
            bias = self.bias(proj)
            if bias is not None:
                yield proj, "bias", bias

    def features(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert's projection."""
        rows, cols = self.param(proj).shape[1:]
        return (rows, cols) if self.transposed else (cols, rows)

    def expert_name(self, index: int, proj: str) -> str:
        return f"{self.name}.expert_{index}.{proj}"

    def expert_names(self) -> list[str]:
        return [self.expert_name(i, p) for i in range(self.num_experts) for p in self.projections]

    def collection_forward(self, kernels: Kernels, sink: RowSink) -> Callable[..., torch.Tensor]:
        """A forward computing the module's outputs with grouped matmuls and feeding `sink` the routed rows."""
        return _REGISTRY[self.family].collection_forward(self, kernels, sink)


RowSink = Callable[[ExpertsLayout, str, torch.Tensor, torch.Tensor, RoutedRows], None]


def null_sink(layout: ExpertsLayout, proj: str, x: torch.Tensor, y: torch.Tensor, rows: RoutedRows) -> None:
    """A sink that records nothing (for checking a collection forward against the module's own)."""


class LayoutFamily:
    """One registry entry: which experts modules it runs (`matches`) and how (`collection_forward`).

    `forward_arity` counts the positional arguments of the module's (undecorated) forward.
    `allows_unused_slots`: the first projection may hold more experts than `down_proj` (slots
    never computed, e.g. longcat's identity experts).
    """

    name: str = ""
    priority: int = 0
    allows_unused_slots: bool = False

    def matches(self, module: nn.Module, decorated: bool, forward_arity: int) -> bool:
        raise NotImplementedError

    def collection_forward(self, layout: ExpertsLayout, kernels: Kernels, sink: RowSink) -> Callable:
        raise NotImplementedError


_REGISTRY: dict[str, LayoutFamily] = {}


def register_layout(cls: type[LayoutFamily]) -> type[LayoutFamily]:
    """Class decorator adding a family to the registry (higher `priority` is asked first)."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"layout family {cls.__name__} needs a unique `name`, got {cls.name!r}")
    _REGISTRY[cls.name] = cls()
    return cls


def registered_families() -> list[str]:
    return [f.name for f in sorted(_REGISTRY.values(), key=lambda f: -f.priority)]


def forward_arity(module: nn.Module) -> int:
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


def looks_like_experts(module: nn.Module) -> bool:
    """Structural test: owns 3D parameters, or is named like an experts module and owns parameters."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    own = dict(module.named_parameters(recurse=False))
    return any(p.dim() == 3 for p in own.values()) or ("expert" in type(module).__name__.lower() and bool(own))


def experts_layout(name: str, module: nn.Module) -> ExpertsLayout | None:
    """Layout of `module` if it is a fused experts module, else None.

    Anything experts-like that does not match a registered family raises `LayoutError`
    naming the module, so no expert is ever skipped silently.
    """
    if not looks_like_experts(module):
        return None
    own = dict(module.named_parameters(recurse=False))
    fused = {n: p for n, p in own.items() if p.dim() == 3}
    gated = "gate_up_proj" in fused
    up_name = "gate_up_proj" if gated else "up_proj"
    if up_name not in fused or "down_proj" not in fused:
        raise LayoutError(
            f"{name} ({type(module).__name__}) looks like a fused experts module (parameters "
            f"{ {n: tuple(p.shape) for n, p in own.items()} }) but has no `gate_up_proj`/`up_proj` + "
            "`down_proj` pair of [E, ., .] parameters. moe-attrib cannot attribute its experts: leave it out "
            "with --filter_modules (or attribute without --track_moe_experts), or register a layout family "
            "in moe_attrib/model/layouts/."
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
    arity = forward_arity(module)
    family = next(
        (f for f in sorted(_REGISTRY.values(), key=lambda f: -f.priority) if f.matches(module, decorated, arity)), None
    )
    if family is None:
        raise LayoutError(
            f"{name} ({type(module).__name__}) stores fused experts but neither declares its layout with "
            "@use_experts_implementation nor matches a registered family "
            f"({', '.join(registered_families())}). Register one in moe_attrib/model/layouts/, or leave the module out "
            "with --filter_modules."
        )
    num_experts = down.shape[0]
    unused = {}
    if up.shape[0] != num_experts:
        if not family.allows_unused_slots or up.shape[0] < num_experts:
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
        family=family.name,
        decorated=decorated,
        unused_slots=unused,
    )
