"""`score --average_with`: ranking by the mean of several checkpoints' score matrices, against brute force,
and the refusals (the same model twice, other queries, a matrix without its description)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_attrib.indexing.index import load_index
from moe_attrib.workflows.ensemble import mean_top_k
from tests.test_build import CORPUS, ENV, build, model_dir  # noqa: F401  (fixture)


def score(*args, check=True):
    res = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "score", *map(str, args), "--top_k", "4"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    if check:
        assert res.returncode == 0, res.stderr[-2000:]
    return res


@pytest.fixture(scope="module")
def checkpoints(model_dir, tmp_path_factory):  # noqa: F811
    """Two checkpoints of one model (the second perturbed), each with its index over the same data,
    and each scored alone with --all_scores."""
    root = tmp_path_factory.mktemp("ensemble")
    other = root / "ckpt-a"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(other)
    queries = root / "q.jsonl"
    queries.write_text(
        "\n".join(json.dumps({"text": t}) for t in ["Ada was born in Lisbon .", "Boris was born in Perth ."]) + "\n"
    )
    out = {}
    for name, ckpt in (("a", other), ("b", model_dir)):
        build(ckpt, CORPUS, "--index", root / f"idx-{name}", "--track_moe_experts", "--projection_dim", 8)
        score("--index", root / f"idx-{name}", ckpt, queries, "--all_scores", root / f"s-{name}.npy",
              "--out", root / f"r-{name}.jsonl")  # fmt: skip
        out[name] = ckpt
    return root, out, queries


def test_average_with_ranks_by_the_mean_of_the_matrices(checkpoints):
    root, ckpt, queries = checkpoints
    a, b = np.load(root / "s-a.npy"), np.load(root / "s-b.npy")
    assert a.shape == b.shape == (2, 48) and not np.allclose(a, b)
    info = json.loads((root / "s-a.npy.json").read_text())
    assert info["shape"] == [2, 48] and info["format"] == "moe-attrib all-scores"
    out = root / "avg.jsonl"
    res = score("--index", root / "idx-b", ckpt["b"], queries, "--average_with", root / "s-a.npy",
                "--per_module", "--out", out, "--all_scores", root / "s-b2.npy")  # fmt: skip
    assert "mean of 2 score matrices" in res.stdout
    assert np.allclose(np.load(root / "s-b2.npy"), b, atol=1e-6)  # this run's own matrix, not the mean
    mean = (a.astype(np.float64) + b) / 2
    ids = load_index(root / "idx-b").manifest["example_ids"]
    for q, line in enumerate(out.read_text().splitlines()):
        hits = json.loads(line)["results"]
        expected = np.argsort(-mean[q])[:4]
        assert [h["example"] for h in hits] == [ids[r] for r in expected]
        assert np.allclose([h["score"] for h in hits], mean[q, expected], atol=1e-5)
        assert all(h["per_module"]["experts"] for h in hits)


def test_all_scores_top_k_equals_a_plain_score_run(checkpoints):
    """With --all_scores the top-k is read back from the written matrix (one pass over the index):
    the same hits, scores and per-module parts as a run without it."""
    root, ckpt, queries = checkpoints
    runs = {}
    for name, extra in (("plain", ()), ("matrix", ("--all_scores", root / "s-b3.npy"))):
        out = root / f"r-b-{name}.jsonl"
        score("--index", root / "idx-b", ckpt["b"], queries, "--per_module", "--out", out, *extra)
        runs[name] = [json.loads(line)["results"] for line in out.read_text().splitlines()]
    assert np.allclose(np.load(root / "s-b3.npy"), np.load(root / "s-b.npy"), atol=1e-6)
    for plain, matrix in zip(runs["plain"], runs["matrix"], strict=True):
        assert [h["example"] for h in plain] == [h["example"] for h in matrix]
        assert np.allclose([h["score"] for h in plain], [h["score"] for h in matrix], atol=1e-5)
        for a, b in zip(plain, matrix, strict=True):
            for kind, parts in a["per_module"].items():
                assert parts.keys() == b["per_module"][kind].keys()
                assert np.allclose(list(parts.values()), list(b["per_module"][kind].values()), atol=1e-6)


def test_mean_top_k_in_blocks_equals_brute_force():
    rng = np.random.default_rng(1)
    mats = [rng.standard_normal((3, 1000)).astype(np.float32) for _ in range(3)]
    mats[1][0, 7] = np.nan  # a non-finite mean ranks last
    values, rows = mean_top_k(mats, 5, block=64)
    mean = np.mean([m.astype(np.float64) for m in mats], axis=0)
    mean[~np.isfinite(mean)] = -np.inf
    for q in range(3):
        assert list(rows[q]) == list(np.argsort(-mean[q])[:5])
        assert np.allclose(values[q], mean[q, rows[q]], atol=1e-6)


def test_average_with_refuses_what_does_not_belong(checkpoints, tmp_path):
    root, ckpt, queries = checkpoints
    base = ["--index", root / "idx-b", ckpt["b"], queries, "--out", tmp_path / "r.jsonl"]
    res = score(*base, "--average_with", root / "s-b.npy", check=False)  # the same weights twice
    assert res.returncode == 2 and "same model weights" in res.stderr
    other_q = tmp_path / "q2.jsonl"
    other_q.write_text(json.dumps({"text": "Ada was born in Perth ."}) + "\n")
    score("--index", root / "idx-a", ckpt["a"], other_q, "--all_scores", tmp_path / "s-q2.npy",
          "--out", tmp_path / "r2.jsonl")  # fmt: skip
    res = score(*base, "--average_with", tmp_path / "s-q2.npy", check=False)
    assert res.returncode == 2 and "another queries" in res.stderr
    bare = tmp_path / "bare.npy"
    np.save(bare, np.load(root / "s-a.npy"))
    res = score(*base, "--average_with", bare, check=False)
    assert res.returncode == 2 and "bare.npy.json beside it" in res.stderr
    assert not (tmp_path / "r.jsonl").exists()
