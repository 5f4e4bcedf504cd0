"""Attribution quality plumbing: EK-FAC on the rows' loss, exact-row indexes, all-row scores, damping, LDS smoke."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import moe_attrib as ma
from moe_attrib.curvature.ekfac import fit_ekfac, set_damping
from moe_attrib.data import Example, collate
from moe_attrib.model.zoo import tiny_model
from tests.conftest import assert_top_rows, rel_err
from tests.test_build import ENV

ROOT = Path(__file__).resolve().parent.parent


def prompt_completion_examples(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 14, (1,), generator=g))
        ids = torch.randint(3, 128, (length,), generator=g).tolist()
        out.append(Example(i, ids, loss_start=int(torch.randint(2, length - 2, (1,), generator=g))))
    return out


def brute_force_covariances(model, exs, name):
    """A and G of one linear module from autograd, one unpadded example at a time, completion-only loss."""
    module = model.get_submodule(name)
    A = torch.zeros(module.in_features, module.in_features, dtype=torch.float64)
    G = torch.zeros(module.out_features, module.out_features, dtype=torch.float64)
    store = {}

    def hook(m, args, out):
        out.retain_grad()
        store["x"], store["y"] = args[0].detach(), out

    handle = module.register_forward_hook(hook)
    tokens = 0
    try:
        for ex in exs:
            ids = torch.tensor([ex.input_ids])
            logits = model(input_ids=ids).logits[0, :-1]
            start = max(ex.loss_start - 1, 0)  # logits[t] predicts token t + 1; tokens before loss_start carry none
            F.cross_entropy(logits[start:], ids[0, start + 1 :], reduction="sum").backward()
            x, g = store["x"][0].double(), store["y"].grad[0].double()
            A += x.T @ x
            G += g.T @ g
            tokens += x.shape[0]
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return A / tokens, G / tokens


def test_ekfac_is_fitted_on_the_completion_only_loss():
    model = tiny_model("qwen3_moe")
    exs = prompt_completion_examples()
    ek = fit_ekfac(model, exs, projection_dim=None, token_batch_size=64, sampled_labels=False, progress=False)
    for name in ("model.layers.1.self_attn.o_proj", "lm_head"):
        A, G = brute_force_covariances(model, exs, name)
        f = ek.factors[name]
        assert rel_err(f.A, A) < 1e-5 and rel_err(f.G, G) < 1e-5, (name, rel_err(f.A, A), rel_err(f.G, G))
        # and it is not the every-token loss's G (what fit_ekfac used before)
        everything = [Example(e.index, e.input_ids) for e in exs]
        _, G_all = brute_force_covariances(model, everything, name)
        assert rel_err(G_all, G) > 1e-2


def test_exact_row_index_equals_per_example_gradients(tmp_path):
    model = tiny_model("gpt_oss")  # transposed experts with biases, a router with a bias
    exs = prompt_completion_examples(6, seed=3)
    ma.build_index(model, exs, tmp_path / "idx", projection_dim=None, token_batch_size=40, progress=False)
    index = ma.load_index(tmp_path / "idx")
    ids, mask = collate(exs, list(range(len(exs))))
    labels = ids.masked_fill(mask == 0, -100)
    for row, ex in enumerate(exs):
        labels[row, : ex.loss_start] = -100
    grads = ma.per_example_gradients(model, ids, mask, labels)
    assert index.gradients.shape == (6, sum(int(np.prod(b.shape)) for b in index.blocks))
    for b in index.blocks:
        got = torch.from_numpy(np.array(index.gradients[:, b.start : b.stop]))
        assert torch.allclose(got, grads[b.name].reshape(6, -1), rtol=1e-4, atol=1e-6), b.name
        assert tuple(grads[b.name].shape[1:]) == b.shape


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("allrows")
    model = tiny_model("qwen3_moe")
    exs = prompt_completion_examples(10, seed=5)
    ma.build_index(model, exs, root / "idx", projection_dim=4, seed=1, token_batch_size=40, progress=False)
    index = ma.load_index(root / "idx")
    ek = fit_ekfac(model, exs, projection_dim=4, seed=1, token_batch_size=40, progress=False)
    q = ma.query_gradients(model, exs[:3], index)
    return root, index, ek, q


@pytest.mark.parametrize("kwargs", [{}, {"unit_normalize": True}, {"ekfac": True}, {"ekfac": True, "unit": True}])
def test_all_row_scores_equal_brute_force(small_index, kwargs, tmp_path):
    root, index, ek, q = small_index
    use_ek, unit = kwargs.get("ekfac"), kwargs.get("unit_normalize") or kwargs.get("unit")
    qq = q.double()
    if use_ek:
        qq = ma.precondition_queries(q, index.blocks, ek, index.manifest["settings"]).double()
    rows = torch.from_numpy(np.array(index.gradients)).double()
    if unit:
        qq, rows = qq / qq.norm(dim=1, keepdim=True), rows / rows.norm(dim=1, keepdim=True)
    brute = (qq @ rows.T).numpy()
    opts = {
        "ekfac": ek if use_ek else None,
        "unit_normalize": bool(unit),
        "block_bytes": 3 * 4 * index.gradients.shape[1],
        "coupling": None,  # the uncoupled brute force; tests/test_coupling.py checks the coupled scores
        "balance": None,  # and tests/test_balance.py the balanced ones
    }
    got = ma.score_matrix(index, q, device="cpu", **opts)
    assert got.shape == (3, 10) and np.allclose(got, brute, rtol=1e-4, atol=1e-8)
    on_disk = ma.score_matrix(index, q, device="cpu", out=tmp_path / "s.npy", **opts)
    assert np.array_equal(np.load(tmp_path / "s.npy"), got) and np.array_equal(np.asarray(on_disk), got)
    top = ma.score(index, q, top_k=4, device="cpu", **opts)
    assert_top_rows(top.rows, brute)


def test_score_damping_keywords_redamp_the_factors(small_index):
    """`damping=` / `damping_scope=` of the Python `score` and `score_matrix` re-damp the factors (they were
    accepted and ignored before), and are refused without factors."""
    root, index, ek, q = small_index
    opts = {"coupling": None, "balance": None, "device": "cpu", "unit_normalize": False}
    qq = ma.precondition_queries(q, index.blocks, ek.with_damping(0.5, "module"), index.manifest["settings"]).double()
    brute = (qq @ torch.from_numpy(np.array(index.gradients)).double().T).numpy()
    got = ma.score_matrix(index, q, ekfac=ek, damping=0.5, damping_scope="module", **opts)
    assert np.allclose(got, brute, rtol=1e-4, atol=1e-8)
    assert not np.allclose(got, ma.score_matrix(index, q, ekfac=ek, **opts), rtol=1e-3)
    top = ma.score(index, q, ekfac=ek, damping=0.5, damping_scope="module", top_k=4, **opts)
    assert_top_rows(top.rows, brute)
    with pytest.raises(ma.ScoreError, match="ekfac="):
        ma.score_matrix(index, q, damping=0.5, **opts)


def test_damping_scopes_and_no_zero_damping():
    model = tiny_model("qwen3_moe")
    exs = [Example(0, [5, 9, 11])]  # 3 tokens x top-2: at least 2 of 8 experts receive none
    ek = fit_ekfac(model, exs, projection_dim=None, token_batch_size=64, progress=False)
    experts = ek.factors["model.layers.0.mlp.experts.gate_up_proj"]
    assert (experts.tokens == 0).any()
    expert = ek.with_damping(0.1, "expert").factors["model.layers.0.mlp.experts.gate_up_proj"]
    module = ek.with_damping(0.1, "module").factors["model.layers.0.mlp.experts.gate_up_proj"]
    whole = ek.with_damping(0.1, "model")
    all_lam = torch.cat([f.lam.reshape(-1) for f in ek.factors.values()])
    means = experts.lam.mean(dim=(-1, -2))
    used = means > 0
    assert torch.allclose(expert.damping[used], 0.1 * means[used])
    assert (~used).any() and torch.allclose(expert.damping[~used], 0.1 * all_lam.mean())  # falls back model-wide
    assert torch.allclose(module.damping, torch.full_like(module.damping, 0.1 * float(experts.lam.mean())))
    for f in whole.factors.values():
        assert torch.allclose(f.damping, torch.full_like(f.damping, 0.1 * float(all_lam.mean())))
    for damped in (expert, module):
        assert (damped.damping > 0).all()
        grad = torch.randn(damped.lam.shape, dtype=torch.float64)
        assert torch.isfinite(damped.precondition(grad)).all()
    with pytest.raises(ValueError, match="scope"):
        set_damping(dict(ek.factors), 0.1, "layer")


def test_lds_benchmark_smoke(tmp_path):
    out = tmp_path / "lds.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lds.py"), "--config", "smoke", "--cache", str(tmp_path / "cache"),
         "--projections", "8", "--workers", "1", "--out", str(out), "--no_keep"],
        capture_output=True, text=True, env={**ENV, "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["variants"]
    assert any(name.startswith("default") for name in rows) and "random scores" in rows
    for name, r in rows.items():
        assert np.isfinite(r["lds"]) and r["ci95"][0] <= r["lds"] <= r["ci95"][1], name
    retest = rows["test-retest (same subsets, another data order)"]
    assert retest["ci95"][0] > rows["random scores"]["ci95"][1]  # the subset models' losses carry signal


@pytest.mark.parametrize("unit", [False, True])
def test_module_restricted_scores_equal_brute_force_on_those_columns(small_index, unit):
    root, index, ek, q = small_index
    cols = np.concatenate([np.arange(b.start, b.stop) for b in index.blocks if ".experts." in b.name])
    qq = ma.precondition_queries(q, index.blocks, ek, index.manifest["settings"]).double()[:, cols]
    rows = torch.from_numpy(np.asarray(index.gradients)[:, cols]).double()
    if unit:
        qq, rows = qq / qq.norm(dim=1, keepdim=True), rows / rows.norm(dim=1, keepdim=True)
    opts = dict(ekfac=ek, unit_normalize=unit, modules="*.experts.*", coupling=None)
    got = ma.score_matrix(index, q, device="cpu", **opts)
    assert np.allclose(got, (qq @ rows.T).numpy(), rtol=1e-4, atol=1e-8)
    top = ma.score(index, q, top_k=2, per_module=True, **opts)
    assert np.allclose(top.parts.sum(-1), top.values, rtol=1e-4, atol=1e-8)
    with pytest.raises(ma.ScoreError, match="matches no block"):
        ma.score_matrix(index, q, modules="*.nothing.*")


def test_shared_vocab_corpus_answers_every_domain_with_the_same_words():
    """`shared_vocab=True` (the LDS `cpu-shared` configuration): every completion word of every domain
    is a digit word; the default corpus is unchanged by the option (same rows, same random draws)."""
    from moe_attrib.synthetic import DIGITS, multi_domain_corpus

    train, queries = multi_domain_corpus(shared_vocab=True, fact_queries="statement")
    words = {
        d: {w for r in train + queries if r["domain"] == d for w in r["completion"].split() if w != "."}
        for d in ("facts", "arithmetic", "sequences")
    }
    assert all(words[d] and words[d] <= set(DIGITS) for d in words), words
    plain, _ = multi_domain_corpus(fact_queries="statement")
    assert [r["prompt"] for r in plain] == [r["prompt"] for r in train if r["domain"] == "facts"] + [
        r["prompt"] for r in plain if r["domain"] == "arithmetic"
    ] + [r["prompt"] for r in plain if r["domain"] == "sequences"]
    assert {w for r in plain if r["domain"] == "facts" for w in r["completion"].split()} & set(DIGITS) == set()


def test_lds_corpora_plain_text_and_python_docs(tmp_path):
    """The plain-text configurations train on `{"text"}` rows (the loss on every token) and query with
    prompt/completion rows; the Python-docs corpus has no query chunk among its training chunks; the
    cache keys of the configurations made before these fields existed are unchanged."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lds
    from python_docs import python_docs_corpus

    from moe_attrib.data import load_examples

    cfg = lds.CONFIGS["text-plain"]
    train, queries, tokenizer = lds.corpus(cfg, tmp_path)
    examples = load_examples(str(tmp_path / "train.jsonl"), tokenizer)
    asked = load_examples(str(tmp_path / "queries.jsonl"), tokenizer)
    assert len(examples) == cfg.people * 3 + cfg.arithmetic + cfg.sequences and all(e.loss_start == 0 for e in examples)
    assert all(e.loss_start > 0 for e in asked) and all("text" in r for r in train)
    again = lds.corpus(lds.CONFIGS["cpu"], tmp_path)[0]  # cached files are read back, whatever the configuration
    assert again == train
    rows, held = python_docs_corpus(20, 4, words=30, seed=1)
    assert {r["domain"] for r in rows} == {"reference", "text", "system"} and len(rows) == 60 and len(held) == 12
    assert not {r["text"] for r in held} & {r["text"] for r in rows}
    assert all(len(r["text"].split()) == 30 for r in rows + held)
    assert lds.cache_dir("cpu", tmp_path).name == "lds-cpu-d434506e64c1"
    assert lds.cache_dir("cpu-deep", tmp_path).name == "lds-cpu-deep-6958e7c19fd0"
    assert set(lds.HELDOUT) <= set(lds.CONFIGS) and not set(lds.HELDOUT) & set(lds.TUNING)


