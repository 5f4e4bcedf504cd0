"""EK-FAC: factors against brute force, corrected eigenvalues, approximation quality, I/O, torchrun."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moe_attrib as ma
from moe_attrib.collect.projection import projection_matrix
from moe_attrib.curvature.ekfac import FactorMemoryError, fit_ekfac, load_ekfac
from moe_attrib.data import Example, collate
from moe_attrib.model.zoo import tiny_model
from tests.conftest import rel_err, run_torchrun
from tests.test_build import CORPUS, ENV, model_dir  # noqa: F401  (fixture)


def examples(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 14, (n,), generator=g)
    return [Example(i, torch.randint(3, 128, (int(lengths[i]),), generator=g).tolist()) for i in range(n)]


def brute_force_expert_covariances(model, exs, layer=0):
    """A_e, G_e of every expert of `layer`'s gate_up_proj by a per-expert loop, one example at a time."""
    experts = model.model.layers[layer].mlp.experts
    E, (H, I2) = experts.num_experts, (experts.gate_up_proj.shape[2], experts.gate_up_proj.shape[1])
    A, G, count = torch.zeros(E, H, H, dtype=torch.float64), torch.zeros(E, I2, I2, dtype=torch.float64), torch.zeros(E)
    store = {}

    def loop_forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(E):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            x = hidden[tok]
            probe = torch.zeros(tok.numel(), I2, requires_grad=True)
            h = F.linear(x, experts.gate_up_proj[e]) + probe
            store[e] = (x.detach(), probe)
            gate, up = h.chunk(2, dim=-1)
            y = F.linear(experts.act_fn(gate) * up, experts.down_proj[e]) * top_k_weights[tok, slot, None]
            out = out.index_add(0, tok, y)
        return out

    experts.forward = loop_forward
    try:
        for ex in exs:
            store.clear()
            ids = torch.tensor([ex.input_ids])
            logits = model(input_ids=ids).logits[0, :-1]
            F.cross_entropy(logits, ids[0, 1:], reduction="sum").backward()
            for e, (x, probe) in store.items():
                A[e] += x.double().T @ x.double()
                G[e] += probe.grad.double().T @ probe.grad.double()
                count[e] += x.shape[0]
    finally:
        del experts.forward
        model.zero_grad(set_to_none=True)
    n = count.clamp(min=1).view(E, 1, 1).double()
    return A / n, G / n, count


# gpt_oss modules with biases: a fused experts projection (transposed), an attention projection, the router
GPT_OSS_BIASED = [
    "model.layers.1.mlp.experts.down_proj",
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.mlp.router",
]


