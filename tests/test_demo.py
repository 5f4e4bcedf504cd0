"""The demo end to end (shortened): trains, builds, fits, scores, and finds planted facts above chance."""

import json

from moe_attrib.app.demo import make_corpus, run_demo


def test_corpus_is_deterministic_and_queries_point_at_their_fact():
    train, queries = make_corpus(seed=3)
    assert (train, queries) == make_corpus(seed=3)
    assert {r["domain"] for r in train} == {"facts", "arithmetic", "sequences"}
    for q in queries:
        fact = f"{train[q['source']]['prompt']} {train[q['source']]['completion']}"
        assert q["completion"] in fact.split() and train[q["source"]]["person"] in q["prompt"].split()
        # the answer word alone does not identify the fact: other people share it
        assert sum(t.get("relation") == q["relation"] and t["completion"] == train[q["source"]]["completion"]
                   for t in train) > 1  # fmt: skip


def test_demo_runs_and_beats_chance(tmp_path):
    """The default pipeline (eigenbasis rows, their factors kept in the index) finds planted facts."""
    results = run_demo(tmp_path / "demo", steps=300, progress=False)
    assert json.loads((tmp_path / "demo" / "results.json").read_text())["queries"] == 40
    manifest = json.loads((tmp_path / "demo" / "index" / "manifest.json").read_text())
    assert "eigenbasis" in manifest["settings"] and (tmp_path / "demo" / "index" / "ekfac.json").exists()
    best = results["variants"]["default: experts tracked, EK-FAC"]
    assert best["recall@10"] > 2 * 10 / results["train"]  # twice chance@10 even in this short run
    assert best["coverage"] > 0.99
    assert {"lm_head alone, EK-FAC", "experts alone, EK-FAC"} <= set(results["variants"])
