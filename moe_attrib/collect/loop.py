"""The collection loop: examples in token-budget batches through a collector, each batch's result to a consumer.

`build_index` (rows to the index writer), both passes of `fit_ekfac` (the covariances through the
collector's row sink, then the eigenvalue correction) and `query_gradients` (rows kept in memory) run
this one loop; what differs between them is the collector and the consumer plugged in. The loop:

- takes the batches of `data.token_batches` (numbered globally, longest first); under torchrun each
  rank takes every `world`-th one, less those `done` says are stored already (a resumed build); the
  ranks of a sharded model run in lockstep, padded with filler steps whose results are dropped
  (`Dist.lockstep`);
- prepares the next batches' inputs (collate, labels, pinning) in a background thread
  (`pipeline.prefetch`) and copies them to the device asynchronously;
- replays unpadded batches of the shapes that repeat enough from CUDA graphs when asked
  (`graphs.GraphedCollector`), every other batch eagerly;
- with `reseed`, seeds torch's generator by the global batch number before each batch, so labels
  sampled from the model are drawn alike in any world size;
- shows a progress bar counting real tokens (with a tok/s rate) or steps.

It adds no host sync: what a consumer does with a batch (an asynchronous copy, an accumulation on the
device) is its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from moe_attrib.collect.collector import GradientCollector, PerExampleGradients
from moe_attrib.collect.graphs import GraphedCollector, graphed_shapes
from moe_attrib.collect.prefetch import batch_inputs, prefetch, to_device
from moe_attrib.data import Example
from moe_attrib.model.distributed import Dist


@dataclass(frozen=True)
class Step:
    """One batch of the loop: its number in the global batch order, the positions of its examples, and
    whether it is real (False: a sharded model's filler step, run only to keep the ranks in lockstep)."""

    number: int
    positions: list[int]
    real: bool = True


@dataclass(frozen=True)
class Progress:
    """A progress bar `"{desc} rank {r}"` that counts real tokens with a tok/s rate (`tokens`) or steps."""

    desc: str
    tokens: bool = False


Consumer = Callable[[Step, PerExampleGradients], None]


class CollectionLoop:
    """This rank's steps over `batches` (positions of `examples` per batch, `data.token_batches`), and `run`.

    `done(b)` True: batch `b` is stored already and skipped. `step` is the step being collected while
    `run` runs (a row sink that must drop a filler step's records reads `step.real`)."""

    def __init__(
        self,
        examples: list[Example],
        batches: list[list[int]],
        dist: Dist,
        *,
        pad_id: int = 0,
        done: Callable[[int], bool] | None = None,
    ):
        self.examples = examples
        self.dist = dist
        self.pad_id = pad_id
        mine = [
            Step(b, positions)
            for b, positions in enumerate(batches)
            if b % dist.world == dist.rank and not (done is not None and done(b))
        ]
        shortest = min(range(len(examples)), key=lambda i: len(examples[i].input_ids), default=0)
        self.steps = [step for step, _real in dist.lockstep(mine, filler=Step(0, [shortest], real=False))]
        self.step: Step | None = None

    def run(
        self,
        collector: GradientCollector,
        consume: Consumer,
        *,
        progress: Progress | None = None,
        graph_min_batches: int = 0,
        reseed: int | None = None,
        **collect_kwargs,
    ) -> None:
        """Collect every step with the entered `collector` (`collect_kwargs` go to its `collect`) and hand
        each real step's result to `consume(step, grads)`; `grads` is dropped before the next step.

        `graph_min_batches` > 0 replays the unpadded shapes of at least that many real steps from CUDA
        graphs (`collect_kwargs` are then `GraphedCollector`'s: fused_experts, attribute_tokens, expert_blocks); as
        batches come longest first, a shape left behind does not come back, so two graphs are kept.
        `reseed`: `torch.manual_seed(reseed * 1_000_003 + step.number)` before each step."""
        dist, examples, pad_id = self.dist, self.examples, self.pad_id
        pin = dist.device.type == "cuda"
        lengths = [[len(examples[i].input_ids) for i in step.positions] for step in self.steps if step.real]
        shapes = graphed_shapes(lengths, graph_min_batches) if graph_min_batches else set()
        graphed = None
        if shapes:
            graphed = GraphedCollector(collector, capture_after=1, max_graphs=2, **collect_kwargs)
        tokens = progress is not None and progress.tokens
        bar = tqdm(
            total=sum(map(sum, lengths)) if tokens else len(self.steps),
            desc=f"{progress.desc if progress else ''} rank {dist.rank}",
            disable=progress is None,
            unit="tok" if tokens else "it",
            unit_scale=tokens,
        )
        start = time.perf_counter()

        def prepare(step: Step):
            return step, batch_inputs(examples, step.positions, pad_id, pin)

        with contextlib.closing(prefetch(self.steps, prepare)) as ready:
            for step, host in ready:
                self.step = step
                if reseed is not None:
                    torch.manual_seed(reseed * 1_000_003 + step.number)
                ids, mask, labels = to_device(host, dist.device)
                if graphed is not None and tuple(ids.shape) in shapes and bool(host[1].all()):  # unpadded: no mask
                    grads = graphed.collect(ids, labels)
                else:
                    grads = collector.collect(ids, mask, labels, **collect_kwargs)
                if step.real:
                    consume(step, grads)
                del grads
                if not tokens:
                    bar.update(1)
                elif step.real:
                    bar.update(int(host[1].sum()))
                    bar.set_postfix(tok_s=f"{bar.n / max(time.perf_counter() - start, 1e-9):,.0f}")
        bar.close()
        self.step = None