def test_expert_factors_equal_brute_force_covariances():
    model = tiny_model("qwen3_moe")
    exs = examples()
    ek = fit_ekfac(model, exs, projection_dim=None, token_batch_size=40, progress=False, sampled_labels=False)
    A, G, count = brute_force_expert_covariances(model, exs)
    f = ek.factors["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(f.tokens.float(), count)
    assert (count == 0).sum() < len(count)
    # fp32 rows from a padded batch vs one unpadded example at a time: agree to fp32 rounding
    assert rel_err(f.A, A) < 1e-5 and rel_err(f.G, G) < 1e-5, (rel_err(f.A, A), rel_err(f.G, G))


def test_corrected_eigenvalues_equal_mean_squared_rotated_gradients():
    model = tiny_model("gpt_oss")  # transposed layouts and biases (not folded here: see the next test)
    exs = examples(10)
    ek = fit_ekfac(
        model, exs, projection_dim=None, token_batch_size=1000, progress=False, sampled_labels=False, fold_bias=False
    )
    ids, mask = collate(exs, list(range(len(exs))))
    grads = ma.per_example_gradients(model, ids, mask)
    for name in GPT_OSS_BIASED:
        f = ek.factors[name]
        qr, qc = f.rows_cols
        w = _stacked(grads, name, f.experts, "weight")
        expected = ((qr.transpose(-1, -2) @ w.double() @ qc) ** 2).mean(dim=0)
        assert rel_err(f.lam, expected) < 1e-5, (name, rel_err(f.lam, expected))


def _stacked(grads, name: str, experts: int | None, kind: str) -> torch.Tensor:
    if not experts:
        return grads[f"{name}.{kind}"]
    layer, proj = name.rsplit(".", 1)
    return torch.stack([grads[f"{layer}.expert_{i}.{proj}.{kind}"] for i in range(experts)], dim=1)


def test_folded_bias_factors_eigenvalues_and_preconditioning():
    """Kronfluence's bias folding: `A` of `[x, 1]`, Lambda of the rotated `[W, b]` per example, and the
    preconditioned `[W, b]` equal to a dense solve with the EK-FAC matrix."""
    from moe_attrib.indexing.index import Block
    from moe_attrib.scoring.score import precondition_queries

    model = tiny_model("gpt_oss")  # biases on attention, routers and experts; transposed experts
    exs = examples(10)
    ek = fit_ekfac(model, exs, projection_dim=None, token_batch_size=1000, progress=False, sampled_labels=False)
    assert ek.settings["fold_bias"] is True
    ids, mask = collate(exs, list(range(len(exs))))
    inputs = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: inputs.append(a[0].detach()))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    hook.remove()
    x = inputs[0].reshape(-1, inputs[0].shape[-1])[mask.reshape(-1).bool()].double()
    f = ek.factors["model.layers.0.self_attn.q_proj"]
    a = x.shape[1]
    assert f.bias and f.A.shape == (a + 1, a + 1)
    assert rel_err(f.A[:a, :a], x.T @ x / len(x)) < 1e-5
    assert rel_err(f.A[:a, a], x.mean(dim=0)) < 1e-5 and abs(float(f.A[a, a]) - 1.0) < 1e-12

    grads = ma.per_example_gradients(model, ids, mask)
    for name in GPT_OSS_BIASED:
        f = ek.factors[name]
        folded = f.augment(_stacked(grads, name, f.experts, "weight"), _stacked(grads, name, f.experts, "bias"))
        qr, qc = f.rows_cols
        expected = ((qr.transpose(-1, -2) @ folded.double() @ qc) ** 2).mean(dim=0)
        assert rel_err(f.lam, expected) < 1e-5, (name, rel_err(f.lam, expected))

    name = "model.layers.0.mlp.router"
    f = ek.factors[name]
    w, b = grads[f"{name}.weight"][0].double(), grads[f"{name}.bias"][0].double()
    blocks = [
        Block(f"{name}.weight", 0, w.numel(), tuple(w.shape)),
        Block(f"{name}.bias", w.numel(), w.numel() + b.numel(), tuple(b.shape)),
    ]
    query = torch.cat([w.reshape(-1), b]).float()[None]
    got = precondition_queries(query, blocks, ek, {"projection_dim": None, "seed": 0})[0].double()
    qr, qc = f.rows_cols
    kron = torch.kron(qr, qc)  # row-major vec: vec(qr^T F qc) = kron(qr, qc)^T vec(F)
    dense = kron @ torch.diag((f.lam + f.damping).reshape(-1)) @ kron.T
    want_w, want_b = f.split(torch.linalg.solve(dense, f.augment(w, b).reshape(-1)).view(f.lam.shape))
    assert rel_err(got[: w.numel()], want_w.reshape(-1)) < 1e-5
    assert rel_err(got[w.numel() :], want_b) < 1e-5
    unfolded = fit_ekfac(
        model, exs, projection_dim=None, token_batch_size=1000, progress=False, sampled_labels=False, fold_bias=False
    )
    assert torch.equal(
        precondition_queries(query, blocks, unfolded, {"projection_dim": None, "seed": 0})[0, w.numel() :],
        query[0, w.numel() :],
    )


def test_projected_factors_are_projected_covariances():
    model = tiny_model("qwen3_moe")
    exs = examples(8)
    full = fit_ekfac(model, exs, projection_dim=None, token_batch_size=1000, progress=False, sampled_labels=False)
    proj = fit_ekfac(model, exs, token_batch_size=1000, projection_dim=8, seed=3, progress=False, sampled_labels=False)
    name = "model.layers.1.mlp.experts.down_proj"
    p_in = projection_matrix(f"{name}/in", 8, 32, 3, batch=8).double()
    assert torch.allclose(proj.factors[name].A, p_in @ full.factors[name].A @ p_in.transpose(1, 2), atol=1e-8)
    name = "model.layers.0.self_attn.o_proj"
    p_out = projection_matrix(f"{name}/out", 8, 64, 3).double()
    assert torch.allclose(proj.factors[name].G, p_out @ full.factors[name].G @ p_out.T, atol=1e-8)


