"""The output-layer balance against its definition, computed densely in numpy (no Woodbury, no
streaming): `q = a / sigma_a + o / sigma_o` rescaled to `|a|`, scored against the rows as scored."""

import numpy as np
import pytest
import torch

import moe_attrib.scoring.balance as balance_module
import tests.test_score_stream as stream_tests
from moe_attrib.curvature.precondition import precondition_queries
from moe_attrib.indexing.index import load_index
from moe_attrib.scoring.balance import OUTPUT_LAYER, fit_balance
from moe_attrib.scoring.coupling import sample_rows
from moe_attrib.scoring.score import ScoreError, hit_parts, query_gradients, score, score_matrix
from tests.conftest import assert_top_rows
from tests.test_build import CORPUS, ENV, model_dir  # noqa: F401  (fixture)
from tests.test_coupling import score_on_and_off
from tests.test_score import built  # noqa: F401  (fixture)

BLOCKS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.expert_0.down_proj.weight",
          "lm_head.weight", "model.layers.0.mlp.gate.weight"]  # fmt: skip


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def balanced(whole: np.ndarray, output: np.ndarray, sampled: np.ndarray) -> np.ndarray:
    """The definition: each prepared query divided by the spread of its scores over the sampled rows."""
    q = whole / (whole @ sampled.T).std(axis=1, ddof=1, keepdims=True)
    q = q + output / (output @ sampled.T).std(axis=1, ddof=1, keepdims=True)
    return q * np.linalg.norm(whole, axis=1, keepdims=True) / np.linalg.norm(q, axis=1, keepdims=True)


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_tests, "BLOCKS", BLOCKS)
    rows = np.random.default_rng(0).standard_normal((53, 24)).astype(np.float32)
    index = load_index(stream_tests.write_index(tmp_path / "idx", rows))
    q = np.random.default_rng(1).standard_normal((4, 24)).astype(np.float32)
    mask = np.zeros(24)
    for b in index.blocks:
        mask[b.start : b.stop] = b.name == "lm_head.weight"
    return index, rows.astype(np.float64), q.astype(np.float64), mask


