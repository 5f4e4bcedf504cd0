"""`moe-attrib build`: index contents, resume after SIGKILL, torchrun, and bad input."""

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

import moe_attrib as ma
from moe_attrib.data import collate, load_examples
from moe_attrib.indexing.index import IndexFileError, load_index
from moe_attrib.model.zoo import save_tiny
from moe_attrib.settings import DEFAULT_OUTPUT_PROJECTION_DIM
from tests.conftest import run_torchrun

CORPUS = Path(__file__).parent / "data" / "tiny_corpus.jsonl"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


def texts():
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    save_tiny(str(path), "qwen3_moe", texts())
    return path


def build(*args, check=True, timeout=600, env=None):
    res = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "build", *map(str, args), "--quiet", "--precision", "fp32"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or ENV,
    )
    if check:
        assert res.returncode == 0, res.stderr
    return res


@pytest.mark.parametrize("blocks,recompute", [("separate", False), ("sum", False), ("sum", True)])
def test_index_rows_equal_per_example_gradients(model_dir, tmp_path, blocks, recompute):
    """With `--recompute_layers` too: rows equal the per-example gradients collected without it."""
    index = tmp_path / "index"
    build(
        *(["--recompute_layers"] if recompute else []),
        model_dir,
        CORPUS,
        "--index",
        index,
        "--track_moe_experts",
        "--projection_dim",
        8,
        "--seed",
        5,
        "--token_batch_size",
        96,
        "--expert_blocks",
        blocks,
    )
    idx = load_index(index)
    assert idx.gradients.shape[0] == 48 and idx.manifest["complete"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = load_examples(str(CORPUS), tok)
    rows = [0, 7, 31, 47]
    ids, mask = collate(examples, rows, tok.pad_token_id)
    grads = ma.per_example_gradients(
        model, ids, mask, projection_dim=8, seed=5, output_projection_dim=DEFAULT_OUTPUT_PROJECTION_DIM
    )
    for block in idx.blocks:
        if blocks == "sum" and ".experts." in block.name:
            layer, proj_key = block.name.split(".experts.")
            per_expert = [k for k in grads if k.startswith(f"{layer}.experts.expert_") and k.endswith(proj_key)]
            expected = torch.stack([grads[k] for k in per_expert]).sum(0)
        else:
            expected = grads[block.name]
        got = torch.from_numpy(np.asarray(idx.gradients[rows, block.start : block.stop]))
        assert torch.allclose(got, expected.reshape(len(rows), -1), rtol=1e-4, atol=1e-6), block.name
    assert np.allclose(idx.losses[rows], grads.losses.numpy(), rtol=1e-5)
    counts = np.asarray(idx.expert_counts[rows])
    assert np.array_equal(counts, grads.expert_counts.numpy())
    assert counts.sum() == mask.sum() * 2 * len(idx.manifest["expert_layers"])


def test_kill_and_resume_gives_identical_index(model_dir, tmp_path):
    args = [model_dir, CORPUS, "--track_moe_experts", "--projection_dim", 8, "--token_batch_size", 16]
    ref = tmp_path / "ref"
    build(*args, "--index", ref)
    index = tmp_path / "killed"
    part = Path(str(index) + ".part")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_attrib",
            "build",
            *map(str, args),
            "--index",
            str(index),
            "--quiet",
            "--precision",
            "fp32",
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    killed_at = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        done = part / "done.npy"
        if done.exists():
            try:
                n = int(np.load(done, mmap_mode="r").sum())
            except (ValueError, OSError):
                n = 0
            if n >= 3:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed_at = n
                break
        time.sleep(0.01)
    assert killed_at is not None, "build finished before it could be killed"
    total = len(np.load(part / "done.npy"))
    assert killed_at < total and not index.exists()
    with pytest.raises(IndexFileError, match="--resume"):
        load_index(index)
    again = build(*args, "--index", index, check=False)
    assert again.returncode != 0 and "--resume" in again.stderr
    mismatch = build(*args[:-2], "--token_batch_size", 32, "--index", index, "--resume", check=False)
    assert mismatch.returncode != 0 and "token_batch_size" in mismatch.stderr
    build(*args, "--index", index, "--resume")
    a, b = load_index(ref), load_index(index)  # the same model file and batches: resume is byte-identical
    assert np.array_equal(a.gradients, b.gradients) and np.array_equal(a.losses, b.losses)
    assert np.array_equal(a.expert_counts, b.expert_counts)


def test_torchrun_two_processes_equal_one(model_dir, tmp_path):
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun not installed")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    args = [str(model_dir), str(CORPUS), "--track_moe_experts", "--projection_dim", "8", "--token_batch_size", "64"]
    one = tmp_path / "one"
    # torchrun runs each rank with OMP_NUM_THREADS=1; the single-process reference uses the same thread count
    build(*args, "--index", one, env={**ENV, "OMP_NUM_THREADS": "1"})
    two = tmp_path / "two"
    res = run_torchrun(
        [
            torchrun,
            "--nproc_per_node=2",
            "-m",
            "moe_attrib",
            "build",
            *args,
            "--index",
            str(two),
            "--overwrite",  # a retried run (see run_torchrun) replaces what the aborted one wrote
            "--quiet",
            "--precision",
            "fp32",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**ENV, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = load_index(one), load_index(two)
    # separate processes: CPU kernels may round differently on operands laid out at other addresses, so
    # rows are compared to float32 rounding (a row in the wrong place or from the wrong example is off by O(1))
    assert np.array_equal(a.expert_counts, b.expert_counts)
    assert np.allclose(a.gradients, b.gradients, rtol=1e-5, atol=1e-6 * np.abs(a.gradients).max())


def test_bad_inputs_are_clear_errors(model_dir, tmp_path):
    def fails(data, *extra, match):
        index = tmp_path / f"idx{len(list(tmp_path.iterdir()))}"
        res = build(model_dir, data, "--index", index, "--track_moe_experts", *extra, check=False)
        assert res.returncode != 0 and match in res.stderr, res.stderr[-2000:]
        assert not index.exists()

    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"body": "no text field here"}\n')
    fails(missing, match="no 'text' field")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails(empty, match="empty")
    fails(CORPUS, "--max_length", 5, match="more than --max_length 5")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{not json\n')
    fails(broken, match="broken.jsonl:2")
    if not torch.cuda.is_available():
        fails(CORPUS, "--cuda_graphs", "--device", "cpu", match="--cuda_graphs needs a CUDA device")


def test_dense_model_with_track_flag_works_with_a_note(tmp_path):
    model_dir = tmp_path / "llama"
    save_tiny(str(model_dir), "llama", texts())
    res = build(model_dir, CORPUS, "--index", tmp_path / "idx", "--track_moe_experts", "--projection_dim", 4)
    assert "no fused experts" in res.stderr
    assert load_index(tmp_path / "idx").gradients.shape[0] == 48


def test_corrupt_index_is_a_clear_error(model_dir, tmp_path):
    index = tmp_path / "idx"
    build(model_dir, CORPUS, "--index", index, "--projection_dim", 4)
    np.save(index / "losses.npy", np.zeros(3, np.float32))
    with pytest.raises(IndexFileError, match="corrupt"):
        load_index(index)
    (index / "manifest.json").write_text("{")
    with pytest.raises(IndexFileError, match="manifest"):
        load_index(index)


@pytest.mark.parametrize("blocks", ["separate", "sum"])
def test_attribute_tokens_rows_sum_to_examples_and_follow_routing(model_dir, tmp_path, blocks):
    common = [model_dir, CORPUS, "--track_moe_experts", "--projection_dim", 4, "--token_batch_size", 128]
    build(*common, "--expert_blocks", blocks, "--index", tmp_path / "ex")
    build(*common, "--expert_blocks", blocks, "--index", tmp_path / "tok", "--attribute_tokens")
    ex, tok = load_index(tmp_path / "ex"), load_index(tmp_path / "tok")
    offsets = tok.token_offsets
    assert tok.gradients.shape[0] == offsets[-1] and len(offsets) == 49
    summed = np.stack([np.asarray(tok.gradients[offsets[i] : offsets[i + 1]]).sum(0) for i in range(48)])
    assert np.allclose(summed, ex.gradients, rtol=1e-4, atol=1e-5)
    if blocks == "sum":
        return
    # a token's expert blocks are nonzero only for the experts the router sent it to
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok_ids = load_examples(str(CORPUS), AutoTokenizer.from_pretrained(model_dir))[5].input_ids
    routed = {}
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: routed.update(idx=out[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([tok_ids]))
    layer0 = {b.name: b for b in tok.blocks if b.name.startswith("model.layers.0.mlp.experts.expert_")}
    for t in range(len(tok_ids) - 1):  # the last token has no next-token loss
        row = np.asarray(tok.gradients[offsets[5] + t])
        for e in range(8):
            block = layer0[f"model.layers.0.mlp.experts.expert_{e}.down_proj.weight"]
            nonzero = np.abs(row[block.start : block.stop]).max() > 0
            assert nonzero == (e in routed["idx"][t].tolist()), (t, e)
