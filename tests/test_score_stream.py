"""The streamed scoring path (threaded reads, double buffers, tiny blocks, block boundaries) and
16-bit indexes (storage, overflow, effect on scores), against brute force in numpy."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_attrib.data import load_examples
from moe_attrib.indexing import stream
from moe_attrib.indexing.index import IndexDtypeError, IndexFileError, IndexWriter, load_index
from moe_attrib.indexing.stream import stream_rows
from moe_attrib.scoring.score import prepare_queries, query_gradients, score, score_matrix
from moe_attrib.workflows.build import build_index
from tests.conftest import assert_top_rows
from tests.test_build import CORPUS, ENV, model_dir  # noqa: F401  (fixture)

BLOCKS = ["a.weight", "model.layers.0.mlp.experts.expert_0.down_proj.weight", "b.weight", "c.bias"]


def write_index(path, rows: np.ndarray, index_dtype="float32", batch=10, example_ids=None, token_offsets=None):
    """An index holding `rows` (float32), written batch by batch through `IndexWriter` as `build` does."""
    n, dim = rows.shape
    examples = n if token_offsets is None else len(token_offsets) - 1
    cuts = np.linspace(0, dim, len(BLOCKS) + 1).astype(int)
    manifest = {
        "format_version": 1,
        "complete": False,
        "rows": n,
        "examples": examples,
        "dim": dim,
        "settings": {"projection_dim": None, "seed": 0, "attribute_tokens": token_offsets is not None},
        "blocks": [
            {"name": b, "start": int(s), "stop": int(e), "shape": [int(e - s)]}
            for b, s, e in zip(BLOCKS, cuts[:-1], cuts[1:], strict=True)
        ],
        "expert_layers": [],
        "example_ids": list(range(examples)) if example_ids is None else example_ids,
    }
    unit = n if token_offsets is None else examples
    batches = [np.arange(s, min(s + batch, unit)) for s in range(0, unit, batch)]
    writer = IndexWriter(path, manifest, rows=n, dim=dim, layers=0, experts=0, num_batches=len(batches),
                         examples=examples, token_offsets=token_offsets, index_dtype=index_dtype)  # fmt: skip
    for b, members in enumerate(batches):
        if token_offsets is None:
            where = members
        else:
            where = np.concatenate([np.arange(token_offsets[i], token_offsets[i + 1]) for i in members])
        writer.write(b, members, where, rows[where], np.zeros(len(members), np.float32), np.zeros((len(members), 0, 0)))
    return writer.finish()


def rounded(rows: np.ndarray, index_dtype: str) -> np.ndarray:
    """What a 16-bit index should hold, rounded by torch (independent of the index's own conversion)."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[index_dtype]
    return torch.from_numpy(np.array(rows, dtype=np.float32)).to(dtype).float().numpy()


@pytest.fixture
def rows53():
    return np.random.default_rng(0).standard_normal((53, 24)).astype(np.float32)


@pytest.mark.parametrize("reader", ["copy", "pread"])
def test_stream_reads_every_row_once_in_order(tmp_path, rows53, reader, monkeypatch):
    index = load_index(write_index(tmp_path / "idx", rows53))
    calls = []
    real = stream.os.preadv
    monkeypatch.setattr(stream.os, "preadv", lambda *a: calls.append(1) or real(*a))
    row_bytes = 24 * 4
    for kwargs, per_block in (
        ({"block_rows": 1}, 1),
        ({"block_rows": 7}, 7),
        ({"block_rows": 53}, 53),
        ({"block_rows": 500}, 53),
        ({"block_bytes": 5 * row_bytes + 3}, 5),  # not a whole number of rows: rounds down
        ({"block_bytes": 1}, 1),  # smaller than a row: one row per block
    ):
        for threads in (1, 3):
            got = [(s, r.clone()) for s, r in stream_rows(index, torch.device("cpu"), threads=threads, reader=reader,
                                                          **kwargs)]  # fmt: skip
            assert [s for s, _ in got] == list(range(0, 53, per_block)), kwargs
            assert all(r.dtype == torch.float32 for _, r in got)
            assert np.array_equal(torch.cat([r for _, r in got]).numpy(), rows53), (kwargs, threads)
    assert bool(calls) == (reader == "pread")  # the file reader really read the file


@pytest.mark.parametrize("index_dtype", ["float32", "float16", "bfloat16"])
def test_score_and_matrix_equal_brute_force_at_block_boundaries(tmp_path, rows53, index_dtype):
    index = load_index(write_index(tmp_path / "idx", rows53, index_dtype))
    stored = rounded(rows53, index_dtype)
    rng = np.random.default_rng(1)
    # queries close to rows on both sides of the 7-row block boundaries: the true top hits straddle blocks
    q = np.concatenate([stored[[6, 7, 13, 14, 52]] + 0.01 * rng.standard_normal((5, 24)), rng.standard_normal((2, 24))])
    q = q.astype(np.float32)
    cuts = [(b.start, b.stop) for b in index.blocks]
    for unit in (False, True):
        for modules, cols in ((None, slice(0, 24)), ("*.experts.*", slice(*cuts[1]))):
            qq, rr = np.zeros_like(q, np.float64), np.zeros_like(stored, np.float64)
            qq[:, cols], rr[:, cols] = q[:, cols], stored[:, cols]
            if unit:
                qq /= np.linalg.norm(qq, axis=1, keepdims=True)
                rr /= np.linalg.norm(rr, axis=1, keepdims=True)
            brute = qq @ rr.T
            order = np.argsort(-brute, axis=1)[:, :9]
            for block_rows in (1, 7, 8, 53):
                opts = dict(
                    unit_normalize=unit, modules=modules, device="cpu", coupling=None, balance=None
                )  # the uncoupled brute force
                res = score(index, q, top_k=9, per_module=True, block_rows=block_rows, threads=2, **opts)
                assert_top_rows(res.rows, brute)
                assert np.allclose(res.values, np.take_along_axis(brute, order, 1), rtol=1e-5, atol=1e-6)
                assert np.allclose(res.parts.sum(-1), res.values, rtol=1e-5, atol=1e-6)
                out = tmp_path / f"all-{unit}-{block_rows}.npy"
                every = score_matrix(index, q, out=out, block_rows=block_rows, **opts)
                assert np.allclose(np.load(out), brute, rtol=1e-5, atol=1e-6) and every.shape == (7, 53)
            assert np.allclose(score_matrix(index, q, block_bytes=3 * 24 * 2, **opts), brute, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index_dtype", ["float16", "bfloat16"])
def test_16_bit_index_stores_rounded_rows_and_a_damaged_row_ranks_last(tmp_path, rows53, index_dtype):
    path = write_index(tmp_path / "idx", rows53, index_dtype)
    index = load_index(path)
    assert index.dtype == index_dtype and index.manifest["settings"]["index_dtype"] == index_dtype
    assert index.gradients.dtype == {"float16": np.float16, "bfloat16": np.uint16}[index_dtype]
    assert (path / "gradients.npy").stat().st_size < 53 * 24 * 2 + 256  # two bytes a value (plus the header)
    assert np.array_equal(index.read_rows(np.arange(53)), rounded(rows53, index_dtype))
    assert np.array_equal(index.read_rows([5, 2]), rounded(rows53[[5, 2]], index_dtype))
    grads = np.load(path / "gradients.npy", mmap_mode="r+")
    grads[5] = {"float16": np.float16(np.inf), "bfloat16": np.uint16(0x7F80)}[index_dtype]  # +inf bits
    grads.flush()
    del grads
    index = load_index(path)
    res = score(
        index, rows53[[5]], top_k=53, unit_normalize=False, block_rows=4, device="cpu", coupling=None, balance=None
    )
    assert res.rows[0, 0] != 5 and res.rows[0, -1] == 5 and np.isnan(res.values[0, -1])
    assert np.isfinite(res.values[0, :-1]).all()


def test_fp16_overflow_names_the_example_and_bf16_keeps_it(tmp_path, rows53):
    big = rows53.copy()
    big[17, 3] = 7e4  # beyond float16's 65504
    with pytest.raises(IndexDtypeError, match=r"example\(s\) \[117\].*float16.*--index_dtype bfloat16"):
        write_index(tmp_path / "fp16", big, "float16", example_ids=[100 + i for i in range(53)])
    assert not (tmp_path / "fp16").exists()
    index = load_index(write_index(tmp_path / "bf16", big, "bfloat16"))
    assert index.read_rows([17])[0, 3] == rounded(big, "bfloat16")[17, 3] == 70144.0
    offsets = np.array([0, 20, 40, 53])  # a token index: row 17 belongs to example position 0
    with pytest.raises(IndexDtypeError, match=r"example\(s\) \[7\]"):
        write_index(tmp_path / "tok", big, "float16", example_ids=[7, 8, 9], token_offsets=offsets, batch=1)


def test_index_dtype_mismatches_are_refused(tmp_path, rows53):
    path = write_index(tmp_path / "idx", rows53, "float16")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["settings"]["index_dtype"] = "bfloat16"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexFileError, match="corrupt index: gradients.npy holds float16 .* 'bfloat16'"):
        load_index(path)
    m = {"rows": 4, "examples": 4, "dim": 2, "settings": {"seed": 0}, "blocks": [], "example_ids": [0, 1, 2, 3]}
    IndexWriter(tmp_path / "part", m, rows=4, dim=2, layers=0, experts=0, num_batches=1, index_dtype="bfloat16")
    with pytest.raises(IndexFileError, match="settings differ .*index_dtype: index 'bfloat16' vs now 'float32'"):
        IndexWriter(tmp_path / "part", m, rows=4, dim=2, layers=0, experts=0, num_batches=1, resume=True)
    with pytest.raises(IndexDtypeError, match="index_dtype must be one of float32, float16, bfloat16"):
        IndexWriter(tmp_path / "x", m, rows=4, dim=2, layers=0, experts=0, num_batches=1, index_dtype="int8")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


def test_16_bit_index_effect_on_real_scores(model_dir, tmp_path):  # noqa: F811
    """fp16 / bf16 indexes of real projected gradients vs the fp32 index, against a bound derived
    from the rounding alone: each stored value r' = r(1 + d) + e with |d| <= u (unit roundoff:
    2^-11 fp16, 2^-9 bf16) and |e| <= eta (fp16 subnormal underflow, 2^-25; 0 for bf16), so
    ||r' - r|| <= u ||r|| + eta sqrt(dim); an inner product moves by at most ||q|| times that and a
    cosine by at most twice that over ||r||. Ranks may swap only between scores closer than twice
    the bound, so a query's top hit is unchanged whenever its fp32 lead exceeds that."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    train = load_examples(str(CORPUS), tok)
    res = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "build", str(model_dir), str(CORPUS),
         "--index", str(tmp_path / "bfloat16"), "--track_moe_experts", "--projection_dim", "8",
         "--index_dtype", "bfloat16", "--quiet", "--precision", "fp32"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    for dt in ("float32", "float16"):
        build_index(model, train, tmp_path / dt, track_moe_experts=True, projection_dim=8, pad_id=tok.pad_token_id,
                    progress=False, index_dtype=dt)  # fmt: skip
    info = subprocess.run([sys.executable, "-m", "moe_attrib", "info", str(tmp_path / "bfloat16")],
                          capture_output=True, text=True, env=ENV)  # fmt: skip
    assert re.search(r"index_dtype +bfloat16 \(rows as stored", info.stdout), info.stdout
    ref = load_index(tmp_path / "float32")
    rows = ref.read_rows(slice(None)).astype(np.float64)
    assert np.array_equal(rows, np.asarray(ref.gradients))
    q = query_gradients(model, train[::3], ref, pad_id=tok.pad_token_id)
    measured = {}
    for dt, u, eta in (("float16", 2.0**-11, 2.0**-25), ("bfloat16", 2.0**-9, 0.0)):
        index = load_index(tmp_path / dt)
        assert index.dtype == dt and np.array_equal(index.read_rows(slice(None)), rounded(ref.gradients[:], dt))
        for unit in (False, True):
            a = score_matrix(ref, q, unit_normalize=unit, device="cpu", block_rows=5).astype(np.float64)
            b = score_matrix(index, q, unit_normalize=unit, device="cpu", block_rows=5).astype(np.float64)
            qn = np.linalg.norm(prepare_queries(ref, q, unit_normalize=unit).double().numpy(), axis=1)[:, None]
            rn = np.linalg.norm(rows, axis=1)[None]
            moved = u * rn + eta * np.sqrt(rows.shape[1])
            bound = 2 * moved / rn if unit else qn * moved
            assert (np.abs(b - a) <= bound).all(), (dt, unit, (np.abs(b - a) / bound).max())
            lead = np.sort(a, axis=1)[:, -1] - np.sort(a, axis=1)[:, -2]
            clear = lead > 2 * bound.max(axis=1)
            assert clear.sum() >= len(a) // 2 and np.array_equal(a.argmax(1)[clear], b.argmax(1)[clear])
            rho = min(spearman(a[i], b[i]) for i in range(len(a)))
            assert rho > 0.999, (dt, unit, rho)  # measured 0.99978 (bf16), 1.0 (fp16): a regression guard
            measured[dt, unit] = (float((np.abs(b - a) / np.abs(a).max(1, keepdims=True)).max()), rho)
    print("max |error| / largest |score| of the query, min Spearman:", measured)


def test_token_shares_of_a_bf16_token_index_read_the_widened_rows(tmp_path, rows53):
    from moe_attrib.scoring.details import token_scores

    offsets = np.array([0, 20, 40, 53])
    index = load_index(write_index(tmp_path / "tok", rows53, "bfloat16", token_offsets=offsets, batch=2))
    q = rows53[[0, 30]]
    shares = token_scores(index, torch.from_numpy(q), [2, 0], unit_normalize=False, coupling=None, balance=None)
    stored = rounded(rows53, "bfloat16").astype(np.float64)
    for p in (0, 2):
        assert np.allclose(shares[p], q @ stored[offsets[p] : offsets[p + 1]].T, rtol=1e-5, atol=1e-5)