def test_ekfac_beats_kfac_and_identity_on_an_exact_block_fisher(capsys):
    model = tiny_model("qwen3_moe")
    exs = examples(48, seed=1)
    ek = fit_ekfac(model, exs, projection_dim=None, token_batch_size=1000, progress=False, sampled_labels=False)
    ids, mask = collate(exs, list(range(48)))
    grads = ma.per_example_gradients(model, ids, mask)
    name = "model.layers.1.self_attn.k_proj"  # 32 x 64: a 2048 x 2048 block Fisher
    f = ek.factors[name]
    w = grads[f"{name}.weight"].double()  # [N, 32, 64]
    vec = w.reshape(48, -1)
    fisher = vec.T @ vec / 48
    qr, qc = f.rows_cols
    basis = torch.kron(qr, qc)  # vec(Qr M Qc^T) = (Qr kron Qc) vec(M) for row-major vec

    def approx(lam):
        return basis @ torch.diag(lam.reshape(-1)) @ basis.T

    err = {
        "ekfac": float((approx(f.lam) - fisher).norm() / fisher.norm()),
        "kfac": float((approx(f.kfac_eigenvalues()) - fisher).norm() / fisher.norm()),
    }
    damp = float(f.damping)
    query = grads[f"{name}.weight"][0].double() + 0.1 * torch.randn(32, 64, dtype=torch.float64)
    exact = torch.linalg.solve(fisher + damp * torch.eye(2048, dtype=torch.float64), query.reshape(-1))

    def cos(a):
        a = a.reshape(-1)
        return float(a @ exact / (a.norm() * exact.norm()))

    sim = {
        "ekfac": cos(f.precondition(query)),
        "kfac": cos(f.precondition(query, f.kfac_eigenvalues())),
        "identity": cos(query),
    }
    with capsys.disabled():
        print(f"\n{name}: Fisher rel. error {err}; cosine to exact (F + damping I)^-1 g: {sim}")
    assert err["ekfac"] < err["kfac"]
    assert sim["ekfac"] > sim["kfac"] and sim["ekfac"] > sim["identity"]


def test_save_load_round_trip(tmp_path):
    model = tiny_model("gpt_oss")
    ek = fit_ekfac(model, examples(6), projection_dim=None, token_batch_size=1000, progress=False, out=tmp_path / "ek")
    back = load_ekfac(tmp_path / "ek")
    assert set(back.factors) == set(ek.factors)
    for name, f in ek.factors.items():
        g = back.factors[name]
        for key in ("A", "G", "QA", "QG", "lam", "damping", "tokens"):
            assert torch.equal(getattr(f, key), getattr(g, key)), (name, key)
        grad = torch.randn(f.lam.shape, dtype=torch.float64)
        # equal factors; eigh's column-major bases come back row-major, so matmuls may round differently
        assert torch.allclose(f.precondition(grad), g.precondition(grad), rtol=1e-10)


def test_memory_budget_refusal():
    with pytest.raises(FactorMemoryError, match="--projection_dim"):
        fit_ekfac(tiny_model("qwen3_moe"), examples(2), projection_dim=None, max_memory_gib=1e-6, progress=False)


