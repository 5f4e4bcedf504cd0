"""The refined inverse-Hessian-vector product (`moe_attrib.curvature.ihvp`) against brute force on a tiny MoE.

The dense Gauss-Newton matrix is built from per-example Jacobians of the logits (one batched
backward per example over every logit), `G = 1/N sum_n sum_t J_t^T (diag p - p p^T) J_t` over the
loss tokens, every block tracked: attention, each expert, the routers and `lm_head`.
"""

import numpy as np
import pytest
import torch

import moe_attrib as ma
from moe_attrib.curvature import ihvp
from moe_attrib.data import Example, collate, labels_for
from moe_attrib.model.zoo import tiny_model
from tests.conftest import rel_err
from tests.test_build import model_dir  # noqa: F401  (fixture)

# small enough for a dense G (3.2k parameters), all of the model's kinds of blocks
SMALL = dict(hidden_size=16, moe_intermediate_size=4, intermediate_size=16, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, vocab_size=8, num_experts=4, num_local_experts=4)  # fmt: skip
GROUPS = {"attention": ".self_attn.", "experts": ".experts.", "routers": ".mlp.gate.", "lm_head": "lm_head."}


def small_model(family: str = "qwen3_moe", dtype=torch.float64, **overrides):
    model = tiny_model(family, **{**SMALL, **overrides}).to(dtype)
    model.config._experts_implementation = "eager"  # torch's grouped matmul has no float64 kernel on the CPU
    return model


def make_examples(lengths, seed: int) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Example(i, torch.randint(3, 8, (length,), generator=gen).tolist(), loss_start=start)
        for i, (length, start) in enumerate(lengths)
    ]


def flat(vectors) -> torch.Tensor:
    return torch.cat([v.flatten(1) for v in vectors], 1)


def unflat(x: torch.Tensor, like) -> list[torch.Tensor]:
    out, at = [], 0
    for v in like:
        size = v[0].numel()
        out.append(x[:, at : at + size].view(x.shape[0], *v.shape[1:]))
        at += size
    return out


def dense_ggn(model, entries, examples) -> torch.Tensor:
    params = [e.param for e in entries]
    size = sum(p.numel() for p in params)
    g = torch.zeros(size, size, dtype=torch.float64)
    for ex in examples:
        ids, mask = collate(examples, [ex.index], 0)
        labels = labels_for(examples, [ex.index], ids, mask)
        with ihvp._differentiable(model, params):
            z = model(input_ids=ids, attention_mask=mask).logits[0, :-1]
            t, v = z.shape
            eye = torch.eye(t * v, dtype=z.dtype).view(t * v, t, v)
            rows = torch.autograd.grad(z, params, eye, is_grads_batched=True, allow_unused=True)
            rows = [
                r if r is not None else torch.zeros(t * v, *p.shape, dtype=z.dtype)
                for r, p in zip(rows, params, strict=True)
            ]
            jac = torch.cat([r.flatten(1) for r in rows], 1).view(t, v, size).double()
            p = torch.softmax(z.detach().double(), -1)
        for k in range(t):
            if labels[0, k + 1] != -100:
                h = torch.diag(p[k]) - torch.outer(p[k], p[k])
                g += jac[k].T @ h @ jac[k]
    return g / len(examples)


@pytest.fixture(scope="module")
def small():
    model = small_model()
    report = ma.discover(model, warn=False)
    entries = ihvp.tracked_entries(model, report)
    train = make_examples([(5, 0), (4, 2), (3, 0)], seed=0)  # one prompt/completion row: loss on its completion
    queries = make_examples([(5, 2), (4, 0)], seed=1)
    return model, report, entries, train, queries, dense_ggn(model, entries, train)


def group_columns(entries, group: str) -> torch.Tensor:
    cols, at = [], 0
    for e in entries:
        if GROUPS[group] in e.key:
            cols.append(torch.arange(at, at + e.param.numel()))
        at += e.param.numel()
    return torch.cat(cols)


