"""The output layer fused with the loss: logits, per-token cross-entropy and their gradient in row chunks.

A collection step needs, from the output layer, three things: each example's summed next-token
loss, the gradient at the layer's input (to backpropagate through the decoder) and, when the
layer is attributed, its output-gradient rows `softmax - onehot` (projected as the capture keeps
them). The eager path materialises the `[tokens, vocab]` logits, their float32 copy, the
log-softmax saved for the backward and two more `[tokens, vocab]` tensors in the backward (about
48 bytes per logit of memory traffic and 12 per logit of peak memory). `FusedHead` computes the
same quantities chunk by chunk of rows inside the output layer's own call (so FSDP's all-gather of
its weight is in place), with no autograd: per logit it writes the bf16 logits, reads them once
into a float32 log-softmax and writes the bf16 gradient from it (about 14 bytes); a chunk holds at
most `HEAD_CHUNK_BYTES` of float32 logits. The decoder's backward then starts from the layer's
input with that gradient.

The values are those of the eager path: the same float32 log-softmax of the layer's bf16 (or
float32) output, the same `softmax - onehot` rounded to the logits' dtype (the target's entry set
from `exp(log p) - 1` in float32, as the eager backward forms it); the decoder's forward, and so the
routing, is untouched. What may differ is the order of a matmul's sums (chunks of rows instead of all
rows), as between two batch sizes.

It is used only where it is the model's own computation: the output layer is a plain `nn.Linear`,
called once per forward on every position, and the model returns its output as `logits`
untouched. Every forward checks that (the returned logits must be the layer's placeholder); a
model that scales, caps or slices its logits, or calls the layer otherwise, has that batch run
eagerly and keeps the eager path from then on. Which path a batch takes depends only on the model
and the batch, never on what ran before it in the process, so a resumed build writes the same rows.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_attrib.collect.capture import BatchInfo, Capture

# float32 logits of one chunk of rows (the log-softmax); the bf16 logits and gradient add half as much
HEAD_CHUNK_BYTES = 256 * 2**20

# models whose output layer was checked (True: fusable, False: keeps the eager path) in this process
_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def fusable(model: nn.Module) -> bool | None:
    """Whether `model`'s collections fuse its output layer with the loss: None until one has tried."""
    return _CHECKED.get(model)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """`[N * S]` next-token target of each position (-100 at each example's last position)."""
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    return targets.reshape(-1)


@dataclass
class HeadResult:
    """What the fused output layer computed for one batch."""

    losses: torch.Tensor  # [N] summed next-token cross-entropy, float32
    inputs: torch.Tensor  # the output layer's input, [N, S, H], in the decoder's graph
    grad: torch.Tensor  # d(sum of losses) / d(inputs)
    placeholder: torch.Tensor  # what the layer returned in place of its logits

    def backward(self) -> None:
        """Backpropagate the losses' gradient through the decoder (the capture's hooks fire)."""
        if self.inputs.requires_grad:
            torch.autograd.backward(self.inputs, self.grad)


