"""Seeded projections: the counter-based hash against an independent reimplementation, statistics,
the process-wide cache, and the legacy Gaussian kind that old indexes and factors keep using."""

import hashlib
import json

import numpy as np
import pytest
import torch

import moe_attrib as ma
from moe_attrib.collect import projection as pj
from moe_attrib.model.zoo import tiny_model
from moe_attrib.scoring.score import ScoreError, precondition_queries
from tests.test_pipeline import examples, model  # noqa: F401  (fixture)

M32 = 0xFFFFFFFF


def ref_seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def ref_mix(x: int) -> int:  # lowbias32, in plain Python integers
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def ref_entry(name: str, seed: int, rows: int, flat: int) -> float:
    """Entry number `flat` (row-major) of the rademacher-hash-v1 matrix, from the spec alone."""
    key = ref_seed(name, seed)
    word, bit = divmod(flat, 32)
    h = ref_mix((word & M32) ^ (key & M32))
    h = ref_mix(h ^ (key >> 32))
    h = ref_mix(h ^ (word >> 32))
    sign = 1.0 if (h >> bit) & 1 else -1.0
    return float(np.float32(sign * np.float32(1.0 / np.sqrt(rows))))


def test_hash_matrix_equals_independent_reimplementation():
    rows, cols, batch = 8, 37, 3
    mat = pj.projection_matrix("model.layers.1.mlp.experts.gate_up_proj/in", rows, cols, seed=11, batch=batch)
    assert mat.dtype == torch.float32 and mat.shape == (batch, rows, cols)
    flat = mat.reshape(-1).numpy()
    rng = np.random.default_rng(0)
    picks = sorted({0, 31, 32, flat.size - 1, *rng.integers(0, flat.size, 60).tolist()})
    for e in picks:
        assert flat[e] == ref_entry("model.layers.1.mlp.experts.gate_up_proj/in", 11, rows, e), e
    dense = pj.projection_matrix("lm_head/out", 16, 5, seed=0)
    assert [dense.reshape(-1)[e].item() for e in range(80)] == [ref_entry("lm_head/out", 0, 16, e) for e in range(80)]


def test_hash_matrix_statistics():
    rows = 16
    mat = pj.projection_matrix("a/in", rows, 4096, seed=1, batch=4).double()
    assert torch.equal(mat.abs(), torch.full_like(mat, 1 / rows**0.5, dtype=torch.float32).double())
    assert mat.mean().abs() < 4 / (rows**0.5 * mat.numel() ** 0.5)  # mean 0: within 4 sigma
    assert (mat**2).mean().item() == pytest.approx(1 / rows, rel=1e-6)  # variance 1/rows
    corr = (mat[0] * mat[1]).sum() / (mat[0].norm() * mat[1].norm())  # experts independent
    assert corr.abs() < 4 / mat[0].numel() ** 0.5
    other = pj.projection_matrix("b/in", rows, 4096, seed=1).double()  # names independent
    assert ((other * mat[0]).sum() / (other.norm() * mat[0].norm())).abs() < 4 / other.numel() ** 0.5


def test_projected_inner_products_are_unbiased_over_seeds():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, generator=gen, dtype=torch.float64), torch.randn(64, generator=gen, dtype=torch.float64)
    b = b + 0.5 * a
    mats = [pj.projection_matrix("x", 8, 64, s).double() for s in range(400)]
    est = torch.stack([(p @ a) @ (p @ b) for p in mats])
    exact = a @ b
    assert (est.mean() - exact).abs() < 4 * est.std() / len(est) ** 0.5, (est.mean().item(), exact.item())
    # variance of the JL estimate with Rademacher entries is at most the Gaussian's (|a|^2|b|^2 + <a,b>^2) / rows
    assert est.var() < 1.3 * (a.norm() ** 2 * b.norm() ** 2 + exact**2) / 8


