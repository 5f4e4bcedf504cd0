"""Datasets for attribution: loading, tokenization, token-budget batches with stable example ids."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


class DataError(ValueError):
    """Input data that cannot be attributed as given; the message names the file/row at fault."""


@dataclass
class Example:
    index: int  # row in the source, the example's id in the index
    input_ids: list[int]
    text: str | None = None
    loss_start: int = 0  # tokens before this position carry no loss (prompt of a prompt/completion pair)
    fields: dict = field(default_factory=dict)  # the record's other scalar fields (ids, metadata), for results


SCALARS = (str, int, float, bool)


def _read_records(source: str, text_field: str) -> list[dict]:
    path = Path(source)
    if path.is_dir():
        try:
            import datasets
        except ImportError as err:
            raise DataError(
                f"{source} is a directory: reading a `datasets` directory needs `pip install datasets`."
            ) from err
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return [dict(r) for r in ds]
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            records = []
            with path.open() as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise DataError(f"{source}:{lineno}: not valid JSON ({err.msg}).") from err
            return records
        return [{text_field: line.rstrip("\n")} for line in path.open() if line.strip()]
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"{source}: no such file or directory (hub datasets need `pip install datasets`).") from err
    return [dict(r) for r in datasets.load_dataset(source, split="train")]


def load_examples(
    source: str,
    tokenizer=None,
    text_field: str = "text",
    max_length: int | None = None,
    truncate: bool = False,
) -> list[Example]:
    """Read and tokenize a dataset: JSONL, plain text (one example per line), a `datasets`
    directory or a hub name. A pretokenized `input_ids` column is used as is; a record with
    `prompt` and `completion` fields is attributed through the completion's tokens only."""
    records = _read_records(source, text_field)
    if not records:
        raise DataError(f"{source}: the dataset is empty; nothing to attribute.")
    examples = []
    for i, rec in enumerate(records):
        loss_start = 0
        used = {"input_ids", text_field}
        if "input_ids" in rec:
            ids, text = [int(t) for t in rec["input_ids"]], rec.get(text_field)
        elif "prompt" in rec and "completion" in rec:
            if tokenizer is None:
                raise DataError(f"{source}: row {i} has text but the model has no tokenizer.")
            text = f"{rec['prompt']} {rec['completion']}"
            used |= {"prompt", "completion"}
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
            loss_start = len(tokenizer(str(rec["prompt"]), add_special_tokens=True)["input_ids"])
        elif text_field in rec:
            if tokenizer is None:
                raise DataError(f"{source}: row {i} has text but the model has no tokenizer.")
            text = str(rec[text_field])
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            raise DataError(
                f"{source}: row {i} has no {text_field!r} field (fields: {sorted(rec)}); "
                "pass --text_field NAME or provide an `input_ids` column."
            )
        if len(ids) < 2:
            raise DataError(f"{source}: row {i} has {len(ids)} token(s); an example needs at least 2.")
        if max_length is not None and len(ids) > max_length:
            if not truncate:
                raise DataError(
                    f"{source}: row {i} has {len(ids)} tokens, more than --max_length {max_length}; "
                    "raise --max_length or pass --truncate."
                )
            ids = ids[:max_length]
        fields = {k: v for k, v in rec.items() if k not in used and isinstance(v, SCALARS)}
        examples.append(Example(i, ids, text, loss_start, fields))
    return examples


def fingerprint(examples: list[Example]) -> str:
    """sha256 over the token ids of every example, in order."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(np.asarray(ex.input_ids, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def token_batches(examples: list[Example], token_batch_size: int) -> list[list[int]]:
    """Positions of examples grouped so that rows x longest length <= token_batch_size.

    Examples are sorted by length (longest first, ties by position) so padding stays small;
    the grouping depends only on the lengths, so it is the same in every run and on every rank.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(examples[i].input_ids)
        if length > token_batch_size:
            raise DataError(
                f"row {examples[i].index} has {length} tokens, more than --token_batch_size {token_batch_size}."
            )
        if current and max(longest, length) * (len(current) + 1) > token_batch_size:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def collate(examples: list[Example], positions: list[int], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids` and `attention_mask` for the given examples."""
    length = max(len(examples[i].input_ids) for i in positions)
    ids = torch.full((len(positions), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(positions), length), dtype=torch.long)
    for row, i in enumerate(positions):
        seq = examples[i].input_ids
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def labels_for(examples: list[Example], positions: list[int], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token labels: padding and prompt tokens (before `loss_start`) are -100."""
    labels = ids.masked_fill(mask == 0, -100)
    for row, i in enumerate(positions):
        if examples[i].loss_start:
            labels[row, : examples[i].loss_start] = -100
    return labels
