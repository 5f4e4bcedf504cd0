"""Temporary probe: routed-row combine variants, forward + backward, bf16 on the GPU."""

import time

import torch

from moe_attrib.layouts.routed import RoutedCombine, route_rows

T, k, E, H = 8192, 8, 128, 2048
torch.manual_seed(0)
idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
rows, perm = route_rows(idx, T, E)
inv = torch.empty_like(perm)
inv[perm] = torch.arange(perm.numel(), device=perm.device)
out = torch.randn(T * k, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.rand(T, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)


def old():
    o = out * w.reshape(-1)[perm].unsqueeze(-1)
    return o[inv].view(T, k, H).sum(1)


def mulsum():
    o = out.index_select(0, inv).view(T, k, H)
    return (o * w.unsqueeze(-1)).sum(1)


def fused():
    return RoutedCombine.apply(out, w, inv, perm)


ref = old()
for name, fn in (("old", old), ("mulsum", mulsum), ("bmm", fused)):
    y = fn()
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    for _ in range(3):
        fn().backward(g)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        fn().backward(g)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms fwd+bwd, rel err vs old {err:.1e}", flush=True)
