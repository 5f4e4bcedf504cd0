"""No silently wrong answers: fingerprints, validation before any work, nothing overwritten, Ctrl-C.

Each test runs the CLI as a user would and checks the exit code, the message and what is on disk.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_attrib.curvature.ekfac import fit_ekfac
from moe_attrib.data import load_examples
from moe_attrib.fingerprint import FingerprintError, model_fingerprint, tokenizer_fingerprint
from moe_attrib.indexing.index import load_index
from moe_attrib.model.zoo import save_tiny, train_tokenizer
from moe_attrib.scoring.score import query_gradients
from tests.test_build import CORPUS, ENV, texts

ROOT = Path(__file__).resolve().parents[1]
ENV = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def cli(*args, cwd=None, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "moe_attrib", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**ENV, **(env or {})},
    )


def inproc(*args, env=None, monkeypatch=None):
    """`moe-attrib ARGS` in this process: the same parsing, checks, messages and exit code as the
    command, without paying a fresh interpreter for checks that stop before any work."""
    from moe_attrib.app.cli import main

    err = io.StringIO()
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else 1
            if not isinstance(exit_.code, int):
                print(exit_.code, file=sys.stderr)
    return subprocess.CompletedProcess(args, rc, "", err.getvalue())


def ok(res):
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def fails(res, *messages, rc=2):
    assert res.returncode == rc, (res.returncode, res.stderr[-3000:])
    for m in messages:
        assert m in res.stderr, (m, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A model, a second model of the same architecture with other weights, an index built from a
    relative data path, and EK-FAC factors fitted for it."""
    root = tmp_path_factory.mktemp("integrity")
    save_tiny(str(root / "model"), "qwen3_moe", texts())
    save_tiny(str(root / "other"), "qwen3_moe", texts(), seed=1)
    shutil.copy(CORPUS, root / "train.jsonl")
    (root / "q.jsonl").write_text(json.dumps({"text": texts()[5]}) + "\n")
    ok(cli("build", "model", "train.jsonl", "--index", "idx", "--track_moe_experts", "--projection_dim", 4,
           "--quiet", "--precision", "fp32", cwd=root))  # fmt: skip
    ok(cli("ekfac", "model", "train.jsonl", "--out", "ek", "--index", "idx", "--track_moe_experts", "--quiet",
           "--precision", "fp32", cwd=root))  # fmt: skip
    return root


def test_fingerprints_are_stable_and_tell_checkpoints_apart(env):
    a = AutoModelForCausalLM.from_pretrained(env / "model").eval()
    b = AutoModelForCausalLM.from_pretrained(env / "model").eval()
    other = AutoModelForCausalLM.from_pretrained(env / "other").eval()
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(other)
    assert load_index(env / "idx").manifest["settings"]["model_fingerprint"] == model_fingerprint(a)
    with torch.no_grad():  # one value changed in one tensor is seen (sampled positions include index 0)
        b.model.layers[1].mlp.experts.down_proj.view(-1)[0] += 1e-3
    assert model_fingerprint(b) != model_fingerprint(a)
    tok = AutoTokenizer.from_pretrained(env / "model")
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(AutoTokenizer.from_pretrained(env / "model"))
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(train_tokenizer(texts()[:10]))
    assert json.loads((env / "ek" / "ekfac.json").read_text())["settings"]["model_fingerprint"] == model_fingerprint(a)


def test_score_refuses_a_model_with_other_weights(env, tmp_path):
    fails(cli("score", "--index", env / "idx", env / "other", env / "q.jsonl", "--out", tmp_path / "s.jsonl"),
                "weights differ", "idx")  # fmt: skip
    assert not (tmp_path / "s.jsonl").exists()
    model = AutoModelForCausalLM.from_pretrained(env / "other").eval()  # the Python API checks too
    queries = load_examples(str(env / "q.jsonl"), AutoTokenizer.from_pretrained(env / "other"))
    with pytest.raises(FingerprintError, match="weights differ"):
        query_gradients(model, queries, load_index(env / "idx"))


