"""A per-expert Python-loop collector, the way `nn.Linear`-per-expert tools (bergson's
`--moe_experts`) work: for every expert, gather its tokens, run its projections, hook each one
and form that expert's per-example projected gradients. Used only as a benchmark baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_attrib.collect.projection import Projections


class LoopCollector:
    """Replaces every experts module's forward with a per-expert loop that captures gradients."""

    def __init__(self, layouts, projection_dim: int, n: int, seq_len: int, seed: int = 0):
        self.layouts, self.p, self.n, self.s = layouts, projection_dim, n, seq_len
        self.seed = seed
        self.results: dict = {}

    def __enter__(self):
        for lay in self.layouts:
            lay.module.forward = self._forward(lay)
        return self

    def __exit__(self, *exc):
        for lay in self.layouts:
            del lay.module.forward

    def _forward(self, lay):
        module, experts = lay.module, lay.num_experts
        up_name, down_name = lay.projections

        def capture(name, e, x, y, tok):
            proj = self.proj
            p_in = proj.get(name, "in", x.shape[-1], experts)  # None: a side no wider than p stays exact
            xp = x.detach() @ p_in[e] if p_in is not None else x.detach()
            example = tok // self.s

            def backward(g):
                p_out = proj.get(name, "out", g.shape[-1], experts)
                gp = g @ p_out[e] if p_out is not None else g
                outer = torch.einsum("rp,rq->rpq", gp.float(), xp.float())
                key = (name, e)
                acc = self.results.setdefault(key, torch.zeros(self.n, *outer.shape[1:], device=g.device))
                acc.index_add_(0, example, outer)

            y.register_hook(backward)

        def forward(hidden, top_k_index, top_k_weights):
            self.proj = Projections(self.p, self.seed, hidden.device, hidden.dtype)
            out = torch.zeros_like(hidden)
            with torch.no_grad():
                mask = F.one_hot(top_k_index, num_classes=experts).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for e in hit.flatten().tolist():
                slot, tok = torch.where(mask[e])
                x = hidden[tok]
                h = F.linear(x, getattr(module, up_name)[e])
                capture(f"{lay.name}.{up_name}", e, x, h, tok)
                gate, up = h.chunk(2, dim=-1)
                a = module.act_fn(gate) * up
                y = F.linear(a, getattr(module, down_name)[e])
                capture(f"{lay.name}.{down_name}", e, a, y, tok)
                out.index_add_(0, tok, (y * top_k_weights[tok, slot, None]).to(out.dtype))
            return out

        return forward
