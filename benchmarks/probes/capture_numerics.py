"""Probe: where does a CUDA-graphed forward of the Qwen3-30B-A3B shape part from the eager one?

A captured forward once differed from the eager one by 0.65-1.3% from the first decoder layer on,
while SDPA alone was bitwise equal under capture (the cause: transformers' packed-sequence check,
answered by `moe_attrib.collect.graphs.unpacked_positions`). This compares, eager
against captured (`e2e.capture_graph`: warm-up on a side stream, then capture): the single ops the
attention block runs (a bf16 `F.linear` of q_proj's shape, the rotary embedding's float32 matmul,
the RMSNorm formula, SDPA), then every intermediate of decoder layer 0 at 2 x 512 tokens (forward
hooks on its submodules, the rotary embedding's cos/sin, o_proj's input). Run it with and without
`CUBLAS_WORKSPACE_CONFIG=:4096:8` (a fixed cuBLAS workspace) to see whether the GEMMs' algorithm
choice is what moves.

    python benchmarks/probes/capture_numerics.py
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from e2e import capture_graph, make_model, rel, token_ids  # noqa: E402

from moe_attrib.collect.graphs import unpacked_positions  # noqa: E402


def compare(name: str, fn) -> None:
    with torch.no_grad():
        eager = fn()
        graph, static = capture_graph(fn)
        graph.replay()
        again = fn()
    torch.cuda.synchronize()
    print(f"  {name:38s} graph vs eager {rel(static, eager):.3g}   eager vs eager {rel(again, eager):.3g}", flush=True)


def single_ops() -> None:
    torch.manual_seed(0)
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    compare("F.linear bf16 [1024,2048]x[4096,2048]^T", lambda: F.linear(x, w))
    wk = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    compare("F.linear bf16 [1024,2048]x[512,2048]^T", lambda: F.linear(x, wk))
    inv = torch.randn(1, 64, 1, device="cuda")
    pos = torch.arange(512, device="cuda", dtype=torch.float32)[None, None, :].expand(2, 1, 512)
    compare("rotary matmul fp32 [2,64,1]x[2,1,512]", lambda: (inv.expand(2, -1, 1) @ pos).transpose(1, 2))

    def norm():
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    compare("RMSNorm formula bf16", norm)
    q = torch.randn(2, 32, 512, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16)
    compare("SDPA causal gqa", lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))


def layer_parts(model, ids: torch.Tensor, unpacked: bool) -> None:
    layer = model.model.layers[0]
    attn = layer.self_attn
    parts = {
        "embed": model.model.embed_tokens,
        "rotary_emb (cos)": model.model.rotary_emb,
        "input_layernorm": layer.input_layernorm,
        "q_proj": attn.q_proj,
        "k_proj": attn.k_proj,
        "v_proj": attn.v_proj,
        "q_norm": attn.q_norm,
        "k_norm": attn.k_norm,
        "o_proj": attn.o_proj,
        "self_attn": attn,
        "post_attention_layernorm": layer.post_attention_layernorm,
        "mlp.gate (logits)": layer.mlp.gate,
        "mlp": layer.mlp,
    }
    seen: dict[str, torch.Tensor] = {}

    def keep(key):
        return lambda m, a, out: seen.__setitem__(key, (out[0] if isinstance(out, tuple) else out).clone())

    hooks = [m.register_forward_hook(keep(k)) for k, m in parts.items()]
    sdpa_out = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o_proj input", a[0].clone()))
    hooks.append(sdpa_out)

    def forward():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    try:
        forward()
        eager = dict(seen)
        forward()
        again = dict(seen)
        with unpacked_positions() if unpacked else contextlib.nullcontext():
            graph, _ = capture_graph(forward)
        graph.replay()
        torch.cuda.synchronize()
        print(f"  transformers' packed-sequence check {'off' if unpacked else 'on'} while capturing:")
        for key in eager:
            print(f"  layer 0 {key:28s} graph vs eager {rel(seen[key], eager[key]):.3g}   eager vs eager "
                  f"{rel(again[key], eager[key]):.3g}", flush=True)  # fmt: skip
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def sdpa_spied(spy):
    """`F.scaled_dot_product_attention` replaced by `spy(real, *args, **kwargs)` while inside (transformers
    looks it up on the module at each call)."""
    real = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *args, **kwargs: spy(real, *args, **kwargs)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def sdpa_call(model, ids: torch.Tensor) -> None:
    """The arguments transformers passes to SDPA in the model (shapes, strides, keywords)."""
    calls = []

    def spy(real, *args, **kwargs):
        calls.append(([(tuple(a.shape), a.stride(), a.dtype) for a in args[:3]], dict(kwargs)))
        return real(*args, **kwargs)

    with sdpa_spied(spy), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    print(f"  SDPA as the model calls it: {calls[0] if calls else 'not through F.scaled_dot_product_attention'}")


def sdpa_in_model(model, ids: torch.Tensor, prepare: str) -> None:
    """Layer 0's SDPA inputs and output in the model, eager vs captured; `prepare`: "as is" or
    "contiguous" (its inputs made contiguous first, in both runs)."""
    seen: list[list[torch.Tensor]] = []

    def spy(real, q, k, v, *args, **kwargs):
        if prepare == "contiguous":
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = real(q, k, v, *args, **kwargs)
        seen.append([q.clone(), k.clone(), v.clone(), out.clone()])
        return out

    def forward():
        seen.clear()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    with sdpa_spied(spy):
        forward()
        eager = list(seen[0])
        graph, _ = capture_graph(forward)
        captured = seen[0]
        graph.replay()
        torch.cuda.synchronize()
    names = ("q", "k", "v", "out")
    shapes = {n: (tuple(c.shape), tuple(e.shape)) for n, c, e in zip(names, captured, eager, strict=True)}
    diffs = {
        n: f"{rel(c, e):.3g}" if c.shape == e.shape else f"shapes {shapes[n]}"
        for n, c, e in zip(names, captured, eager, strict=True)
    }
    print(f"  layer 0 SDPA ({prepare}), graph vs eager: {diffs}", flush=True)


def main() -> None:
    print(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}", flush=True)
    model = make_model("qwen3-30b-a3b-shaped")
    ids = token_ids(model, 2, 512).cuda()
    sdpa_call(model, ids)
    if "--sdpa" in sys.argv:
        sdpa_in_model(model, ids, "as is")
        sdpa_in_model(model, ids, "contiguous")
        return
    single_ops()
    layer_parts(model, ids, unpacked=False)
    layer_parts(model, ids, unpacked=True)


if __name__ == "__main__":
    main()
