"""What a backward hook costs on the host (issue 15, the 1k-token row): a chain of linears at small
batches, its backward timed with nothing on the outputs, with a Python tensor hook that does nothing,
with one that projects the gradient rows (what `Capture` does per dense target), and with
`retain_grad()` (a C++ hook: the gradient is kept, projected after the backward in one loop).

A CUDA backward runs on the autograd engine's device thread, so every Python hook takes the GIL
from that thread; the CPU (where the engine runs on the calling thread) cannot show that cost.

    python benchmarks/hook_cost.py
"""

from __future__ import annotations

import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from collect_speed import timed  # noqa: E402


def chain(depth: int, width: int) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(depth)]
    for layer in layers:
        layer.weight.requires_grad_(False)
    return layers


def step(layers, x, mode: str, proj: torch.Tensor, sink: list) -> None:
    h = x.detach().requires_grad_(True)
    outs = []
    for layer in layers:
        h = layer(h)
        if mode == "noop hook":
            h.register_hook(lambda g: None)
        elif mode == "projecting hook":
            h.register_hook(lambda g: sink.append(torch.mm(g.reshape(-1, g.shape[-1]), proj, out_dtype=torch.float32)))
        elif mode == "retain_grad":
            h.retain_grad()
            outs.append(h)
        h = torch.tanh(h)
    h.float().square().sum().backward()
    for o in outs:
        sink.append(torch.mm(o.grad.reshape(-1, o.shape[-1]), proj, out_dtype=torch.float32))
    sink.clear()


def main() -> None:
    for rows, width, depth in ((1024, 2048, 28), (8192, 2048, 28)):
        layers = chain(depth, width)
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        proj = torch.randn(width, 32, device="cuda", dtype=torch.bfloat16)
        sink: list = []
        modes = ("none", "noop hook", "projecting hook", "retain_grad")
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(5):
            for m in modes:
                times[m].extend(timed(partial(step, layers, x, m, proj, sink), 3, 20)[1])
        base = statistics.median(times["none"])
        row = {"rows": rows, "width": width, "depth": depth, "none_ms": base * 1e3}
        for m in modes[1:]:
            med = statistics.median(times[m])
            row[f"{m}_ms"] = med * 1e3
            row[f"{m}_us_per_hook"] = (med - base) / depth * 1e6
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
