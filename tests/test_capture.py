"""Capture pipeline: accelerate hooks, kernel fallbacks, runtime router taps, exception safety, layout checks."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_attrib as ma
from moe_attrib.collect.projection import projection_matrix
from moe_attrib.curvature.ekfac import fit_ekfac
from moe_attrib.data import Example
from moe_attrib.model.zoo import tiny_model
from tests.conftest import rel_err
from tests.reference import reference_gradients


def _mode_depth() -> int:
    return torch._C._len_torch_function_stack()


def _assert_matches_reference(grads, model, ids, mask, report, names=None):
    ref = reference_gradients(model, ids, mask, report.targets)
    keys = names or list(grads)
    for key in keys:
        for n in range(ids.shape[0]):
            if ref[n][key].norm() == 0:
                assert grads[key][n].abs().max() < 1e-6, (key, n)
            else:
                assert rel_err(grads[key][n], ref[n][key]) < 1e-4, (key, n, rel_err(grads[key][n], ref[n][key]))


# -- accelerate ---------------------------------------------------------------------------------


def test_accelerate_hooks_survive_collect_and_restore(padded_batch):
    pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    expected = ma.per_example_gradients(model, ids, mask)  # no hooks
    report = ma.discover(model)
    hooked = [lay.module for lay in report.experts] + [model.model.layers[0].mlp.gate]
    for module in hooked:  # what dispatch_model / device_map installs, plus a hook that counts calls
        add_hook_to_module(module, SequentialHook(AlignDevicesHook(execution_device="cpu"), Counting()))
    installed = {id(m): (m.__dict__["forward"], m.__dict__["_old_forward"], m._hf_hook) for m in hooked}
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits

    got = ma.per_example_gradients(model, ids, mask)
    assert Counting.calls >= len(hooked)  # accelerate's forward ran around the collection forward
    assert set(got) == set(expected)
    assert all(torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-7) for k in got)
    for m in hooked:  # restored exactly: accelerate's instance forward, its hook and the wrapped forward
        forward, old_forward, hook = installed[id(m)]
        assert m.__dict__["forward"] is forward and m.__dict__["_old_forward"] is old_forward and m._hf_hook is hook
        assert old_forward.__func__ is type(m).forward
    calls = Counting.calls
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after) and Counting.calls > calls


# -- kernel fallbacks -----------------------------------------------------------------------------


def test_oom_in_grouped_mm_propagates_and_leaves_no_fallback(padded_batch, monkeypatch):
    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    real = F.grouped_mm
    calls = []

    def oom(*args, **kwargs):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(F, "grouped_mm", oom)
    with ma.GradientCollector(model, projection_dim=8) as collector:
        with pytest.raises(torch.OutOfMemoryError):
            collector.collect(ids, mask)
        assert calls, "grouped_mm was not reached"
        assert collector.fallbacks == {}
        assert _mode_depth() == 0
    monkeypatch.setattr(F, "grouped_mm", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback announced: grouped_mm is used again
        with ma.GradientCollector(model, projection_dim=8) as collector:
            collector.collect(ids, mask)
            assert collector.fallbacks == {}
    assert not any(p.requires_grad is False for p in model.parameters())


def test_unsupported_grouped_mm_falls_back_for_that_collector_only(padded_batch, monkeypatch):
    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    expected = ma.per_example_gradients(model, ids, mask)
    real = F.grouped_mm

    def unsupported(*args, **kwargs):
        raise NotImplementedError("grouped_mm: no kernel for this device")

    monkeypatch.setattr(F, "grouped_mm", unsupported)
    with pytest.warns(UserWarning, match="no kernel for this device") as record:
        with ma.GradientCollector(model) as collector:
            got = collector.collect(ids, mask)
            collector.collect(ids, mask)
    # each kernel announced once over both batches: the grouped matmul and the segment sums (formation)
    assert sum("is not available" in str(w.message) for w in record) == 2
    assert sorted(collector.fallbacks) == ["grouped_mm(segments)[cpu, torch.float32]", "grouped_mm[cpu, torch.float32]"]
    assert all(torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-7) for k in got)
    monkeypatch.setattr(F, "grouped_mm", real)
    with ma.GradientCollector(model) as fresh:
        fresh.collect(ids, mask)
        assert fresh.fallbacks == {}


# -- routers found at run time ------------------------------------------------------------------


class HelperRouter(nn.Module):
    """Scores tokens through a helper method that reads a child's weight (no `self.wg.weight` in forward)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.top_k = 2
        self.wg = nn.Linear(hidden, experts, bias=False)

    def scores(self, x):
        return F.linear(x.float(), self.wg.weight.float())

    def forward(self, x):
        return torch.softmax(self.scores(x), dim=-1)


