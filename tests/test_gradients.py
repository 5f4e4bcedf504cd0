"""Per-example gradients against per-sample autograd, every family, exact and projected."""

import pytest
import torch

import moe_attrib as ma
from moe_attrib.collect.projection import projection_matrix
from moe_attrib.model.discovery import decoder_layers
from moe_attrib.model.zoo import FAMILIES, tiny_model
from tests.conftest import rel_err
from tests.reference import reference_gradients

RTOL = 1e-4


def _check_exact(model, ids, mask):
    report = ma.discover(model, track_moe_experts=True)
    grads = ma.per_example_gradients(model, ids, mask)
    ref = reference_gradients(model, ids, mask, report.targets)
    assert set(grads) == set(ref[0]), set(grads) ^ set(ref[0])
    worst = 0.0
    for name, value in grads.items():
        for n in range(ids.shape[0]):
            expected = ref[n][name]
            assert value[n].shape == expected.shape, name
            if expected.norm() == 0:
                assert value[n].abs().max() < 1e-6, (name, n)
                continue
            err = rel_err(value[n], expected)
            worst = max(worst, err)
            assert err < RTOL, f"{name}[{n}] relative error {err:.2e}"
    return grads, report, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_matches_per_sample_autograd(family, padded_batch):
    ids, mask = padded_batch
    model = tiny_model(family)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    flags = [p.requires_grad for p in model.parameters()]
    grads, report, _ = _check_exact(model, ids, mask)
    # experts, routers and linears are all there, every expert of every layer
    assert any(".expert_0." in k for k in grads)
    n_expert_keys = sum(len(lay.expert_names()) for lay in report.experts)
    assert sum(".expert_" in k and k.endswith(".weight") for k in grads) == n_expert_keys
    # routing metadata counts real tokens only
    counts = grads.expert_counts
    assert counts.shape[:2] == (3, len(report.experts))
    k = model.config.get_text_config().num_experts_per_tok if family != "hunyuan_v1_moe" else 2
    routed = counts.sum(dim=2)
    expected = (mask.sum(1, keepdim=True) * k).float().expand_as(routed)
    if family == "longcat_flash":  # tokens sent to zero-compute experts are not counted
        assert (routed <= expected).all() and routed.sum() > 0
    elif family != "llama4_text":  # llama4 computes every expert on every token (unrouted rows are zero)
        assert torch.equal(routed, expected)
    # the model is left exactly as it was
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert "forward" not in vars(report.experts[0].module)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v4", "jamba"])
def test_recomputed_layers_match_per_sample_autograd(family, padded_batch):
    """`recompute=True`: every decoder layer runs twice (forward, then again in the backward) and the
    gradients still equal per-sample autograd; the layers' forwards are restored afterwards."""
    ids, mask = padded_batch
    model = tiny_model(family)
    layers = decoder_layers(model)
    cls, calls = type(layers[0]), []
    original = cls.forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    cls.forward = counted
    try:
        report = ma.discover(model, track_moe_experts=True)
        grads = ma.per_example_gradients(model, ids, mask, recompute=True)
    finally:
        cls.forward = original
    assert len(calls) == 2 * sum(isinstance(layer, cls) for layer in layers)
    assert not any("forward" in vars(layer) for layer in layers)
    ref = reference_gradients(model, ids, mask, report.targets)
    assert set(grads) == set(ref[0])
    for name, value in grads.items():
        for n in range(ids.shape[0]):
            expected = ref[n][name]
            if expected.norm() == 0:
                assert value[n].abs().max() < 1e-6, (name, n)
            else:
                assert rel_err(value[n], expected) < RTOL, name


def side_matrix(name: str, p: int, features: int, seed: int, batch: int | None = None) -> torch.Tensor:
    """The default kind's rule, stated here: a side no wider than p is kept (identity), a wider one projected."""
    if features <= p:
        eye = torch.eye(features)
        return eye if batch is None else eye.expand(batch, features, features)
    return projection_matrix(name, p, features, seed, batch)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4_text", "deepseek_v4"])