def test_ekfac_and_factors_of_another_model_are_refused(env, tmp_path):
    fails(cli("ekfac", env / "other", env / "train.jsonl", "--out", tmp_path / "ek", "--index", env / "idx",
              "--track_moe_experts", "--quiet", "--precision", "fp32"), "weights differ")  # fmt: skip
    assert not (tmp_path / "ek").exists()
    other = AutoModelForCausalLM.from_pretrained(env / "other").eval()
    tok = AutoTokenizer.from_pretrained(env / "other")
    fit_ekfac(other, load_examples(str(env / "train.jsonl"), tok), projection_dim=4, progress=False,
              out=tmp_path / "ek_other")  # fmt: skip
    res = cli("score", "--index", env / "idx", "--ekfac", tmp_path / "ek_other", env / "model", env / "q.jsonl",
              "--out", tmp_path / "s.jsonl")  # fmt: skip
    fails(res, "--ekfac", "other model weights")
    assert not (tmp_path / "s.jsonl").exists()


def test_score_refuses_another_tokenizer(env, tmp_path):
    train_tokenizer([t.upper() for t in texts()]).save_pretrained(tmp_path / "tok")
    res = cli("score", "--index", env / "idx", env / "model", env / "q.jsonl", "--tokenizer", tmp_path / "tok",
              "--out", tmp_path / "s.jsonl")  # fmt: skip
    fails(res, "tokenizer differs")
    assert not (tmp_path / "s.jsonl").exists()


