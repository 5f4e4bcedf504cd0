"""Find what can be attributed in a model and report what cannot, parameter by parameter.

Targets are `nn.Linear` (and subclasses), HF `Conv1D`, routers whose logits come from a bare
2D parameter, deepseek_v4-style grouped linears, and fused experts (one target per experts
module, attributed per expert). Every trainable parameter that is not covered gets a reason;
nothing is skipped silently.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from moe_attrib.model.experts import ExpertLinear, ExpertSlot
from moe_attrib.model.layouts import ExpertsLayout, LayoutError, experts_layout

EMBEDDING_REASON = "embedding table (excluded by design: its per-example gradient is a sparse row gather)"
TRACK_FLAG = "--track_moe_experts"


@dataclass
class Target:
    """One attributed module. `kind`: linear, conv1d, grouped_linear, router or experts."""

    name: str
    module: nn.Module
    kind: str
    transposed: bool = False
    layout: ExpertsLayout | None = None
    scope: nn.Module | None = None  # tapped inside its own forward (custom forward, router); None: hooked

    @property
    def tracked_names(self) -> list[str]:
        return self.layout.expert_names() if self.layout is not None else [self.name]

    def entries(self) -> Iterator[Entry]:
        """Every attributed parameter of the target, in plan order (weight before bias, projection-major)."""
        if self.layout is not None:
            for proj, key, param in self.layout.params():
                yield Entry(f"{self.layout.name}.{proj}.{key}", self, f"{self.layout.name}.{proj}", key, param, proj)
            return
        for key in ("weight", "bias"):
            param = self.module._parameters.get(key)
            if param is not None:
                yield Entry(f"{self.name}.{key}", self, self.name, key, param)


@dataclass
class Entry:
    """One attributed parameter. `key`: its key in a fused `collect` result (`<block>.weight|bias`);
    `block`: the target or experts projection (`<experts>.<proj>`) it belongs to; `proj`: the experts
    projection, None for other targets."""

    key: str
    target: Target
    block: str
    kind: str  # "weight" | "bias"
    param: nn.Parameter
    proj: str | None = None

    @property
    def layout(self) -> ExpertsLayout | None:
        return self.target.layout


def iter_entries(targets: Iterable[Target]) -> Iterator[Entry]:
    """The one walk over attributed parameters that every consumer (formation, index, EK-FAC, normalizers) uses."""
    for t in targets:
        yield from t.entries()


def grouped_linear_groups(module: nn.Module) -> int | None:
    """Number of groups of a block-diagonal grouped linear (deepseek_v4 `o_a_proj`), else None.

    Such a module is an `nn.Linear` whose weight `[out, in_per_group]` is applied group-wise:
    input `[..., G, in_per_group]`, output `[..., G, out / G]`.
    """
    groups = getattr(module, "n_groups", None)
    if isinstance(module, nn.Linear) and isinstance(groups, int) and type(module).forward is not nn.Linear.forward:
        return groups
    return None


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


_ROUTER_HINTS = ("top_k", "num_experts", "n_routed_experts", "num_local_experts")


def _routerish(module: nn.Module) -> bool:
    return any(hasattr(module, h) for h in _ROUTER_HINTS) or "router" in type(module).__name__.lower()


def _named_like_router(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "router" in name or name.endswith("gate")


def _is_router(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2 and _routerish(module)


def _reason(module: nn.Module, pname: str, param: torch.Tensor) -> str:
    cls = type(module).__name__
    if isinstance(module, nn.Embedding):
        return EMBEDDING_REASON
    if param.dim() <= 1 and ("norm" in cls.lower() or "norm" in pname.lower()):
        return f"normalization weight of {cls} (not a linear map)"
    if isinstance(module, nn.modules.conv._ConvNd):
        return f"{cls} convolution (per-example convolution gradients are not supported)"
    return f"bare {param.dim()}D parameter used inside {cls}.forward (not a linear map moe-attrib can attribute)"


@dataclass
class CoverageReport:
    """What will be attributed. `coverage` excludes embedding tables and never-used expert slots.

    `skipped` maps every trainable parameter that is not attributed (and not excluded by
    design) to the reason; `excluded` lists those left out by design; `partial` lists fused
    parameters of which only some expert slots are attributed.
    """

    tracked: list[str]
    skipped: dict[str, str]
    excluded: dict[str, str]
    targets: list[Target]
    experts: list[ExpertsLayout]
    total_params: int
    tracked_params: int
    excluded_params: int
    param_sizes: dict[str, int] = field(default_factory=dict)
    track_moe_experts: bool = True
    unsupported: dict[str, str] = field(default_factory=dict)  # experts-like module -> why it cannot be read
    output_layer: str | None = None  # the target that is the model's output layer (`get_output_embeddings`)

    @property
    def coverage(self) -> float:
        denom = self.total_params - self.excluded_params
        return self.tracked_params / denom if denom else 1.0

    @property
    def coverage_including_embeddings(self) -> float:
        return self.tracked_params / self.total_params if self.total_params else 1.0

    @property
    def routers(self) -> list[str]:
        return [t.name for t in self.targets if t.kind == "router"]

    @property
    def skipped_experts_params(self) -> int:
        if self.track_moe_experts:
            return 0
        return sum(int(lay.param(p).numel()) for lay in self.experts for p in _all_params(lay))

    def __str__(self) -> str:
        kinds: dict[str, int] = {}
        for t in self.targets:
            kinds[t.kind] = kinds.get(t.kind, 0) + (len(t.tracked_names))
        lines = [
            f"moe-attrib coverage: {self.coverage:.2%} of trainable parameters attributed "
            f"({self.tracked_params:,} / {self.total_params - self.excluded_params:,}; "
            f"embedding tables and never-used expert slots excluded by design, "
            f"{self.coverage_including_embeddings:.2%} counting them)",
            f"  tracked modules: {len(self.tracked):,}  ("
            + ", ".join(f"{k}: {v:,}" for k, v in sorted(kinds.items()))
            + ")",
            f"  fused experts modules: {len(self.experts)}"
            + ("" if self.track_moe_experts or not self.experts else f"  (SKIPPED: pass {TRACK_FLAG})"),
        ]
        rows = [(n, self.param_sizes.get(n, 0), r) for n, r in self.skipped.items()]
        rows += [(n, self.param_sizes.get(n, 0), "excluded: " + r) for n, r in self.excluded.items()]
        if rows:
            width = max(len(n) for n, _, _ in rows)
            lines.append(f"  {'not attributed':<{width}}  {'params':>12}  reason")
            for n, size, r in sorted(rows, key=lambda x: -x[1]):
                lines.append(f"  {n:<{width}}  {size:>12,}  {r}")
        return "\n".join(lines)


def _all_params(layout: ExpertsLayout) -> list[str]:
    names = list(layout.projections)
    if layout.has_bias:
        names += [f"{p}_bias" for p in layout.projections if hasattr(layout.module, f"{p}_bias")]
    return names


def _matches(names: list[str], pattern: str | None) -> bool:
    return pattern is None or any(fnmatch.fnmatchcase(n, pattern) for n in names)


def discover(
    model: nn.Module, track_moe_experts: bool = True, warn: bool = True, filter_modules: str | None = None
) -> CoverageReport:
    """Find every attributable module of `model` and account for every trainable parameter.

    With `track_moe_experts=False` on a model with fused experts, a `UserWarning` names the
    experts modules that will be skipped, the share of parameters lost, and the flag that
    tracks them. `filter_modules` (a glob, e.g. `*.mlp.*`) keeps only targets whose module name
    or one of whose per-expert names matches; the rest are reported as filtered out.

    An experts-like module whose layout no registered family reads raises `LayoutError` only when
    it would be attributed (tracking on and kept by the filter); otherwise it is reported as
    skipped and a `UserWarning` names it with the share of parameters lost.
    """
    owner: dict[int, tuple[str, nn.Module, str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, (ExpertLinear, ExpertSlot)):
            continue
        for pname, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (mname, module, pname))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sizes = {n: int(p.numel()) for n, p in params.items()}
    covered: dict[int, int] = {}  # param id -> elements attributed
    excluded: dict[str, str] = {}
    excluded_ids: dict[int, int] = {}
    targets: list[Target] = []
    experts: list[ExpertsLayout] = []

    unsupported: dict[str, str] = {}
    unsupported_ids: dict[int, str] = {}
    parents: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    for mname, module in model.named_modules():
        if isinstance(module, (ExpertLinear, ExpertSlot)):
            continue
        try:
            layout = experts_layout(mname, module)
        except LayoutError as err:
            own = [pn for pn, _ in module.named_parameters(recurse=False)]
            if track_moe_experts and _matches([mname] + [f"{mname}.{pn}" for pn in own], filter_modules):
                raise
            unsupported[mname] = str(err)
            for _, p in module.named_parameters(recurse=False):
                unsupported_ids[id(p)] = mname
            continue
        if layout is not None:
            experts.append(layout)
            if track_moe_experts:
                targets.append(Target(mname, module, "experts", layout.transposed, layout))
                for pn in _all_params(layout):
                    p = getattr(module, pn)
                    used = p.numel() // p.shape[0] * layout.num_experts
                    covered[id(p)] = used
                    if used < p.numel():
                        excluded_ids[id(p)] = p.numel() - used
            continue
        groups = grouped_linear_groups(module)
        if groups is not None:
            kind, transposed = "grouped_linear", False
        elif isinstance(module, nn.Linear):
            kind, transposed = ("router" if _routerish(module) else "linear"), False
        elif _is_conv1d(module):
            kind, transposed = "conv1d", True
        elif _is_router(module):
            kind, transposed = "router", False
        else:
            continue
        parent = parents.get(id(module))
        if kind == "linear" and parent is not None and _routerish(parent) and _named_like_router(parent):
            kind = "router"  # a router's scoring linear (e.g. longcat's `router.classifier`)
        scope = None
        if kind != "conv1d" and (kind == "router" or type(module).forward is not nn.Linear.forward):
            scope = module  # custom forward: tap the weight's use inside it
        targets.append(Target(mname, module, kind, transposed, scope=scope))
        for pn in ("weight", "bias"):
            p = module._parameters.get(pn)
            if p is not None:
                covered[id(p)] = p.numel()

    if filter_modules is not None:
        kept = [t for t in targets if any(fnmatch.fnmatchcase(n, filter_modules) for n in [t.name, *t.tracked_names])]
        dropped = {id(p) for t in targets if t not in kept for p in _target_params(t)}
        covered = {k: v for k, v in covered.items() if k not in dropped}
        targets = kept
        filtered_ids = dropped
    else:
        filtered_ids = set()

    skipped: dict[str, str] = {}
    tracked_params = excluded_params = 0
    for n, p in params.items():
        done = covered.get(id(p), 0)
        tracked_params += done
        mname, module, pname = owner[id(p)]
        if id(p) in excluded_ids:
            excluded[n] = (
                f"{excluded_ids[id(p)]:,} expert slots never used by {type(module).__name__}.forward "
                "(zero-compute experts); their gradient is always zero"
            )
            excluded_params += excluded_ids[id(p)]
        elif done == 0:
            if id(p) in unsupported_ids:
                reason = unsupported[unsupported_ids[id(p)]].split(". ")[0]
                skipped[n] = f"experts layout moe-attrib cannot read ({reason})"
            elif id(p) in filtered_ids:
                skipped[n] = f"not matched by --filter_modules {filter_modules!r}"
            elif experts_layout_for(experts, module) is not None:
                skipped[n] = f"fused experts parameter of {type(module).__name__} (tracking off: pass {TRACK_FLAG})"
            else:
                reason = _reason(module, pname, p)
                if reason == EMBEDDING_REASON:
                    excluded[n] = reason
                    excluded_params += p.numel()
                else:
                    skipped[n] = reason

    tracked = [name for t in targets for name in t.tracked_names]
    getter = getattr(model, "get_output_embeddings", None)  # absent on models that are not transformers'
    head = getter() if callable(getter) else None
    output_layer = next((t.name for t in targets if head is not None and t.module is head), None)
    report = CoverageReport(
        tracked=tracked,
        skipped=skipped,
        excluded=excluded,
        targets=targets,
        experts=experts,
        total_params=sum(sizes.values()),
        tracked_params=tracked_params,
        excluded_params=excluded_params,
        param_sizes=sizes,
        track_moe_experts=track_moe_experts,
        unsupported=unsupported,
        output_layer=output_layer,
    )
    if warn and experts and not track_moe_experts:
        warn_skipped_experts(report)
    if warn and unsupported:
        warn_unsupported_experts(report)
    return report


def _target_params(t: Target) -> list[torch.Tensor]:
    return [e.param for e in t.entries()]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the `nn.ModuleList` holding the most parameters (FSDP units, recomputed layers)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no decoder layer list (nn.ModuleList) found in the model.")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def experts_layout_for(experts: list[ExpertsLayout], module: nn.Module) -> ExpertsLayout | None:
    return next((lay for lay in experts if lay.module is module), None)


def warn_skipped_experts(report: CoverageReport) -> None:
    """The one warning users get when fused experts exist and tracking is off."""
    lost = report.skipped_experts_params
    share = lost / report.total_params if report.total_params else 0.0
    names = [lay.name for lay in report.experts]
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    warnings.warn(
        f"moe-attrib: {len(names)} fused experts module(s) will NOT be attributed ({shown}): "
        f"{lost:,} parameters, {share:.1%} of all trainable parameters. Pass {TRACK_FLAG} "
        "(track_moe_experts=True in Python) to attribute every expert.",
        UserWarning,
        stacklevel=3,
    )


def warn_unsupported_experts(report: CoverageReport) -> None:
    """The warning for experts-like modules left out because no registered layout family reads them."""
    sizes = {}
    for name in report.unsupported:
        sizes[name] = sum(size for pname, size in report.param_sizes.items() if pname.rsplit(".", 1)[0] == name)
    lost = sum(sizes.values())
    share = lost / report.total_params if report.total_params else 0.0
    shown = ", ".join(f"{n} ({sizes[n]:,} parameters)" for n in list(report.unsupported)[:4])
    more = f", ... ({len(report.unsupported)} in all)" if len(report.unsupported) > 4 else ""
    warnings.warn(
        f"moe-attrib: {len(report.unsupported)} experts module(s) with a layout moe-attrib cannot read are NOT "
        f"attributed: {shown}{more}; {lost:,} parameters, {share:.1%} of all trainable parameters. The rest of "
        f"the model is attributed. Reason: {next(iter(report.unsupported.values())).split('. ')[0]}.",
        UserWarning,
        stacklevel=3,
    )