def test_ggn_product_equals_dense(small):
    model, _, entries, train, _, g = small
    gen = torch.Generator().manual_seed(0)
    v = [torch.randn(3, *e.param.shape, generator=gen, dtype=torch.float64) for e in entries]
    got = flat(ihvp.GaussNewton(model, entries, train, token_batch_size=8)(v))  # two batches
    want = flat(v) @ g
    # the router's softmax runs in float32 inside the float64 model: agreement to float32 rounding
    assert rel_err(got, want) < 1e-6
    for group in GROUPS:  # every kind of block is on the loss path and agrees
        cols = group_columns(entries, group)
        assert want[:, cols].norm() > 0, group
        assert rel_err(got[:, cols], want[:, cols]) < 1e-6, group
    experts = next(e for e in entries if e.layout is not None)  # each expert's block of the first experts parameter
    at = sum(e.param.numel() for e in entries[: entries.index(experts)])
    per_expert = (got - want)[:, at : at + experts.param.numel()].view(3, experts.param.shape[0], -1)
    scale = want[:, at : at + experts.param.numel()].view(3, experts.param.shape[0], -1)
    assert all(scale[:, i].norm() > 0 for i in range(scale.shape[1]))  # every expert receives curvature
    assert per_expert.norm() < 1e-6 * scale.norm()


def test_conjugate_gradients_solve_dense():
    """The solver alone, on a dense SPD system with a dense preconditioner: enough iterations give the solve."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(40, 12, generator=gen, dtype=torch.float64)
    mat = a @ a.T + 0.05 * torch.eye(40, dtype=torch.float64)
    m_inv = torch.linalg.inv(torch.diag(torch.diag(mat)))
    rhs = torch.randn(2, 40, generator=gen, dtype=torch.float64)
    solved = ihvp.conjugate_gradients(lambda v: [v[0] @ mat], [rhs], lambda v: [v[0] @ m_inv], iterations=40)
    assert rel_err(solved.solution[0], torch.linalg.solve(mat, rhs.T).T) < 1e-6
    assert solved.residuals.shape == (41, 2) and solved.residuals[-1].max() < 1e-6
    none = ihvp.conjugate_gradients(lambda v: [v[0] @ mat], [rhs], lambda v: [v[0] @ m_inv], iterations=0)
    assert rel_err(none.solution[0], rhs @ m_inv) < 1e-12  # iteration 0: the preconditioner's answer


def exact_query_gradients(model, entries, queries) -> torch.Tensor:
    """Each query's summed token cross-entropy (completion tokens only), differentiated by autograd."""
    params = [e.param for e in entries]
    out = []
    for ex in queries:
        ids, mask = collate(queries, [ex.index], 0)
        labels = labels_for(queries, [ex.index], ids, mask)
        with ihvp._differentiable(model, params):
            logits = model(input_ids=ids).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum")
            out.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(out).double()


