"""The fused output layer (`moe_attrib.collect.head`) against per-sample autograd and the eager loss."""

import pytest
import torch

import moe_attrib as ma
import moe_attrib.collect.head as head
from moe_attrib.collect.collector import GradientCollector
from moe_attrib.model.zoo import FAMILIES, tiny_model
from tests.conftest import rel_err
from tests.reference import example_loss, reference_gradients

RTOL = 1e-4
SCALED_LOGITS = {"granitemoe"}  # divides its logits by config.logits_scaling: the eager path


def _check_against_autograd(model, ids, mask, grads) -> None:
    report = ma.discover(model, track_moe_experts=True, warn=False)
    ref = reference_gradients(model, ids, mask, report.targets)
    assert set(grads) == set(ref[0])
    for name, value in grads.items():
        for n in range(ids.shape[0]):
            expected = ref[n][name]
            if expected.norm() == 0:
                assert value[n].abs().max() < 1e-6, (name, n)
            else:
                assert rel_err(value[n], expected) < RTOL, (name, n, rel_err(value[n], expected))
    for n in range(ids.shape[0]):
        length = int(mask[n].sum())
        with torch.no_grad():
            loss = example_loss(model, ids[n : n + 1, :length])
        assert abs(float(grads.losses[n]) - float(loss)) < 1e-4 * max(1.0, float(loss)), n


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_head_in_chunks_matches_per_sample_autograd(family, padded_batch, monkeypatch):
    """Every family, the first collection of the model (no history), logits formed 3 rows at a time."""
    ids, mask = padded_batch
    model = tiny_model(family)
    monkeypatch.setattr(head, "HEAD_CHUNK_BYTES", 4 * model.config.vocab_size * 3)
    grads = ma.per_example_gradients(model, ids, mask)
    assert head.fusable(model) is (family not in SCALED_LOGITS)
    _check_against_autograd(model, ids, mask, grads)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_eager_head_matches_per_sample_autograd(family, padded_batch):
    """`fused_head=False` (also what sampled labels and models with other heads run)."""
    ids, mask = padded_batch
    model = tiny_model(family)
    grads = ma.per_example_gradients(model, ids, mask, fused_head=False)
    assert head.fusable(model) is None
    _check_against_autograd(model, ids, mask, grads)


def test_projected_and_per_token_rows_equal_the_eager_heads(padded_batch):
    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    report = ma.discover(model, track_moe_experts=True, warn=False)
    for kwargs in ({"fused_experts": True}, {"attribute_tokens": True}):
        got = {}
        for fused in (False, True):
            with GradientCollector(model, report, projection_dim=8, fused_head=fused) as c:
                got[fused] = c.collect(ids, mask, **kwargs)
        for name, value in got[False].items():
            assert rel_err(got[True][name], value) < 1e-5, name
        assert torch.allclose(got[True].losses, got[False].losses, rtol=1e-6)


def test_a_model_that_changes_its_logits_runs_eagerly(padded_batch):
    """A head the fused path does not compute (logits changed after the layer, in place or not):
    the batch is run again eagerly, and the answer is autograd's for the model as it computes."""
    ids, mask = padded_batch
    for in_place in (False, True):
        model = tiny_model("qwen3_moe")
        forward = type(model).forward

        def scaled(self, *args, in_place=in_place, forward=forward, **kwargs):
            out = forward(self, *args, **kwargs)
            out.logits = out.logits.mul_(0.5) if in_place else out.logits * 0.5
            return out

        model.forward = scaled.__get__(model)
        grads = ma.per_example_gradients(model, ids, mask)
        assert head.fusable(model) is False
        _check_against_autograd(model, ids, mask, grads)