def test_same_float32_matrix_whatever_the_path():
    ref = pj.projection_matrix("m.layers.0.mlp.experts.down_proj/out", 8, 24, seed=2, batch=2)
    got = pj.Projections(8, seed=2, device="cpu").get("m.layers.0.mlp.experts.down_proj", "out", 24, batch=2)
    assert got.dtype == torch.float32 and torch.equal(got, ref.transpose(-1, -2))
    bf16 = pj.Projections(8, seed=2, dtype=torch.bfloat16).get("m.layers.0.mlp.experts.down_proj", "out", 24, batch=2)
    assert torch.equal(bf16.float(), ref.transpose(-1, -2).bfloat16().float())


def test_cache_serves_new_collectors_and_respects_its_budget():
    pj.clear_cache()
    before = pj.cache_draws()
    pj.Projections(8, seed=9).get("cache.test", "in", 100)
    pj.Projections(8, seed=9).get("cache.test", "in", 100)  # a second collector: no redraw
    assert pj.cache_draws() == before + 1
    pj.Projections(8, seed=10).get("cache.test", "in", 100)  # another seed is another matrix
    assert pj.cache_draws() == before + 2
    try:
        pj.set_cache_budget(8 * 100 * 4)  # room for one of them
        pj.Projections(8, seed=9).get("cache.test", "in", 100)  # seed 10's is the one kept
        assert pj.cache_draws() == before + 3
        pj.set_cache_budget(0)
        assert pj._CACHE.used == 0 and not pj._CACHE.items
    finally:
        pj.set_cache_budget(pj.DEFAULT_CACHE_BYTES)


def test_legacy_kind_is_the_old_cpu_gaussian():
    name, rows, cols, seed = "model.layers.0.self_attn.q_proj/in", 8, 32, 4
    gen = torch.Generator().manual_seed(ref_seed(name, seed))
    old = torch.randn((rows, cols), generator=gen, dtype=torch.float32) / rows**0.5
    assert torch.equal(pj.projection_matrix(name, rows, cols, seed, kind=pj.LEGACY_PROJECTION), old)
    assert pj.projection_kind({}) == pj.LEGACY_PROJECTION
    assert pj.projection_kind({"projection": pj.PROJECTION}) == pj.PROJECTION
    with pytest.raises(ValueError, match="unknown projection kind 'gaussian-v9'.*upgrade"):
        pj.projection_kind({"projection": "gaussian-v9"})


def test_legacy_index_keeps_scoring_with_its_own_projection(model, tmp_path):  # noqa: F811
    ex = examples(6)
    legacy = ma.build_index(model, ex, tmp_path / "old", projection_dim=8, seed=1, token_batch_size=64,
                            projection=pj.LEGACY_PROJECTION, progress=False)  # fmt: skip
    manifest = json.loads((legacy / "manifest.json").read_text())
    del manifest["settings"]["projection"]  # an index written before the key existed
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    old = ma.load_index(legacy)
    q = ma.query_gradients(model, ex[:3], old)
    assert torch.allclose(q, torch.from_numpy(np.array(old.gradients[:3])), rtol=1e-4, atol=1e-6)
    new = ma.load_index(ma.build_index(model, ex, tmp_path / "new", projection_dim=8, seed=1, token_batch_size=64,
                                       progress=False))  # fmt: skip
    assert new.manifest["settings"]["projection"] == pj.PROJECTION
    assert not np.allclose(np.asarray(new.gradients), np.asarray(old.gradients))  # a different projection
    assert torch.allclose(ma.query_gradients(model, ex[:3], new), torch.from_numpy(np.array(new.gradients[:3])),
                          rtol=1e-4, atol=1e-6)  # fmt: skip
    ek_new = ma.fit_ekfac(model, ex, projection_dim=8, seed=1, progress=False)
    assert ek_new.settings["projection"] == pj.PROJECTION
    with pytest.raises(ScoreError, match=f"fitted with projection '{pj.PROJECTION}' but the index uses 'gaussian"):
        precondition_queries(q, old.blocks, ek_new, old.manifest["settings"])
    ek_old = ma.fit_ekfac(model, ex, projection_dim=8, seed=1, projection=pj.LEGACY_PROJECTION, progress=False)
    ek_old.save(tmp_path / "ek")
    info = json.loads((tmp_path / "ek" / "ekfac.json").read_text())
    del info["settings"]["projection"]  # factors written before the key existed
    (tmp_path / "ek" / "ekfac.json").write_text(json.dumps(info))
    loaded = ma.load_ekfac(tmp_path / "ek")
    assert loaded.projection == pj.LEGACY_PROJECTION
    assert torch.isfinite(precondition_queries(q, old.blocks, loaded, old.manifest["settings"])).all()


