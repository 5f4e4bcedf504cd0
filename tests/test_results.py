"""Results files (.jsonl/.csv/.tsv), record fields carried into them, `show`, `info`, `--version`/`--help`."""

import csv
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_attrib.curvature.ekfac import fit_ekfac
from moe_attrib.data import load_examples
from moe_attrib.indexing.index import load_index
from moe_attrib.scoring.details import query_expert_counts, token_scores
from moe_attrib.scoring.results import ResultsError, read_results, score_records, write_results
from moe_attrib.scoring.score import query_gradients, score
from moe_attrib.workflows.build import build_index
from tests.test_build import ENV, texts
from tests.test_build import model_dir as model_dir  # noqa: F401  (fixture)

QUERIES = [
    {"text": "Ada was born in Lisbon .", "qid": "q-ada", "lang": "en"},
    {"text": "Boris was born in Perth .", "qid": "q-boris", "lang": "en"},
]


def cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "moe_attrib", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny(model_dir, tmp_path_factory):  # noqa: F811
    """The tiny corpus with metadata fields, an example index and a token index of it, the queries."""
    root = tmp_path_factory.mktemp("results")
    data = root / "data.jsonl"
    rows = [{"text": t, "doc": f"doc-{i}", "n": i, "even": i % 2 == 0, "w": i / 4} for i, t in enumerate(texts())]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    train = load_examples(str(data), tok)
    queries = load_examples(str(root / "q.jsonl"), tok)
    for name, tokens in (("idx", False), ("tok", True)):
        build_index(model, train, root / name, model_name=str(model_dir), track_moe_experts=True, projection_dim=4,
                    attribute_tokens=tokens, pad_id=tok.pad_token_id, progress=False,
                    extra_settings={"data": str(data)})  # fmt: skip
    return root, model, tok, train, queries, rows


def records_for(tiny, name="idx", **kwargs):
    root, model, tok, train, queries, _ = tiny
    index = load_index(root / name)
    q = query_gradients(model, queries, index, pad_id=tok.pad_token_id)
    res = score(index, q, top_k=4, per_module=True, unit_normalize=False, device="cpu", coupling=None, balance=None)
    counts = query_expert_counts(model, queries, index, pad_id=tok.pad_token_id)
    shares = None
    if index.token_offsets is not None:
        positions = np.searchsorted(index.token_offsets, res.rows.reshape(-1), side="right") - 1
        shares = token_scores(index, q, positions.tolist(), unit_normalize=False, coupling=None, balance=None)
    return score_records(queries, res, index, train, query_counts=counts, token_scores=shares, tokenizer=tok, **kwargs)


def test_record_fields_and_routing_are_carried(tiny):
    root, model, tok, train, queries, rows = tiny
    records = records_for(tiny)
    assert [r["query_fields"] for r in records] == [{"qid": q["qid"], "lang": q["lang"]} for q in QUERIES]
    for record in records:
        for hit in record["results"]:
            source = rows[hit["example"]]
            assert hit["text"] == source["text"]
            assert hit["fields"] == {k: v for k, v in source.items() if k != "text"}
        # routing: every query token is routed to top-2 experts in each expert layer
        counts = np.asarray(record["query_expert_counts"])
        assert counts.shape == (2, 8) and np.all(counts.sum(-1) == 2 * len(queries[record["query"]].input_ids))
    first = records[0]["results"][0]["example"]  # the first hit carried: which row depends on the projection
    with pytest.raises(ResultsError, match=rf"row {first} has no scalar field 'qid'"):
        records_for(tiny, id_field="qid")  # the training data has no `qid`