@pytest.mark.parametrize("unit_normalize", [True, False])
@pytest.mark.parametrize("sample, seed", [(256, 0), (20, 7)])
def test_balanced_scores_equal_the_definition(synthetic, unit_normalize, sample, seed):
    index, rows, q, mask = synthetic
    scored = unit(rows) if unit_normalize else rows
    whole = unit(q) if unit_normalize else q
    expected = balanced(whole, q * mask, scored[sample_rows(53, sample, seed)]) @ scored.T
    fitted = fit_balance(index, unit_normalize=unit_normalize, sample=sample, seed=seed)
    assert fitted.settings["sample"] == min(sample, 53) and fitted.coupling is None
    opts = dict(unit_normalize=unit_normalize, coupling=None, balance=fitted, device="cpu")
    got = score_matrix(index, q, block_rows=7, **opts)
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-5)
    plain = score_matrix(index, q, unit_normalize=unit_normalize, coupling=None, balance=None, device="cpu")
    assert np.abs(plain - expected).max() > 1e-3  # the balance changes the scores
    top = score(index, q, top_k=5, per_module=True, block_rows=7, **opts)
    assert_top_rows(top.rows, expected)
    assert np.allclose(top.parts.sum(-1), top.values, rtol=1e-5, atol=1e-6)
    assert np.allclose(hit_parts(index, q, top.rows, **opts), top.parts, rtol=1e-5, atol=1e-7)
    if sample >= 53:  # "auto" fits the same balance
        auto = score_matrix(index, q, unit_normalize=unit_normalize, coupling=None, device="cpu")
        assert np.allclose(auto, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("unit_normalize", [True, False])
def test_rest_balance_equals_the_definition(synthetic, unit_normalize, monkeypatch):
    """`whole="rest"`: the whole-model vote `a` with the output layer's columns zeroed, so the output layer votes once;
    by hand, `q = a_rest / sigma + o / sigma_o` rescaled to `|a_rest|`. `BALANCE_WHOLE` is what "auto" fits; a bad
    value is refused before any work."""
    index, rows, q, mask = synthetic
    scored = unit(rows) if unit_normalize else rows
    whole = unit(q) if unit_normalize else q
    expected = balanced(whole * (1 - mask), q * mask, scored[sample_rows(53, 256, 0)]) @ scored.T
    fitted = fit_balance(index, unit_normalize=unit_normalize, whole="rest")
    assert fitted.settings["whole"] == "rest"
    opts = dict(unit_normalize=unit_normalize, coupling=None, device="cpu")
    assert np.allclose(score_matrix(index, q, balance=fitted, **opts), expected, rtol=1e-4, atol=1e-5)
    model_vote = score_matrix(index, q, balance=fit_balance(index, unit_normalize=unit_normalize), **opts)
    assert np.abs(model_vote - expected).max() > 1e-3
    monkeypatch.setattr(balance_module, "BALANCE_WHOLE", "rest")
    assert np.allclose(score_matrix(index, q, **opts), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ScoreError, match="whole='all'"):
        fit_balance(index, whole="all")


def test_a_balance_is_checked_and_never_applied_to_a_module_restricted_score(synthetic):
    index, rows, q, mask = synthetic
    fitted = fit_balance(index, unit_normalize=True)
    with pytest.raises(ScoreError, match="unit_normalize=True .* unit_normalize=False"):
        score_matrix(index, q, unit_normalize=False, coupling=None, balance=fitted, device="cpu")
    with pytest.raises(ScoreError, match="coupled=False .* coupled=True"):
        score_matrix(index, q, balance=fitted, device="cpu")  # the whole model coupled ("auto"), the balance not
    restricted = score_matrix(index, q, modules="*.experts.*", coupling=None, balance=fitted, device="cpu")
    plain = score_matrix(index, q, modules="*.experts.*", coupling=None, balance=None, device="cpu")
    assert np.array_equal(restricted, plain)
    with pytest.raises(ScoreError, match="at least 2 sampled rows"):
        fit_balance(index, sample=1)


def test_a_balance_that_does_not_fit_in_host_memory_is_refused_before_any_read(synthetic, monkeypatch):
    index, *_ = synthetic
    monkeypatch.setattr(balance_module, "memory_available", lambda device: 1000)
    monkeypatch.setattr(type(index), "read_rows", lambda *a: pytest.fail("rows were read"))
    with pytest.raises(ScoreError, match="balance of index .* on the host.*--no-output_balance"):
        fit_balance(index)


def test_an_index_without_an_output_layer_is_scored_unbalanced_with_a_warning(tmp_path):
    rows = np.random.default_rng(0).standard_normal((30, 24)).astype(np.float32)
    index = load_index(stream_tests.write_index(tmp_path / "idx", rows))  # no lm_head block
    with pytest.warns(UserWarning, match="no output-layer block"):
        assert fit_balance(index) is None
    with pytest.warns(UserWarning, match="no output-layer block"):
        got = score_matrix(index, rows[:2], coupling=None, device="cpu")
    assert np.allclose(got, score_matrix(index, rows[:2], coupling=None, balance=None, device="cpu"))


def coupled_query(rows: np.ndarray, q: np.ndarray, b_inv: np.ndarray, gamma: float) -> np.ndarray:
    """`(B + gamma G^T G / (s m))^-1 q` densely, G every row unit-normalised (rank not truncated)."""
    g = unit(rows)
    m = np.trace(g @ b_inv @ g.T) / len(g)
    h = np.linalg.inv(b_inv) + gamma * g.T @ g / (len(g) * m)
    return np.linalg.solve(h, q.T).T


def test_default_scores_with_ekfac_and_couplings_equal_the_dense_definition(built):  # noqa: F811
    root, model, tok, train, ek = built
    index = load_index(root / "idx")
    rows = np.asarray(index.gradients, dtype=np.float64)
    assert len(rows) <= 64  # every coupling keeps its full rank: the dense inverse below is exact
    d = rows.shape[1]
    b_inv = precondition_queries(torch.eye(d), index.blocks, ek, index.manifest["settings"]).double().numpy()
    b_inv = (b_inv + b_inv.T) / 2
    out = np.array([b.name.startswith("lm_head.") for b in index.blocks for _ in range(b.stop - b.start)])
    q = query_gradients(model, train[:3], index, pad_id=tok.pad_token_id).double().numpy()
    whole = unit(coupled_query(rows, q, b_inv, 30.0))
    output = np.zeros_like(q)
    output[:, out] = coupled_query(rows[:, out], q[:, out], b_inv[np.ix_(out, out)], 30.0)
    expected = balanced(whole, output, unit(rows)) @ unit(rows).T
    got = score_matrix(index, q, ekfac=ek, device="cpu")  # the defaults: coupling and balance fitted here
    assert np.allclose(got, expected, rtol=1e-3, atol=1e-4)
    fitted = fit_balance(index, ekfac=ek, coupling={})  # by hand: the output layer coupled with the defaults
    assert fitted.settings["modules"] == OUTPUT_LAYER and fitted.coupling is not None
    assert np.allclose(score_matrix(index, q, ekfac=ek, balance=fitted, device="cpu"), expected, rtol=1e-3, atol=1e-4)
    other = ek.with_damping(10 * ek.settings["damping"], ek.settings["damping_scope"])
    with pytest.raises(ScoreError, match="balance was fitted with ekfac="):
        score_matrix(index, q, ekfac=other, balance=fitted, device="cpu")


def test_cli_balances_by_default_and_records_it(built, model_dir, tmp_path):  # noqa: F811
    root, *_ = built
    outs, res = score_on_and_off(
        root, model_dir, tmp_path, ["--no-output_balance"], "output-layer balance: lm_head's vote"
    )
    assert outs["on"][1]["output_balance"] is True and outs["off"][1]["output_balance"] is False
    assert np.abs(outs["on"][0] - outs["off"][0]).max() > 0.01 * np.abs(outs["off"][0]).max()  # changed, not noise
    assert res.returncode == 2 and "output-layer balance" in res.stderr


def test_fit_balance_takes_the_whole_models_coupling_and_refuses_other_arguments_up_front(synthetic, monkeypatch):
    """A fitted `Coupling` gives the output layer's coupling its gamma, rank and sample (what `"auto"`
    fits); a wrong type or an unknown key is a TypeError naming what it takes, before any row is read."""
    from moe_attrib.scoring.coupling import fit_coupling

    index, rows, q, mask = synthetic
    whole = fit_coupling(index, gamma=0.5, rank=3, sample=40)
    by_object = fit_balance(index, coupling=whole)
    by_keys = fit_balance(index, coupling={"gamma": 0.5, "rank": 3, "sample": 40})
    assert by_object.coupling.settings == by_keys.coupling.settings
    assert torch.equal(by_object.coupling.left, by_keys.coupling.left)
    auto = score_matrix(index, q, coupling=whole, balance="auto", device="cpu")
    explicit = score_matrix(index, q, coupling=whole, balance=by_object, device="cpu")
    assert np.array_equal(auto, explicit)
    monkeypatch.setattr(balance_module, "sampled_rows", lambda *a, **k: pytest.fail("rows read"))
    with pytest.raises(TypeError, match="keyword arguments as a dict"):
        fit_balance(index, coupling=0.5)
    with pytest.raises(TypeError, match=r"unknown keys \['gama'\]"):
        fit_balance(index, coupling={"gama": 0.5})
