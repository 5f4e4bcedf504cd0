"""The collection loop: this rank's batches, results equal to a plain loop's, label draws alike in any world size."""

import re

import numpy as np
import torch

import moe_attrib as ma
from moe_attrib.collect.collector import GradientCollector
from moe_attrib.collect.loop import CollectionLoop, Progress, Step
from moe_attrib.data import collate, labels_for, token_batches
from moe_attrib.indexing.index import column_plan, flatten_batch
from moe_attrib.model.distributed import Dist
from tests.test_pipeline import examples, model  # noqa: F401  (fixture)

CPU = torch.device("cpu")


def test_each_rank_takes_every_world_th_batch_less_those_done():
    ex = examples(40)
    batches = token_batches(ex, 24)
    assert len(batches) > 7
    done = {1, 4}
    seen = []
    for rank in range(3):
        loop = CollectionLoop(ex, batches, Dist(rank, 3, CPU), done=done.__contains__)
        want = [b for b in range(len(batches)) if b % 3 == rank and b not in done]  # by hand
        assert [s.number for s in loop.steps] == want
        assert [s.positions for s in loop.steps] == [batches[b] for b in want]
        assert all(s.real for s in loop.steps)
        seen += want
    assert sorted(seen + sorted(done)) == list(range(len(batches)))


def test_rows_equal_a_plain_loop_and_a_filler_step_is_collected_but_not_consumed(model, capsys):  # noqa: F811
    """Against a plain loop (no thread, no loop module): each consumed batch's rows and losses; a filler
    step (as `Dist.lockstep` pads a sharded model's ranks with) runs the collector with `step.real`
    False, reaches no consumer, and the token bar counts only real tokens."""
    ex = examples()
    report = ma.discover(model)
    blocks = column_plan(report, 8, "separate")
    want = {}
    with GradientCollector(model, report, projection_dim=8, seed=2) as collector:
        for positions in token_batches(ex, 24):
            ids, mask = collate(ex, positions, 0)
            out = collector.collect(ids, mask, labels_for(ex, positions, ids, mask), fused_experts=True)
            want[tuple(positions)] = (flatten_batch(out, report, blocks, "separate"), out.losses.numpy())

    loop = CollectionLoop(ex, token_batches(ex, 24), Dist(0, 1, CPU))
    loop.steps.insert(1, Step(0, [3], real=False))
    seen, got = [], {}

    def consume(step, out):
        got[tuple(step.positions)] = (flatten_batch(out, report, blocks, "separate"), out.losses.numpy())

    class Watched:  # what the loop's current step says while the collector runs
        def __init__(self, collector):
            self.collector = collector

        def collect(self, *args, **kwargs):
            seen.append(loop.step.real)
            return self.collector.collect(*args, **kwargs)

    with GradientCollector(model, report, projection_dim=8, seed=2) as collector:
        loop.run(Watched(collector), consume, progress=Progress("test", tokens=True), fused_experts=True)
    assert seen == [s.real for s in loop.steps] and seen.count(False) == 1
    assert got.keys() == want.keys()
    for key, (rows, losses) in want.items():
        assert np.array_equal(got[key][0], rows) and np.array_equal(got[key][1], losses)
    tokens = sum(len(e.input_ids) for e in ex)  # the filler's example counted once, as a real one
    last = capsys.readouterr().err.split("\r")[-1]
    counted = re.search(r"test rank 0: 100%\|\S+\| (\S+)/(\S+) ", last)
    assert counted and float(counted[1]) == float(counted[2]) == tokens, last
    assert loop.step is None


def test_reseeded_label_draws_are_the_same_in_any_world_size(model):  # noqa: F811
    """Labels sampled from the model (the true Fisher's, `sample_labels=True`): with `reseed`, the losses
    of every batch are the same whether one rank runs them all or two ranks share them, and the run's
    own draws differ from another seed's (the seeding reaches the sampling)."""
    ex = examples()
    batches = token_batches(ex, 24)
    report = ma.discover(model)

    def losses(rank, world, seed):
        out = {}
        loop = CollectionLoop(ex, batches, Dist(rank, world, CPU))
        with GradientCollector(model, report, projection_dim=8, seed=2) as collector:
            loop.run(collector, lambda step, g: out.update({step.number: g.losses.clone()}), reseed=seed,
                     fused_experts=True, sample_labels=True)  # fmt: skip
        return out

    one = losses(0, 1, seed=7)
    two = {**losses(0, 2, seed=7), **losses(1, 2, seed=7)}
    assert one.keys() == two.keys() == set(range(len(batches)))
    assert all(torch.equal(one[b], two[b]) for b in one)
    other = losses(0, 1, seed=8)
    assert not all(torch.equal(one[b], other[b]) for b in one)
