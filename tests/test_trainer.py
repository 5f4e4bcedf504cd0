"""Attribution where training happens: the `Trainer` callback leaves the run unchanged, its checkpoints' rows
equal `build` on the checkpoints' weights, `score --run` equals averaging `--all_scores` by hand, and a run
that does not belong together is refused before any model is loaded."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

import moe_attrib as ma
from moe_attrib.data import DataError, load_examples
from moe_attrib.model.zoo import tiny_model, train_tokenizer
from moe_attrib.synthetic import multi_domain_corpus, texts
from moe_attrib.workflows.ensemble import EnsembleError, plan_run
from moe_attrib.workflows.trainer import AttributionCheckpointer, TrainerAttributionError, examples_from_batch
from tests.conftest import run_torchrun
from tests.test_build import ENV

P = 8  # projection dim: small rows, quick tests
STEPS = [2, 6]  # collection steps of the accumulated run (6 optimizer steps)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer-data")
    train, queries = multi_domain_corpus(people=2, arithmetic=8, sequences=8, queries_per_domain=2, seed=0)
    tokenizer = train_tokenizer(texts(train + queries))
    for name, rows in (("train.jsonl", train), ("queries.jsonl", queries)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_examples(str(root / "train.jsonl"), tokenizer)
    assert len(examples) == 22 and all(ex.loss_start > 0 for ex in examples)
    return root, tokenizer, examples


def rows_of(examples):
    """The training set as a Trainer dataset: the prompt masked in `labels` (what a completion-only collator does)."""
    return [
        {"input_ids": ex.input_ids, "labels": [-100] * ex.loss_start + ex.input_ids[ex.loss_start :]} for ex in examples
    ]


def train(out, tokenizer, examples, callbacks=(), **overrides):
    """A tiny qwen3_moe trained with `Trainer`: batch 4, gradient accumulation 2 (3 optimizer steps per epoch), 2
    epochs, dropout-free model, shuffled data, linear decay; returns the model and its logged losses."""
    model = tiny_model(
        "qwen3_moe", seed=0, vocab_size=len(tokenizer), hidden_size=32, head_dim=8, moe_intermediate_size=16
    )
    opts = dict(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
        learning_rate=3e-3, lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    opts.update(overrides)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**opts),
        train_dataset=rows_of(examples),
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """The same run without and with the callback (collecting at steps 2 and 6, projection 8)."""
    _, tokenizer, examples = corpus
    root = tmp_path_factory.mktemp("trainer-runs")
    plain, plain_losses = train(root / "plain", tokenizer, examples)
    callback = ma.AttributionCallback(STEPS, projection_dim=P)
    model, losses = train(root / "run", tokenizer, examples, [callback])
    return root / "run", (plain, plain_losses), (model, losses), callback


def test_callback_leaves_the_run_unchanged(runs):
    """Same logged losses and final weights, bitwise: collection restores the RNG (the sampler's next epoch
    order is drawn from it), the train mode and `.grad`, and forms no parameter gradient."""
    run, (plain, plain_losses), (model, losses), callback = runs
    assert len(losses) == 6 and losses == plain_losses
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert model.training and all(p.grad is None for p in model.parameters())
    assert [c.name for c in callback.checkpointer.collected] == ["checkpoint-2", "checkpoint-6"]
    for step in STEPS:
        assert (run / f"checkpoint-{step}" / "model.safetensors").exists()  # the save the callback asked for


def test_checkpoint_rows_equal_a_build_on_its_weights(runs, corpus, tmp_path):
    """checkpoint-N's index rows and EK-FAC factors equal `build_index` / `fit_ekfac` on checkpoint-N's saved
    weights over the prompt/completion examples `load_examples` makes (loss on the completion only): the
    labels' -100 prefix became each example's `loss_start`. Float32 rounding apart: the CPU grouped-matmul
    kernel rounds differently on safetensors-loaded (unaligned) weights (tests/test_zoo.py)."""
    run, *_ = runs
    _, tokenizer, examples = corpus
    for step in STEPS:
        ckpt = run / f"checkpoint-{step}"
        got = ma.load_index(ckpt / "attribution" / "index")
        model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        ma.build_index(model, examples, tmp_path / f"idx-{step}", projection_dim=P, progress=False)
        want = ma.load_index(tmp_path / f"idx-{step}")
        st = got.manifest["settings"]
        assert st["data_fingerprint"] == want.manifest["settings"]["data_fingerprint"]
        assert st["model_fingerprint"] == want.manifest["settings"]["model_fingerprint"]
        assert st["trainer_step"] == step and got.manifest["example_ids"] == list(range(22))
        a, b = np.asarray(got.gradients), np.asarray(want.gradients)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), np.abs(a - b).max()
        assert np.allclose(got.losses, want.losses, rtol=1e-5)
        fitted = ma.fit_ekfac(model, examples, projection_dim=P, progress=False)
        saved = ma.load_ekfac(ckpt / "attribution" / "ekfac")
        assert saved.settings["model_fingerprint"] == st["model_fingerprint"]
        for name, f in fitted.factors.items():
            assert torch.allclose(saved.factors[name].lam, f.lam, rtol=1e-4, atol=1e-9 * float(f.lam.abs().max()))
    rows = [json.loads(r) for r in (run / "checkpoint-2" / "attribution" / "train.jsonl").read_text().splitlines()]
    assert [r["loss_start"] for r in rows] == [ex.loss_start for ex in examples]


def test_checkpoints_at_each_save(corpus, tmp_path):
    """`steps=None`: one collection at each of the Trainer's own saves (save_steps=3: steps 3 and 6)."""
    _, tokenizer, examples = corpus
    cb = ma.AttributionCallback(projection_dim=P, ekfac=False, subset=range(0, 22, 2))
    train(tmp_path, tokenizer, examples, [cb], save_strategy="steps", save_steps=3)
    assert [c.name for c in cb.checkpointer.collected] == ["checkpoint-3", "checkpoint-6"]
    index = ma.load_index(tmp_path / "checkpoint-3" / "attribution" / "index")
    assert index.manifest["example_ids"] == list(range(0, 22, 2))
    assert not (tmp_path / "checkpoint-3" / "attribution" / "ekfac").exists()


