"""Discovery, coverage, warnings and the reversible per-expert expansion, for every family."""

import warnings

import pytest
import torch
from torch import nn

import moe_attrib as ma
from moe_attrib.model.experts import ExpertLinear
from moe_attrib.model.zoo import FAMILIES, tiny_model


def _snapshot(model):
    return (
        [(n, type(m)) for n, m in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        [(n, p.data_ptr()) for n, p in model.named_parameters()],
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_coverage_warning_and_exact_restore(family, padded_batch):
    ids, mask = padded_batch
    model = tiny_model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = ma.discover(model, track_moe_experts=True)
    assert report.coverage >= 0.99, str(report)
    assert report.experts, "no fused experts found"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    tracked_params = {n for n in trainable if n not in report.skipped and n not in report.excluded}
    assert set(report.skipped) | set(report.excluded) | tracked_params == trainable
    assert all(reason for reason in report.skipped.values())

    with pytest.warns(UserWarning, match="--track_moe_experts") as record:
        off = ma.discover(model, track_moe_experts=False)
    message = str(record[0].message)
    assert report.experts[0].name in message and "%" in message
    assert off.coverage < report.coverage
    assert all(any(lay.name in n for lay in off.experts) for n in off.skipped if "experts" in n)

    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    snap = _snapshot(model)
    names = ma.expand_moe(model)
    assert names == report.tracked[-len(names) :] or set(names) <= set(report.tracked)
    lay = report.experts[0]
    view = model.get_submodule(lay.expert_name(lay.num_experts - 1, lay.projections[-1]))
    assert isinstance(view, ExpertLinear)
    assert view.weight.data_ptr() == lay.param(lay.projections[-1])[lay.num_experts - 1].data_ptr()
    assert list(model.state_dict()) == list(snap[1])
    assert all(torch.equal(v, snap[1][k]) for k, v in model.state_dict().items())
    assert ma.expand_moe(model) == names  # expanding twice is a no-op
    with torch.no_grad():
        during = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, during)
    assert ma.restore_moe(model) == names
    assert ma.restore_moe(model) == []  # restoring an unexpanded model is a no-op
    after_snap = _snapshot(model)
    assert after_snap[0] == snap[0] and after_snap[2] == snap[2]
    assert all(torch.equal(v, snap[1][k]) for k, v in after_snap[1].items())
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_expert_linear_matches_fused_computation():
    model = tiny_model("gpt_oss")  # transposed storage with biases
    lay = ma.discover(model).experts[0]
    with ma.track_moe_experts(model):
        module = model.get_submodule(lay.expert_name(3, "gate_up_proj"))
        x = torch.randn(5, module.in_features)
        expected = x @ lay.module.gate_up_proj[3] + lay.module.gate_up_proj_bias[3]
        assert torch.allclose(module(x), expected, atol=1e-6)
        assert module.weight.shape == lay.module.gate_up_proj.shape[1:]


def test_context_manager_restores_on_error():
    model = tiny_model("qwen3_moe")
    before = [n for n, _ in model.named_modules()]
    with pytest.raises(RuntimeError), ma.track_moe_experts(model) as names:
        assert names and any(n == names[0] for n, _ in model.named_modules())
        raise RuntimeError("boom")
    assert [n for n, _ in model.named_modules()] == before


def test_unknown_experts_layout_is_an_error():
    class WeirdExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in = nn.Parameter(torch.zeros(4, 8, 8))

    model = nn.Module()
    model.block = nn.Module()
    model.block.experts = WeirdExperts()
    with pytest.raises(ma.LayoutError, match="block.experts"):
        ma.discover(model)


def test_report_prints_table():
    report = ma.discover(tiny_model("qwen3_moe"))
    text = str(report)
    assert "coverage" in text and "excluded" in text and "embed_tokens" in text


def test_dbrx_experts_are_reported_not_skipped():
    from transformers.models.dbrx import configuration_dbrx, modeling_dbrx

    config = configuration_dbrx.DbrxConfig(
        d_model=32,
        n_heads=4,
        n_layers=1,
        vocab_size=64,
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
    )
    with pytest.raises(ma.LayoutError, match="DbrxExpertGLU"):
        ma.discover(modeling_dbrx.DbrxForCausalLM(config))
