"""Scoring against brute-force dot products, EK-FAC preconditioning, the CLI end to end."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_attrib.curvature.ekfac import fit_ekfac, load_ekfac
from moe_attrib.data import load_examples
from moe_attrib.indexing.index import load_index
from moe_attrib.scoring.score import ScoreError, precondition_queries, query_gradients, score
from tests.conftest import assert_top_rows
from tests.test_build import CORPUS, ENV, build, model_dir  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def built(model_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("score")
    build(model_dir, CORPUS, "--index", root / "idx", "--track_moe_experts", "--projection_dim", 8, "--seed", 2)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    train = load_examples(str(CORPUS), tok)
    ek = fit_ekfac(model, train, projection_dim=8, seed=2, progress=False, out=root / "ek")
    return root, model, tok, train, ek


def test_scores_equal_brute_force(built):
    root, model, tok, train, ek = built
    index = load_index(root / "idx")
    q = query_gradients(model, train[:3], index, pad_id=tok.pad_token_id)
    full = np.asarray(index.gradients, dtype=np.float64)
    for kwargs in ({"unit_normalize": False}, {"unit_normalize": True}, {"ekfac": ek, "unit_normalize": False}):
        res = score(
            index, q, top_k=5, per_module=True, block_rows=7, device="cpu", coupling=None, balance=None, **kwargs
        )
        qq = q.double().numpy()
        if "ekfac" in kwargs:
            qq = precondition_queries(q, index.blocks, ek, index.manifest["settings"]).double().numpy()
        rows = full
        if kwargs.get("unit_normalize"):
            qq = qq / np.linalg.norm(qq, axis=1, keepdims=True)
            rows = full / np.linalg.norm(full, axis=1, keepdims=True)
        brute = qq @ rows.T
        order = np.argsort(-brute, axis=1)[:, :5]
        assert_top_rows(res.rows, brute)
        assert np.allclose(res.values, np.take_along_axis(brute, order, 1), rtol=1e-4), kwargs
        assert np.allclose(res.parts.sum(-1), res.values, rtol=1e-4)
    # a training example is its own top match (exact inner product)
    got = score(index, q, top_k=1, unit_normalize=False, device="cpu", coupling=None, balance=None)
    assert list(got.rows[:, 0]) == [0, 1, 2]


def test_preconditioning_matches_factor_apply(built):
    root, model, tok, train, ek = built
    index = load_index(root / "idx")
    q = query_gradients(model, train[:2], index, pad_id=tok.pad_token_id)
    pre = precondition_queries(q, index.blocks, ek, index.manifest["settings"])
    block = next(b for b in index.blocks if b.name == "model.layers.1.mlp.experts.expert_3.down_proj.weight")
    f = ek.factors["model.layers.1.mlp.experts.down_proj"]
    g = q[:, block.start : block.stop].reshape(2, 8, 8).double()
    qr, qc = f.rows_cols
    expected = qr[3] @ ((qr[3].T @ g @ qc[3]) / (f.lam[3] + f.damping[3])) @ qc[3].T
    assert torch.allclose(pre[:, block.start : block.stop].reshape(2, 8, 8).double(), expected, rtol=1e-4)
    wrong = fit_ekfac(model, train[:4], projection_dim=4, progress=False)
    with pytest.raises(ScoreError, match="projection_dim"):
        precondition_queries(q, index.blocks, wrong, index.manifest["settings"])


def test_cli_score_end_to_end(built, model_dir, tmp_path):  # noqa: F811
    root, *_ = built
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"text": "Ada was born in Lisbon ."}) + "\n")
    out = tmp_path / "scores.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "score", "--index", str(root / "idx"), str(model_dir), str(queries),
         "--ekfac", str(root / "ek"), "--per_module", "--top_k", "3", "--out", str(out)],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    line = json.loads(out.read_text().splitlines()[0])
    assert len(line["results"]) == 3 and line["results"][0]["text"]
    assert any(k.endswith("expert_0") for k in line["results"][0]["per_module"]["experts"])
    assert load_ekfac(root / "ek").projection_dim == 8


def test_cli_score_against_a_token_index(model_dir, tmp_path):  # noqa: F811
    build(model_dir, CORPUS, "--index", tmp_path / "tok", "--projection_dim", 4, "--attribute_tokens")
    index = load_index(tmp_path / "tok")
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"text": "Boris was born in Perth ."}) + "\n")
    out = tmp_path / "s.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "score", "--index", str(tmp_path / "tok"), str(model_dir), str(queries),
         "--top_k", "5", "--out", str(out)],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    for hit in json.loads(out.read_text())["results"]:
        start, stop = index.token_offsets[hit["example"]], index.token_offsets[hit["example"] + 1]
        assert start <= hit["row"] < stop and hit["token"] == hit["row"] - start
