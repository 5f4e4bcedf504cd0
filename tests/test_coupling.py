"""The cross-module coupling against a dense inverse of `B + gamma G^T G / (s m)`, and its CLI."""

import json

import numpy as np
import pytest
import torch

from moe_attrib.curvature.precondition import precondition_queries
from moe_attrib.indexing.index import load_index
from moe_attrib.scoring import coupling as cp
from moe_attrib.scoring.coupling import fit_coupling, resolve_coupling
from moe_attrib.scoring.score import ScoreError, query_gradients, score, score_matrix
from tests.conftest import assert_top_rows
from tests.test_build import CORPUS, ENV, model_dir  # noqa: F401  (fixture)
from tests.test_integrity import cli, inproc
from tests.test_score import built  # noqa: F401  (fixture)
from tests.test_score_stream import write_index


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute(rows: np.ndarray, q: np.ndarray, b_inv: np.ndarray, picked: np.ndarray, gamma: float, rank: int):
    """Scores of `q` with the preconditioner `(B + gamma G^T G / (s m))^-1`, G the unit sampled rows,
    the Gram part kept to its top `rank` directions in the B^-1/2-whitened space; dense, no Woodbury."""
    g = unit(rows[picked])
    s = len(picked)
    w_evals, w_vecs = np.linalg.eigh(b_inv)
    b_inv_half = w_vecs @ np.diag(np.sqrt(w_evals)) @ w_vecs.T
    phi = g @ b_inv_half  # whitened rows
    m = np.trace(phi @ phi.T) / s
    lam, v = np.linalg.eigh(phi.T @ phi)
    lam, v = lam[::-1][:rank], v[:, ::-1][:, :rank]
    inner = np.eye(len(b_inv)) + v @ np.diag(gamma * lam / (s * m)) @ v.T
    pre = b_inv_half @ np.linalg.solve(inner, b_inv_half @ q.T)  # H^-1 q
    return unit(pre.T) @ unit(rows).T


@pytest.mark.parametrize("sample, rank", [(64, 64), (53, 5), (20, 64)])
def test_coupled_scores_equal_the_dense_inverse_without_ekfac(tmp_path, sample, rank):
    rows = np.random.default_rng(0).standard_normal((53, 24)).astype(np.float32)
    rows[:, :6] += 2.0 * rows[:, [0]]  # a direction many rows share: what the coupling shrinks
    index = load_index(write_index(tmp_path / "idx", rows))
    q = np.random.default_rng(1).standard_normal((4, 24)).astype(np.float32)
    picked = np.arange(53) if sample >= 53 else np.sort(np.random.default_rng(7).choice(53, sample, replace=False))
    expected = brute(rows.astype(np.float64), q.astype(np.float64), np.eye(24), picked, 30.0, rank)
    c = fit_coupling(index, gamma=30.0, rank=rank, sample=sample, seed=7)
    assert c.settings["sample"] == len(picked) and c.settings["rank"] == min(rank, len(picked), 24)
    got = score_matrix(index, q, coupling=c, balance=None, device="cpu", block_rows=7)
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-5)
    plain = score_matrix(index, q, coupling=None, balance=None, device="cpu")
    assert np.abs(plain - expected).max() > 1e-2  # the coupling changes the scores
    top = score(index, q, top_k=5, coupling=c, balance=None, per_module=True, device="cpu", block_rows=7)
    assert_top_rows(top.rows, expected)
    assert np.allclose(top.parts.sum(-1), top.values, rtol=1e-5, atol=1e-6)


