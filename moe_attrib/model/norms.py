"""The decoder's RMSNorms with a one-pass backward during collection (the forward stays the model's own).

In eager autograd an RMSNorm is seven or eight elementwise ops and a reduction, each saving a float32
copy of the rows for the backward, and its backward about a dozen more kernels over those copies: on
a 4-layer Qwen3-30B-A3B shape at 8k tokens the 17 norms (input, post-attention, q and k norms per
layer, the final norm) take about 9 of 57 ms of kernels. `fused_norms(model)` runs each norm's own
forward unchanged (under no grad: the same kernels, bit for bit, so routing is untouched) inside an
autograd function that keeps only the input rows and forms `dx = r (g - x̂ mean(g x̂))`, with
`g = dy * w` (or `dy * (1 + w)` for the zero-centred weight of Gemma-style norms, `dy` without a
weight), in one pass: a Triton kernel on CUDA (one program per row, float32 inside), the same formula
in torch elsewhere.

A norm module is used this way only once the formula matched autograd's own backward of the module
on seeded rows (relative error below 1e-2 in 16-bit dtypes, 1e-5 in float32), trying both weight
conventions, and only for inputs of its weight's dtype and device; a module matching neither keeps
eager autograd. Only modules named `*RMSNorm` with a one-dimensional frozen weight (not sharded by
FSDP, not offloaded) or with no parameters at all (a weightless norm, `w = 1`: llama4's q/k norms,
checked and used for the dtype and device of the model's first parameter) and a one-argument
forward qualify.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator

import torch
from torch import nn

# norm module -> {(dtype, device): weight convention ("w" | "1+w" | "none") or None (keeps eager autograd)}
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()

_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}

try:  # Triton ships with CUDA builds of torch; without it the torch formula runs
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_backward_kernel(
        x_ptr, dy_ptr, w_ptr, dx_ptr, width, eps, HAS_WEIGHT: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=keep, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * width + cols, mask=keep, other=0.0).to(tl.float32)
        g = dy
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
            if ONE_PLUS:
                w = w + 1.0
            g = dy * w
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        xhat = x * r
        dx = r * (g - xhat * (tl.sum(g * xhat, axis=0) / width))
        tl.store(dx_ptr + row * width + cols, dx.to(dx_ptr.dtype.element_ty), mask=keep)

except ImportError:  # pragma: no cover - CPU builds
    triton = None


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor | None, dy: torch.Tensor, eps: float, one_plus: bool
) -> torch.Tensor:
    """`d loss / d x` of `y = w * x / rms(x)` (`w` -> `1 + w` with `one_plus`, 1 without a weight) given `dy`,
    float32 (float64) inside."""
    width = x.shape[-1]
    if x.is_cuda and triton is not None and width <= 65536:
        rows = x.reshape(-1, width).contiguous()
        grads = dy.reshape(-1, width).contiguous()
        dx = torch.empty_like(rows)
        if rows.shape[0]:
            block = triton.next_power_of_2(width)
            _rms_norm_backward_kernel[(rows.shape[0],)](
                rows,
                grads,
                weight if weight is not None else rows,
                dx,
                width,
                eps,
                HAS_WEIGHT=weight is not None,
                ONE_PLUS=one_plus,
                BLOCK=block,
                num_warps=min(16, max(1, block // 256)),
            )
        return dx.view(x.shape)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, g = x.to(wide), dy.to(wide)
    if weight is not None:
        w = weight.to(wide)
        g = g * (w + 1.0 if one_plus else w)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * r
    return (r * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module, eps, one_plus):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.one_plus = eps, one_plus
        return type(module).forward(module, x)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return rms_norm_backward(x, weight, dy, ctx.eps, ctx.one_plus), None, None, None, None


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _in_place(tensor: torch.Tensor) -> bool:
    """A plain tensor holding its values here: not an FSDP shard (DTensor), not offloaded (meta)."""
    return type(tensor.data) is torch.Tensor and tensor.device.type != "meta"


def qualifies(module: nn.Module) -> bool:
    """An `*RMSNorm` module with a frozen 1-D `weight` (or no parameters and buffers at all: a weightless
    norm), an epsilon and a one-argument forward."""
    if not type(module).__name__.endswith("RMSNorm") or _eps(module) is None or "forward" in module.__dict__:
        return False
    weight = module._parameters.get("weight")
    if weight is None:
        if next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
            return False
    elif weight.dim() != 1 or weight.requires_grad or not _in_place(weight):
        return False
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1 and not any(p.kind is p.VAR_POSITIONAL for p in params)


def convention(module: nn.Module) -> str | None:
    """The weight convention last found for `module` in this process ("w", "1+w", "none" for a
    weightless norm), None if none or unchecked."""
    found = _CHECKED.get(module)
    return list(found.values())[-1] if found else None


# (convention, one_plus) pairs tried for a norm with a weight, and for a weightless one
_CONVENTIONS = {True: (("w", False), ("1+w", True)), False: (("none", False),)}


def _check(module: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Which weight convention the module's own autograd backward has, on seeded rows of `dtype` on
    `device` (its weight's, or the model's for a weightless norm), or None (checked once per module and
    process, before any batch: a check inside a recomputed layer's forward would change what the
    recomputation saves); a model moved to another device or dtype is checked again there."""
    key = (dtype, str(device))
    if key not in _CHECKED.setdefault(module, {}):
        weight = module._parameters.get("weight")
        width = weight.shape[0] if weight is not None else 64
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(8, width, generator=gen, device=device).to(dtype)
        with torch.enable_grad():
            ref_in = x.clone().requires_grad_(True)
            out = type(module).forward(module, ref_in)
            dy = torch.randn(out.shape, generator=gen, device=x.device).to(out.dtype)
            (expected,) = torch.autograd.grad(out, ref_in, dy)
        tol = _TOLERANCE.get(x.dtype, 1e-2)
        found = None
        w = weight.detach() if weight is not None else None
        for name, one_plus in _CONVENTIONS[weight is not None]:
            got = rms_norm_backward(x, w, dy, _eps(module), one_plus)
            err = (got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
            if float(err) < tol:
                found = name
                break
        _CHECKED[module][key] = found
    return _CHECKED[module][key]


@contextlib.contextmanager
def fused_norms(model: nn.Module) -> Iterator[list[str]]:
    """Install the one-pass backward on every qualifying RMSNorm of `model`; yields their names.
    A weightless norm is checked, and used, for rows of the dtype and device of the model's first
    floating-point parameter. Exit restores each module's forward exactly."""
    names = []
    installed: list[nn.Module] = []
    first = next((p for p in model.parameters() if p.is_floating_point()), None)

    def wrapped(module: nn.Module, dtype: torch.dtype, device: torch.device, one_plus: bool):
        eps, weight = _eps(module), module._parameters.get("weight")

        def forward(x, *args, **kwargs):
            plain = isinstance(x, torch.Tensor) and not args and not kwargs
            if not plain or x.dtype != dtype or x.device != device or not torch.is_grad_enabled():
                return type(module).forward(module, x, *args, **kwargs)
            return _NormFunction.apply(x, weight, module, eps, one_plus)

        return forward

    try:
        for name, module in model.named_modules():
            if not qualifies(module):
                continue
            weight = module._parameters.get("weight")
            like = weight if weight is not None else first
            if like is None or not _in_place(like):  # a weightless norm in a sharded or offloaded model
                continue
            found = _check(module, like.dtype, like.device)
            if found is not None:
                module.__dict__["forward"] = wrapped(module, like.dtype, like.device, found == "1+w")
                installed.append(module)
                names.append(name)
        yield names
    finally:
        for module in installed:
            module.__dict__.pop("forward", None)
