"""The build pipeline: prefetch thread, writer thread, asynchronous copies; its index equals a plain loop's."""

import threading
import time

import numpy as np
import pytest
import torch

import moe_attrib as ma
from moe_attrib.collect.collector import GradientCollector
from moe_attrib.collect.prefetch import BackgroundWriter, HostCopy, prefetch
from moe_attrib.data import Example, collate, labels_for, token_batches
from moe_attrib.indexing.index import IndexWriter, column_plan, flatten_batch, load_index, part_dir
from moe_attrib.model.zoo import tiny_model
from moe_attrib.settings import CollectSettings


def examples(n=10):
    gen = torch.Generator().manual_seed(3)
    return [Example(i, torch.randint(3, 120, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist())
            for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe")


def build(model, ex, path, **kw):
    kw = {"projection_dim": 8, "seed": 2, "token_batch_size": 24, "progress": False, **kw}
    return ma.build_index(model, ex, path, **kw)


def plain_loop(model, ex, attribute_tokens=False, expert_blocks="separate", token_batch_size=24):
    """Rows of every example computed batch by batch with no thread, no asynchronous copy."""
    report = ma.discover(model)
    dims = CollectSettings(projection_dim=8).target_dims(report.output_layer)  # the output layer's default width
    blocks = column_plan(report, 8, expert_blocks, target_dims=dims)
    rows, losses = {}, {}
    with GradientCollector(model, report, projection_dim=8, seed=2, target_dims=dims) as collector:
        for positions in token_batches(ex, token_batch_size):
            ids, mask = collate(ex, positions, 0)
            out = collector.collect(ids, mask, labels_for(ex, positions, ids, mask), fused_experts=True,
                                    attribute_tokens=attribute_tokens, expert_blocks=expert_blocks)  # fmt: skip
            grads = flatten_batch(out, report, blocks, expert_blocks, attribute_tokens)
            for n, i in enumerate(positions):
                rows[i] = grads[n, : len(ex[i].input_ids)] if attribute_tokens else grads[n]
                losses[i] = out.losses[n].item()
    return np.concatenate([rows[i].reshape(-1, blocks[-1].stop) for i in range(len(ex))]), np.array(
        [losses[i] for i in range(len(ex))], np.float32
    )


@pytest.mark.parametrize("attribute_tokens,blocks", [(False, "separate"), (False, "sum"), (True, "separate")])
def test_pipeline_build_equals_a_plain_loop_byte_for_byte(model, tmp_path, attribute_tokens, blocks):
    ex = examples()
    idx = load_index(build(model, ex, tmp_path / "i", attribute_tokens=attribute_tokens, expert_blocks=blocks))
    assert idx.manifest["num_batches"] > 3
    rows, losses = plain_loop(model, ex, attribute_tokens, blocks)
    assert np.array_equal(np.asarray(idx.gradients), rows)
    assert np.array_equal(np.asarray(idx.losses), losses)


def test_pipeline_build_matches_one_example_per_batch(model, tmp_path):
    """Batching changes only float rounding (padding, matmul shapes), not which row lands where."""
    ex = examples()
    many = load_index(build(model, ex, tmp_path / "many"))
    single = load_index(build(model, ex, tmp_path / "single", token_batch_size=12))
    assert single.manifest["num_batches"] == len(ex)
    a, b = np.asarray(many.gradients), np.asarray(single.gradients)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    assert np.allclose(many.losses, single.losses, rtol=1e-5)
    assert np.array_equal(many.expert_counts, single.expert_counts)


def test_writer_thread_error_propagates_and_leaves_a_resumable_part(model, tmp_path, monkeypatch):
    ex = examples()
    full = load_index(build(model, ex, tmp_path / "full"))
    real, calls = IndexWriter.write, []

    def failing(self, batch, *args):
        calls.append(batch)
        if len(calls) == 3:
            raise OSError("No space left on device (injected)")
        return real(self, batch, *args)

    monkeypatch.setattr(IndexWriter, "write", failing)
    with pytest.raises(OSError, match="injected"):
        build(model, ex, tmp_path / "idx")
    done = np.load(part_dir(tmp_path / "idx") / "done.npy")
    assert done.sum() == 2 and not (tmp_path / "idx").exists()  # the batch that failed is not marked
    monkeypatch.setattr(IndexWriter, "write", real)
    resumed = load_index(build(model, ex, tmp_path / "idx", resume=True))
    assert np.array_equal(np.asarray(resumed.gradients), np.asarray(full.gradients))
    assert np.array_equal(np.asarray(resumed.losses), np.asarray(full.losses))


def test_interrupt_keeps_finished_batches_and_resume_is_exact(model, tmp_path, monkeypatch):
    ex = examples()
    full = load_index(build(model, ex, tmp_path / "full"))
    real, calls = GradientCollector.collect, []

    def interrupted(self, *args, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, *args, **kw)

    monkeypatch.setattr(GradientCollector, "collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(model, ex, tmp_path / "idx")
    done = np.load(part_dir(tmp_path / "idx") / "done.npy")
    assert done.tolist()[:3] == [1, 1, 1] and done.sum() == 3  # batches already computed were written
    monkeypatch.setattr(GradientCollector, "collect", real)
    resumed = load_index(build(model, ex, tmp_path / "idx", resume=True))
    assert np.array_equal(np.asarray(resumed.gradients), np.asarray(full.gradients))


def test_background_writer_runs_in_order_and_raises_the_first_error():
    seen = []
    with BackgroundWriter(depth=1) as bg:
        for i in range(5):
            bg.submit(lambda i=i: seen.append(i))
    assert seen == list(range(5))

    def boom():
        raise RuntimeError("job 1 failed")

    ran = []
    bg = BackgroundWriter(depth=1)
    bg.submit(boom)
    with pytest.raises(RuntimeError, match="job 1 failed"):
        for i in range(100):  # raised at a later submit
            bg.submit(lambda i=i: ran.append(i))
            time.sleep(0.01)
    with pytest.raises(RuntimeError, match="job 1 failed"):
        bg.close()  # and again at close, which ends the thread
    assert ran == [] and not bg.thread.is_alive()  # nothing after the failing job runs
    with pytest.raises(ValueError, match="body"), BackgroundWriter() as bg:  # the body's error wins
        bg.submit(boom)
        time.sleep(0.05)
        raise ValueError("body")
    assert not bg.thread.is_alive()


def test_prefetch_keeps_order_raises_errors_and_stops_when_closed():
    assert list(prefetch(range(7), lambda i: i * i)) == [i * i for i in range(7)]

    def bad(i):
        if i == 3:
            raise KeyError("row 3")
        return i

    got = []
    with pytest.raises(KeyError, match="row 3"):
        for v in prefetch(range(10), bad):
            got.append(v)
    assert got == [0, 1, 2]
    before = threading.active_count()
    gen = prefetch(range(1000), lambda i: i)
    assert next(gen) == 0
    gen.close()
    assert threading.active_count() <= before


def test_host_copy_on_cpu_gives_the_values():
    t = torch.arange(6.0).view(2, 3)
    a, b = HostCopy([t, t.sum(dim=0)]).numpy()
    assert np.array_equal(a, t.numpy()) and np.array_equal(b, [3.0, 5.0, 7.0])