def test_module_restricted_coupling_is_fitted_on_those_columns(tmp_path):
    rows = np.random.default_rng(2).standard_normal((40, 24)).astype(np.float32)
    index = load_index(write_index(tmp_path / "idx", rows))
    cols = np.concatenate([np.arange(b.start, b.stop) for b in index.blocks if ".experts." in b.name])
    assert 0 < len(cols) < 24
    q = np.random.default_rng(3).standard_normal((3, 24)).astype(np.float32)
    sub = rows[:, cols].astype(np.float64)
    expected = brute(sub, q[:, cols].astype(np.float64), np.eye(len(cols)), np.arange(40), 30.0, 64)
    got = score_matrix(index, q, modules="*.experts.*", device="cpu")
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_coupled_ekfac_scores_equal_the_dense_inverse(built):  # noqa: F811
    root, model, tok, train, ek = built
    index = load_index(root / "idx")
    rows = np.asarray(index.gradients, dtype=np.float64)
    d = rows.shape[1]
    b_inv = precondition_queries(torch.eye(d), index.blocks, ek, index.manifest["settings"]).double().numpy()
    assert np.allclose(b_inv, b_inv.T, atol=1e-6 * np.abs(b_inv).max())
    b_inv = (b_inv + b_inv.T) / 2
    q = query_gradients(model, train[:3], index, pad_id=tok.pad_token_id)
    expected = brute(rows, q.double().numpy(), b_inv, np.arange(len(rows)), 30.0, 64)
    got = score_matrix(index, q, ekfac=ek, balance=None, device="cpu")  # coupling fitted here ("auto")
    assert np.allclose(got, expected, rtol=1e-3, atol=1e-4)
    assert_top_rows(score(index, q, ekfac=ek, top_k=3, balance=None, device="cpu").rows, expected, rtol=1e-3)
    fitted = fit_coupling(index, ekfac=ek)  # by hand: checked against the factors the queries use
    got = score_matrix(index, q, ekfac=ek, coupling=fitted, balance=None, device="cpu")
    assert np.allclose(got, expected, rtol=1e-3, atol=1e-4)
    other = ek.with_damping(10 * ek.settings["damping"], ek.settings["damping_scope"])
    with pytest.raises(ScoreError, match="fitted with ekfac=.*'damping'"):
        score_matrix(index, q, ekfac=other, coupling=fitted, device="cpu")
    with pytest.raises(ScoreError, match="ekfac=None"):
        score_matrix(index, q, ekfac=None, coupling=fitted, device="cpu")


def test_a_coupling_fitted_for_other_scoring_is_refused(tmp_path):
    rows = np.random.default_rng(0).standard_normal((30, 24)).astype(np.float32)
    index = load_index(write_index(tmp_path / "idx", rows))
    c = fit_coupling(index, unit_normalize=True)
    with pytest.raises(ScoreError, match="unit_normalize=True .* unit_normalize=False"):
        score(index, rows[:2], unit_normalize=False, coupling=c, device="cpu")
    with pytest.raises(ScoreError, match="modules=None .* modules='\\*.experts.\\*'"):
        resolve_coupling(index, c, ekfac=None, unit_normalize=True, modules="*.experts.*")
    assert fit_coupling(index, gamma=0.0) is None
    with pytest.raises(ScoreError, match="gamma >= 0"):
        fit_coupling(index, gamma=-1.0)


def test_a_fit_that_does_not_fit_in_memory_is_refused_before_any_read(tmp_path, monkeypatch):
    rows = np.random.default_rng(0).standard_normal((30, 24)).astype(np.float32)
    index = load_index(write_index(tmp_path / "idx", rows))
    monkeypatch.setattr(cp, "memory_available", lambda device: 1000)
    monkeypatch.setattr(type(index), "read_rows", lambda *a: pytest.fail("rows were read"))
    with pytest.raises(ScoreError, match="--coupling_sample .* or --coupling_gamma 0"):
        fit_coupling(index)


def score_on_and_off(root, model_path, tmp_path, off: list, announced: str) -> tuple[dict, object]:
    """`score --all_scores` with a setting on (the default) and `off`, checking that only the first run
    prints `announced`; `({"on"|"off": (matrix, its sidecar)}, the result of averaging "on" with "off")`."""
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["alpha beta", "gamma delta epsilon"]))
    outs = {}
    for name, extra in (("on", []), ("off", off)):
        out, matrix = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.npy"
        res = cli("score", "--index", root / "idx", model_path, queries, "--ekfac", root / "ek", "--top_k", 3,
                  "--out", out, "--all_scores", matrix, *extra)  # fmt: skip
        assert res.returncode == 0, res.stderr[-2000:]
        assert (announced in res.stdout) == (name == "on")
        outs[name] = (np.load(matrix), json.loads((tmp_path / f"{name}.npy.json").read_text()))
    averaged = inproc("score", "--index", root / "idx", model_path, queries, "--ekfac", root / "ek", "--out",
                      tmp_path / "avg.jsonl", "--average_with", tmp_path / "off.npy")  # fmt: skip
    return outs, averaged


def test_cli_scores_with_the_coupling_and_records_it(built, model_dir, tmp_path):  # noqa: F811
    root, *_ = built
    outs, res = score_on_and_off(
        root, model_dir, tmp_path, ["--coupling_gamma", 0], "cross-module coupling: gamma 30, rank"
    )
    assert outs["on"][1]["coupling"] == {"gamma": 30.0, "rank": 64, "sample": 512}
    assert outs["off"][1]["coupling"] is None
    assert np.abs(outs["on"][0] - outs["off"][0]).max() > 0.01 * np.abs(outs["off"][0]).max()  # changed, not noise
    assert res.returncode == 2 and "cross-module coupling" in res.stderr
