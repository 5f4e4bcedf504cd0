"""Activation recomputation for collection (`--recompute_layers`): big models on one device.

A collection step keeps every decoder layer's activations until the backward reaches it, as a
training step does: at 48 layers and 8k tokens that is tens of GB (mostly the experts' routed
rows). With recomputation each decoder layer keeps only its inputs; its forward is run again,
inside the backward, when the backward reaches it (`torch.utils.checkpoint`, non-reentrant), at
the cost of one more forward per step. The capture records rows in the first forward only: the
second runs with the capture paused, and the backward hooks registered in the first forward fire
on the original graph as usual, so the rows are the same as without recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_attrib.model.discovery import decoder_layers


@contextlib.contextmanager
def recompute_layers(model: nn.Module, pause: Callable[[], AbstractContextManager]) -> Iterator[int]:
    """Inside: every decoder layer of `model` recomputes its forward in the backward, with `pause()`
    entered during the recomputation. Yields the number of layers wrapped; restores them on exit."""
    restore: list[tuple[nn.Module, bool, object]] = []

    def contexts():
        return contextlib.nullcontext(), pause()

    try:
        for layer in decoder_layers(model):
            own = "forward" in layer.__dict__
            previous = layer.__dict__.get("forward")
            inner = layer.forward

            def forward(*args, _inner=inner, **kwargs):
                return checkpoint(_inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

            restore.append((layer, own, previous))
            layer.forward = forward
        yield len(restore)
    finally:
        for layer, own, previous in reversed(restore):
            if own:
                layer.forward = previous
            else:
                del layer.forward
