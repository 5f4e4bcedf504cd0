"""Outputs as well guarded as inputs: nothing overwritten, nothing half-written, nothing accepted that
does not fit, one error line and exit status for every command, no tracebacks.

Each test runs the command as a user would (in this process where the check stops before any
work, else as a subprocess) and checks the exit status, the message and the bytes on disk.
"""

import contextlib
import errno
import importlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_attrib.indexing.index import load_index, part_dir
from moe_attrib.model.zoo import save_tiny
from tests.test_build import CORPUS, texts
from tests.test_integrity import ENV, fails, ok

BUILD = ["--track_moe_experts", "--projection_dim", 4, "--quiet", "--precision", "fp32"]


def inproc(*args) -> subprocess.CompletedProcess:
    """`moe-attrib ARGS` in this process; a KeyboardInterrupt escaping `main()` fails the test (it would
    otherwise stop the whole test session)."""
    from moe_attrib.app.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else 1
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped moe-attrib's main()")
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def one_line(res) -> str:
    """The message of a failed command: exactly one `moe-attrib ...` line (besides progress bars), no traceback."""
    lines = [line for line in res.stderr.splitlines() if line.startswith("moe-attrib")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny model (context 256 positions), its training data and queries, an index, and its scores."""
    root = tmp_path_factory.mktemp("guards")
    save_tiny(str(root / "model"), "qwen3_moe", texts())
    shutil.copy(CORPUS, root / "train.jsonl")
    (root / "q.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts()[3:6]))
    ok(inproc("build", root / "model", root / "train.jsonl", "--index", root / "idx", *BUILD))
    ok(inproc("score", "--index", root / "idx", root / "model", root / "q.jsonl", "--out", root / "s.jsonl"))
    return root


def snapshot(*paths: Path) -> dict:
    return {p: p.read_bytes() for p in paths}


# -- 1: outputs never replace inputs, each other, or an existing file without --overwrite ---------------------


def test_outputs_never_replace_inputs_or_existing_files(env, tmp_path):
    score = ["score", "--index", env / "idx", env / "model", env / "q.jsonl"]
    before = snapshot(env / "train.jsonl", env / "q.jsonl", env / "s.jsonl", env / "idx" / "manifest.json")
    line = one_line(fails(inproc(*score, "--out", env / "train.jsonl"), "refusing to overwrite the training data"))
    assert line.startswith("moe-attrib score: error: --out ")
    fails(inproc(*score, "--out", env / "q.jsonl"), "refusing to overwrite the queries")
    fails(inproc(*score, "--out", env / "idx" / "s.jsonl"), "refusing to overwrite the index")
    fails(inproc(*score, "--out", env / "s.jsonl"), "the file exists; pass --overwrite")
    x = tmp_path / "x.jsonl"
    fails(inproc(*score, "--out", x, "--report", x), "--report writes the same file")
    fails(inproc(*score, "--out", x, "--all_scores", env / "train.jsonl"), "refusing to overwrite the training data")
    report = ["report", "--index", env / "idx", env / "s.jsonl"]
    fails(inproc(*report, "--out", env / "s.jsonl"), "refusing to overwrite the scores file being read")
    fails(inproc(*report, "--out", env / "train.jsonl"), "refusing to overwrite the training data")
    (tmp_path / "r.html").write_text("mine")
    fails(inproc(*report, "--out", tmp_path / "r.html"), "exists; pass --overwrite")
    assert snapshot(*before) == before and (tmp_path / "r.html").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]

    ok(inproc(*report, "--out", tmp_path / "r.html", "--overwrite"))
    assert "<!DOCTYPE html>" in (tmp_path / "r.html").read_text()
    ok(inproc(*score, "--out", tmp_path / "again.jsonl"))
    ok(inproc(*score, "--out", tmp_path / "again.jsonl", "--overwrite"))
    assert (tmp_path / "again.jsonl").read_text() == (env / "s.jsonl").read_text()
    fails(inproc(*score, "--out", env / "train.jsonl", "--overwrite"), "refusing to overwrite the training data")
    assert snapshot(*before) == before


# -- 2: an interrupted --all_scores leaves the previous matrix and its description as they were ---------------


def test_interrupted_all_scores_leaves_the_previous_matrix(env, tmp_path, monkeypatch):
    score_module = importlib.import_module("moe_attrib.scoring.score")  # the package exports a function `score`
    matrix = tmp_path / "S.npy"
    score = ["score", "--index", env / "idx", env / "model", env / "q.jsonl", "--out", tmp_path / "s.jsonl"]
    ok(inproc(*score, "--all_scores", matrix))
    old_bytes = snapshot(matrix, Path(f"{matrix}.json"), tmp_path / "s.jsonl")
    assert np.abs(np.load(matrix)).min() > 0  # cosine scores: no exact zero

    blocks = score_module.row_blocks

    def interrupted(*args, **kwargs):  # Ctrl-C once the first block of scores is written
        for item in blocks(*args, **kwargs):
            yield item
            raise KeyboardInterrupt

    monkeypatch.setattr(score_module, "row_blocks", interrupted)
    res = inproc(*score, "--all_scores", matrix, "--overwrite")
    assert res.returncode == 130 and one_line(res).startswith("moe-attrib score: interrupted"), res.stderr
    assert snapshot(*old_bytes) == old_bytes
    new = tmp_path / "new.npy"
    assert inproc(*score[:-1], tmp_path / "t.jsonl", "--all_scores", new).returncode == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["S.npy", "S.npy.json", "s.jsonl"]  # no temporary left


# -- 3: a report is drawn only from the index its scores were computed against --------------------------------


def test_report_refuses_an_index_the_scores_were_not_computed_against(env, tmp_path):
    other = tmp_path / "other"
    ok(inproc("build", env / "model", env / "train.jsonl", "--index", other, *BUILD[:1], "--projection_dim", 2,
              "--quiet", "--precision", "fp32"))  # fmt: skip
    records = [json.loads(line) for line in (env / "s.jsonl").read_text().splitlines()]
    assert {r["index_fingerprint"] for r in records} != {None}
    res = fails(inproc("report", "--index", other, env / "s.jsonl", "--out", tmp_path / "r.html"),
                "computed against another index")  # fmt: skip
    assert one_line(res).startswith("moe-attrib report: error:") and not (tmp_path / "r.html").exists()
    ok(inproc("report", "--index", env / "idx", env / "s.jsonl", "--out", tmp_path / "r.html"))
    csv = tmp_path / "s.csv"  # the fingerprint survives the CSV round trip
    ok(inproc("score", "--index", env / "idx", env / "model", env / "q.jsonl", "--out", csv))
    fails(inproc("report", "--index", other, csv, "--out", tmp_path / "r2.html"), "computed against another index")


# -- 4: rows over the model's context and empty completions are refused before any work -----------------------


def test_rows_over_the_context_and_empty_completions(env, tmp_path):
    long = " ".join(texts()) * 3  # far beyond the tiny model's 256 positions
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": texts()[0]}) + "\n" + json.dumps({"text": long}) + "\n")
    res = fails(inproc("build", env / "model", data, "--index", tmp_path / "idx", *BUILD),
                f"{data}: row 1 has", "more than the model's context (256 positions")  # fmt: skip
    assert "--truncate" in one_line(res) and not part_dir(tmp_path / "idx").exists()
    ok(inproc("build", env / "model", data, "--index", tmp_path / "idx", *BUILD, "--truncate"))
    index = load_index(tmp_path / "idx")
    assert index.manifest["settings"]["max_length"] == 256 and index.gradients.shape[0] == 2
    ok(inproc("score", "--index", tmp_path / "idx", env / "model", data, "--out", tmp_path / "s.jsonl"))  # re-read

    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"text": long}) + "\n")
    res = fails(inproc("score", "--index", env / "idx", env / "model", queries, "--out", tmp_path / "s2.jsonl"),
                f"{queries}: row 0 has", "model's context")  # fmt: skip
    assert "--token_batch_size" not in res.stderr and "--truncate" not in res.stderr  # score has neither

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "the cat", "completion": "sat"}) + "\n"
                     + json.dumps({"prompt": "the dog", "completion": "  "}) + "\n")  # fmt: skip
    fails(
        inproc("build", env / "model", pairs, "--index", tmp_path / "p", *BUILD),
        f"{pairs}: row 1 has an empty completion",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx", "long.jsonl", "pairs.jsonl", "q.jsonl", "s.jsonl"]


# -- 5: one build at a time writes an index's DIR.part ---------------------------------------------------------


def test_a_part_being_written_is_never_shared(env, tmp_path, monkeypatch):
    from moe_attrib.indexing.index import IndexWriter

    target = tmp_path / "idx"
    args = ["build", env / "model", env / "train.jsonl", "--index", target, *BUILD]
    monkeypatch.setattr(IndexWriter, "finish", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    assert inproc(*args).returncode == 130  # every batch written, never renamed: a DIR.part
    monkeypatch.undo()
    owner_file = part_dir(target) / "owner.json"
    assert json.loads(owner_file.read_text())["pid"] == os.getpid()

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        time.sleep(0.2)
        owner = {"pid": live.pid, "host": socket.gethostname(), "started": time.time()}
        owner_file.write_text(json.dumps(owner))
        for extra in ([], ["--resume"]):
            res = fails(inproc(*args, *extra), "is being written by a running build", f"pid {live.pid}")
            assert one_line(res).startswith("moe-attrib build: error:")
        assert json.loads(owner_file.read_text()) == owner
    finally:
        live.kill()
        live.wait()
    fails(inproc(*args), "holds an interrupted build; pass --resume")  # its owner is gone: resumable
    res = ok(inproc(*args, "--resume"))
    assert f"pid {live.pid}" in res.stderr and "takes it over" in res.stderr
    assert not part_dir(target).exists() and not (target / "owner.json").exists()
    assert np.array_equal(load_index(target).gradients, load_index(env / "idx").gradients)


# -- tracebacks: each is one line and a non-zero exit -----------------------------------------------------------


def test_show_into_a_closed_pipe_ends_quietly(tmp_path):
    hit = {"rank": 1, "row": 0, "example": 0, "score": 0.5, "text": "x" * 80, "fields": {}}
    record = {"query": 0, "query_text": "q", "query_fields": {}, "results": [hit] * 5}
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({**record, "query": i}) + "\n" for i in range(4000)))
    proc = subprocess.Popen([sys.executable, "-m", "moe_attrib", "show", tmp_path / "s.jsonl"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().startswith("query 0")
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err and err == "", err
    assert proc.returncode != 0


def test_show_and_report_on_files_that_are_not_results(env, tmp_path):
    for name in ("train.jsonl", "q.jsonl"):
        res = fails(inproc("show", env / name), "not a moe-attrib results record")
        assert one_line(res).startswith("moe-attrib show: error:")
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    fails(inproc("show", tmp_path / "x.csv"), "not a moe-attrib results file")
    fails(inproc("report", "--index", env / "idx", env / "train.jsonl", "--out", tmp_path / "r.html"), "not a moe")


def test_report_into_a_directory_or_an_unwritable_place(env, tmp_path, monkeypatch):
    report = ["report", "--index", env / "idx", env / "s.jsonl", "--out"]
    one_line(fails(inproc(*report, tmp_path), "is a directory; give a file name"))
    outputs = importlib.import_module("moe_attrib.outputs")

    def read_only(path, *args, **kwargs):  # a read-only filesystem
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(outputs, "open", read_only, raising=False)
    line = one_line(fails(inproc(*report, tmp_path / "r.html"), "Read-only file system"))
    assert line.startswith("moe-attrib report: error:") and "r.html" in line
    line = one_line(fails(inproc("demo", "--out", tmp_path / "demo", "--quiet"), "Read-only file system"))
    assert line.startswith("moe-attrib demo: error:")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["demo"]  # its empty directory, nothing else
    if os.geteuid() != 0:  # root writes anywhere; the pre-check is for everybody else
        monkeypatch.undo()
        (tmp_path / "ro").mkdir(mode=0o555)
        fails(inproc(*report, tmp_path / "ro" / "r.html"), "cannot write in")
        fails(inproc("demo", "--out", tmp_path / "ro" / "demo", "--quiet"), "cannot write in")


def test_ctrl_c_in_ekfac_and_score_is_one_line(env, tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("moe_attrib.curvature.ekfac"), "fit_ekfac", stop)
    monkeypatch.setattr(importlib.import_module("moe_attrib.scoring.score"), "query_gradients", stop)
    res = inproc("ekfac", env / "model", env / "train.jsonl", "--out", tmp_path / "ek", *BUILD)
    assert res.returncode == 130 and one_line(res).startswith("moe-attrib ekfac: interrupted"), res.stderr
    res = inproc("score", "--index", env / "idx", env / "model", env / "q.jsonl", "--out", tmp_path / "s.jsonl")
    assert res.returncode == 130 and one_line(res).startswith("moe-attrib score: interrupted"), res.stderr
    assert not (tmp_path / "ek").exists() and not (tmp_path / "s.jsonl").exists()


def test_plain_forward_inside_a_collector(env):
    from transformers import AutoModelForCausalLM

    from moe_attrib.collect.collector import GradientCollector
    from tests.reference import reference_gradients

    model = AutoModelForCausalLM.from_pretrained(env / "model").eval()
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with GradientCollector(model, track_moe_experts=True) as collector:
        assert torch.allclose(model(input_ids=ids).logits, expected, atol=1e-6)  # between collects: a plain model
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, expected, atol=1e-6)
        grads = collector.collect(ids, mask)
        model(input_ids=ids).logits.sum().backward()  # a forward + backward of its own records nothing
        again = collector.collect(ids, mask)
        targets = collector.report.targets
    reference = reference_gradients(model, ids, mask, targets)
    for name, value in reference[1].items():
        assert torch.allclose(grads[name][1], value, rtol=1e-4, atol=1e-6), name
        assert torch.equal(grads[name], again[name]), name


# -- what a user would trip on ----------------------------------------------------------------------------------


def test_one_error_style_for_arguments_and_every_command(env, tmp_path):
    res = fails(inproc("build", env / "model"), "the following arguments are required")
    assert one_line(res).startswith("moe-attrib build: error:")
    res = fails(inproc("inspect", tmp_path / "missing"), "cannot load model", "no such model directory")
    assert one_line(res).startswith("moe-attrib inspect: error:")
    for cmd in (["show", env / "s.jsonl"], ["report", "--index", env / "idx", env / "s.jsonl", "--out", "r.html"]):
        for bad in ("0", "-1"):
            fails(inproc(*cmd, "--top", bad), "--top", "must be a positive integer")
    build = ["build", env / "model", env / "train.jsonl", "--index", tmp_path / "i", "--quiet"]
    fails(inproc(*build, "--projection_dim", 8, "--no_projection"), "contradict each other")
    fails(inproc(*build, "--projection_dim", 10**12), "must be at most 4096")
    csv = tmp_path / "d.csv"
    csv.write_text("text\nhello world\n")
    fails(inproc("build", env / "model", csv, "--index", tmp_path / "i", "--split", "test", "--quiet"),
          "a single file has no splits")  # fmt: skip
    score = ["score", "--index", env / "idx", env / "model", env / "q.jsonl", "--out", tmp_path / "s.jsonl"]
    fails(inproc(*score, "--damping", "0.1"), "give --ekfac DIR")
    fails(inproc(*score, "--id_field", "nope"), f"{env / 'q.jsonl'}: row 0 has no scalar field 'nope'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.csv"]


def test_encodings_escapes_and_help(env, tmp_path):
    from moe_attrib.app.cli import build_parser
    from moe_attrib.app.report import show_text
    from moe_attrib.data import load_examples

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + CORPUS.read_bytes())
    assert [e.text for e in load_examples(str(bom), _tokenizer(env))] == texts()
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    fails(inproc("build", env / "model", latin, "--index", tmp_path / "i", "--quiet"), f"{latin}:2: not UTF-8 text")

    hit = {"rank": 1, "row": 0, "example": 0, "score": 1.0, "text": "evil \x1b[2J\x1b]0;owned\x07 text"}
    shown = show_text([{"query": 0, "query_text": "q\x1b[31m", "results": [hit]}], width=200)
    assert "\x1b" not in shown and "\x07" not in shown and "\\x1b[2J" in shown

    sub = build_parser()._subparsers._group_actions[0].choices
    for name, parser in sub.items():
        text = parser.format_help()
        assert (
            "(default 32) (default" not in text and "(default: on; never with --modules; docs/scoring.md) (" not in text
        )
        for action in parser._actions:
            if action.option_strings and action.dest not in ("help",):
                assert action.help, (name, action.dest)


def _tokenizer(env):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(env / "model")