# -- rademacher-hash-v2: sides no wider than p are kept exact ------------------------------------------------------


def side(name: str, p: int, features: int, seed: int, kind: str, batch: int | None = None) -> torch.Tensor:
    """Each kind's rule, stated here: v2 keeps a side of width <= p (identity), every other side is projected."""
    if kind == pj.PROJECTION and features <= p:
        eye = torch.eye(features, dtype=torch.float64)
        return eye if batch is None else eye.expand(batch, features, features)
    return pj.projection_matrix(name, p, features, seed, batch, kind=kind).double()


def by_hand(
    exact: dict, report, p: int, seed: int, kind: str, dims: dict | None = None
) -> dict[str, tuple[torch.Tensor, bool, bool]]:
    """Every exact per-example block projected by hand: key -> (float64 [N, ...], out side kept, in side kept);
    a target named in `dims` takes its own p."""
    out, base = {}, p
    for t in report.targets:
        if t.kind == "experts":
            lay = t.layout
            for pr in lay.projections:
                fin, fout = lay.features(pr)
                p_in = side(f"{lay.name}.{pr}/in", p, fin, seed, kind, lay.num_experts)
                p_out = side(f"{lay.name}.{pr}/out", p, fout, seed, kind, lay.num_experts)
                for i in range(lay.num_experts):
                    left, right = (p_in[i], p_out[i]) if lay.transposed else (p_out[i], p_in[i])
                    name = lay.expert_name(i, pr)
                    kept = (fout <= p and kind == pj.PROJECTION, fin <= p and kind == pj.PROJECTION)
                    out[f"{name}.weight"] = (left @ exact[f"{name}.weight"].double() @ right.T, *kept)
                    if lay.has_bias:
                        out[f"{name}.bias"] = (exact[f"{name}.bias"].double() @ p_out[i].T, kept[0], kept[0])
            continue
        p = (dims or {}).get(t.name, base)
        rows, cols = t.module.weight.shape
        fout, fin = (cols, rows) if t.transposed else (rows, cols)
        p_in, p_out = side(f"{t.name}/in", p, fin, seed, kind), side(f"{t.name}/out", p, fout, seed, kind)
        left, right = (p_in, p_out) if t.transposed else (p_out, p_in)
        kept = (fout <= p and kind == pj.PROJECTION, fin <= p and kind == pj.PROJECTION)
        out[f"{t.name}.weight"] = (left @ exact[f"{t.name}.weight"].double() @ right.T, *kept)
        if t.module._parameters.get("bias") is not None:
            out[f"{t.name}.bias"] = (exact[f"{t.name}.bias"].double() @ p_out.T, kept[0], kept[0])
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_v2_keeps_narrow_sides_exact(family, padded_batch):
    """Per-example gradients under v2 against exact (autograd-checked) gradients with the wide sides
    projected by hand: a kept side is bitwise the exact gradient's, blocks are min(out, p) x min(in, p)."""
    ids, mask = padded_batch
    net = tiny_model(family)
    exact = ma.per_example_gradients(net, ids, mask)
    report = ma.discover(net)
    seen = {"both kept": 0, "one kept": 0, "none kept": 0}
    for p in (16, 64):
        got = ma.per_example_gradients(net, ids, mask, projection_dim=p, seed=5)
        want = by_hand(exact, report, p, 5, pj.PROJECTION)
        assert set(got) == set(want)
        for key, (expected, out_kept, in_kept) in want.items():
            assert got[key].shape == expected.shape, key
            if out_kept and in_kept:
                assert torch.equal(got[key], exact[key]), key
            assert torch.allclose(got[key].double(), expected, rtol=1e-4, atol=1e-5), key
            if key.endswith(".weight"):
                seen["both kept" if out_kept and in_kept else "one kept" if out_kept or in_kept else "none kept"] += 1
    router = "model.layers.0.mlp.router" if family == "gpt_oss" else "model.layers.0.mlp.gate"
    assert got[f"{router}.weight"].shape[1:] == (8, 64)  # 8 experts and hidden 64, both <= p = 64
    assert min(seen.values()) > 0, seen


