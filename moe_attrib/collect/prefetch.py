"""Keep the device busy: data prepared ahead in a thread, asynchronous device-to-host copies, a writer thread.

`prefetch` runs the data side (collate, labels, pinning) of the next batches in a background
thread while the device computes the current one. `HostCopy` starts a device-to-host copy into
pinned host memory with `non_blocking=True` and records an event, so the copy overlaps the next
batch's forward; whoever needs the values waits on the event (the writer thread, not the main
one). `BackgroundWriter` runs jobs in order on one thread behind a bounded queue; an error there
is raised in the main thread at its next `submit` or at the end. On the CPU the same code runs:
no pinning, and copies are plain copies.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np
import torch

from moe_attrib.data import Example, collate, labels_for

T = TypeVar("T")
R = TypeVar("R")
_END = object()


def prefetch(items: Iterable[T], prepare: Callable[[T], R], depth: int = 2) -> Iterator[R]:
    """`prepare(item)` for every item, computed up to `depth` items ahead in a background thread.

    An error in `prepare` is raised here, at the item it happened on. Closing the iterator early
    (break, an exception in the consumer) stops the thread.
    """
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for item in items:
                value = prepare(item)
                while not stop.is_set():
                    try:
                        out.put((value, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            out.put((None, err))
            return
        out.put((_END, None))

    thread = threading.Thread(target=work, name="moe-attrib-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            value, err = out.get()
            if err is not None:
                raise err
            if value is _END:
                return
            yield value
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                out.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()


def batch_inputs(
    examples: list[Example], positions: list[int], pad_id: int, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of one batch on the host, pinned when `pin` (for a CUDA device)."""
    ids, mask = collate(examples, positions, pad_id)
    labels = labels_for(examples, positions, ids, mask)
    if pin:
        ids, mask, labels = ids.pin_memory(), mask.pin_memory(), labels.pin_memory()
    return ids, mask, labels


def to_device(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host-to-device copies; asynchronous from pinned memory."""
    return [t.to(device, non_blocking=t.is_pinned()) for t in tensors]


class HostCopy:
    """Device-to-host copies of some tensors, started now, waited for in `numpy()`.

    On CUDA each tensor is copied into pinned host memory with `non_blocking=True` on the current
    stream and one event is recorded after the copies; the source tensors are kept alive until
    the copies are waited for. On the CPU the tensors are used as they are.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        self.event = None
        self.sources: list[torch.Tensor] | None = None
        if tensors and tensors[0].device.type == "cuda":
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(hosts, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            self.sources = tensors  # alive until the copies are done
            self.hosts = hosts
        else:
            self.hosts = [t.detach().cpu() for t in tensors]

    def numpy(self) -> list[np.ndarray]:
        """Wait for the copies (this thread only) and return them as arrays."""
        if self.event is not None:
            self.event.synchronize()
            self.sources = None
        return [h.numpy() for h in self.hosts]


class BackgroundWriter:
    """Runs submitted jobs in order on one background thread behind a queue of `depth` jobs.

    The first job that raises stops the thread; its error is raised in the submitting thread at
    the next `submit` or at `close`, and later jobs are dropped (never run). Use as a context
    manager: on leaving, the jobs already queued finish (also when the body raised, e.g. Ctrl-C,
    so completed batches are kept) and the thread's error, if any, is raised.
    """

    def __init__(self, depth: int = 2):
        self.jobs: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="moe-attrib-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is _END:
                return
            if self.error is not None:
                continue  # drain without running
            try:
                job()
            except BaseException as err:  # noqa: BLE001 - raised in the submitting thread
                self.error = err

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; blocks while the queue is full; raises a previous job's error first."""
        self._raise()
        while True:
            try:
                self.jobs.put(job, timeout=0.1)
                return
            except queue.Full:
                self._raise()

    def close(self) -> None:
        """Finish the queued jobs, stop the thread, raise a job's error."""
        if self.thread.is_alive():
            self.jobs.put(_END)
            self.thread.join()
        self._raise()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except BaseException:  # noqa: BLE001 - the body's exception is the one to report
            pass