def fused_rows(
    layer: nn.Linear,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    out_rows=None,
    chunk_bytes: int = HEAD_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token losses `[T]`, the input gradient `[T, H]` and (with `out_rows`, a map of
    `[rows, vocab]` output-gradient rows to what is kept of them) the kept rows `[T, b]`, for
    `inputs` `[T, H]` and `targets` `[T]` (-100: no loss), chunk by chunk of rows."""
    weight, bias = layer.weight, layer.bias
    rows, vocab = inputs.shape[0], weight.shape[0]
    chunk = max(1, min(rows, chunk_bytes // (4 * vocab)))
    valid = targets != -100
    safe = targets.clamp_min(0).unsqueeze(1)
    losses = torch.empty(rows, dtype=torch.float32, device=inputs.device)
    grad = torch.empty_like(inputs)
    kept = None
    with torch.no_grad():
        for start in range(0, rows, chunk):
            end = min(rows, start + chunk)
            logits = F.linear(inputs[start:end], weight, bias)
            logp = torch.log_softmax(logits, dim=1, dtype=torch.float32)
            picked = logp.gather(1, safe[start:end])
            losses[start:end] = torch.where(valid[start:end], -picked.squeeze(1), 0.0)
            dz = torch.exp(logp, out=torch.empty_like(logits))  # softmax, rounded to the logits' dtype
            del logp
            dz.scatter_(1, safe[start:end], (picked.exp() - 1).to(dz.dtype))
            keep = valid[start:end].unsqueeze(1)
            torch.mm(dz, weight, out=grad[start:end])
            grad[start:end].mul_(keep)
            if out_rows is not None:
                part = out_rows(dz)
                if kept is None:
                    kept = torch.empty(rows, part.shape[1], dtype=part.dtype, device=part.device)
                torch.mul(part, keep, out=kept[start:end])
    return losses, grad, kept


class FusedHead:
    """The model's output layer fused with the loss during a collection forward (see the module doc).

    `fused(batch, labels)` is a context for one forward: the output layer, called once on every
    position, computes the losses, the input gradient and the capture's record of its rows, and
    returns a zero-stride placeholder in place of the logits. `result(out)` then tells the caller
    what the forward gave: the fused result, or that the forward was an eager one (the layer was not
    called as the fused head needs), or that it must be run again eagerly (the model did something
    with the placeholder). The outcome depends only on the model and the batch, so a build and its
    resumed continuation take the same path for every batch.
    """

    def __init__(self, model: nn.Module, capture: Capture, chunk_bytes: int | None = None):
        self.model = model
        self.capture = capture
        self.chunk_bytes = chunk_bytes or HEAD_CHUNK_BYTES
        getter = getattr(model, "get_output_embeddings", None)  # absent on models that are not transformers'
        self.layer = getter() if callable(getter) else None
        self.target = capture.hooked_target(self.layer) if self.layer is not None else None
        self._result: HeadResult | None = None
        if not self._plain():
            _CHECKED[model] = False

    @property
    def usable(self) -> bool:
        """False once this model's output layer is known not to be fusable (then the eager path runs)."""
        return _CHECKED.get(self.model) is not False

    def _plain(self) -> bool:
        layer = self.layer
        return (
            isinstance(layer, nn.Linear)
            and type(layer).forward is nn.Linear.forward
            and "forward" not in layer.__dict__
        )

    @contextlib.contextmanager
    def fused(self, batch: BatchInfo, labels: torch.Tensor) -> Iterator[None]:
        """One forward with the output layer fused with the loss of `labels` (`[N, S]`)."""
        layer, targets = self.layer, shifted_targets(labels)
        self._result = None

        def forward(inputs: torch.Tensor) -> torch.Tensor:
            if tuple(inputs.shape[:-1]) != (batch.n, batch.seq_len) or self._result is not None:
                return F.linear(inputs, layer.weight, layer.bias)  # not every position once: the eager layer
            record = None
            if self.target is not None and inputs.requires_grad and not self.capture.is_paused:
                record = self.capture.dense_record(self.target, inputs)
            flat = inputs.detach().reshape(-1, inputs.shape[-1])
            out_rows = (lambda g, r=record: self.capture.out_rows(r, g)) if record is not None else None
            losses, grad, kept = fused_rows(layer, flat, targets, out_rows, self.chunk_bytes)
            if record is not None:
                self.capture.set_out_rows(record, kept)
            placeholder = flat.new_zeros(()).expand(batch.n, batch.seq_len, layer.weight.shape[0])
            self._result = HeadResult(
                losses.view(batch.n, batch.seq_len).sum(dim=1), inputs, grad.view_as(inputs), placeholder
            )
            return placeholder

        layer.__dict__["forward"] = forward
        try:
            yield
        finally:
            del layer.__dict__["forward"]

    @property
    def called(self) -> bool:
        """True when the layer computed the fused head in the forward just run."""
        return self._result is not None

    def result(self, out) -> tuple[HeadResult | None, bool]:
        """`(fused result, run again)` for the forward that returned `out` (None: it failed after the
        fused head). `(result, False)`: use it; `(None, False)`: the forward was eager, use `out`;
        `(None, True)`: the model did something with the placeholder, run the batch again eagerly.
        A model that needs either of the last two is not tried again."""
        result, self._result = self._result, None
        if result is not None and out is not None and getattr(out, "logits", None) is result.placeholder:
            _CHECKED[self.model] = True
            return result, False
        if _CHECKED.get(self.model) is None:
            _CHECKED[self.model] = False
        return None, result is not None
