"""The RMSNorms' one-pass backward (`moe_attrib.model.norms`) against autograd."""

import pytest
import torch
from torch import nn

import moe_attrib as ma
from moe_attrib.model import norms
from moe_attrib.model.zoo import tiny_model
from tests.conftest import rel_err


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, width: int, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, dtype=torch.float64))
        self.variance_epsilon = 1e-6
        self.zero_centred = zero_centred

    def forward(self, x):
        xf = x.to(torch.float64)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight if self.zero_centred else self.weight) * xf.to(x.dtype)


class WeightlessRMSNorm(nn.Module):
    """llama4's q/k norm: no parameters."""

    def __init__(self):
        super().__init__()
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class MeanAbsRMSNorm(LlamaStyleRMSNorm):
    """Named like an RMSNorm, normalises by the mean absolute value: its backward is not the formula."""

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.variance_epsilon)


def test_formula_equals_autograd_for_every_weight_convention():
    torch.manual_seed(0)
    x = torch.randn(5, 7, 24, dtype=torch.float64)
    dy = torch.randn_like(x)
    for zero_centred in (False, True):
        module = LlamaStyleRMSNorm(24, zero_centred)
        ref_in = x.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(module(ref_in), ref_in, dy)
        got = norms.rms_norm_backward(x, module.weight.detach(), dy, 1e-6, zero_centred)
        assert rel_err(got, expected) < 1e-12
    ref_in = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(WeightlessRMSNorm()(ref_in), ref_in, dy)
    assert rel_err(norms.rms_norm_backward(x, None, dy, 1e-6, False), expected) < 1e-12


def test_installed_norms_keep_the_forward_and_give_autograds_gradient():
    torch.manual_seed(0)
    layers = [
        LlamaStyleRMSNorm(16),
        nn.Linear(16, 16).double(),
        LlamaStyleRMSNorm(16, True),
        MeanAbsRMSNorm(16),
        WeightlessRMSNorm(),
    ]
    model = nn.Sequential(*layers)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 16, dtype=torch.float64)
    dy = torch.randn(4, 16, dtype=torch.float64)
    ref_in = x.clone().requires_grad_(True)
    y_ref = model(ref_in)
    (expected,) = torch.autograd.grad(y_ref, ref_in, dy)
    with norms.fused_norms(model) as names:
        assert names == ["0", "2", "4"]  # not 3: its backward is not the formula
        fused_in = x.clone().requires_grad_(True)
        y = model(fused_in)
        (got,) = torch.autograd.grad(y, fused_in, dy)
    assert torch.equal(y, y_ref)  # the forward is the modules' own
    assert rel_err(got, expected) < 1e-12
    found = [norms.convention(model[i]) for i in (0, 2, 3, 4)]
    assert found == ["w", "1+w", None, "none"]  # 3 keeps eager autograd
    assert all("forward" not in m.__dict__ for m in model)


@pytest.mark.parametrize("family", ["qwen3_next", "llama4_text"])  # zero-centred weights; weightless q/k norms
def test_collection_with_and_without_the_norms_backward(family, padded_batch):
    """Same rows either way (the per-sample autograd comparison of the default is test_gradients')."""
    ids, mask = padded_batch
    model = tiny_model(family)
    report = ma.discover(model, track_moe_experts=True, warn=False)
    with ma.GradientCollector(model, report, fused_norms=False) as c:
        eager = c.collect(ids, mask, fused_experts=True)
    with ma.GradientCollector(model, report) as c:
        got = c.collect(ids, mask, fused_experts=True)
    for name, value in eager.items():
        assert rel_err(got[name], value) < 1e-5, name
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
