"""Per-example and per-token gradient formation from capture records, and the `GradientCollector` around it.

For a linear map `y = x W^T` the gradient of example n's loss is `sum_t dy_t x_t^T` over its
tokens. `moe_attrib.collect.capture` records each target's input rows and output-gradient rows (projected
first when a projection is set: `P_out dy`, `P_in x`, so nothing of size `out x in` is formed);
this module turns records into gradients. Dense records of the same shape are formed together
with one batched matmul; the experts layers' routed rows are formed per (expert, example)
segment by one grouped GEMM per chunk of layers (`Kernels.segment_mm`), whose temporaries are
sized by the routed rows. No parameter gradient is computed: parameters are frozen during
collection and only activation gradients flow.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_attrib.collect.capture import BatchInfo, Capture, CaptureRecord
from moe_attrib.collect.head import FusedHead
from moe_attrib.collect.projection import PROJECTION, Projections, side_width
from moe_attrib.model import norms
from moe_attrib.model.discovery import CoverageReport, discover, iter_entries
from moe_attrib.model.layouts import Kernels, is_out_of_memory
from moe_attrib.model.recompute import recompute_layers
from moe_attrib.settings import output_dims


class PerExampleGradients(dict):
    """`{"<module>.weight" | "<module>.bias": Tensor [N, ...]}` plus batch metadata.

    `losses`: `[N]` summed token cross-entropy per example. `expert_counts`: `[N, layers, E]`
    real (non-padding) tokens of each example routed to each expert, one row per experts
    module in `expert_layers` order (layers with fewer experts are zero-padded). `missing`: the
    targets (`<module>` or `<experts>.<proj>`) that received no gradient in this batch (off the
    loss path), whose entries are zeros.
    """

    losses: torch.Tensor
    expert_counts: torch.Tensor
    expert_layers: list[str]
    missing: frozenset = frozenset()


def example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of each example (`labels` -100 are ignored)."""
    shifted = logits[:, :-1].float()
    target = labels[:, 1:]
    loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target.reshape(-1), reduction="none")
    return loss.view(target.shape).sum(dim=1)


