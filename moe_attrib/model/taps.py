"""Weight-use taps: find which module's forward uses each watched weight, then tap only those forwards.

Routers often compute logits from a bare parameter (`F.linear(h, self.weight)`, with casts or a
transpose on the way), and some modules read a child's `.weight` directly, in their forward or a
helper method. On the first batch a torch function mode follows every watched weight while a
stack of running modules says whose forward (or helper) uses it; from then on only those modules
are tapped, entering the mode in a pre-hook and leaving it in an `always_call` forward hook, so an
exception inside the forward leaves no mode behind. A weight that is expected but not seen, or
used through anything but `F.linear` / a matmul, is a `LayoutError`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from moe_attrib.model.discovery import Target
from moe_attrib.model.layouts import LayoutError
from moe_attrib.model.sharding import is_sharded

OnUse = Callable[[Target, torch.Tensor, torch.Tensor, bool], None]


class LinearTap(TorchFunctionMode):
    """Catches `F.linear` / matmul calls that use a watched weight (also through casts and transposes).

    `on_use(target, x, out, out_transposed)` receives each call's input rows and output. With a
    module `stack` (first batch), each use is also recorded in `uses` under the module running it.
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
    _METADATA = {"__get__", "size", "numel", "dim", "stride", "data_ptr", "element_size", "is_contiguous", "__len__",
                 "__hash__", "__format__", "__repr__", "detach", "storage_offset", "is_floating_point", "nelement",
                 "ndimension", "untyped_storage", "__reduce_ex__", "__deepcopy__"}  # fmt: skip

    def __init__(self, targets: list[Target], on_use: Callable, stack: list[nn.Module] | None = None):
        super().__init__()
        self.tracked: dict[int, tuple[torch.Tensor, Target, bool]] = {
            id(t.module.weight): (t.module.weight, t, False) for t in targets
        }
        self.targets = targets
        self.on_use = on_use
        self.stack = stack
        self.hit: set[str] = set()
        self.uses: dict[str, set[nn.Module]] = {}
        self.other_uses: dict[str, str] = {}  # first batch: a watched weight passed to another function

    def follow_current_weights(self) -> None:
        """Also follow the tensors the targets' `.weight` attributes hold now: FSDP2 (`--fsdp`) swaps a
        sharded parameter for its gathered one while its layer runs."""
        for t in self.targets:
            self.tracked.setdefault(id(t.module.weight), (t.module.weight, t, False))

    def _use(self, entry, x, out, weight_left: bool = False) -> None:
        target = entry[1]
        if self.stack is not None:
            running = self.stack[-1] if self.stack else None
            self.uses.setdefault(target.name, set()).add(running)
            if running is target.module and target.scope is None:
                return  # a hooked module's own forward: its forward hook captures it
        self.hit.add(target.name)
        if weight_left:  # W @ X with X [..., in, S]: rows are the last axis
            self.on_use(target, x.transpose(-1, -2), out, True)
        else:
            self.on_use(target, x, out, False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            entry = self.tracked.get(id(weight))
            if entry is not None and not entry[2]:
                self._use(entry, args[0], out)
        elif func in self._MATMUL and len(args) == 2:
            entry = self.tracked.get(id(args[1]))
            if entry is not None and entry[2]:
                self._use(entry, args[0], out)
            entry = self.tracked.get(id(args[0]))
            if entry is not None and not entry[2]:
                self._use(entry, args[1], out, weight_left=True)
        elif func in self._DERIVE or func in self._FLIP:
            entry = self.tracked.get(id(args[0])) if args else None
            if entry is not None and isinstance(out, torch.Tensor):
                self.tracked[id(out)] = (out, entry[1], entry[2] ^ (func in self._FLIP))
        elif self.stack is not None and getattr(func, "__name__", "") not in self._METADATA:
            for arg in (*args, *kwargs.values()):
                for a in arg if isinstance(arg, (list, tuple)) else (arg,):
                    entry = self.tracked.get(id(a)) if isinstance(a, torch.Tensor) else None
                    if entry is not None:
                        running = type(self.stack[-1]).__name__ if self.stack else "the model"
                        name = getattr(func, "__qualname__", repr(func))
                        self.other_uses.setdefault(entry[1].name, f"{name} in {running}.forward")
        return out


class WeightTaps:
    """Taps for `watched` targets of `model`; `on_use(target, x, out, out_transposed)` gets each use.

    A target with `scope is None` is captured by its own forward hook; if its weight turns out to
    be used by another module's forward instead, its name lands in `moved` (its hook is then the
    caller's to remove). `remove()` takes every hook out.
    """

    def __init__(self, model: nn.Module, watched: list[Target], on_use: OnUse):
        self.model = model
        self.watched = watched
        self.on_use = on_use
        self.pending = bool(watched)
        self.moved: list[str] = []
        self._handles: list = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def first_batch(self) -> Iterator[None]:
        """Wrap the first batch's forward: capture every use and learn where each weight is used."""
        stack: list[nn.Module] = []
        ran: set[int] = set()
        hooks = []
        sharded = is_sharded(self.model)

        def push(module, args) -> None:
            stack.append(module)
            ran.add(id(module))
            if sharded:
                tap.follow_current_weights()

        def pop(module, args, out) -> None:
            stack.pop()

        for module in self.model.modules():
            hooks.append(module.register_forward_pre_hook(push))
            hooks.append(module.register_forward_hook(pop, always_call=True))
        tap = LinearTap(self.watched, self.on_use, stack)
        try:
            with tap:
                yield
        finally:
            for h in hooks:
                h.remove()
        self._install(tap.uses, tap.other_uses, ran)
        self.pending = False

    def _install(self, uses: dict[str, set[nn.Module]], other_uses: dict[str, str], ran: set[int]) -> None:
        """Tap each watched weight in the forward that used it on the first batch."""
        taps: dict[nn.Module, list[Target]] = {}
        for t in self.watched:
            if t.name in other_uses and t.name not in uses:
                raise LayoutError(
                    f"{t.name} ({type(t.module).__name__}): its weight is used through {other_uses[t.name]}, not "
                    "F.linear or a matmul, so moe-attrib cannot attribute it. Leave it out with --filter_modules."
                )
            hooked = t.scope is None
            scopes = {m for m in uses.get(t.name, set()) if not (hooked and m is t.module)}
            if hooked and not scopes:
                continue  # used by its own forward (or not on the path): the forward hook covers it
            if not scopes:
                if id(t.module) in ran:
                    raise LayoutError(
                        f"{t.name} ({type(t.module).__name__}): its forward ran but its weight was not used through "
                        "F.linear or a matmul, so moe-attrib cannot attribute it. Leave it out with --filter_modules "
                        "or report the model."
                    )
                continue  # never ran: not on the loss path, reported with zeros like any such module
            if None in scopes or len(scopes) > 1 or (hooked and t.module in uses.get(t.name, set())):
                where = sorted(type(m).__name__ if m is not None else "<outside any module>" for m in scopes)
                raise LayoutError(
                    f"{t.name}: weight used in several places ({where}); moe-attrib attributes a weight used "
                    "in one module's forward only. Leave it out with --filter_modules."
                )
            if hooked:
                self.moved.append(t.name)
            taps.setdefault(next(iter(scopes)), []).append(t)
        for scope, targets in taps.items():
            self._handles.append(scope.register_forward_pre_hook(lambda m, a, ts=targets: self._tap_enter(m, ts)))
            self._handles.append(
                scope.register_forward_hook(lambda m, a, out, ts=targets: self._tap_exit(m, ts), always_call=True)
            )

    def _tap_enter(self, scope: nn.Module, targets: list[Target]) -> None:
        tap = LinearTap(targets, self.on_use)
        tap.__enter__()
        scope.__dict__.setdefault("_moe_attrib_taps", []).append(tap)

    def _tap_exit(self, scope: nn.Module, targets: list[Target]) -> None:
        """Leave the tap (also when the forward raised: always_call), then check every weight was seen."""
        taps = scope.__dict__["_moe_attrib_taps"]
        tap = taps.pop()
        if not taps:
            del scope.__dict__["_moe_attrib_taps"]
        tap.__exit__(None, None, None)
        if sys.exc_info()[0] is not None:
            return
        missed = [t.name for t in targets if t.name not in tap.hit]
        if missed:
            raise LayoutError(
                f"{missed}: weight not used through F.linear or a matmul during {type(scope).__name__}.forward "
                "(it was on the first batch), so moe-attrib cannot attribute it. Leave it out with --filter_modules."
            )
