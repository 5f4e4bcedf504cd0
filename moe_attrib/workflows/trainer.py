"""Attribution where training happens: index rows and EK-FAC factors of checkpoints, written during training.

`AttributionCallback` (a `transformers.TrainerCallback`) collects, at chosen steps or at each save, what
`build` and `ekfac` would write for the model as it is then, into `RUN_DIR/checkpoint-N/attribution/`:

    checkpoint-N/                 the Trainer's own checkpoint (weights, config, optimizer, ...)
      attribution/train.jsonl     the training rows as attributed (token ids, loss start, text)
      attribution/index/          `build`'s index of those rows, weights fingerprint of step N
      attribution/ekfac/          `ekfac`'s factors, same projection, same fingerprints

`AttributionCheckpointer` does the same in a plain training loop (`maybe_collect(step, model)`), and
also saves the weights there. `moe_attrib.workflows.ensemble.score_run` (`moe-attrib score --run RUN_DIR`) then
scores queries against every checkpoint and ranks by the mean.

The loss is the one the run trained on: each training row is passed through the run's own data
collator and its `labels` (prompt tokens set to -100) become the example's `loss_start`; labels that
this cannot represent (a masked gap after the first scored token, targets other than the next input
token) are an error naming the row. Collection leaves the run unchanged: the RNG states (Python,
NumPy, torch CPU and CUDA) and the train/eval mode are restored, and no parameter gradient is formed
(the collector turns `requires_grad` off), so the optimizer never sees it.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn
from transformers.trainer_callback import TrainerCallback

from moe_attrib.curvature.ekfac import DEFAULT_DAMPING, DEFAULT_DAMPING_SCOPE, fit_ekfac
from moe_attrib.data import SCALARS, DataError, Example, check_token_ids, fingerprint
from moe_attrib.errors import MoeAttribError
from moe_attrib.fingerprint import tokenizer_fingerprint
from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM
from moe_attrib.model.distributed import Dist
from moe_attrib.model.sharding import is_sharded
from moe_attrib.settings import DEFAULT_OUTPUT_PROJECTION_DIM
from moe_attrib.workflows.build import build_index

ATTRIBUTION = "attribution"  # inside each checkpoint directory
INDEX = "index"
EKFAC = "ekfac"
TRAIN = "train.jsonl"
CHECKPOINT = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR: RUN_DIR/checkpoint-N


class TrainerAttributionError(MoeAttribError, ValueError):
    """A training setup the callback cannot attribute faithfully; the message says what to change."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where a run's checkpoint of optimizer step `step` lives (the Trainer's naming)."""
    return Path(run_dir) / f"{CHECKPOINT}-{step}"