def test_v2_index_rows_by_hand_and_v1_index_unchanged(model, tmp_path):  # noqa: F811
    """Index rows of both Rademacher kinds against exact gradients projected by hand (v1: every side to p,
    the router's 8 experts expanded to p = 16); each scores its own query rows; a mixed EK-FAC is refused."""
    from moe_attrib.data import collate, labels_for
    from moe_attrib.workflows.checks import UsageError, check_ekfac_dirs

    ex, p = examples(6), 16
    ids, mask = collate(ex, list(range(6)))
    exact = ma.per_example_gradients(model, ids, mask, labels_for(ex, list(range(6)), ids, mask))
    report = ma.discover(model)
    index = {}
    for kind in (pj.PROJECTION, pj.PROJECTION_V1):
        path = ma.build_index(model, ex, tmp_path / kind, projection_dim=p, seed=4, token_batch_size=64,
                              projection=kind, progress=False)  # fmt: skip
        index[kind] = idx = ma.load_index(path)
        assert idx.manifest["settings"]["projection"] == kind
        rows = torch.from_numpy(np.array(idx.gradients)).double()
        want = by_hand(exact, report, p, 4, kind)
        assert {b.name for b in idx.blocks} == set(want)
        for b in idx.blocks:
            expected = want[b.name][0]
            assert tuple(b.shape) == tuple(expected.shape[1:]), (kind, b.name)
            assert torch.allclose(rows[:, b.start : b.stop], expected.reshape(6, -1), rtol=1e-4, atol=1e-5), b.name
        router = next(b for b in idx.blocks if b.name == "model.layers.1.mlp.gate.weight")
        assert tuple(router.shape) == ((8, p) if kind == pj.PROJECTION else (p, p))
        q = ma.query_gradients(model, ex[:3], idx)
        assert torch.allclose(q, rows[:3].float(), rtol=1e-4, atol=1e-6)
    assert index[pj.PROJECTION].blocks[-1].stop < index[pj.PROJECTION_V1].blocks[-1].stop
    ek = ma.fit_ekfac(model, ex, projection_dim=p, seed=4, progress=False)  # the default kind: v2
    ek.save(tmp_path / "ek")
    old = index[pj.PROJECTION_V1]
    mixed = "fitted with projection 'rademacher-hash-v2' but the index uses 'rademacher-hash-v1'"
    with pytest.raises(ScoreError, match=mixed):
        precondition_queries(ma.query_gradients(model, ex[:2], old), old.blocks, ek, old.manifest["settings"])
    with pytest.raises(UsageError, match="--ekfac .*ek: fitted with projection 'rademacher-hash-v2' but the index"):
        check_ekfac_dirs([str(tmp_path / "ek")], old.manifest["settings"], str(old.path))
    new = index[pj.PROJECTION]
    check_ekfac_dirs([str(tmp_path / "ek")], new.manifest["settings"], str(new.path))  # same kind: accepted


