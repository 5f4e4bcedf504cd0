"""Per-sample autograd reference: one example at a time, unpadded, `.grad` of each parameter."""

import torch
import torch.nn.functional as F

from moe_attrib.model.discovery import Target


def example_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return F.cross_entropy(logits, ids[0, 1:], reduction="sum")


def reference_gradients(model, ids, mask, targets: list[Target]) -> list[dict[str, torch.Tensor]]:
    """For each example n: {"<tracked module>.weight"/".bias": autograd gradient of loss_n}."""
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(True)
    out = []
    try:
        for n in range(ids.shape[0]):
            length = int(mask[n].sum())
            model.zero_grad(set_to_none=True)
            example_loss(model, ids[n : n + 1, :length]).backward()
            grads = {}
            for t in targets:
                if t.kind == "experts":
                    lay = t.layout
                    for proj in lay.projections:
                        for key, pname in (("weight", proj), ("bias", f"{proj}_bias")):
                            p = getattr(lay.module, pname, None) if key == "weight" or lay.has_bias else None
                            if p is None:
                                continue
                            g = p.grad if p.grad is not None else torch.zeros_like(p)
                            for i in range(lay.num_experts):
                                grads[f"{lay.expert_name(i, proj)}.{key}"] = g[i].clone()
                else:
                    for key in ("weight", "bias"):
                        p = t.module._parameters.get(key)
                        if p is not None:
                            grads[f"{t.name}.{key}"] = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            out.append(grads)
    finally:
        model.zero_grad(set_to_none=True)
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return out
