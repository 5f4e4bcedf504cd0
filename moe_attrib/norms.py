"""The decoder's RMSNorms with a one-pass backward during collection (the forward stays the model's own).

In eager autograd an RMSNorm is seven or eight elementwise ops and a reduction, each saving a float32
copy of the rows for the backward, and its backward about a dozen more kernels over those copies: on
a 4-layer Qwen3-30B-A3B shape at 8k tokens the 17 norms (input, post-attention, q and k norms per
layer, the final norm) take about 9 of 57 ms of kernels. `fused_norms(model)` runs each norm's own
forward unchanged (under no grad: the same kernels, bit for bit, so routing is untouched) inside an
autograd function that keeps only the input rows and forms `dx = r (g - x̂ mean(g x̂))`, with
`g = dy * w` (or `dy * (1 + w)` for the zero-centred weight of Gemma-style norms), in one pass: a
Triton kernel on CUDA (one program per row, float32 inside), the same formula in torch elsewhere.

A norm module is used this way only once the formula matched autograd's own backward of the module
on seeded rows (relative error below 1e-2 in 16-bit dtypes, 1e-5 in float32), trying both weight
conventions, and only for inputs of its weight's dtype and device; a module matching neither keeps
eager autograd. Only modules named `*RMSNorm` with a one-dimensional frozen weight (not sharded by
FSDP, not offloaded) and a one-argument forward qualify.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator

import torch
from torch import nn

# norm module -> weight convention ("w" | "1+w") or None (keeps eager autograd)
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()

_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}

try:  # Triton ships with CUDA builds of torch; without it the torch formula runs
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_backward_kernel(
        x_ptr, dy_ptr, w_ptr, dx_ptr, width, eps, ONE_PLUS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=keep, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * width + cols, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        if ONE_PLUS:
            w = w + 1.0
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        xhat = x * r
        g = dy * w
        dx = r * (g - xhat * (tl.sum(g * xhat, axis=0) / width))
        tl.store(dx_ptr + row * width + cols, dx.to(dx_ptr.dtype.element_ty), mask=keep)

except ImportError:  # pragma: no cover - CPU builds
    triton = None


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float, one_plus: bool
) -> torch.Tensor:
    """`d loss / d x` of `y = w * x / rms(x)` (`w` -> `1 + w` with `one_plus`) given `dy`, float32 (float64) inside."""
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
                weight,
                dx,
                width,
                eps,
                ONE_PLUS=one_plus,
                BLOCK=block,
                num_warps=min(16, max(1, block // 256)),
            )
        return dx.view(x.shape)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.to(wide)
    xf, g = x.to(wide), dy.to(wide) * (w + 1.0 if one_plus else w)
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


def qualifies(module: nn.Module) -> bool:
    """An `*RMSNorm` module with a frozen 1-D `weight`, an epsilon and a one-argument forward."""
    weight = module._parameters.get("weight")
    if not type(module).__name__.endswith("RMSNorm") or weight is None or weight.dim() != 1:
        return False
    if weight.requires_grad or _eps(module) is None or "forward" in module.__dict__:
        return False
    if type(weight.data) is not torch.Tensor or weight.device.type == "meta":  # sharded (FSDP) or not loaded
        return False
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1 and not any(p.kind is p.VAR_POSITIONAL for p in params)


def convention(module: nn.Module) -> str | None:
    """The weight convention found for `module` in this process ("w", "1+w"), None if none or unchecked."""
    return _CHECKED.get(module)


def _check(module: nn.Module) -> str | None:
    """Which weight convention the module's own autograd backward has, on seeded rows of its weight's
    dtype and device, or None (checked once per module and process, before any batch: a check inside
    a recomputed layer's forward would change what the recomputation saves)."""
    if module not in _CHECKED:
        weight = module.weight
        gen = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(8, weight.shape[0], generator=gen, device=weight.device).to(weight.dtype)
        with torch.enable_grad():
            ref_in = x.clone().requires_grad_(True)
            out = type(module).forward(module, ref_in)
            dy = torch.randn(out.shape, generator=gen, device=x.device).to(out.dtype)
            (expected,) = torch.autograd.grad(out, ref_in, dy)
        tol = _TOLERANCE.get(x.dtype, 1e-2)
        found = None
        for name, one_plus in (("w", False), ("1+w", True)):
            got = rms_norm_backward(x, weight.detach(), dy, _eps(module), one_plus)
            err = (got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
            if float(err) < tol:
                found = name
                break
        _CHECKED[module] = found
    return _CHECKED[module]


@contextlib.contextmanager
def fused_norms(model: nn.Module) -> Iterator[list[str]]:
    """Install the one-pass backward on every qualifying RMSNorm of `model`; yields their names.
    Exit restores each module's forward exactly."""
    names = []
    installed: list[nn.Module] = []

    def wrapped(module: nn.Module, one_plus: bool):
        eps, weight = _eps(module), module.weight

        def forward(x, *args, **kwargs):
            plain = isinstance(x, torch.Tensor) and not args and not kwargs
            if not plain or x.dtype != weight.dtype or x.device != weight.device or not torch.is_grad_enabled():
                return type(module).forward(module, x, *args, **kwargs)
            return _NormFunction.apply(x, weight, module, eps, one_plus)

        return forward

    try:
        for name, module in model.named_modules():
            if qualifies(module) and _check(module) is not None:
                module.__dict__["forward"] = wrapped(module, _check(module) == "1+w")
                installed.append(module)
                names.append(name)
        yield names
    finally:
        for module in installed:
            module.__dict__.pop("forward", None)