def test_v2_ekfac_factors_are_covariances_of_partly_projected_rows(model):  # noqa: F811
    """EK-FAC fitted under v2 (p = 32): a kept side's covariance is the exact one, a wide side's is P C P^T,
    and the corrected eigenvalues are the brute-force mean squares of the by-hand projected gradients."""
    from moe_attrib.data import collate, labels_for

    ex, p, seed = examples(8), 32, 6
    kw = dict(token_batch_size=1000, progress=False, sampled_labels=False)
    full = ma.fit_ekfac(model, ex, projection_dim=None, **kw)
    proj = ma.fit_ekfac(model, ex, projection_dim=p, seed=seed, **kw)
    assert proj.settings["projection"] == pj.PROJECTION
    router, down = "model.layers.0.mlp.gate", "model.layers.1.mlp.experts.down_proj"  # router [8, 64]; down [64, 32]
    p_in = side(f"{router}/in", p, 64, seed, pj.PROJECTION)
    assert torch.allclose(proj.factors[router].G, full.factors[router].G, rtol=1e-10, atol=1e-12)  # 8 experts: kept
    assert torch.allclose(proj.factors[router].A, p_in @ full.factors[router].A @ p_in.T, rtol=1e-5, atol=1e-6)
    p_out = side(f"{down}/out", p, 64, seed, pj.PROJECTION, batch=8)
    assert torch.allclose(proj.factors[down].A, full.factors[down].A, rtol=1e-10, atol=1e-12)  # width 32: kept
    projected = p_out @ full.factors[down].G @ p_out.transpose(1, 2)
    assert torch.allclose(proj.factors[down].G, projected, rtol=1e-5, atol=1e-8)
    assert proj.factors[router].A.shape == (p, p) and proj.factors[router].G.shape == (8, 8)
    ids, mask = collate(ex, list(range(8)))
    exact = ma.per_example_gradients(model, ids, mask, labels_for(ex, list(range(8)), ids, mask))
    want = by_hand(exact, ma.discover(model), p, seed, pj.PROJECTION)
    f = proj.factors[router]
    qr, qc = f.rows_cols
    lam = ((qr.T @ want[f"{router}.weight"][0] @ qc) ** 2).mean(dim=0)
    assert torch.allclose(f.lam, lam, rtol=1e-5, atol=1e-12)
    f = proj.factors[down]
    qr, qc = f.rows_cols
    w = torch.stack([want[f"model.layers.1.mlp.experts.expert_{i}.down_proj.weight"][0] for i in range(8)], dim=1)
    lam = ((qr.transpose(-1, -2) @ w @ qc) ** 2).mean(dim=0)
    assert torch.allclose(f.lam, lam, rtol=1e-5, atol=1e-12)