def attribution_dir(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / ATTRIBUTION


# -- the run's loss, as examples ---------------------------------------------------------------
def examples_from_batch(batch: dict, indices: Sequence[int], tokenizer=None) -> list[Example]:
    """The rows of a collated batch (`input_ids`, `attention_mask`, `labels` as a causal-LM collator
    makes them: labels aligned with the inputs, shifted inside the model) as `Example`s with ids
    `indices`. Padding is dropped; `loss_start` is the first position whose label is scored.

    Raises `DataError` naming the row where the labels cannot be represented that way: every label
    masked, a masked gap after the first scored token, or a label that is not the input token."""
    if "input_ids" not in batch or "labels" not in batch:
        raise DataError(
            f"the data collator's batches have {sorted(batch)}; attribution needs `input_ids` and `labels` "
            "(prompt tokens -100), the loss the model trains on."
        )
    ids = torch.as_tensor(batch["input_ids"])
    labels = torch.as_tensor(batch["labels"])
    mask = torch.as_tensor(batch["attention_mask"]) if "attention_mask" in batch else torch.ones_like(ids)
    if ids.shape != labels.shape or ids.shape != mask.shape:
        raise DataError(f"the batch's input_ids {tuple(ids.shape)}, labels {tuple(labels.shape)} and attention_mask "
                        f"{tuple(mask.shape)} differ in shape; labels must be aligned with the inputs.")  # fmt: skip
    out = []
    for row, i in enumerate(indices):
        keep = torch.nonzero(mask[row]).flatten()
        if len(keep) < 2 or int(keep[-1] - keep[0]) + 1 != len(keep):
            raise DataError(f"training row {i}: its attention_mask is not one run of at least 2 tokens.")
        start, stop = int(keep[0]), int(keep[-1]) + 1
        if (labels[row, :start] != -100).any() or (labels[row, stop:] != -100).any():
            raise DataError(f"training row {i}: padding has labels other than -100.")
        seq, lab = ids[row, start:stop], labels[row, start:stop]
        scored = (lab != -100)[1:]  # position 0 predicts nothing (the model shifts the labels)
        if not scored.any():
            raise DataError(f"training row {i}: every label is -100, so it carries no loss; drop it (or pass subset).")
        first = int(torch.nonzero(scored)[0]) + 1
        if not scored[first - 1 :].all():
            gap = first + int(torch.nonzero(~scored[first - 1 :])[0])
            raise DataError(
                f"training row {i}: label {gap} is -100 after scored labels from position {first}; moe-attrib "
                "attributes the loss of one contiguous completion (Example.loss_start), not masked gaps."
            )
        wrong = torch.nonzero(lab[first:] != seq[first:]).flatten()
        if len(wrong):
            raise DataError(
                f"training row {i}: label {first + int(wrong[0])} is not that position's input token; labels must be "
                "the input_ids (the model shifts them) with ignored tokens set to -100."
            )
        tokens = [int(t) for t in seq]
        text = tokenizer.decode(tokens) if tokenizer is not None else None
        out.append(Example(int(i), tokens, text, first if first > 1 else 0))
    return out


def examples_from_dataset(
    dataset, data_collator: Callable, subset: Iterable[int] | None = None, tokenizer=None
) -> list[Example]:
    """Each row of `dataset` (or of `subset`, row numbers) through `data_collator` alone, as an `Example`
    with the row number as its id and the row's other scalar fields kept (for results)."""
    rows = list(range(len(dataset))) if subset is None else [int(i) for i in subset]
    if not rows:
        raise DataError("no training rows to attribute (the dataset or subset is empty).")
    bad = [i for i in rows if not 0 <= i < len(dataset)]
    if bad:
        raise DataError(f"subset rows {bad[:5]} are outside the training set (rows 0..{len(dataset) - 1}).")
    out = []
    with preserved_rng():  # a collator may draw random numbers; the run's must not move
        for i in rows:
            record = dataset[i]
            (example,) = examples_from_batch(data_collator([record]), [i], tokenizer)
            if isinstance(record, dict):
                example.fields = {k: v for k, v in record.items() if isinstance(v, SCALARS) and k != "text"}
            out.append(example)
    return out


def trainer_rows(examples: list[Example]) -> list[dict]:
    """`Example`s (e.g. from `load_examples`) as a Trainer dataset: `input_ids` and `labels` with the prompt
    (tokens before `loss_start`) set to -100, for a collator that pads labels with -100
    (`transformers.DataCollatorForSeq2Seq`); the callback reads the same loss back from its batches."""
    return [
        {"input_ids": ex.input_ids, "labels": [-100] * ex.loss_start + ex.input_ids[ex.loss_start :]} for ex in examples
    ]


def write_examples(examples: list[Example], path: Path) -> None:
    """The attributed rows as JSONL that `load_examples` reads back to the same token ids (`input_ids`)."""
    with path.open("w") as f:
        for ex in examples:
            record = {**ex.fields, "input_ids": ex.input_ids, "loss_start": ex.loss_start}
            if ex.text is not None:
                record["text"] = ex.text
            f.write(json.dumps(record) + "\n")


# -- leaving the run as it was -----------------------------------------------------------------
@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's (CPU and every CUDA device's) random states on exit."""
    state = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Collect from `model` in eval mode (no dropout), then give it back as it was: its mode, the RNG
    states, and each parameter's `.grad` (the collector forms no parameter gradient; a gradient
    accumulated so far in a plain loop stays in place)."""
    training = model.training
    grads = [(p, p.grad) for p in model.parameters()]
    model.eval()
    try:
        with preserved_rng():
            yield
    finally:
        model.train(training)
        for p, g in grads:
            p.grad = g


def current_dist(model: nn.Module) -> Dist:
    """This process's place in the run: torchrun's process group (as the Trainer joined it), or alone."""
    device = next(model.parameters()).device
    if torch_dist.is_available() and torch_dist.is_initialized():
        return Dist(torch_dist.get_rank(), torch_dist.get_world_size(), device)
    return Dist(0, 1, device)