class ToyLM(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 16, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.router = HelperRouter(hidden, experts)
        self.mix = nn.Linear(experts, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        h = self.embed(input_ids)
        h = h + torch.tanh(self.mix(self.router(h)))
        return SimpleNamespace(logits=self.head(h))


def test_router_weight_used_through_a_helper_method_is_captured(padded_batch):
    ids, mask = padded_batch
    torch.manual_seed(0)
    model = ToyLM()
    report = ma.discover(model)
    assert "router.wg" in report.routers
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "received no gradient" warning
        with ma.GradientCollector(model, report) as collector:
            first = collector.collect(ids, mask)  # uses found at run time
            second = collector.collect(ids, mask)  # tapped in HelperRouter.forward from now on
    assert first["router.wg.weight"].abs().sum() > 0
    _assert_matches_reference(first, model, ids, mask, report)
    _assert_matches_reference(second, model, ids, mask, report)


def test_router_weight_not_used_through_a_linear_is_an_error(padded_batch):
    ids, mask = padded_batch
    model = ToyLM()
    model.router.scores = lambda x: torch.einsum("bsh,eh->bse", x, model.router.wg.weight)
    with ma.GradientCollector(model) as collector:
        with pytest.raises(ma.LayoutError, match=r"router\.wg .*einsum in HelperRouter\.forward"):
            collector.collect(ids, mask)
    assert _mode_depth() == 0


@pytest.mark.parametrize("batch_index", [0, 1], ids=["first_batch", "later_batch"])
def test_exception_inside_a_router_forward_leaves_no_mode_on_the_stack(padded_batch, batch_index):
    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    router = model.model.layers[1].mlp.gate
    original = type(router).forward

    def boom(self, *args, **kwargs):
        original(self, *args, **kwargs)  # the weight is used (and tapped), then the forward fails
        raise RuntimeError("boom inside the router")

    with ma.GradientCollector(model) as collector:
        if batch_index:
            collector.collect(ids, mask)
        router.forward = boom.__get__(router)
        with pytest.raises(RuntimeError, match="boom inside the router"):
            collector.collect(ids, mask)
        assert _mode_depth() == 0
        del router.forward
        got = collector.collect(ids, mask)  # the collector still works
    assert _mode_depth() == 0
    _assert_matches_reference(got, model, ids, mask, ma.discover(model), ["model.layers.1.mlp.gate.weight"])


# -- experts checked against their own forward ------------------------------------------------


def test_decorated_experts_forward_disagreeing_with_the_layout_is_an_error(padded_batch):
    from transformers.integrations.moe import use_experts_implementation

    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts

    class UpFirst(type(experts)):
        """Stores [up; gate] although it declares the default [gate; up] layout."""

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for slot in range(top_k_index.shape[-1]):
                for e in range(self.num_experts):
                    rows = top_k_index[:, slot] == e
                    up, gate = F.linear(hidden_states[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                    y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
                    out[rows] += y * top_k_weights[rows, slot, None]
            return out

    experts.__class__ = use_experts_implementation(UpFirst)
    with ma.GradientCollector(model) as collector:
        with pytest.raises(ma.LayoutError, match=r"layers\.0\.mlp\.experts.*differs from the module's own forward"):
            collector.collect(ids, mask)
    assert "forward" not in vars(experts) and _mode_depth() == 0


# -- unknown experts layouts no longer block the rest ------------------------------------------


def _tiny_dbrx():
    from transformers.models.dbrx import configuration_dbrx, modeling_dbrx

    config = configuration_dbrx.DbrxConfig(
        d_model=32,
        n_heads=4,
        n_layers=1,
        vocab_size=128,
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # None fails in DbrxAttention
    )
    torch.manual_seed(0)
    return modeling_dbrx.DbrxForCausalLM(config).eval()


def test_unknown_experts_layout_builds_attention_only_with_a_warning(padded_batch):
    ids, mask = padded_batch
    model = _tiny_dbrx()
    experts = next(n for n, m in model.named_modules() if type(m).__name__ == "DbrxExpertGLU")
    with pytest.raises(ma.LayoutError, match=rf"{experts}.*--filter_modules"):
        ma.discover(model, track_moe_experts=True)
    with pytest.warns(UserWarning, match=rf"{experts} \([\d,]+ parameters\).*%") as record:
        report = ma.discover(model, track_moe_experts=False)
    lost = sum(p.numel() for n, p in model.named_parameters() if n.startswith(experts + "."))
    share = lost / sum(p.numel() for p in model.parameters())
    assert any(f"{share:.1%}" in str(w.message) for w in record)
    assert all(experts not in name for name in report.tracked)
    assert any("attn" in name for name in report.tracked)
    assert all("cannot read" in report.skipped[n] for n, _ in model.named_parameters() if n.startswith(experts))
    with pytest.warns(UserWarning, match=experts):
        filtered = ma.discover(model, track_moe_experts=True, filter_modules="*.attn.*")
    assert filtered.tracked and all(".attn." in name for name in filtered.tracked)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        grads = ma.per_example_gradients(model, ids, mask, track_moe_experts=False)
    _assert_matches_reference(grads, model, ids, mask, report)


# -- grouped linears are ordinary captures now -----------------------------------------------


def test_ekfac_covers_grouped_linears_against_brute_force_covariances():
    """deepseek_v4's o_a_proj: rows are (token, group) pairs; A and G (the data's labels) equal brute force."""
    model = tiny_model("deepseek_v4")
    name, p = "model.layers.0.self_attn.o_a_proj", 8
    module = model.get_submodule(name)
    groups, out = module.n_groups, module.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    exs = [Example(i, torch.randint(3, 128, (int(n),), generator=g).tolist()) for i, n in enumerate([9, 5, 12, 7])]
    ek = fit_ekfac(
        model, exs, projection_dim=p, filter_modules="*.o_a_proj", sampled_labels=False, token_batch_size=64,
        progress=False,
    )  # fmt: skip
    assert name in ek.factors
    fin = module.weight.shape[1]  # 8 = p: the default kind keeps this side exact (identity)
    p_in = (torch.eye(fin) if fin <= p else projection_matrix(f"{name}/in", p, fin).T).double()
    p_out = projection_matrix(f"{name}/out", p, out).T.double().view(groups, out // groups, p)
    xs, gs = [], []

    def hook(m, args, y):
        xs.append(args[0].detach().reshape(-1, args[0].shape[-1]).double() @ p_in)
        y.register_hook(
            lambda dy: gs.append(
                torch.einsum("tgo,gop->tgp", dy.reshape(-1, groups, out // groups).double(), p_out).reshape(-1, p)
            )
        )

    handle = module.register_forward_hook(hook)
    try:
        for ex in exs:  # one unpadded example at a time, autograd's own output gradients
            ids = torch.tensor([ex.input_ids])
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum").backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    x, gy = torch.cat(xs), torch.cat(gs)
    f = ek.factors[name]
    assert int(f.tokens) == x.shape[0] == sum(len(e.input_ids) for e in exs) * groups
    assert rel_err(f.A, x.T @ x / x.shape[0]) < 1e-5
    assert rel_err(f.G, gy.T @ gy / gy.shape[0]) < 1e-4
    assert torch.isfinite(f.lam).all() and f.lam.sum() > 0


@pytest.mark.parametrize("projection_dim", [None, 8], ids=["exact", "projected"])
def test_grouped_linear_token_rows_sum_to_its_example_gradient(padded_batch, projection_dim):
    ids, mask = padded_batch
    model = tiny_model("deepseek_v4")
    key = "model.layers.0.self_attn.o_a_proj.weight"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # compressor modules off the loss path
        with ma.GradientCollector(model, projection_dim=projection_dim) as collector:
            examples = collector.collect(ids, mask, fused_experts=True)
            tokens = collector.collect(ids, mask, attribute_tokens=True)
        if projection_dim is None:
            exact = ma.per_example_gradients(model, ids, mask)
            _assert_matches_reference(exact, model, ids, mask, ma.discover(model), [key])
    assert tokens[key].shape[:2] == ids.shape
    assert rel_err(tokens[key].sum(dim=1), examples[key]) < 1e-5
    assert tokens[key][mask == 0].abs().max() == 0  # padding positions carry nothing


def test_experts_are_checked_once_per_process(padded_batch, monkeypatch):
    """The check against the module's own (eager, slow) forward runs on the first capture only;
    a later collector on the same module skips it and still gives the same gradients."""
    from moe_attrib.collect.capture import Capture

    ids, mask = padded_batch
    model = tiny_model("qwen3_moe")
    calls = []
    original = Capture._verify
    monkeypatch.setattr(
        Capture, "_verify", lambda self, layout, *a: calls.append(layout.name) or original(self, layout, *a)
    )
    with ma.GradientCollector(model, projection_dim=4) as collector:
        first = collector.collect(ids, mask)
    assert sorted(calls) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with ma.GradientCollector(model, projection_dim=4) as collector:
        second = collector.collect(ids, mask)
    assert len(calls) == 2
    assert all(torch.equal(first[k], second[k]) for k in first)
    with ma.GradientCollector(tiny_model("qwen3_moe"), projection_dim=4) as collector:  # another model: checked
        collector.collect(ids, mask)
    assert len(calls) == 4


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4_text"])
def test_a_collection_leaves_no_tensor_in_a_reference_cycle(family, padded_batch):
    """Everything a batch recorded is freed when its last reference goes, not at the next garbage
    collection: on a 48-layer model at 8k tokens a cycle per experts layer held megabytes per batch."""
    import gc

    ids, mask = padded_batch
    model = tiny_model(family)

    def tensors() -> int:
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    with ma.GradientCollector(model, projection_dim=8) as collector:
        collector.collect(ids, mask, fused_experts=True)  # first batch: the one-time checks
        gc.collect()
        gc.disable()
        try:
            out = collector.collect(ids, mask, fused_experts=True)
            del out
            left = tensors()
            gc.collect()
            assert tensors() == left
        finally:
            gc.enable()


@pytest.mark.parametrize("recompute", [False, True])
def test_a_build_leaves_nothing_for_the_garbage_collector(recompute, tmp_path):
    """A finished build frees its collector, capture and projection matrices at once, not at the next
    garbage collection: on a 48-layer model a cycle through them held 2.4-2.8 GB of GPU memory until then."""
    import gc

    from moe_attrib.data import Example

    model = tiny_model("qwen3_moe")
    gen = torch.Generator().manual_seed(0)
    examples = [Example(i, torch.randint(3, 100, (5 + 3 * i,), generator=gen).tolist()) for i in range(6)]

    def build(path):
        ma.build_index(
            model, examples, path, projection_dim=8, token_batch_size=48, recompute=recompute, progress=False
        )

    build(tmp_path / "first")  # one-time checks and caches
    gc.collect()
    gc.disable()
    try:
        build(tmp_path / "second")
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        ours = {type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("moe_attrib")}
        ours |= {"Tensor" for o in gc.garbage if isinstance(o, torch.Tensor)}
        assert not ours
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