def test_score_from_another_directory_and_changed_training_data(env, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ekfac_args = ["--ekfac", env / "ek"]  # the flag before the positionals no longer swallows them
    ok(cli("score", "--index", env / "idx", *ekfac_args, env / "model", env / "q.jsonl", "--top_k", 3,
           "--out", "s.jsonl", cwd=elsewhere))  # fmt: skip
    hits = json.loads((elsewhere / "s.jsonl").read_text())["results"]
    assert [h["text"] for h in hits] == [texts()[h["example"]] for h in hits]
    assert load_index(env / "idx").manifest["settings"]["data"] == str(env / "train.jsonl")

    data = tmp_path / "train.jsonl"  # an index of its own whose data we then edit
    shutil.copy(CORPUS, data)
    ok(cli("build", env / "model", data, "--index", tmp_path / "idx", "--projection_dim", 4, "--quiet",
           "--track_moe_experts", "--precision", "fp32"))  # fmt: skip
    data.write_text(json.dumps({"text": "A new first line ."}) + "\n" + CORPUS.read_text())
    out = tmp_path / "s.jsonl"
    args = ["score", "--index", tmp_path / "idx", env / "model", env / "q.jsonl", "--out", out]
    fails(cli(*args), "changed since the index was built", "--no_texts")
    assert not out.exists()
    ok(cli(*args, "--no_texts"))
    hits = json.loads(out.read_text())["results"]
    assert hits and all(h["text"] is None and isinstance(h["score"], float) for h in hits)


def test_non_finite_gradient_stops_the_build_naming_the_example(env, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(env / "model").eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[7] = float("nan")
    model.save_pretrained(tmp_path / "nan_model")
    data = tmp_path / "ids.jsonl"
    rows = [[3, 4, 5, 6], [3, 4, 7, 5], [4, 5, 6, 3]]
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    res = cli("build", tmp_path / "nan_model", data, "--index", tmp_path / "idx", "--track_moe_experts",
              "--projection_dim", 4, "--token_batch_size", 4, "--quiet", "--precision", "fp32")  # fmt: skip
    fails(res, "example(s) [1]", "non-finite")
    assert not (tmp_path / "idx").exists()


def test_a_nan_row_never_ranks_first_and_scores_are_strict_json(env, tmp_path):
    shutil.copytree(env / "idx", tmp_path / "idx")
    grads = np.load(tmp_path / "idx" / "gradients.npy", mmap_mode="r+")
    grads[5] = np.nan  # the row the query was taken from: without the NaN it ranks first
    grads.flush()
    del grads
    out = tmp_path / "s.jsonl"
    ok(cli("score", "--index", tmp_path / "idx", env / "model", env / "q.jsonl", "--top_k", 48, "--out", out,
           "--per_module"))  # fmt: skip

    def no_constants(name):
        raise AssertionError(f"bare {name} in the scores")

    hits = json.loads(out.read_text(), parse_constant=no_constants)["results"]
    assert hits[0]["row"] != 5 and hits[-1]["row"] == 5 and hits[-1]["score"] is None
    assert all(h["score"] is not None for h in hits[:-1])


def test_nothing_is_overwritten_that_the_tool_did_not_write(env, tmp_path, monkeypatch):
    base = ["--track_moe_experts", "--projection_dim", 4, "--quiet", "--precision", "fp32"]
    target = tmp_path / "idx"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    fails(cli("build", env / "model", env / "train.jsonl", "--index", target, *base), "not empty", "--overwrite")
    fails(cli("build", env / "model", env / "train.jsonl", "--index", target, *base, "--overwrite"), "did not write")
    assert (target / "notes.txt").read_text() == "mine" and not Path(f"{target}.part").exists()

    shutil.copytree(env / "idx", tmp_path / "old")  # an index is replaced (only its files) with --overwrite
    fails(cli("build", env / "model", env / "train.jsonl", "--index", tmp_path / "old", "--quiet"), "not empty")
    ok(cli("build", env / "model", env / "train.jsonl", "--index", tmp_path / "old", "--projection_dim", 2, "--quiet",
           "--overwrite"))  # fmt: skip
    assert load_index(tmp_path / "old").manifest["settings"]["projection_dim"] == 2

    ek = tmp_path / "ek"
    ek.mkdir()
    (ek / "notes.txt").write_text("mine")
    ekfac = ["ekfac", env / "model", env / "train.jsonl", "--out", ek, "--projection_dim", 4, "--quiet"]
    fails(cli(*ekfac), "not empty", "--overwrite")
    assert sorted(p.name for p in ek.iterdir()) == ["notes.txt"]
    ok(cli(*ekfac, "--overwrite"))
    assert sorted(p.name for p in ek.iterdir()) == ["ekfac.json", "factors.safetensors", "notes.txt"]

    (tmp_path / "cwd" / "index").mkdir(parents=True)
    (tmp_path / "cwd" / "index" / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "cwd")
    fails(inproc("demo", "--out", ".", "--quiet"), "not empty", "--overwrite")
    fails(inproc("demo", "--out", ".", "--quiet", "--overwrite"), "did not write")
    assert sorted(p.name for p in (tmp_path / "cwd").rglob("*")) == ["index", "keep.txt"]


def test_arguments_are_validated_before_any_work(env, tmp_path):
    build = ["build", env / "model", env / "train.jsonl", "--index", tmp_path / "idx", "--quiet"]
    for bad in ("0", "-3", "x"):
        fails(inproc(*build, "--projection_dim", bad), "--projection_dim", "must be a positive integer")
    fails(inproc(*build, "--token_batch_size", "0"), "--token_batch_size", "positive integer")
    score = ["score", "--index", env / "idx", env / "model", env / "q.jsonl"]
    fails(inproc(*score, "--top_k", "0", "--out", tmp_path / "s.jsonl"), "--top_k", "positive integer")
    fails(inproc(*score, "--out", tmp_path / "no" / "such" / "s.jsonl"), "--out", "no such directory")
    fails(inproc(*score, "--out", tmp_path), "--out", "is a directory")
    ekfac = ["ekfac", env / "model", env / "train.jsonl", "--quiet"]
    fails(inproc(*ekfac, "--out", tmp_path / "ek", "--damping", "-1"), "--damping", "must be a number >= 0")
    (tmp_path / "afile").write_text("")
    fails(inproc(*ekfac, "--out", tmp_path / "afile" / "ek"), "--out", "cannot create it")
    fails(
        inproc(*ekfac, "--out", tmp_path / "ek", "--index", env / "idx", "--projection_dim", 8), "differ from the index"
    )
    if not torch.cuda.is_available():
        fails(inproc(*build, "--device", "cuda"), "--device cuda", "no CUDA device")
        fails(inproc(*ekfac, "--out", tmp_path / "ek", "--device", "cuda:0"), "no CUDA device")
    fails(inproc(*build, "--device", "gpu7"), "--device 'gpu7'", "not a device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no idx, idx.part, ek, s.jsonl


def test_a_setup_error_leaves_no_part_directory(env, tmp_path):
    index = tmp_path / "idx"
    junk = tmp_path / "optimizer.pt"
    junk.write_bytes(b"not a torch file")
    args = [env / "train.jsonl", "--index", index, "--projection_dim", 4, "--quiet", "--precision", "fp32"]
    res = inproc("build", env / "model", *args, "--track_moe_experts", "--optimizer_state", junk)
    assert res.returncode == 2 and "optimizer" in res.stderr.lower(), res.stderr[-2000:]
    fails(inproc("build", env / "model", *args, "--filter_modules", "nothing.matches.*"), "matched nothing")
    fails(inproc("build", "tiny:no_such_family", *args), "unknown tiny family")
    fails(inproc("build", env / "model", *args, "--optimizer_state", tmp_path / "missing.pt"), "no such file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt"]


def test_mistyped_paths_say_so_and_the_hub_is_asked_only_for_hub_ids(env, tmp_path, monkeypatch):
    offline = {"HF_HUB_OFFLINE": "1"}
    index = ["--index", tmp_path / "idx", "--quiet"]
    fails(inproc("build", tmp_path / "modle", env / "train.jsonl", *index), "no such model directory")
    fails(cli("build", "modle", env / "train.jsonl", *index, cwd=env), "modle: no such model directory")
    res = inproc("inspect", tmp_path / "no" / "model")
    assert res.returncode != 0 and "no such model directory" in res.stderr
    fails(inproc("score", "--index", env / "idx", "typo/model/dir", env / "q.jsonl", "--out", tmp_path / "s.jsonl"),
          "no such model directory")  # fmt: skip
    fails(inproc("build", env / "model", tmp_path / "trian.jsonl", *index), "trian.jsonl: no such file or directory")
    fails(inproc("build", env / "model", "someorg/somedata", *index, env=offline, monkeypatch=monkeypatch),
          "HF_HUB_OFFLINE")  # fmt: skip
    start = time.perf_counter()
    res = cli("build", "someorg/somemodel", env / "train.jsonl", *index, env=offline)
    assert res.returncode != 0 and "cannot load model" in res.stderr and time.perf_counter() - start < 60
    assert list(tmp_path.iterdir()) == []


def test_coverage_note_comes_before_the_work(env, tmp_path):
    res = ok(cli("build", env / "model", env / "train.jsonl", "--index", tmp_path / "idx", "--projection_dim", 4,
                 "--precision", "fp32"))  # fmt: skip
    assert res.stderr.count("NOTE: moe-attrib:") == 1 and "--track_moe_experts" in res.stderr
    assert res.stderr.index("NOTE: moe-attrib:") < res.stderr.index("build rank 0")
    res = ok(cli("ekfac", env / "model", env / "train.jsonl", "--out", tmp_path / "ek", "--projection_dim", 4))
    assert res.stderr.count("NOTE: moe-attrib:") == 1 and "UserWarning" not in res.stderr
    assert res.stderr.index("NOTE: moe-attrib:") < res.stderr.index("ekfac covariances")


def test_ekfac_partitions_repeat_the_flag(env, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(env / "model").eval()
    train = load_examples(str(env / "train.jsonl"), AutoTokenizer.from_pretrained(env / "model"))
    parts = []
    for n, glob in enumerate(("model.layers.0.*", "model.layers.1.*", "lm_head")):
        fit_ekfac(model, train, filter_modules=glob, projection_dim=4, progress=False, out=tmp_path / f"p{n}")
        parts += ["--ekfac", tmp_path / f"p{n}"]
    ok(cli("score", "--index", env / "idx", *parts, env / "model", env / "q.jsonl", "--out", tmp_path / "s.jsonl"))
    whole = tmp_path / "whole.jsonl"
    ok(cli("score", "--index", env / "idx", "--ekfac", env / "ek", env / "model", env / "q.jsonl", "--out", whole))
    a = [h["row"] for h in json.loads((tmp_path / "s.jsonl").read_text())["results"]]
    assert a == [h["row"] for h in json.loads(whole.read_text())["results"]]


def test_ctrl_c_prints_the_resume_command_and_resume_compares_resolved_paths(env, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "data.jsonl").write_text(CORPUS.read_text() * 12)
    shutil.copy(a / "data.jsonl", b / "data.jsonl")  # same content, another path
    args = ["build", env / "model", "data.jsonl", "--index", tmp_path / "idx", "--track_moe_experts",
            "--projection_dim", 4, "--token_batch_size", 16, "--quiet", "--precision", "fp32"]  # fmt: skip
    # SIGINT as in a terminal, also when the suite itself runs with it ignored (a `cmd &` in a script)
    proc = subprocess.Popen([sys.executable, "-m", "moe_attrib", *map(str, args)], cwd=a, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    done = tmp_path / "idx.part" / "done.npy"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if done.exists() and int(np.load(done, mmap_mode="r").sum()) >= 3:
                break
        except (ValueError, OSError, EOFError):  # the file is being created
            pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted; continue with: moe-attrib build") and last.endswith("--resume")
    assert (tmp_path / "idx.part").exists() and not (tmp_path / "idx").exists()

    fails(cli(*args, "--resume", cwd=b), "settings differ", "data:")  # another file, same relative name
    ok(cli(*args[:2], "../a/data.jsonl", *args[3:], "--resume", cwd=b))  # same file, another relative path
    assert load_index(tmp_path / "idx").gradients.shape == (48 * 12, load_index(env / "idx").gradients.shape[1])
