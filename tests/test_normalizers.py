"""Optimizer-state normalisation with a real optimizer state after a few steps."""

import pytest
import torch

import moe_attrib as ma
from moe_attrib.collect.collector import GradientCollector, example_losses
from moe_attrib.collect.normalizers import Normalizer, OptimizerStateError, load_optimizer_state
from moe_attrib.collect.projection import projection_matrix
from moe_attrib.model.zoo import tiny_model
from tests.conftest import rel_err


def train_a_bit(model, optimizer, ids, mask, steps=3):
    for p in model.parameters():
        p.requires_grad_(True)
    for _ in range(steps):
        out = model(input_ids=ids, attention_mask=mask)
        example_losses(out.logits, ids.masked_fill(mask == 0, -100)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def expected_scaling(state, transposed):
    """1/sqrt(v) in rank-1 form, computed straight from the optimizer's tensors."""
    if "row_var" in state:
        v = state["row_var"] @ state["col_var"] / state["row_var"].mean(dim=-2, keepdim=True)
    else:
        v = state["exp_avg_sq"] / (1 - 0.999 ** float(state["step"]))
        v = v.mean(-1, keepdim=True) * v.mean(-2, keepdim=True) / v.mean(dim=(-1, -2), keepdim=True)
    return 1 / (v.double() + 0).sqrt()


@pytest.mark.parametrize("family,opt", [("qwen3_moe", "adam"), ("gpt_oss", "adam"), ("qwen3_moe", "adafactor")])
def test_normalised_projected_gradients(family, opt, padded_batch, tmp_path):
    ids, mask = padded_batch
    model = tiny_model(family)
    optimizer = (torch.optim.Adam if opt == "adam" else torch.optim.Adafactor)(model.parameters(), lr=1e-3)
    train_a_bit(model, optimizer, ids, mask)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    states = load_optimizer_state(tmp_path, model)  # an HF-Trainer-style checkpoint directory
    report = ma.discover(model)
    normalizer = Normalizer(model, report, states)
    exact = ma.per_example_gradients(model, ids, mask)
    p, seed = 8, 1
    with GradientCollector(model, report, projector=normalizer.projector(p, seed)) as collector:
        got = collector.collect(ids, mask)
    lay = report.experts[0]
    checks = [(f"{lay.name}.{proj}", lay.param(proj), lay.transposed, True) for proj in lay.projections]
    q = next(t for t in report.targets if t.name.endswith("layers.1.self_attn.q_proj"))
    checks.append((q.name, q.module.weight, False, False))
    names = {id(w): n for n, w in model.named_parameters()}
    for name, weight, transposed, fused in checks:
        scale = expected_scaling(optimizer.state[weight], transposed)
        rows, cols = weight.shape[-2:]
        fin, fout = (rows, cols) if transposed else (cols, rows)
        batch = weight.shape[0] if fused else None
        p_in = projection_matrix(f"{name}/in", p, fin, seed, batch).double()
        p_out = projection_matrix(f"{name}/out", p, fout, seed, batch).double()
        for i in range(weight.shape[0] if fused else 1):
            key = f"{lay.expert_name(i, name.rsplit('.', 1)[1])}.weight" if fused else f"{name}.weight"
            s = scale[i] if fused else scale
            left, right = (
                (p_in[i], p_out[i]) if fused and transposed else ((p_out[i], p_in[i]) if fused else (p_out, p_in))
            )
            expected = left @ (exact[key].double() * s) @ right.T
            assert rel_err(got[key], expected) < 1e-4, (names[id(weight)], i, rel_err(got[key], expected))


def test_mismatched_state_is_an_error(tmp_path):
    model = tiny_model("qwen3_moe")
    other = tiny_model("mixtral")
    opt = torch.optim.Adam(other.parameters())
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    with pytest.raises(OptimizerStateError, match="parameters"):
        load_optimizer_state(tmp_path / "opt.pt", model)
    with pytest.raises(OptimizerStateError, match="cannot read"):
        load_optimizer_state(tmp_path / "missing.pt", model)


def test_build_and_score_with_optimizer_state(tmp_path):
    """The index and the query gradients are normalised alike: a training example finds itself."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from moe_attrib.indexing.index import load_index
    from moe_attrib.model.zoo import save_tiny
    from tests.test_build import CORPUS, ENV, texts

    model_dir = tmp_path / "m"
    save_tiny(str(model_dir), "qwen3_moe", texts())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(3, model.config.vocab_size, (4, 12))
    train_a_bit(model, opt, ids, torch.ones_like(ids))
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    model.save_pretrained(model_dir)
    run = [sys.executable, "-m", "moe_attrib"]
    res = subprocess.run(run + ["build", str(model_dir), str(CORPUS), "--index", str(tmp_path / "idx"),
                                "--track_moe_experts", "--projection_dim", "8", "--quiet", "--precision", "fp32",
                                "--optimizer_state", str(tmp_path / "opt.pt")],
                         capture_output=True, text=True, env=ENV, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert load_index(tmp_path / "idx").manifest["settings"]["optimizer_state"].endswith("opt.pt")
    first = json.loads(CORPUS.read_text().splitlines()[0])
    (tmp_path / "q.jsonl").write_text(json.dumps(first) + "\n")
    res = subprocess.run(run + ["score", "--index", str(tmp_path / "idx"), str(model_dir), str(tmp_path / "q.jsonl"),
                                "--top_k", "1", "--out", str(tmp_path / "s.jsonl")],
                         capture_output=True, text=True, env=ENV, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "s.jsonl").read_text())["results"][0]["example"] == 0