def test_refined_queries_equal_dense_solve(small, tmp_path):
    """Exact rows: the refined query rows equal `(G + damping m I)^-1 q` once CG has converged; every
    block (attention, each expert, routers, lm_head) takes part."""
    model, _, entries, train, queries, g = small
    ma.build_index(model, train, tmp_path / "index", projection_dim=None, progress=False)
    index = ma.load_index(tmp_path / "index")
    # G's largest eigenvalue is ~340x its mean: a damping of 30x the mean converges in ~20 iterations
    refined = ma.refine_queries(model, train, queries, index, iterations=24, damping=30.0, dtype=torch.float64)
    lam = 30.0 * refined.settings["mean_eigenvalue"]
    q = exact_query_gradients(model, entries, queries)
    want = torch.linalg.solve(g + lam * torch.eye(g.shape[0], dtype=torch.float64), q.T).T
    assert rel_err(refined.rows, want) < 1e-4
    assert rel_err(q / lam, want) > 0.5  # the curvature matters at this damping
    assert refined.residuals.shape == (25, 2) and refined.residuals[-1].max() < 1e-4
    assert refined.products == 24 + 4 // 2  # 24 CG products + the Hutchinson probes' sweep (4 probes, 2 queries)
    # Hutchinson's estimate of trace(G) / D is within its noise of the true mean eigenvalue
    assert 0.3 < refined.settings["mean_eigenvalue"] / float(torch.trace(g) / g.shape[0]) < 3
    # scoring takes them as they are: the cosine against the stored rows
    scores = ma.score_matrix(index, refined, device="cpu")
    rows = torch.from_numpy(np.asarray(index.gradients)).double()
    cosine = (want / want.norm(dim=1, keepdim=True)) @ (rows / rows.norm(dim=1, keepdim=True)).T
    assert rel_err(torch.from_numpy(scores), cosine) < 1e-4
    with pytest.raises(ma.ScoreError, match="ekfac=None"):
        ma.score(index, refined, ekfac=ma.fit_ekfac(model, train, projection_dim=None, progress=False))


def dense_ekfac(entries, ekfac, lam_damping: float, scale: float) -> torch.Tensor:
    """The damped EK-FAC matrix `B + damping I` over every tracked parameter, built with Kronecker products
    (a folded bias is its weight's extra input column); blocks without factors are `scale + damping`."""
    sizes = [e.param.numel() for e in entries]
    starts = np.cumsum([0, *sizes])
    cols = {e.key: torch.arange(starts[i], starts[i + 1]).view(e.param.shape) for i, e in enumerate(entries)}
    b = torch.diag(torch.full((sum(sizes),), scale + lam_damping, dtype=torch.float64))
    for e in entries:
        if e.kind != "weight" or e.block not in ekfac.factors:
            continue
        f = ekfac.factors[e.block]
        w = cols[e.key]
        if f.bias:
            w = f.augment(w, cols[f"{e.block}.bias"])
        experts = [None] if f.experts is None else range(f.experts)
        for i in experts:
            qr, qc = (q if i is None else q[i] for q in f.rows_cols)
            lam = f.lam if i is None else f.lam[i]
            idx = (w if i is None else w[i]).reshape(-1)
            k = torch.kron(qr, qc)  # vec(Qr X Qc^T) = kron(Qr, Qc) vec(X), row-major
            b[idx[:, None], idx[None, :]] = k @ torch.diag(lam.reshape(-1) + lam_damping) @ k.T
    return b


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_preconditioner_inverts_damped_ekfac(family):
    """`Preconditioner` applies `(B + damping I)^-1` of the unprojected EK-FAC factors (gpt_oss: folded
    biases, biased experts); projected factors are refused."""
    model = small_model(family)
    report = ma.discover(model, warn=False)
    entries = ihvp.tracked_entries(model, report)
    train = make_examples([(5, 0), (4, 0)], seed=0)
    ekfac = ma.fit_ekfac(model, train, projection_dim=None, progress=False)
    scale = ihvp.mean_eigenvalue(ekfac, None, [])
    want_scale = sum(float(f.lam.sum()) for f in ekfac.factors.values()) / sum(
        f.lam.numel() for f in ekfac.factors.values()
    )
    assert scale == pytest.approx(want_scale)
    pre = ihvp.Preconditioner(entries, ekfac, 0.3 * scale, scale, "cpu")
    assert any(e.kind == "bias" for e in entries) == (family == "gpt_oss")
    gen = torch.Generator().manual_seed(0)
    v = [torch.randn(2, *e.param.shape, generator=gen, dtype=torch.float64) for e in entries]
    dense = dense_ekfac(entries, ekfac, 0.3 * scale, scale)
    assert rel_err(flat(pre(v)) @ dense, flat(v)) < 1e-8  # (B + d I) M^-1 v = v (B symmetric)
    with pytest.raises(ma.RefineError, match="without projection"):
        ihvp.Preconditioner(entries, ma.fit_ekfac(model, train, projection_dim=4, progress=False), 1, 1, "cpu")