def default_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`input_ids` with padding set to -100 (no host sync: no boolean-mask indexing)."""
    if attention_mask is None:
        return input_ids.clone()
    return torch.where(attention_mask == 0, -100, input_ids)


def _accumulate(results: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    results[key] = results[key] + value if key in results else value


# bytes of routed rows (both sides) and per-segment outputs formed in one experts call (one chunk of layers)
EXPERTS_CHUNK_BYTES = 512 * 2**20


def form_examples(
    records: list[CaptureRecord],
    n: int,
    kernels: Kernels | None = None,
    chunk_bytes: int = EXPERTS_CHUNK_BYTES,
) -> dict[str, torch.Tensor]:
    """Per-example gradients `{"<target>.weight|bias" or "<experts>.<proj>.weight|bias": [N, (E,) ...]}`.

    Records whose rows have the same widths and orientation are formed together: dense targets
    as `[T * N, R, .]` batches (one batched matmul), experts layers in chunks of at most
    `chunk_bytes` (rows of both sides plus outputs; a layer over it is a chunk of its own), each
    chunk one `kernels.segment_mm` over its layers' (expert, example) segments.
    """
    kernels = kernels or Kernels()
    groups: dict[tuple, list[CaptureRecord]] = {}
    for c in records:
        if c.g is None:
            continue
        kind = ("experts", 0) if c.grid is not None else ("dense", c.x.shape[1])
        groups.setdefault((*kind, c.transposed, c.x.shape[-1], c.g.shape[-1]), []).append(c)
    results: dict[str, torch.Tensor] = {}
    for key, recs in groups.items():
        if key[0] == "dense":
            _form_dense(results, recs, n)
            continue
        chunk, size = [], 0
        for c in recs:
            cost = 4 * (c.x.numel() + c.g.numel() + c.grid.segments * c.x.shape[-1] * c.g.shape[-1])
            if chunk and size + cost > chunk_bytes:
                _form_experts(results, chunk, n, kernels)
                chunk, size = [], 0
            chunk.append(c)
            size += cost
        _form_experts(results, chunk, n, kernels)
    return results


def _form_dense(results: dict, recs: list[CaptureRecord], n: int) -> None:
    x = torch.cat([c.x for c in recs]) if len(recs) > 1 else recs[0].x
    g = torch.cat([c.g for c in recs]) if len(recs) > 1 else recs[0].g
    left, right = (x, g) if recs[0].transposed else (g, x)
    w = torch.bmm(left.transpose(1, 2), right)
    bias = g.sum(dim=1) if any(c.has_bias for c in recs) else None
    if len(recs) == 1:  # no slicing of the whole (one op less)
        _accumulate(results, f"{recs[0].name}.weight", w)
        if recs[0].has_bias:
            _accumulate(results, f"{recs[0].name}.bias", bias)
        return
    for i, c in enumerate(recs):
        _accumulate(results, f"{c.name}.weight", w[i * n : (i + 1) * n])
        if c.has_bias:
            _accumulate(results, f"{c.name}.bias", bias[i * n : (i + 1) * n])


def _form_experts(results: dict, recs: list[CaptureRecord], n: int, kernels: Kernels) -> None:
    """Experts records of one chunk: their rows and segments concatenated, one `segment_mm`.

    Each layer contributes its `E * N` segments and then one segment holding its remaining rows
    (zero-compute experts, or none), whose product is dropped.
    """
    ends, base_rows, base_segs = [], 0, 0
    for c in recs:
        # the grid's bounds: its E * N segment ends, then its row count (the dropped segment's end)
        ends.append(c.grid.bounds + base_rows if base_rows else c.grid.bounds)
        base_rows += c.x.shape[0]
        base_segs += c.grid.segments + 1
    ends = torch.cat(ends) if len(ends) > 1 else ends[0]
    x = torch.cat([c.x for c in recs]) if len(recs) > 1 else recs[0].x
    g = torch.cat([c.g for c in recs]) if len(recs) > 1 else recs[0].g
    left, right = (x, g) if recs[0].transposed else (g, x)
    w = kernels.segment_mm(left, right, ends)
    bias = None
    if any(c.has_bias for c in recs):
        segs, start = [], 0
        for c in recs:
            segs.append(c.grid.seg + start if start else c.grid.seg)
            start += c.grid.segments + 1
        seg = torch.cat(segs) if len(segs) > 1 else segs[0]
        bias = g.new_zeros(base_segs, g.shape[-1]).index_add_(0, seg, g)
    e = recs[0].layout.num_experts
    if len(recs) > 1 and all(c.layout.num_experts == e for c in recs) and bias is None:
        # the same views as below, from four ops for the chunk instead of three per record
        per = w.view(len(recs), e * n + 1, *w.shape[1:])[:, :-1].view(len(recs), e, n, *w.shape[1:]).transpose(1, 2)
        for i, c in enumerate(recs):
            _accumulate(results, f"{c.name}.weight", per[i])
        return
    start = 0
    for c in recs:
        e, stop = c.layout.num_experts, start + c.grid.segments
        _accumulate(results, f"{c.name}.weight", w[start:stop].view(e, n, *w.shape[1:]).transpose(0, 1))
        if c.has_bias:
            _accumulate(results, f"{c.name}.bias", bias[start:stop].view(e, n, -1).transpose(0, 1))
        start = stop + 1


def form_tokens(records: list[CaptureRecord], batch: BatchInfo, expert_blocks: str) -> dict[str, torch.Tensor]:
    """Per-token rows: token t's share `outer(dy_t, x_t)` of every target, summing to the example's.

    Experts blocks are `[N, S, E, ...]`, or `[N, S, ...]` summed over the token's experts with
    `expert_blocks="sum"`.
    """
    n, s = batch.n, batch.seq_len
    results: dict[str, torch.Tensor] = {}
    for c in records:
        if c.g is None:
            continue
        left, right = (c.x, c.g) if c.transposed else (c.g, c.x)
        if c.grid is None:
            outer = torch.einsum("nsa,nsb->nsab", left, right)
            bias = c.g
            if c.groups > 1:  # rows are (token, group) pairs: a token's share sums its groups
                outer = outer.view(n, -1, c.groups, *outer.shape[2:]).sum(dim=2)
                bias = bias.view(n, -1, c.groups, bias.shape[-1]).sum(dim=2)
            _accumulate(results, f"{c.name}.weight", outer)
            if c.has_bias:
                _accumulate(results, f"{c.name}.bias", bias)
            continue
        rows, lay = c.grid.rows, c.layout
        outer = torch.einsum("ra,rb->rab", left, right)
        valid = rows.expert < lay.num_experts  # zero-compute expert rows hold no gradient
        outer = torch.where(valid.view(-1, 1, 1), outer, 0.0)
        bias = torch.where(valid.view(-1, 1), c.g, 0.0) if c.has_bias else None
        if rows.num_tokens // n != s:
            raise RuntimeError(f"{lay.name}: per-token attribution needs one row per token position.")
        for key, val in (("weight", outer), ("bias", bias)):
            if val is None:
                continue
            if expert_blocks == "sum":
                full = val.new_zeros(rows.num_tokens * rows.slots, *val.shape[1:]).index_copy_(0, rows.slot, val)
                _accumulate(results, f"{c.name}.{key}", full.view(n, s, rows.slots, *val.shape[1:]).sum(dim=2))
            else:
                e = lay.num_experts
                place = rows.token * e + rows.expert.clamp(max=e - 1)
                full = val.new_zeros(rows.num_tokens * e, *val.shape[1:]).index_add_(0, place, val)
                _accumulate(results, f"{c.name}.{key}", full.view(n, s, e, *val.shape[1:]))
    return results


class GradientCollector:
    """Installs capture on a model; `collect(batch)` returns per-example gradients.

    Use as a context manager: on exit every hook and forward override is removed and the
    parameters' `requires_grad` flags are restored. `fallbacks` lists the kernels this
    collector could not use (each announced once with a warning).
    """

    def __init__(
        self,
        model: nn.Module,
        report: CoverageReport | None = None,
        *,
        track_moe_experts: bool = True,
        projection_dim: int | None = None,
        seed: int = 0,
        projector: Callable | None = None,
        row_sink: Callable | None = None,
        projection: str = PROJECTION,
        recompute: bool = False,
        fused_head: bool = True,
        fused_norms: bool = True,
        target_dims: dict[str, int] | None = None,
    ):
        """`projector(name, side, features, like, batch)` replaces the seeded random projections
        (EK-FAC uses it to rotate rows into its eigenbases; None for a side kept as it is);
        `row_sink(records, batch)` receives the `CaptureRecord`s and `BatchInfo` instead of forming
        per-example gradients (EK-FAC's covariances). `projection`: the kind of seeded projection
        (`moe_attrib.collect.projection`; an index's own kind), which with `projection_dim` also sets the
        shape of a block that received no gradient (zeros) when a `projector` is given. `target_dims`: targets
        projected to their own dimension instead of `projection_dim` (`moe_attrib.settings.output_dims`).
        `recompute=True` keeps only each decoder layer's inputs and runs its forward again in the
        backward (`moe_attrib.model.recompute`): the same rows for far less activation memory, one more forward.
        `fused_head=True` computes the output layer with the loss in row chunks (`moe_attrib.collect.head`)
        once the model's first collection has shown its output layer to be a plain one: the same
        losses and gradients without the `[tokens, vocab]` tensors of the eager loss. `fused_norms=True`
        gives the decoder's RMSNorms a one-pass backward that keeps only their input (`moe_attrib.model.norms`;
        their forward is the model's own)."""
        self.model = model
        self.projector = projector
        self.row_sink = row_sink
        self.report = report if report is not None else discover(model, track_moe_experts=track_moe_experts)
        self.projection_dim = projection_dim
        self.target_dims = dict(target_dims or {})
        self.seed = seed
        self.projection = projection
        self.recompute = recompute
        self.fused_head = fused_head
        self.fused_norms = fused_norms
        self.head: FusedHead | None = None
        self.kernels = Kernels()
        self.capture: Capture | None = None
        self._stack: contextlib.ExitStack | None = None
        self._proj: Projections | None = None
        self._idle: contextlib.AbstractContextManager | None = None

    @property
    def fallbacks(self) -> dict[str, str]:
        return self.kernels.fallbacks

    def __enter__(self) -> GradientCollector:
        projecting = bool(self.projection_dim) or self.projector is not None
        capture = Capture(
            self.model,
            self.report.targets,
            projector=self._projection if projecting else None,
            kernels=self.kernels,
        )
        with contextlib.ExitStack() as stack:
            self.capture = stack.enter_context(capture)
            if self.recompute:
                stack.enter_context(recompute_layers(self.model, capture.paused))
            if self.fused_norms:
                stack.enter_context(norms.fused_norms(self.model))
            self.head = FusedHead(self.model, capture) if self.fused_head else None
            self._stack = stack.pop_all()
        self._idle = capture.paused()  # a plain forward of the model between collects records nothing
        self._idle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._idle is not None:
            self._idle.__exit__(None, None, None)
            self._idle = None
        if self._stack is not None:
            self._stack.__exit__(*exc)
            self._stack = None
        self.capture = None
        self.head = None

    def _projection(self, name: str, side: str, features: int, like: torch.Tensor, batch: int | None = None):
        if self.projector is not None:
            return self.projector(name, side, features, like, batch)
        if self._proj is None or self._proj.device != like.device or self._proj.dtype != like.dtype:
            self._proj = Projections(
                self.projection_dim, self.seed, like.device, like.dtype, self.projection, self.target_dims
            )
        return self._proj.get(name, side, features, batch)

    def collect(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        fused_experts: bool = False,
        attribute_tokens: bool = False,
        expert_blocks: str = "separate",
        sample_labels: bool = False,
    ) -> PerExampleGradients:
        """Forward + activation backward on one batch; per-example gradients of every target.

        With `fused_experts=True` each experts projection comes as one `[N, E, ...]` block keyed
        `<experts>.<proj>.weight` (what the index stores) instead of one key per expert.
        With `attribute_tokens=True` (implies fused blocks) every tensor gains a token axis after N:
        token t's share `outer(dy_t, x_t)`, so the tokens of an example sum to its gradient; an
        experts block is `[N, S, E, ...]`, or `[N, S, ...]` summed over the experts the token was
        routed to with `expert_blocks="sum"`. `sample_labels=True` draws next tokens from the
        model's own predictions (the true Fisher's labels) instead of using the data's.
        Forming the gradients waits for no host sync (no per-example length bound, no retry).
        """
        if self.capture is None:
            raise RuntimeError("GradientCollector.collect() needs an entered collector: `with GradientCollector(...)`.")
        capture = self.capture
        fused_experts = fused_experts or attribute_tokens
        n, s = input_ids.shape
        mask = attention_mask.reshape(-1).to(torch.float32) if attention_mask is not None else None
        batch = BatchInfo(n, s, mask)
        if labels is None:
            labels = default_labels(input_ids, attention_mask)
        head = self.head if self.head is not None and self.head.usable and not sample_labels else None
        self._idle.__exit__(None, None, None)  # record this batch
        try:
            with torch.enable_grad():
                fused, out = self._forward(head, batch, input_ids, attention_mask, labels)
                if fused is not None:
                    losses = fused.losses
                    fused.backward()
                    del fused
                else:
                    if sample_labels:
                        probs = torch.softmax(out.logits.detach().float(), dim=-1)
                        drawn = torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(n, s)
                        labels = torch.where(labels == -100, -100, torch.roll(drawn, 1, dims=1))
                    losses = example_losses(out.logits, labels)
                    del out
                    losses.sum().backward()
            if self.row_sink is not None:
                self.row_sink(capture.records, batch)
                results = {}
            elif attribute_tokens:
                results = form_tokens(capture.records, batch, expert_blocks)
            else:
                results = form_examples(capture.records, n, self.kernels)
            counts = capture.counts
        finally:
            capture.reset()
            self._idle = capture.paused()
            self._idle.__enter__()
        if self.row_sink is not None:
            result = PerExampleGradients()
            result.losses, result.expert_counts, result.expert_layers = losses.detach(), None, []
            return result
        tokens = s if attribute_tokens else 0
        return self._package(results, counts, losses.detach(), n, fused_experts, tokens, expert_blocks)

    def _forward(self, head: FusedHead | None, batch: BatchInfo, input_ids, attention_mask, labels) -> tuple:
        """The batch's recorded forward: `(fused head's result, None)`, or `(None, the model's output)`
        for the eager loss (no fused head, or one whose forward turned out to be eager or must be run again)."""
        capture = self.capture
        if head is not None:
            with capture.recording(batch), head.fused(batch, labels):
                try:
                    out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                except RuntimeError as err:  # the model's own code on the placeholder (an in-place op)
                    if not head.called or is_out_of_memory(err):
                        raise
                    out = None
            fused, again = head.result(out)
            if fused is not None or not again:
                return fused, out
            del out
        with capture.recording(batch):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return None, out

    def _package(
        self,
        results: dict[str, torch.Tensor],
        counts: dict[str, torch.Tensor],
        losses: torch.Tensor,
        n: int,
        fused_experts: bool,
        tokens: int,
        expert_blocks: str,
    ) -> PerExampleGradients:
        result = PerExampleGradients()
        missing = []
        for entry in iter_entries(self.report.targets):
            lay = entry.layout
            value = results.get(entry.key)
            if value is None:
                missing.append(entry.block)
                shape = entry.param.shape[1:] if lay is not None else entry.param.shape
                value = self._zeros(shape, entry.block, n, tokens, losses.device)
                if lay is not None and not (tokens and expert_blocks == "sum"):
                    axis = 2 if tokens else 1
                    value = value.unsqueeze(axis).repeat_interleave(lay.num_experts, dim=axis)
            if lay is None or fused_experts:
                result[entry.key] = value
                continue
            for i in range(lay.num_experts):
                result[f"{lay.expert_name(i, entry.proj)}.{entry.kind}"] = value[:, i]
        if missing:
            warnings.warn(
                f"moe-attrib: {len(set(missing))} tracked module(s) received no gradient in this batch "
                f"(zeros recorded), e.g. {sorted(set(missing))[:3]}: they are not on the loss path.",
                UserWarning,
                stacklevel=3,
            )
        result.losses = losses
        result.missing = frozenset(missing)
        layers = [lay.name for lay in self.report.experts if lay.name in counts]
        width = max((counts[name].shape[1] for name in layers), default=0)
        if layers and all(counts[name].shape[1] == width for name in layers):
            expert_counts = torch.stack([counts[name] for name in layers], dim=1)  # one op, not one copy per layer
        else:
            expert_counts = torch.zeros(n, len(layers), width, device=losses.device)
            for i, name in enumerate(layers):
                c = counts[name]
                expert_counts[:, i, : c.shape[1]] = c
        result.expert_counts = expert_counts
        result.expert_layers = layers
        return result

    def _zeros(self, shape, block: str, n: int, tokens: int, device) -> torch.Tensor:
        if self.projection_dim:
            dim = self.target_dims.get(block, self.projection_dim)
            shape = tuple(side_width(self.projection, d, dim) for d in shape)
        lead = (n, tokens) if tokens else (n,)
        return torch.zeros(*lead, *shape, device=device)


def make_collector(
    model: nn.Module,
    report: CoverageReport,
    projection_dim: int | None,
    seed: int,
    optimizer_state: str | None,
    projection: str = PROJECTION,
    recompute: bool = False,
    target_dims: dict[str, int] | None = None,
) -> GradientCollector:
    """The collector an index is built with: seeded projections of kind `projection` (`target_dims`: targets
    with their own dimension), optimizer-normalised if asked; `recompute` runs each decoder layer's forward
    again in the backward (`moe_attrib.model.recompute`)."""
    projector = None
    if optimizer_state:
        from moe_attrib.collect.normalizers import Normalizer, load_optimizer_state

        normalizer = Normalizer(model, report, load_optimizer_state(optimizer_state, model))
        projector = normalizer.projector(projection_dim, seed, projection, target_dims)
    return GradientCollector(
        model,
        report,
        projection_dim=projection_dim,
        seed=seed,
        projector=projector,
        projection=projection,
        recompute=recompute,
        target_dims=target_dims,
    )


def per_example_gradients(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    track_moe_experts: bool = True,
    projection_dim: int | None = None,
    seed: int = 0,
    projection: str = PROJECTION,
    recompute: bool = False,
    fused_head: bool = True,
    fused_norms: bool = True,
    output_projection_dim: int | None = None,
) -> PerExampleGradients:
    """Per-example gradients of every tracked module for one batch.

    Returns `{"<module>.weight" / ".bias": Tensor [N, *shape]}`: the module's weight shape
    (ExpertLinear: the fused slice as stored) when `projection_dim` is None, else each side of
    that shape projected to `projection_dim` columns, a side no wider kept exact under the
    default `projection` kind (`rademacher-hash-v2`: weights `min(out, p) x min(in, p)` in the
    stored orientation, biases `min(out, p)`; `rademacher-hash-v1`: `p x p` and `p`).
    Each example's loss is its summed token cross-entropy (labels = input_ids, padding
    ignored), so entry n equals autograd's gradient of example n's loss alone. `recompute`,
    `fused_head`, `fused_norms`: see `GradientCollector`. `output_projection_dim`: the output layer's
    own projection dimension, as `build_index`'s (None here: projected like every block).
    """
    report = discover(model, track_moe_experts=track_moe_experts)
    with GradientCollector(
        model,
        report,
        projection_dim=projection_dim,
        seed=seed,
        projection=projection,
        recompute=recompute,
        fused_head=fused_head,
        fused_norms=fused_norms,
        target_dims=output_dims(report.output_layer, projection_dim, output_projection_dim),
    ) as collector:
        return collector.collect(input_ids, attention_mask, labels)