def test_cli_torchrun_two_ranks_equal_one(model_dir, tmp_path):  # noqa: F811
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not Path(torchrun).exists():
        pytest.skip("torchrun not installed")
    args = [
        str(model_dir),
        str(CORPUS),
        "--track_moe_experts",
        "--token_batch_size",
        "64",
        "--quiet",
        "--precision",
        "fp32",
    ]
    env = {**ENV, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "ekfac", *args, "--out", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_torchrun(
        [
            torchrun,
            "--nproc_per_node=2",
            "-m",
            "moe_attrib",
            "ekfac",
            *args,
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "two"),
            "--overwrite",  # a retried run (see run_torchrun) replaces what the aborted one wrote
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load_ekfac(tmp_path / "one"), load_ekfac(tmp_path / "two")
    for name, f in a.factors.items():
        g = b.factors[name]
        for key in ("A", "G", "tokens", "lam"):
            assert torch.allclose(getattr(f, key), getattr(g, key), rtol=1e-9, atol=1e-12), (name, key)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_attrib",
            "ekfac",
            *args,
            "--out",
            str(tmp_path / "x"),
            "--max_factor_memory",
            "1e-6",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert refused.returncode == 2 and "--filter_modules" in refused.stderr


def test_partitions_merge(tmp_path):
    model = tiny_model("qwen3_moe")
    exs = examples(6)
    kw = dict(projection_dim=None, token_batch_size=1000, progress=False)
    whole = fit_ekfac(model, exs, **kw)
    for part, modules in (("a", "model.layers.0.*"), ("b", "model.layers.1.*"), ("c", "lm_head")):
        fit_ekfac(model, exs, filter_modules=modules, out=tmp_path / part, **kw)
    merged = load_ekfac([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert set(merged.factors) == set(whole.factors)
    for name, f in whole.factors.items():
        assert rel_err(merged.factors[name].lam, f.lam) < 1e-5, name  # rows are rotated in fp32
    with pytest.raises(ValueError, match="twice"):
        load_ekfac([tmp_path / "a", tmp_path / "a"])


def test_modules_off_the_loss_path_get_empty_factors_not_an_error():
    """deepseek_v4's attention compressor receives no gradient: its factors stay empty (zero Lambda,
    no tokens) and the rest are fitted; the eigenvalue pass used to fail on its zero-filled entry."""
    model = tiny_model("deepseek_v4")
    ek = fit_ekfac(model, examples(6), projection_dim=8, progress=False, sampled_labels=False)
    off = [n for n in ek.factors if ".compressor." in n]
    assert off and all(
        float(ek.factors[n].lam.abs().max()) == 0 and float(ek.factors[n].tokens.sum()) == 0 for n in off
    )
    on = ek.factors["model.layers.0.mlp.experts.down_proj"]
    assert float(on.lam.max()) > 0 and bool((ek.factors[off[0]].damping > 0).all())


def _hand_factors() -> dict:
    """Two factors with identity eigenbases and eigenvalues written out: a dense 2 x 2 module
    (Lambda = [[1, 3], [5, 7]], mean 4) and a fused 2-expert module whose second expert saw nothing
    (Lambda = all 2, all 0: expert means 2 and 0, module mean 1). Model-wide mean: 24 / 12 = 2."""
    from moe_attrib.curvature.ekfac import Factor

    eye = torch.eye(2, dtype=torch.float64)
    dense_lam = torch.tensor([[1.0, 3.0], [5.0, 7.0]], dtype=torch.float64)
    expert_lam = torch.stack([torch.full((2, 2), 2.0), torch.zeros(2, 2)]).double()
    zero = torch.zeros(2, 2, dtype=torch.float64)
    return {
        "dense": Factor("dense", False, None, zero, zero, torch.tensor(4.0), eye, eye, None, None, dense_lam, 4),
        "experts": Factor("experts", False, 2, zero.expand(2, 2, 2), zero.expand(2, 2, 2), torch.tensor([4.0, 0.0]),
                          eye.expand(2, 2, 2), eye.expand(2, 2, 2), None, None, expert_lam, 4),
    }  # fmt: skip


@pytest.mark.parametrize(
    "scope, dense, experts",
    [("model", 1.0, [1.0, 1.0]), ("module", 2.0, [0.5, 0.5]), ("expert", 2.0, [1.0, 1.0])],
)
def test_damping_rule_on_eigenvalues_computed_by_hand(scope, dense, experts):
    """`damping 0.5 x mean(Lambda)` over each scope, against the means worked out by hand (model 2,
    dense module 4, expert module 1, experts 2 and 0; a zero mean falls back to the model-wide
    0.5 x 2 = 1), and the preconditioned gradient of all ones against `1 / (Lambda + damping)`."""
    from moe_attrib.curvature.ekfac import set_damping

    factors = _hand_factors()
    set_damping(factors, 0.5, scope)
    assert factors["dense"].damping.tolist() == dense
    assert factors["experts"].damping.tolist() == experts
    ones = torch.ones(2, 2, dtype=torch.float64)
    lam = torch.tensor([[1.0, 3.0], [5.0, 7.0]], dtype=torch.float64)
    assert torch.allclose(factors["dense"].precondition(ones), 1.0 / (lam + dense))
    got = factors["experts"].precondition(ones.expand(2, 2, 2))
    assert torch.allclose(got[0], torch.full((2, 2), 1.0 / (2.0 + experts[0]), dtype=torch.float64))
    assert torch.allclose(got[1], torch.full((2, 2), 1.0 / experts[1], dtype=torch.float64))


def test_an_interrupted_save_leaves_the_previous_factors_and_no_description(tmp_path, monkeypatch):
    """A save killed while writing the tensors (simulated: half the bytes, then an error) leaves the previous
    `factors.safetensors` byte for byte and no `ekfac.json`, so the directory is refused, never mismatched."""
    import safetensors.torch

    model = tiny_model("qwen3_moe")
    ek = fit_ekfac(model, examples(4), projection_dim=4, token_batch_size=1000, progress=False, out=tmp_path / "ek")
    before = (tmp_path / "ek" / "factors.safetensors").read_bytes()

    def killed(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        ek.save(tmp_path / "ek")
    assert (tmp_path / "ek" / "factors.safetensors").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "ek").iterdir()) == ["factors.safetensors"]
    with pytest.raises(FileNotFoundError):
        load_ekfac(tmp_path / "ek")