def test_refined_with_ekfac_equals_dense_pcg(small, tmp_path):
    """With EK-FAC as the preconditioner, 3 iterations equal 3 iterations of dense preconditioned CG, and the
    projected index gets them through its own projection (`P_out^T W P_in`, as its rows)."""
    model, report, entries, train, queries, g = small
    ekfac = ma.fit_ekfac(model, train, projection_dim=None, progress=False)
    ma.build_index(model, train, tmp_path / "exact", projection_dim=None, progress=False)
    ma.build_index(model, train, tmp_path / "p4", projection_dim=4, progress=False)
    exact, projected = ma.load_index(tmp_path / "exact"), ma.load_index(tmp_path / "p4")
    refined = ma.refine_queries(model, train, queries, exact, ekfac=ekfac, iterations=3, damping=0.2,
                                dtype=torch.float64)  # fmt: skip
    scale = refined.settings["mean_eigenvalue"]
    lam = 0.2 * scale
    m_inv = torch.linalg.inv(dense_ekfac(entries, ekfac, lam, scale))
    a = g + lam * torch.eye(g.shape[0], dtype=torch.float64)
    q = exact_query_gradients(model, entries, queries)
    x, r = torch.zeros_like(q), q.clone()
    z = r @ m_inv
    p, rz = z, (r * z).sum(1)
    for _ in range(3):  # textbook PCG, dense
        ap = p @ a
        alpha = rz / (p * ap).sum(1)
        x, r = x + alpha[:, None] * p, r - alpha[:, None] * ap
        z = r @ m_inv
        rz, old = (r * z).sum(1), rz
        p = z + (rz / old)[:, None] * p
    assert rel_err(refined.rows, x) < 1e-5
    assert refined.products == 3
    # the projected index: its rows of the training examples come from the same map as the refined query
    again = ma.refine_queries(model, train, queries, projected, ekfac=ekfac, iterations=3, damping=0.2,
                              dtype=torch.float64)  # fmt: skip
    grads = ihvp.full_gradients(model, report, entries, train, dtype=torch.float64)
    train_rows = ihvp.to_index_columns(projected, report, entries, grads)
    assert rel_err(train_rows, torch.from_numpy(np.asarray(projected.gradients))) < 1e-5
    assert rel_err(again.rows, ihvp.to_index_columns(projected, report, entries, unflat(x, grads))) < 1e-5


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_index_projection_map_other_families(family, tmp_path):
    """Biases, transposed experts and other router names: the map to index columns gives the index's rows."""
    model = tiny_model(family)
    report = ma.discover(model, warn=False)
    entries = ihvp.tracked_entries(model, report)
    train = [Example(i, list(range(3 + i, 11 + i)), loss_start=2 * i) for i in range(3)]
    ma.build_index(model, train, tmp_path / "index", projection_dim=8, progress=False)
    index = ma.load_index(tmp_path / "index")
    rows = ihvp.to_index_columns(index, report, entries, ihvp.full_gradients(model, report, entries, train))
    assert rel_err(rows, torch.from_numpy(np.asarray(index.gradients))) < 1e-5


