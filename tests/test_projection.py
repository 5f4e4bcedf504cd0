"""Seeded projections: the counter-based hash against an independent reimplementation, statistics,
the process-wide cache, and the legacy Gaussian kind that old indexes and factors keep using."""

import hashlib
import json

import numpy as np
import pytest
import torch

import moe_attrib as ma
from moe_attrib import projection as pj
from moe_attrib.score import ScoreError, precondition_queries
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