def test_refusals_before_training(corpus, tmp_path):
    _, tokenizer, examples = corpus
    with pytest.raises(TrainerAttributionError, match="save_total_limit"):
        train(tmp_path, tokenizer, examples, [ma.AttributionCallback(STEPS)], save_total_limit=1)
    with pytest.raises(ValueError, match="steps >= 1"):
        ma.AttributionCallback([0])
    with pytest.raises(TypeError, match="unknown option"):
        ma.AttributionCallback(STEPS, projection=P)


def test_labels_become_loss_start_or_a_clear_error():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])

    def convert(labels):
        return examples_from_batch({"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([labels])}, [7])

    (ex,) = convert([-100, -100, -100, 8, 9, -100])
    assert (ex.index, ex.input_ids, ex.loss_start) == (7, [5, 6, 7, 8, 9], 3)
    assert convert([5, 6, 7, 8, 9, -100])[0].loss_start == 0
    for labels, match in (
        ([-100, 6, -100, 8, 9, -100], "label 2 is -100 after scored labels"),
        ([-100, -100, -100, 8, 4, -100], "label 4 is not that position's input token"),
        ([-100] * 6, "every label is -100"),
        ([-100, 6, 7, 8, 9, 3], "padding has labels"),
    ):
        with pytest.raises(DataError, match=f"training row 7: {match}"):
            convert(labels)


def test_plain_loop_helper_mid_accumulation(corpus, tmp_path):
    """`maybe_collect` between two micro-batches of one accumulated step: the gradient accumulated so far, the
    RNG and the train mode are as they were, and the rows are the model's (a `build` on the same weights)."""
    _, tokenizer, examples = corpus
    model = tiny_model("qwen3_moe", seed=0, vocab_size=len(tokenizer)).train()
    ckpt = AttributionCheckpointer(tmp_path / "run", examples[:8], steps=[1], tokenizer=tokenizer, projection_dim=P,
                                   ekfac=False)  # fmt: skip
    batch = DataCollatorForSeq2Seq(tokenizer, padding=True)(rows_of(examples[:4]))
    model(**batch).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    state = torch.random.get_rng_state()
    assert ckpt.maybe_collect(0, model) is None
    out = ckpt.maybe_collect(1, model)
    assert out == tmp_path / "run" / "checkpoint-1" and model.training
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    ma.build_index(model.eval(), examples[:8], tmp_path / "want", projection_dim=P, progress=False)
    got, want = ma.load_index(out / "attribution" / "index"), ma.load_index(tmp_path / "want")
    assert np.array_equal(np.asarray(got.gradients), np.asarray(want.gradients))
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def cli(*args):
    res = subprocess.run([sys.executable, "-m", "moe_attrib", *map(str, args)], capture_output=True, text=True,
                         env=ENV, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def test_score_run_equals_averaging_all_scores_by_hand(runs, corpus, tmp_path):
    """`score --run` ranks by the mean of what `score --all_scores` writes for each checkpoint alone."""
    run, *_ = runs
    root, *_ = corpus
    queries = root / "queries.jsonl"
    mats = []
    for step in STEPS:
        att = run / f"checkpoint-{step}" / "attribution"
        out = tmp_path / f"s-{step}.npy"
        cli("score", "--index", att / "index", run / f"checkpoint-{step}", queries, "--ekfac", att / "ekfac",
            "--all_scores", out, "--out", tmp_path / f"r-{step}.jsonl", "--device", "cpu")  # fmt: skip
        mats.append(np.load(out).astype(np.float64))
    cli("score", "--run", run, run / "checkpoint-6", queries, "--top_k", 5, "--out", tmp_path / "run.jsonl",
        "--device", "cpu", "--report", tmp_path / "run.html")  # fmt: skip
    assert (tmp_path / "run.html").stat().st_size > 0
    mean = (mats[0] + mats[1]) / 2
    records = [json.loads(r) for r in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert len(records) == mean.shape[0] == 6
    for q, rec in enumerate(records):
        hits = rec["results"]
        want = np.sort(mean[q])[::-1][:5]
        assert np.allclose([h["score"] for h in hits], want, rtol=1e-5, atol=1e-6)
        assert np.allclose(mean[q, [h["example"] for h in hits]], want, rtol=1e-5, atol=1e-6)
        assert all(h.get("text") for h in hits)
    # the Python equivalent, matrices kept
    queries_ex = load_examples(str(queries), corpus[1])
    result = ma.score_run(run, queries_ex, top_k=5, out=tmp_path / "mats", device="cpu")
    assert [p.name for p in result.checkpoints] == ["checkpoint-2", "checkpoint-6"]
    for m, path in zip(mats, result.matrices, strict=True):
        assert np.allclose(np.load(path), m, rtol=1e-5, atol=1e-6)
    assert np.allclose(result.scores.values, np.sort(mean, 1)[:, ::-1][:, :5], rtol=1e-5, atol=1e-6)


def never(path):
    raise AssertionError(f"a model was loaded ({path}) before the run's checks")


def copy_run(run, dst, steps):
    for step in steps:
        shutil.copytree(run / f"checkpoint-{step}", dst / f"checkpoint-{step}")
    return dst


def test_score_run_refuses_what_does_not_belong_together(runs, corpus, tmp_path):
    """Each refusal comes from the checks before any model is loaded (`load_model` would fail the test)."""
    run, *_ = runs
    root, tokenizer, examples = corpus
    queries = load_examples(str(root / "queries.jsonl"), tokenizer)

    def refuse(path, match, **kw):
        with pytest.raises((EnsembleError, ValueError), match=match):
            ma.score_run(path, queries, load_model=never, device="cpu", **kw)

    # another training set in one checkpoint
    other = copy_run(run, tmp_path / "other-data", STEPS)
    model = AutoModelForCausalLM.from_pretrained(other / "checkpoint-6")
    shutil.rmtree(other / "checkpoint-6" / "attribution" / "index")
    ma.build_index(model, examples[:12], other / "checkpoint-6" / "attribution" / "index", projection_dim=P,
                   progress=False)  # fmt: skip
    refuse(other, "checkpoint-6 scores another training data .* than checkpoint-2", ekfac=False)
    # factors of another checkpoint's weights
    swapped = copy_run(run, tmp_path / "swapped", STEPS)
    shutil.rmtree(swapped / "checkpoint-6" / "attribution" / "ekfac")
    shutil.copytree(run / "checkpoint-2" / "attribution" / "ekfac", swapped / "checkpoint-6" / "attribution" / "ekfac")
    refuse(swapped, "other model weights")
    # the same weights twice
    twice = copy_run(run, tmp_path / "twice", STEPS)
    shutil.copytree(run / "checkpoint-6", twice / "checkpoint-7")
    refuse(twice, "checkpoint-7 was collected from the same weights as checkpoint-6")
    # a scoring setting the factors cannot give, a missing run
    shutil.rmtree(twice / "checkpoint-7" / "attribution" / "ekfac")
    refuse(twice, "checkpoint-7 has no attribution/ekfac")
    refuse(tmp_path / "nothing", "no such directory")
    with pytest.raises(EnsembleError, match="no checkpoint-N/attribution/index"):
        plan_run(tmp_path, "x", 1, ekfac=False, unit_normalize=True, modules=None, coupling=None, balance=False)


def test_torchrun_two_ranks(corpus, tmp_path):
    """Under torchrun (2 CPU ranks, gloo, DDP as the Trainer sets it up) each rank collects its share of the
    batches and rank 0 writes: checkpoint-2's rows equal a one-process build on checkpoint-2's weights, to
    float32 rounding (separate processes; see tests/test_build.py)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    root, tokenizer, examples = corpus
    tokenizer.save_pretrained(root)
    env = {**ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    res = run_torchrun([torchrun, "--nproc_per_node=2", str(Path(__file__).parent / "trainer_driver.py"), str(root),
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoint-2"
    got = ma.load_index(ckpt / "attribution" / "index")
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ma.build_index(model, examples, tmp_path / "want", projection_dim=P, token_batch_size=64, progress=False)
    want = ma.load_index(tmp_path / "want")
    assert got.manifest["settings"]["model_fingerprint"] == want.manifest["settings"]["model_fingerprint"]
    a, b = np.asarray(got.gradients), np.asarray(want.gradients)
    assert np.allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    assert ma.load_ekfac(ckpt / "attribution" / "ekfac").settings["examples"] == len(examples)


def test_a_stock_language_modeling_collator(corpus):
    """transformers' `DataCollatorForLanguageModeling(mlm=False)` (labels = input_ids, padding -100): every token
    after the first carries loss, as `load_examples` makes plain-text rows; a left-padded batch converts alike."""
    from transformers import DataCollatorForLanguageModeling

    from moe_attrib.workflows.trainer import examples_from_dataset

    _, tokenizer, examples = corpus
    rows = [{"input_ids": ex.input_ids} for ex in examples]
    got = examples_from_dataset(rows, DataCollatorForLanguageModeling(tokenizer, mlm=False), tokenizer=tokenizer)
    assert [(ex.index, ex.input_ids, ex.loss_start) for ex in got] == [
        (i, r["input_ids"], 0) for i, r in enumerate(rows)
    ]
    tokenizer.padding_side = "left"
    try:
        batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)(rows[:5])
    finally:
        tokenizer.padding_side = "right"
    assert (batch["attention_mask"][:, 0] == 0).any()
    assert [ex.input_ids for ex in examples_from_batch(batch, range(5))] == [r["input_ids"] for r in rows[:5]]
