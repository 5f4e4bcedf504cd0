"""CUDA-graphed collection steps: small unpadded batches at the GPU's speed, not the host's.

At about 1k tokens a collection step is bound by the host (Python, dispatch, launches): every op of
the model's forward and of the capture costs more host time than GPU time. `GraphedCollector` runs
the first batch of each shape eagerly (the capture's one-time checks and the weight taps' discovery
happen there), then captures the whole step (forward, backward, per-example formation) in a CUDA
graph and replays it for every later batch of that shape: one launch instead of a few thousand.

The graphed step runs the eager step's kernels on the same inputs. One thing made them differ: with
no attention mask, transformers checks the positions for packed sequences by reading them on the
host; under stream capture it cannot, assumes packing and builds an explicit causal mask, so
attention runs masked on repeated key/value heads, another computation than the eager forward's.
Positions the model derives itself are never packed (the eager check finds none), so capture runs
with that check answering "not packed" (`unpacked_positions`). Measured on an H100
(docs/performance.md), the replayed rows differ from a fresh eager step's by at most 2.5e-7 to
3.9e-7 of a block's largest entry at 1k tokens, as two eager steps do (3e-7); at 4k by 2.4e-7 in one
run and 7.4e-3 in another, where two eager steps at 8k differed by 4.2e-3 (the eager backward is not
bitwise repeatable at these sizes). Other model code may also take another path under capture, so
each graph's first replay is checked against the eager step of the same batch (routing, losses,
gradients) before the graph is kept.

Batches must be unpadded (no attention mask: a mask is read on the host by transformers), of a fixed
shape per graph, on a CUDA device; results are copied out of the graph's memory before they are
returned, so they survive the next replay. A step that waits for the device anywhere cannot be
captured (float32 tiny models, whose experts take transformers' per-expert fallback on CUDA, failed
on an H100): a trial step with host waits made errors finds that before any capture, a failed
capture is caught too; either is announced once and every batch then runs eagerly.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import torch

from moe_attrib.collect.collector import GradientCollector, PerExampleGradients


# a capture costs about five steps (an eager one, a trial with host waits made errors, a warm-up, the
# capture, the checked replay); a replay saves 20% of a step at 8k tokens, 60% at 1k (H100): a shape
# with this many batches pays for its capture at any size
def graphed_shapes(batch_lengths: Iterable[Sequence[int]], min_batches: int) -> set[tuple[int, int]]:
    """The batch shapes `(rows, tokens)` worth a graph: unpadded batches (every member of one length)
    whose shape occurs in at least `min_batches` batches. `batch_lengths` holds each batch's member
    lengths, in any order."""
    counts = Counter((len(lengths), lengths[0]) for lengths in batch_lengths if lengths and len(set(lengths)) == 1)
    return {shape for shape, count in counts.items() if count >= min_batches}


def graphs_unavailable(device: torch.device, recompute: bool, sharded: bool) -> str | None:
    """Why a build on `device` cannot replay CUDA graphs (a CUDA device, no per-batch Python), or None."""
    if device.type != "cuda":
        return f"--cuda_graphs needs a CUDA device; this build runs on {device}."
    if recompute:
        return "--cuda_graphs and --recompute_layers cannot be combined: recomputing runs Python per layer."
    if sharded:
        return "--cuda_graphs cannot replay a sharded (--fsdp) model's collectives; leave one out."
    return None


def check_graphable(device: torch.device, recompute: bool, sharded: bool) -> None:
    """`cuda_graphs=True` that cannot run: a clear error before any work."""
    reason = graphs_unavailable(device, recompute, sharded)
    if reason is not None:
        raise ValueError(reason)


@contextlib.contextmanager
def unpacked_positions() -> Iterator[None]:
    """While inside, transformers' packed-sequence check (`find_packed_sequence_indices`) says "not
    packed" without reading the positions on the host. Only for batches whose positions the model
    derives itself (no `position_ids` passed), where the eager check says the same."""
    import transformers.masking_utils as masking

    real = getattr(masking, "find_packed_sequence_indices", None)
    if real is None:
        raise RuntimeError(
            "transformers.masking_utils.find_packed_sequence_indices is gone in this transformers version; "
            "moe-attrib cannot keep a captured forward equal to the eager one. Collect eagerly (no cuda_graphs)."
        )
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = real


class GraphedCollector:
    """Collection steps replayed from CUDA graphs, one per batch shape `(N, S)`.

    Wraps an entered `GradientCollector` (without `row_sink` or `recompute`: their Python runs per
    batch); `collect(input_ids, labels)` returns what `collector.collect(input_ids, None, labels,
    **collect_kwargs)` returns (as closely as two eager steps agree; see above). A shape's first
    `capture_after - 1` batches run eagerly, its next one eagerly and then captured, and every later
    one is replayed: a build whose batches rarely repeat a shape pays no capture for them.
    `max_graphs` bounds the graphs kept (each holds its step's activations in a private memory
    pool); the oldest is dropped past it.
    """

    def __init__(
        self,
        collector: GradientCollector,
        *,
        capture_after: int = 1,
        max_graphs: int = 4,
        fused_experts: bool = True,
        attribute_tokens: bool = False,
        expert_blocks: str = "separate",
    ):
        if collector.capture is None:
            raise RuntimeError("GraphedCollector needs an entered collector: `with GradientCollector(...) as c`.")
        if collector.row_sink is not None or collector.recompute:
            raise ValueError(
                "GraphedCollector replays a fixed step: a collector with a row_sink (EK-FAC covariances) or "
                "recompute=True runs Python per batch. Collect eagerly with it instead."
            )
        if capture_after < 1 or max_graphs < 1:
            raise ValueError(f"capture_after ({capture_after}) and max_graphs ({max_graphs}) must be at least 1.")
        self.collector = collector
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.kwargs = dict(fused_experts=fused_experts, attribute_tokens=attribute_tokens, expert_blocks=expert_blocks)
        self._graphs: dict[tuple, tuple] = {}
        self._seen: dict[tuple, int] = {}
        self.captured = 0  # graphs captured so far (for tests and benchmarks)
        self.replayed = 0
        self.unsupported: str | None = None  # why the step cannot be captured (then every batch runs eagerly)

    def collect(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> PerExampleGradients:
        """Per-example gradients of one unpadded batch (`labels` default to `input_ids`)."""
        if not input_ids.is_cuda:
            raise ValueError(f"GraphedCollector needs the batch on a CUDA device; input_ids is on {input_ids.device}.")
        labels = input_ids if labels is None else labels
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} do not match input_ids {tuple(input_ids.shape)}.")
        if self.unsupported is not None:
            return self._step(input_ids, labels)
        key = (tuple(input_ids.shape), input_ids.dtype, labels.dtype, input_ids.device)
        entry = self._graphs.get(key)
        if entry is not None:
            graph, ids, lab, static, _ = entry
            ids.copy_(input_ids)
            lab.copy_(labels)
            graph.replay()
            self.replayed += 1
            return _copied(static)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        result = self._step(input_ids, labels)
        if seen >= self.capture_after:
            self._capture(key, input_ids, labels, result)
        return result

    def _step(self, ids: torch.Tensor, labels: torch.Tensor) -> PerExampleGradients:
        return self.collector.collect(ids, None, labels, **self.kwargs)

    def _capture(self, key: tuple, input_ids: torch.Tensor, labels: torch.Tensor, eager: PerExampleGradients) -> None:
        """Capture the step for `key`'s shape, after an eager one (`eager`, on this batch) has run its
        one-time checks: a trial step off the capture (a host wait there is an error), a warm-up step,
        the capture, and one replay on this batch checked against `eager` (model code that reads
        tensors on the host may take another path under capture, as transformers' mask code does)."""
        ids, lab = input_ids.clone(), labels.clone()
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with unpacked_positions(), _holding_projections(self.collector) as matrices:
            with torch.cuda.stream(side):
                reason = _host_sync(lambda: self._step(ids, lab))
                if reason is None:
                    self._step(ids, lab)  # allocations and lazy state settle off the capture
            torch.cuda.current_stream(ids.device).wait_stream(side)
            if reason is None:
                graph = torch.cuda.CUDAGraph()
                try:
                    # thread_local: a build's prefetch and writer threads pin memory and wait for
                    # copies meanwhile; only this thread's calls must be capturable
                    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                        static = self._step(ids, lab)
                except RuntimeError as err:
                    reason = f"capture failed: {str(err).splitlines()[0][:200]}"
                else:
                    graph.replay()
                    reason = _disagreement(static, eager)
        if reason is not None:
            self.unsupported = reason
            warnings.warn(
                f"moe-attrib: this collection step cannot be captured in a CUDA graph ({reason}); every batch "
                "runs eagerly (the same rows). A step with no host wait takes bf16/fp16 experts on CUDA.",
                UserWarning,
                stacklevel=3,
            )
            return
        if len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        # the graph reads the projection matrices where they are now: they live as long as it does,
        # whatever the process-wide projection cache evicts meanwhile
        self._graphs[key] = (graph, ids, lab, static, matrices)
        self.captured += 1


@contextlib.contextmanager
def _holding_projections(collector: GradientCollector) -> Iterator[list[torch.Tensor]]:
    """Yield a list that receives every projection matrix the capture asks for while inside."""
    capture = collector.capture
    project = capture.projector
    matrices: list[torch.Tensor] = []
    if project is None:
        yield matrices
        return

    def holding(*args):
        matrix = project(*args)
        if matrix is not None:
            matrices.append(matrix)
        return matrix

    capture.projector = holding
    try:
        yield matrices
    finally:
        capture.projector = project


# a replay must give the eager forward's values (losses, routing) and gradients within the eager
# backward's own run-to-run spread (its attention backward is not bitwise repeatable at 4k-8k tokens)
LOSS_TOLERANCE = 1e-6
GRADIENT_TOLERANCE = 5e-2


def _disagreement(replayed: PerExampleGradients, eager: PerExampleGradients) -> str | None:
    """Why a replay of the eager step's batch is not that step's result, or None."""
    if not torch.equal(replayed.expert_counts, eager.expert_counts):
        return "the replay routed tokens to other experts than the eager step"
    loss = float((replayed.losses - eager.losses).abs().max() / eager.losses.abs().max().clamp_min(1e-30))
    if loss > LOSS_TOLERANCE:
        return f"the replay's losses differ from the eager step's by {loss:.2e} (relative)"
    for name, want in eager.items():
        scale = want.float().abs().max()
        diff = float((replayed[name].float() - want.float()).abs().max() / scale.clamp_min(1e-30))
        if scale > 0 and diff > GRADIENT_TOLERANCE:
            return f"the replay's {name} differs from the eager step's by {diff:.2e} (relative)"
    return None


def _host_sync(step) -> str | None:
    """Run `step` with synchronizing CUDA operations made errors; the error's first line if one
    waited for the device (a capture would fail there), else None."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as err:
        if "synchroniz" not in str(err).lower():
            raise
        return str(err).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def _copied(static: PerExampleGradients) -> PerExampleGradients:
    out = PerExampleGradients({k: v.clone() for k, v in static.items()})
    out.losses = static.losses.clone()
    out.expert_counts = static.expert_counts.clone()
    out.expert_layers = list(static.expert_layers)
    out.missing = static.missing
    return out
