"""Probe (issue 15): which SDPA backend does the 1k-token Qwen3-30B-A3B-shaped attention take eagerly
and while a CUDA graph is being captured? A collection step captured whole differs from the eager one
from the first attention on (`graph-probe-s6b.txt`); a different backend under capture would say why.

    python benchmarks/sdpa_capture_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAMES = {0: "MATH", 1: "FLASH_ATTENTION", 2: "EFFICIENT_ATTENTION", 3: "CUDNN_ATTENTION", 4: "OVERRIDEABLE"}


def main() -> None:
    torch.manual_seed(0)
    for layout in ("contiguous [B, H, S, D]", "transposed from [B, S, H, D] (as transformers passes them)"):
        for grad in (False, True):
            probe(layout, grad)


def probe(layout: str, grad: bool) -> None:
    torch.manual_seed(0)
    if layout.startswith("contiguous"):
        q = torch.randn(2, 32, 512, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16)
    else:
        q = torch.randn(2, 512, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
    args = dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=128**-0.5, enable_gqa=True)
    eager = torch._fused_sdp_choice(qq, kk, vv, **args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=128**-0.5, enable_gqa=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch._fused_sdp_choice(qq, kk, vv, **args)
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=128**-0.5, enable_gqa=True)
    graph.replay()
    ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=128**-0.5, enable_gqa=True)
    torch.cuda.synchronize()
    diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(
        f"{layout}, requires_grad={grad}: eager {NAMES.get(eager, eager)}, "
        f"under capture {NAMES.get(captured, captured)}, graph vs eager max rel diff {diff:.3g}",
        flush=True,
    )


if __name__ == "__main__":
    main()