# -- collection --------------------------------------------------------------------------------
class AttributionCheckpointer:
    """Writes a checkpoint's attribution (index rows and EK-FAC factors of `examples`) at chosen steps.

    For a plain training loop: call `maybe_collect(step, model)` after each optimizer step; at a step in
    `steps` (or every `every` steps) it writes `RUN_DIR/checkpoint-N/attribution/` and, with `save_model`,
    the weights as `save_pretrained` (and the tokenizer, if given) into `RUN_DIR/checkpoint-N/`, which is
    what `score_run` loads. Settings are `build_index`'s and `fit_ekfac`'s; `ekfac=False` writes no factors.
    Under torchrun every rank calls it (the rows and the factors' sums are split over the ranks); rank 0
    alone writes files and manifests."""

    def __init__(
        self,
        run_dir: str | Path,
        examples: list[Example],
        *,
        steps: Iterable[int] | None = None,
        every: int | None = None,
        tokenizer=None,
        save_model: bool = True,
        projection_dim: int | None = DEFAULT_PROJECTION_DIM,
        output_projection_dim: int | None = DEFAULT_OUTPUT_PROJECTION_DIM,
        seed: int = 0,
        ekfac: bool = True,
        track_moe_experts: bool = True,
        token_batch_size: int = 8192,
        damping: float = DEFAULT_DAMPING,
        damping_scope: str = DEFAULT_DAMPING_SCOPE,
        pad_id: int | None = None,
        progress: bool = False,
    ):
        self.steps = check_steps(steps)
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be a positive number of steps, not {every!r}.")
        if not examples:
            raise DataError("no training rows to attribute (examples is empty).")
        self.run_dir = Path(run_dir)
        self.examples = examples
        self.every = every
        self.tokenizer = tokenizer
        self.save_model = save_model
        self.ekfac = ekfac
        self.build_opts = dict(
            track_moe_experts=track_moe_experts,
            projection_dim=projection_dim,
            output_projection_dim=output_projection_dim,
            seed=seed,
            token_batch_size=token_batch_size,
        )
        self.ekfac_opts = dict(self.build_opts, damping=damping, damping_scope=damping_scope)
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.pad_id = pad_id
        self.progress = progress
        self.collected: list[Path] = []

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based, as the Trainer counts) is a collection step."""
        return step in self.steps or (self.every is not None and step % self.every == 0)

    def check_model(self, model: nn.Module) -> None:
        """Errors before training: a sharded model, token ids outside the vocabulary."""
        if is_sharded(model):
            raise TrainerAttributionError(
                "the model is sharded (FSDP); the attribution callback runs on a whole model per rank "
                "(data parallel). Build from the saved checkpoints with `moe-attrib build --fsdp` instead."
            )
        check_token_ids(self.examples, model.get_input_embeddings().num_embeddings, "the training set")

    def maybe_collect(self, step: int, model: nn.Module) -> Path | None:
        """`collect` at a collection step, else nothing; returns the checkpoint directory or None."""
        return self.collect(step, model) if self.due(step) else None

    def collect(self, step: int, model: nn.Module, save_model: bool | None = None) -> Path:
        """Write `RUN_DIR/checkpoint-{step}/attribution/` for `model` as it is now (and its weights,
        with `save_model`); the model, its gradients and the RNG states are left as they were."""
        save = self.save_model if save_model is None else save_model
        model = getattr(model, "module", model) if isinstance(model, nn.parallel.DistributedDataParallel) else model
        if not self.collected:
            self.check_model(model)
        dist = current_dist(model)
        ckpt = checkpoint_dir(self.run_dir, step)
        out = attribution_dir(ckpt)
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            write_examples(self.examples, out / TRAIN)
            if save:
                model.save_pretrained(ckpt)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(ckpt)
        dist.barrier()
        settings = {
            "model": str(ckpt.resolve()),
            "data": str((out / TRAIN).resolve()),
            "text_field": "text",
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else None,
            "trainer_step": step,
        }
        with untouched(model):
            build_index(
                model, self.examples, out / INDEX, model_name=settings["model"], pad_id=self.pad_id,
                extra_settings=settings, dist=dist, progress=self.progress, overwrite=True, **self.build_opts,
            )  # fmt: skip
            if self.ekfac:
                factors = fit_ekfac(
                    model, self.examples, pad_id=self.pad_id, dist=dist, progress=self.progress, **self.ekfac_opts
                )
                if dist.is_main:
                    factors.settings.update(settings, data_fingerprint=fingerprint(self.examples),
                                            dtype=str(next(model.parameters()).dtype))  # fmt: skip
                    factors.save(out / EKFAC)
        dist.barrier()
        self.collected.append(ckpt)
        return ckpt


def check_steps(steps: Iterable[int] | None) -> set[int]:
    out = set()
    for s in steps or ():
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise ValueError(f"collection steps are optimizer steps >= 1, not {s!r}.")
        out.add(int(s))
    return out


class AttributionCallback(TrainerCallback):
    """A `transformers.TrainerCallback` that writes each checkpoint's attribution during training.

    With `steps=None` it collects at every save of the Trainer (its `save_strategy`); with `steps` (optimizer
    steps, 1-based) at those steps only, asking the Trainer to save a checkpoint there. The training rows
    are the Trainer's `train_dataset` (or `subset` of its row numbers), each passed through the Trainer's
    data collator so that the batches' own `labels` define the loss; `examples` replaces both. The other
    arguments are `AttributionCheckpointer`'s. Under torchrun every rank runs it, rank 0 writes.

    Checkpoints rotated away by `save_total_limit` would take their attribution with them, so a
    `save_total_limit` is refused when training begins, as is a sharded (FSDP) model."""

    def __init__(
        self,
        steps: Iterable[int] | None = None,
        *,
        subset: Iterable[int] | None = None,
        examples: list[Example] | None = None,
        dataset=None,
        data_collator: Callable | None = None,
        **options,
    ):
        self.steps = check_steps(steps)
        self.subset = None if subset is None else [int(i) for i in subset]
        if examples is not None and (subset is not None or dataset is not None):
            raise ValueError("give either examples or dataset/subset, not both.")
        self.examples = examples
        self.dataset = dataset
        self.data_collator = data_collator
        unknown = set(options) - CHECKPOINTER_OPTIONS
        if unknown:
            raise TypeError(
                f"unknown option(s) {sorted(unknown)}; AttributionCallback takes {sorted(CHECKPOINTER_OPTIONS)}."
            )
        self.options = options
        self.checkpointer: AttributionCheckpointer | None = None

    def on_train_begin(self, args, state, control, model=None, processing_class=None, train_dataloader=None, **kw):
        if args.save_total_limit is not None:
            raise TrainerAttributionError(
                f"save_total_limit={args.save_total_limit} deletes older checkpoints, and their attribution with them; "
                "leave it unset (None) to average over the run's checkpoints."
            )
        tokenizer = self.options.get("tokenizer", processing_class)
        tokenizer = tokenizer if hasattr(tokenizer, "decode") else getattr(tokenizer, "tokenizer", None)
        examples = self.examples
        if examples is None:
            dataset = self.dataset if self.dataset is not None else getattr(train_dataloader, "dataset", None)
            collator = self.data_collator or getattr(train_dataloader, "collate_fn", None)
            if dataset is None or collator is None:
                raise TrainerAttributionError(
                    "no training dataset and data collator to attribute: pass dataset= and data_collator= "
                    "(or examples=) to AttributionCallback."
                )
            examples = examples_from_dataset(dataset, collator, self.subset, tokenizer)
        options = {**self.options, "tokenizer": tokenizer}
        self.checkpointer = AttributionCheckpointer(args.output_dir, examples, steps=self.steps, save_model=False,
                                                    **options)  # fmt: skip
        self.checkpointer.check_model(model)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step in self.steps:
            control.should_save = True
        return control

    def on_save(self, args, state, control, model=None, **kw):
        if self.steps and state.global_step not in self.steps:
            return control
        self.checkpointer.collect(state.global_step, model)
        return control


CHECKPOINTER_OPTIONS = {
    "tokenizer",
    "projection_dim",
    "output_projection_dim",
    "seed",
    "ekfac",
    "track_moe_experts",
    "token_batch_size",
    "damping",
    "damping_scope",
    "pad_id",
    "progress",
}