def test_lds_ground_truth_matches_its_configuration(tmp_path):
    """Every tracked ground truth (`benchmarks/ground_truth/`) belongs to a configuration as it is now (its cache
    key), holds one subset mask per model over the corpus it keeps and one loss per query for both data orders,
    and is restored into an empty cache (the tracked copy is never overwritten by a cache's)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lds

    keys = {lds.cache_dir(name, tmp_path).name: name for name in lds.CONFIGS}
    kept = sorted(d for d in lds.GROUND_TRUTH.iterdir() if d.is_dir()) if lds.GROUND_TRUTH.exists() else []
    for d in kept:
        assert d.name in keys, f"{d}: no configuration has this cache key (a Config changed? retrain it)"
        cfg = lds.CONFIGS[keys[d.name]]
        rows = len((d / "train.jsonl").read_text().splitlines())
        queries = len((d / "queries.jsonl").read_text().splitlines())
        assert (d / "tokenizer" / "tokenizer.json").exists()
        if not (d / "subset_losses.npz").exists():
            continue  # a corpus kept before its models were trained
        saved = np.load(d / "subset_losses.npz")
        assert saved["subsets"].shape == (cfg.models, rows) and saved["subsets"].dtype == bool
        assert (saved["subsets"].sum(1) == rows // 2).all()
        for key in ("losses", "retest"):
            assert saved[key].shape == (cfg.models, queries) and np.isfinite(saved[key]).all()
    if kept:
        cache = tmp_path / kept[0].name
        cache.mkdir()
        (cache / "train.jsonl").write_text("cache's own\n")
        assert lds.restore_ground_truth(cache) == (kept[0] / "subset_losses.npz").exists()
        assert (cache / "train.jsonl").read_text() == "cache's own\n"  # a cache's file is left as it is
        assert (cache / "queries.jsonl").read_bytes() == (kept[0] / "queries.jsonl").read_bytes()
        lds.keep_ground_truth(cache)
        assert (kept[0] / "train.jsonl").read_text() != "cache's own\n"