def test_projected_equals_projected_exact(family, padded_batch):
    ids, mask = padded_batch
    model = tiny_model(family)
    p, seed = 8, 7
    exact = ma.per_example_gradients(model, ids, mask)
    proj = ma.per_example_gradients(model, ids, mask, projection_dim=p, seed=seed)
    report = ma.discover(model)
    checked = 0
    for t in report.targets:
        if t.kind == "experts":
            lay = t.layout
            for pr in lay.projections:
                fin, fout = lay.features(pr)
                p_in = side_matrix(f"{lay.name}.{pr}/in", p, fin, seed, lay.num_experts)
                p_out = side_matrix(f"{lay.name}.{pr}/out", p, fout, seed, lay.num_experts)
                for i in range(lay.num_experts):
                    key = f"{lay.expert_name(i, pr)}.weight"
                    left, right = (p_in[i], p_out[i]) if lay.transposed else (p_out[i], p_in[i])
                    expected = left @ exact[key] @ right.T
                    assert torch.allclose(proj[key], expected, rtol=1e-4, atol=1e-5), key
                    if lay.has_bias:
                        bkey = f"{lay.expert_name(i, pr)}.bias"
                        assert torch.allclose(proj[bkey], exact[bkey] @ p_out[i].T, rtol=1e-4, atol=1e-5)
                    checked += 1
        else:
            w = t.module.weight
            rows, cols = w.shape
            fout, fin = (cols, rows) if t.transposed else (rows, cols)
            p_in = side_matrix(f"{t.name}/in", p, fin, seed).double()  # fp64 reference: 8k-term sums
            p_out = side_matrix(f"{t.name}/out", p, fout, seed).double()
            left, right = (p_in, p_out) if t.transposed else (p_out, p_in)
            key = f"{t.name}.weight"
            expected = left @ exact[key].double() @ right.T
            assert torch.allclose(proj[key].double(), expected, rtol=1e-4, atol=1e-5), key
            if t.module._parameters.get("bias") is not None:
                bias = exact[f"{t.name}.bias"].double() @ p_out.T
                assert torch.allclose(proj[f"{t.name}.bias"].double(), bias, rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked > 10


def test_projection_is_seeded_and_named():
    a = projection_matrix("model.layers.0.mlp.experts.down_proj/in", 16, 32, seed=3, batch=4)
    b = projection_matrix("model.layers.0.mlp.experts.down_proj/in", 16, 32, seed=3, batch=4)
    c = projection_matrix("model.layers.1.mlp.experts.down_proj/in", 16, 32, seed=3, batch=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a[0], a[1])  # experts are projected independently


class HashRoutedBlock(torch.nn.Module):
    """A hand-built MoE block that supplies its own routing: expert = f(token id), never the last."""

    def __init__(self, gate, experts, num_experts, repeat=False):
        super().__init__()
        self.gate, self.experts, self.num_experts, self.repeat = gate, experts, num_experts, repeat
        self.input_ids = None

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        logits = torch.nn.functional.linear(flat, self.gate.weight)
        ids = self.input_ids.reshape(-1)
        index = torch.stack([ids % (self.num_experts - 1), (ids // 7) % (self.num_experts - 1)], dim=-1)
        if self.repeat == "skewed":  # expert 0 takes ~90% of the tokens, experts 3..7 none
            index[:, 0] = torch.where(ids % 10 == 0, 2, 0)
            index[:, 1] = 1
        elif self.repeat:  # every token picks expert 0 or 1, in both slots (rows per example > length)
            index[:] = (ids % 2 * (ids % 5 == 0)).unsqueeze(-1)
        else:
            index[:, 1] = torch.where(
                index[:, 1] == index[:, 0], (index[:, 0] + 1) % (self.num_experts - 1), index[:, 1]
            )
        weights = torch.softmax(logits, dim=-1).gather(1, index)
        return self.experts(flat, index, weights).reshape(b, s, h)


@pytest.mark.parametrize("repeat", [False, True, "skewed"], ids=["distinct", "repeated-expert", "skewed"])
def test_hand_built_hash_routed_block_and_idle_expert(padded_batch, repeat):
    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    blocks = []
    for layer in model.model.layers:
        block = HashRoutedBlock(layer.mlp.gate, layer.mlp.experts, 8, repeat)
        layer.mlp = block
        blocks.append(block)

    def set_ids(module, args, kwargs):
        for b in blocks:
            b.input_ids = kwargs["input_ids"]

    model.register_forward_pre_hook(set_ids, with_kwargs=True)
    grads, report, worst = _check_exact(model, ids, mask)
    last = "model.layers.0.mlp.experts.expert_7.down_proj.weight"
    assert grads[last].abs().max() == 0  # the idle expert gets exactly zero
    assert grads.expert_counts[:, :, 7].sum() == 0
    assert "model.layers.0.mlp.gate.weight" in grads  # router tapped inside a custom block
    assert worst < RTOL
    if repeat == "skewed":  # empty experts are exactly zero, the crowded one exact (checked above)
        assert grads["model.layers.1.mlp.experts.expert_4.gate_up_proj.weight"].abs().max() == 0
        assert float(grads.expert_counts[:, 0, 0].sum()) > 0.8 * float(mask.sum())


def test_bf16_gradients_close_to_fp32(padded_batch):
    ids, mask = padded_batch
    ref = ma.per_example_gradients(tiny_model("qwen3_moe"), ids, mask, projection_dim=8)
    low = ma.per_example_gradients(tiny_model("qwen3_moe", dtype=torch.bfloat16), ids, mask, projection_dim=8)
    errs = [rel_err(low[k], ref[k]) for k in ref if ref[k].norm() > 0]
    assert all(v.dtype == torch.float32 for v in low.values())
    assert float(torch.tensor(errs).median()) < 0.05, max(errs)


def test_silu_gate_keeps_only_gate_up_and_matches_eager_bitwise():
    """The experts' SiLU gate keeps only the gate_up rows for the backward (eager autograd also keeps
    silu(gate)), with the same forward and input gradient, bit for bit."""
    import torch.nn.functional as F

    from moe_attrib.model.layouts.routed import SiluGate

    def kept_bytes(fn, x):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(x)
        return y, sum(storages.values())

    x = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(40, 8, dtype=torch.bfloat16)

    def eager(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    outs, grads, kept = [], [], []
    for fn in (SiluGate.apply, eager):
        y, nbytes = kept_bytes(fn, x)
        (grad,) = torch.autograd.grad(y, x, g)
        outs.append(y)
        grads.append(grad)
        kept.append(nbytes)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert kept[0] == x.numel() * x.element_size() and kept[1] == kept[0] * 3 // 2, kept
