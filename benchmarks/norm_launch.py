"""Host cost of one RMSNorm backward at small batches (issue 15, the 1k-token row): the paths a
collection step could take for a norm, timed per call on the host (no synchronisation inside the
loop, so launch overhead, not GPU time, dominates at small row counts) and on the GPU.

- `triton`: `moe_attrib.norms.rms_norm_backward` (one Triton kernel, launched through `JITFunction.run`);
- `formula`: the same formula in torch ops (what a CPU runs);
- `eager`: autograd's backward of the module's own forward (what a plain training step runs), forward
  included, as `eager fwd+bwd` next to `function fwd+bwd` (the collection's `_NormFunction`).

    python benchmarks/norm_launch.py
"""

from __future__ import annotations

import json
import time

import torch

from moe_attrib import norms
from moe_attrib.zoo import tiny_model


def per_call_us(fn, calls: int = 200, rounds: int = 5) -> dict:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) / calls * 1e6)
    return {"host_us": sorted(host)[rounds // 2], "wall_us": sorted(wall)[rounds // 2]}


def aten_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's own fused RMSNorm backward (CUDA), its `rstd` recomputed from `x` (the forward is the model's)."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, w, [True, False])[0]


def measure(norm: torch.nn.Module, rows: int, width: int) -> dict:
    norm.weight = torch.nn.Parameter(torch.ones(width, device="cuda", dtype=torch.bfloat16), requires_grad=False)
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    eps, w = norm.variance_epsilon, norm.weight

    def eager():
        xi = x.detach().requires_grad_(True)
        type(norm).forward(norm, xi).backward(dy)

    def function():
        xi = x.detach().requires_grad_(True)
        norms._NormFunction.apply(xi, w, norm, eps, False).backward(dy)

    def formula():
        saved, norms.triton = norms.triton, None
        try:
            return norms.rms_norm_backward(x, w, dy, eps, False)
        finally:
            norms.triton = saved

    row = {"rows": rows, "width": width}
    ref = norms.rms_norm_backward(x, w, dy, eps, False).float()
    row["aten_vs_triton_max_rel"] = float((aten_backward(x, w, dy, eps).float() - ref).abs().max() / ref.abs().max())
    row["triton"] = per_call_us(lambda: norms.rms_norm_backward(x, w, dy, eps, False))
    row["formula"] = per_call_us(formula)
    row["aten fused"] = per_call_us(lambda: aten_backward(x, w, dy, eps))
    row["eager fwd+bwd"] = per_call_us(eager)
    row["function fwd+bwd"] = per_call_us(function)
    row["forward only"] = per_call_us(lambda: type(norm).forward(norm, x))
    return row


def main() -> None:
    norm = tiny_model("qwen3_moe", dtype=torch.bfloat16).cuda().model.layers[0].input_layernorm
    for rows, width in ((1024, 2048), (1024 * 16, 128), (8192, 2048)):
        print(json.dumps(measure(norm, rows, width)), flush=True)


if __name__ == "__main__":
    main()
