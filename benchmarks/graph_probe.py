"""Probe: is a CUDA-graphed collection step the same as an eager one? (H200; issue 15, 1k tokens)

For two batch shapes of the 4-layer Qwen3-30B-A3B shape: two eager steps on the same batch (is the
eager step itself deterministic?), then a graph captured after a warm-up on a side stream, replayed,
and each result tensor compared with an eager step's: max |diff| / max |eager| per key, worst keys
printed, plus the kernels' fallbacks and any warning raised while capturing.

    python benchmarks/graph_probe.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from e2e import capture_graph, make_model, rel, token_ids  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.collector import GradientCollector  # noqa: E402


def worst(a: dict, b: dict, top: int = 6) -> list[tuple[str, float]]:
    return sorted(((k, rel(a[k], b[k])) for k in b), key=lambda kv: -kv[1])[:top]


def plain_forward_probe(model, ids: torch.Tensor) -> None:
    """The model's own forward (no moe-attrib), eager twice and captured: where do they part?"""

    def forward():
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states

    a, b = forward(), forward()
    print(f"  plain forward eager vs eager, per layer: {[round(rel(x, y), 8) for x, y in zip(a, b, strict=True)]}")
    graph, static = capture_graph(forward)
    graph.replay()
    torch.cuda.synchronize()
    print(f"  plain forward graph vs eager, per layer: {[round(rel(x, y), 8) for x, y in zip(static, a, strict=True)]}")
    layer = model.model.layers[0]
    parts = {
        "self_attn": layer.self_attn,
        "mlp.gate": layer.mlp.gate,
        "mlp.experts": layer.mlp.experts,
        "mlp": layer.mlp,
    }
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(
            lambda m, a, out, k=k: seen.__setitem__(k, (out[0] if isinstance(out, tuple) else out).clone())
        )
        for k, m in parts.items()
    ]
    try:
        forward()
        eager = dict(seen)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        graph.replay()
        torch.cuda.synchronize()
        print(f"  layer 0 parts, graph vs eager: {[(k, round(rel(seen[k], eager[k]), 8)) for k in parts]}")
    finally:
        for h in hooks:
            h.remove()


def backend_probe(model, ids: torch.Tensor) -> None:
    """Per SDPA backend: eager default vs eager with that backend, and eager vs graph with it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward():
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states

    default = forward()
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                eager = forward()
                graph, static = capture_graph(forward)
                graph.replay()
                torch.cuda.synchronize()
        except RuntimeError as err:
            print(f"  {backend.name}: {str(err)[:200]}")
            continue
        vs_default = max(rel(x, y) for x, y in zip(eager, default, strict=True))
        vs_graph = max(rel(x, y) for x, y in zip(static, eager, strict=True))
        print(f"  {backend.name}: eager vs default eager {vs_default:.3g}, graph vs eager {vs_graph:.3g}", flush=True)
        del graph, static


def main() -> None:
    model = make_model("qwen3-30b-a3b-shaped")
    report = ma.discover(model, track_moe_experts=True, warn=False)
    for shape in ((2, 512), (2, 4096)):
        print(f"SDPA backends, {shape}", flush=True)
        backend_probe(model, token_ids(model, *shape).cuda())
    plain_forward_probe(model, token_ids(model, 2, 512).cuda())
    for n, s in ((2, 512), (2, 4096)):
        ids = token_ids(model, n, s).cuda()
        labels = ids.clone()
        with GradientCollector(model, report, projection_dim=32) as c:
            a = c.collect(ids, None, labels, fused_experts=True)
            b = c.collect(ids, None, labels, fused_experts=True)
            a = {k: v.clone() for k, v in a.items()}
            print(f"{n}x{s} eager vs eager: worst {worst(a, b)}", flush=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph, static = capture_graph(lambda c=c, i=ids, y=labels: c.collect(i, None, y, fused_experts=True))
            print(f"  warnings while capturing: {[str(w.message)[:160] for w in caught]}")
            print(f"  kernel fallbacks: {c.kernels.fallbacks}")
            graph.replay()
            torch.cuda.synchronize()
            print(f"  graph vs eager: worst {worst(static, a)}", flush=True)
            graph.replay()
            torch.cuda.synchronize()
            print(f"  graph replayed again vs eager: worst {worst(static, a, 3)}", flush=True)
            print(f"  losses graph vs eager: {rel(static.losses, a.losses if hasattr(a, 'losses') else b.losses)}")
            print(f"  expert counts equal: {torch.equal(static.expert_counts, b.expert_counts)}")
        del graph, static


if __name__ == "__main__":
    main()