def test_formats_round_trip(tiny, tmp_path):
    records = records_for(tiny) + records_for(tiny, "tok")
    for ext in ("jsonl", "csv", "tsv"):
        path = write_results(records, tmp_path / f"s.{ext}")
        assert read_results(path) == records, ext
    # CSV is a plain table: one row per hit, the record fields as columns
    with open(tmp_path / "s.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == sum(len(r["results"]) for r in records)
    assert table[0]["fields.doc"] == records[0]["results"][0]["fields"]["doc"]
    assert float(table[0]["score"]) == records[0]["results"][0]["score"]
    with pytest.raises(ResultsError, match="unknown results format '.xlsx'"):
        write_results(records, tmp_path / "s.xlsx")


def test_token_shares_sum_to_the_example_score(tiny):
    """Token rows of an example sum to its gradient, so its token scores sum to its score in the example index."""
    root, model, tok, train, queries, _ = tiny
    example_index, token_index = load_index(root / "idx"), load_index(root / "tok")
    q = query_gradients(model, queries, example_index, pad_id=tok.pad_token_id)
    brute = q.double().numpy() @ np.asarray(example_index.gradients, dtype=np.float64).T
    for record in records_for(tiny, "tok"):
        for hit in record["results"]:
            shares = np.asarray(hit["token_scores"])
            assert len(hit["tokens"]) == len(shares) == len(train[hit["example"]].input_ids)
            assert np.isclose(shares[hit["token"]], hit["score"], rtol=1e-5)
            assert np.isclose(shares.sum(), brute[record["query"], hit["example"]], rtol=1e-3)
            start = token_index.token_offsets[hit["example"]]
            assert hit["row"] == start + hit["token"]


def test_cli_score_csv_with_id_field_and_show(tiny, model_dir, tmp_path):  # noqa: F811
    root, *_, rows = tiny
    out = tmp_path / "s.tsv"
    res = cli("score", "--index", root / "idx", model_dir, root / "q.jsonl", "--per_module", "--top_k", 3,
              "--id_field", "doc", "--out", out)  # fmt: skip
    assert res.returncode != 0 and "q.jsonl: row 0 has no scalar field 'doc'" in res.stderr  # queries lack `doc`
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({**q, "doc": q["qid"]}) + "\n" for q in QUERIES))
    res = cli("score", "--index", root / "idx", model_dir, tmp_path / "q.jsonl", "--per_module", "--top_k", 3,
              "--id_field", "doc", "--out", out)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    with open(out, newline="") as f:
        table = list(csv.DictReader(f, delimiter="\t"))
    assert len(table) == 6 and not any(c.startswith("fields.") for c in table[0])
    for row in table:
        assert row["id"] == rows[int(row["example"])]["doc"] and row["text"] == rows[int(row["example"])]["text"]
        assert row["query_id"] == QUERIES[int(row["query"])]["qid"]

    shown = cli("show", out, "--top", 2, "--experts", 2)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    for qi, q in enumerate(QUERIES):
        head = lines.index(f"query {qi} [{q['qid']}]: {q['text']}")
        for rank, row in enumerate([r for r in table if int(r["query"]) == qi][:2]):
            hit_line, experts_line = lines[head + 1 + 2 * rank], lines[head + 2 + 2 * rank]
            assert hit_line.split()[:2] == [str(rank + 1), f"{float(row['score']):+.3e}"]
            assert f"#{row['example']} [{row['id']}]" in hit_line and hit_line.endswith(row["text"][-30:])
            parts = json.loads(row["per_module"])["experts"]
            largest = max(parts.items(), key=lambda kv: abs(kv[1]))
            assert experts_line.split()[1:3] == [f"L{largest[0].split('layers.')[1][0]}.e{largest[0][-1]}",
                                                 f"{largest[1]:+.2e},"]  # fmt: skip
        assert lines[head + 5] == ""  # two hits of two lines each, then a blank line
    missing = cli("show", tmp_path / "nope.jsonl")
    assert missing.returncode == 2 and "nope.jsonl: no such results file" in missing.stderr


def test_info_on_index_ekfac_and_other_dirs(tiny, tmp_path):
    root, model, tok, train, *_ = tiny
    res = cli("info", root / "tok")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((root / "tok" / "manifest.json").read_text())
    info = dict(line.split(None, 1) if " " in line else (line, "") for line in res.stdout.splitlines())
    assert info["kind"].strip() == "token index (--attribute_tokens), complete"
    rows_line = res.stdout.split("rows", 1)[1].splitlines()[0]
    assert f"{manifest['rows']:,} rows for {len(train)} examples" in rows_line
    assert re.search(rf"data_fingerprint +{manifest['settings']['data_fingerprint']}", res.stdout)
    size = sum(p.stat().st_size for p in (root / "tok").iterdir())
    assert re.search(rf"size on disk +{size / 1024 / 1024:.1f} MiB", res.stdout)
    fit_ekfac(model, train[:8], projection_dim=4, progress=False, out=tmp_path / "ek")
    res = cli("info", tmp_path / "ek")
    assert res.returncode == 0 and "EK-FAC factors" in res.stdout and "projection_dim=4, seed=0" in res.stdout
    res = cli("info", tmp_path)
    assert res.returncode == 2 and "neither an index (manifest.json) nor EK-FAC factors" in res.stderr


def test_version_and_defaults_in_help():
    from moe_attrib import __version__

    assert cli("--version").stdout.strip() == f"moe-attrib {__version__}"
    assert "(default: 10)" in " ".join(cli("score", "--help").stdout.split())


def test_cli_score_report_on_a_token_index(tiny, model_dir, tmp_path):  # noqa: F811
    root, model, tok, train, queries, rows = tiny
    out, page = tmp_path / "s.jsonl", tmp_path / "r.html"
    res = cli("score", "--index", root / "tok", model_dir, root / "q.jsonl", "--top_k", 4, "--out", out,
              "--report", page)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"report written to {page}" in res.stdout
    text = page.read_text()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record, chunk in zip(records, text.split("<section class='query'")[1:], strict=True):
        tokens = chunk.split("class='section tokens'")[1]
        examples = list(dict.fromkeys(h["example"] for h in record["results"]))
        assert tokens.count("<p class='example'>") == len(examples)
        assert tokens.count('<span class="tok') == sum(len(train[e].input_ids) for e in examples)
        assert tokens.count('<span class="tok hit"') == len(record["results"])  # each hit token outlined once
        hit = record["results"][0]
        assert f'title="token {hit["token"]}: {hit["score"]:+.3e}' in tokens