def test_refine_refusals(small, tmp_path):
    model, _, _, train, queries, _ = small
    ma.build_index(model, train, tmp_path / "index", projection_dim=None, progress=False)
    index = ma.load_index(tmp_path / "index")
    with pytest.raises(ma.RefineError, match="damping > 0"):
        ma.refine_queries(model, train, queries, index, damping=0.0)
    with pytest.raises(ma.RefineError, match="at least one training example"):
        ma.refine_queries(model, [], queries, index)
    tied = tiny_model("qwen3_moe", tie_word_embeddings=True)
    with pytest.raises(ma.RefineError, match="tied to the input embeddings"):
        ihvp.tracked_entries(tied, ma.discover(tied, warn=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_grouped_mm_ggn_and_refine(small, tmp_path):
    """On CUDA through transformers' grouped-matmul experts (double backward of `_grouped_mm`), in bf16: the
    GGN product against the CPU float64 dense G, and the refined rows against the float64 dense solve."""
    _, _, _, train, queries, _ = small
    aligned = dict(moe_intermediate_size=8)  # 16-byte rows in bf16: what torch's CUDA grouped matmul needs
    cpu = small_model(**aligned)
    g = dense_ggn(cpu, ihvp.tracked_entries(cpu, ma.discover(cpu, warn=False)), train)
    model = small_model(dtype=torch.bfloat16, **aligned).cuda()
    model.config._experts_implementation = "grouped_mm"
    report = ma.discover(model, warn=False)
    entries = ihvp.tracked_entries(model, report)
    gen = torch.Generator().manual_seed(0)
    v = [torch.randn(2, *e.param.shape, generator=gen).cuda() for e in entries]
    got = flat(ihvp.GaussNewton(model, entries, train)(v)).double().cpu()
    assert rel_err(got, flat(v).double().cpu() @ g) < 5e-2  # bf16 weights and activations
    ma.build_index(model, train, tmp_path / "index", projection_dim=None, progress=False)
    index = ma.load_index(tmp_path / "index")
    refined = ma.refine_queries(model, train, queries, index, iterations=24, damping=30.0)  # converges (above)
    lam = 30.0 * refined.settings["mean_eigenvalue"]
    q = exact_query_gradients(cpu, ihvp.tracked_entries(cpu, ma.discover(cpu, warn=False)), queries)
    want = torch.linalg.solve(g + lam * torch.eye(g.shape[0], dtype=torch.float64), q.T).T
    cos = torch.nn.functional.cosine_similarity(refined.rows.double(), want, dim=1)
    assert cos.min() > 0.98, cos


def test_cli_score_refine_equals_the_python_api(model_dir, tmp_path):  # noqa: F811
    """`score --refine N --refine_ekfac DIR` ranks by the library's refined rows; `--ekfac` with it is refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_build import CORPUS, build
    from tests.test_integrity import cli, inproc

    build(model_dir, CORPUS, "--index", tmp_path / "idx", "--track_moe_experts", "--no_projection")
    res = cli("ekfac", model_dir, CORPUS, "--out", tmp_path / "ek", "--track_moe_experts", "--no_projection",
              "--precision", "fp32", "--quiet")  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"text": "Ada was born in Lisbon"}\n{"text": "Boris kept a camera"}\n')
    refine = ["--refine", 2, "--refine_ekfac", tmp_path / "ek", "--refine_examples", 6, "--refine_damping", 0.5]
    res = cli("score", "--index", tmp_path / "idx", model_dir, queries, "--out", tmp_path / "r.jsonl",
              "--all_scores", tmp_path / "m.npy", *refine)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "2 CG iterations, 2 GGN products per query over 6 training rows" in res.stdout
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    index = ma.load_index(tmp_path / "idx")
    refined = ma.refine_queries(
        model, ma.load_examples(str(CORPUS), tok), ma.load_examples(str(queries), tok), index,
        ekfac=ma.load_ekfac(tmp_path / "ek"), iterations=2, damping=0.5, examples=6,
    )  # fmt: skip
    want = ma.score_matrix(index, refined, device="cpu")
    assert np.allclose(np.load(tmp_path / "m.npy"), want, atol=1e-4)
    res = inproc("score", "--index", tmp_path / "idx", model_dir, queries, "--out", tmp_path / "x.jsonl",
                 "--ekfac", tmp_path / "ek", *refine)  # fmt: skip
    assert res.returncode == 2 and "cannot be combined with --ekfac" in res.stderr