def test_output_layer_own_width_rows_queries_factors_and_refusals(model, tmp_path):  # noqa: F811
    """`output_projection_dim=W`: the output layer's block is its exact gradient projected by hand at W (the
    64-wide hidden side kept, the 128-word vocabulary side projected), every other block at p as before; query
    rows, the refinement's projection of full-size vectors and the EK-FAC factors (P C P^T at W) follow it;
    factors without it are refused for such an index, before any scoring."""
    from moe_attrib.curvature import ihvp
    from moe_attrib.data import collate, labels_for
    from moe_attrib.workflows.checks import UsageError, check_ekfac_dirs

    ex, p, w, seed = examples(6), 16, 64, 4
    ids, mask = collate(ex, list(range(6)))
    exact = ma.per_example_gradients(model, ids, mask, labels_for(ex, list(range(6)), ids, mask))
    report = ma.discover(model)
    assert report.output_layer == "lm_head"
    path = ma.build_index(model, ex, tmp_path / "idx", projection_dim=p, output_projection_dim=w, seed=seed,
                          token_batch_size=64, progress=False)  # fmt: skip
    idx = ma.load_index(path)
    assert idx.manifest["settings"]["output_projection_dim"] == w and idx.settings.collect.output_projection_dim == w
    rows = torch.from_numpy(np.array(idx.gradients)).double()
    want = by_hand(exact, report, p, seed, pj.PROJECTION, {"lm_head": w})
    assert {b.name for b in idx.blocks} == set(want)
    for b in idx.blocks:
        expected = want[b.name][0]
        assert tuple(b.shape) == tuple(expected.shape[1:]), b.name
        assert torch.allclose(rows[:, b.start : b.stop], expected.reshape(6, -1), rtol=1e-4, atol=1e-5), b.name
    head = next(b for b in idx.blocks if b.name == "lm_head.weight")
    assert tuple(head.shape) == (w, 64)  # vocabulary 128 -> 64 columns, hidden 64 kept; p = 16 would give 16 x 16
    uniform = ma.build_index(model, ex, tmp_path / "uniform", projection_dim=p, seed=seed, token_batch_size=64,
                             progress=False)  # fmt: skip
    same = ma.load_index(uniform)
    other = [b for b in idx.blocks if b.name != "lm_head.weight"]
    assert [(b.name, tuple(b.shape)) for b in other] == [(b.name, tuple(b.shape)) for b in same.blocks[: len(other)]]
    assert ma.load_index(uniform).manifest["settings"]["output_projection_dim"] is None
    q = ma.query_gradients(model, ex[:3], idx)
    assert torch.allclose(q, rows[:3].float(), rtol=1e-4, atol=1e-6)
    entries = ihvp.tracked_entries(model, report)
    vectors = ihvp.full_gradients(model, report, entries, ex[:3])
    cols = ihvp.to_index_columns(idx, report, entries, vectors)
    assert torch.allclose(cols.double(), rows[:3], rtol=1e-4, atol=1e-5)

    kw = dict(token_batch_size=1000, progress=False, sampled_labels=False)
    full = ma.fit_ekfac(model, ex, projection_dim=None, **kw)
    ek = ma.fit_ekfac(model, ex, projection_dim=p, output_projection_dim=w, seed=seed, **kw)
    assert ek.output_projection_dim == w and ek.target_dims(report) == {"lm_head": w}
    f, ref = ek.factors["lm_head"], full.factors["lm_head"]
    p_out = side("lm_head/out", w, 128, seed, pj.PROJECTION)
    assert torch.allclose(f.A, ref.A, rtol=1e-10, atol=1e-12)  # hidden 64 <= w: kept
    assert torch.allclose(f.G, p_out @ ref.G @ p_out.T, rtol=1e-5, atol=1e-8)
    router = "model.layers.0.mlp.gate"
    p_in = side(f"{router}/in", p, 64, seed, pj.PROJECTION)
    assert torch.allclose(ek.factors[router].A, p_in @ full.factors[router].A @ p_in.T, rtol=1e-5, atol=1e-6)
    precondition_queries(q, idx.blocks, ek, idx.manifest["settings"])  # matching factors: accepted
    ek.save(tmp_path / "ek")
    check_ekfac_dirs([str(tmp_path / "ek")], idx.manifest["settings"], str(idx.path))
    plain = ma.fit_ekfac(model, ex, projection_dim=p, seed=seed, **kw)
    assert plain.output_projection_dim is None
    plain.save(tmp_path / "plain")
    with pytest.raises(ScoreError, match="fitted with output_projection_dim=None but the index uses 64"):
        precondition_queries(q, idx.blocks, plain, idx.manifest["settings"])
    with pytest.raises(UsageError, match="--ekfac .*plain: fitted with output_projection_dim=None but the index"):
        check_ekfac_dirs([str(tmp_path / "plain")], idx.manifest["settings"], str(idx.path))
    with pytest.raises(UsageError, match="--ekfac .*ek: fitted with output_projection_dim=64 but the index"):
        check_ekfac_dirs([str(tmp_path / "ek")], same.manifest["settings"], str(same.path))
    from moe_attrib.app.cli import build_parser, index_projection

    def ekfac_args(index, *flags):
        return build_parser().parse_args(["ekfac", "tiny:qwen3_moe", "d.jsonl", "--out", "o", "--index", index, *flags])

    for index, taken in ((path, w), (uniform, p)):  # the index's own width; none of its own: p, like every block
        args = ekfac_args(str(index))
        index_projection(args)
        assert (args.projection_dim, args.output_projection_dim) == (p, taken)
    index_projection(ekfac_args(str(path), "--output_projection_dim", str(w)))  # the index's own: accepted
    with pytest.raises(UsageError, match="--output_projection_dim 32 differs from the index .*idx's \\(64\\)"):
        index_projection(ekfac_args(str(path), "--output_projection_dim", "32"))
