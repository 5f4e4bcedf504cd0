"""Datasets for attribution: loading, tokenization, token-budget batches with stable example ids."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moe_attrib.errors import MoeAttribError


class DataError(MoeAttribError, ValueError):
    """Input data that cannot be attributed as given; the message names the file/row at fault."""


NO_TOKENIZER = "the model has none: pass --tokenizer DIR (or give pretokenized input_ids)."


@dataclass
class Example:
    index: int  # row in the source, the example's id in the index
    input_ids: list[int]
    text: str | None = None
    loss_start: int = 0  # tokens before this position carry no loss (prompt of a prompt/completion pair)
    fields: dict = field(default_factory=dict)  # the record's other scalar fields (ids, metadata), for results


SCALARS = (str, int, float, bool)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(spec: str) -> bool:
    """`org/name` that is not an existing local path: the only strings sent to the hub."""
    return bool(HUB_ID.match(spec)) and not Path(spec).exists() and not spec.endswith(LOCAL_SUFFIXES)


LOCAL_SUFFIXES = (".jsonl", ".json", ".txt", ".csv", ".parquet", ".tsv")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _import_datasets(source: str, why: str):
    try:
        import datasets
    except ImportError as err:
        raise DataError(
            f"{source}: {why} needs the `datasets` package: `pip install moe-attrib[datasets]` "
            "(or convert the data to JSONL)."
        ) from err
    return datasets


def _pick_split(ds, source: str, split: str | None):
    datasets = _import_datasets(source, "reading it")
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            split = "train" if "train" in ds else next(iter(ds))
        if split not in ds:
            raise DataError(f"{source}: no split {split!r} (splits: {sorted(ds)}); pass --split NAME.")
        ds = ds[split]
    return [dict(r) for r in ds]


def read_text(path: Path, source: str) -> str:
    """A file's text as UTF-8 (a leading byte-order mark is dropped); undecodable bytes are an error
    naming the file, line and byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{source}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`."
        ) from err


def _read_json(path: Path, source: str) -> list:
    text = read_text(path, source)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{source}:{err.lineno}: not valid JSON ({err.msg}).") from err
        return records
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(f"{source}:{lineno}: not valid JSON ({err.msg}).") from err
    return records


def _read_csv(path: Path, source: str) -> list[dict]:
    """Rows of a CSV/TSV file with a header line; every value is read as a string."""
    text = read_text(path, source)
    try:
        return list(csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if path.suffix == ".tsv" else ","))
    except csv.Error as err:
        raise DataError(f"{source}: cannot read as {path.suffix[1:].upper()} ({err}).") from err


def _read_parquet(path: Path, source: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError(
            f"{source}: reading Parquet needs pyarrow: `pip install moe-attrib[datasets]` (or convert to JSONL)."
        ) from err
    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # any reader failure is this file's fault
        raise DataError(f"{source}: cannot read as Parquet ({type(err).__name__}: {err}).") from err


def _read_records(source: str, text_field: str, split: str | None = None) -> list[dict]:
    path = Path(source)
    if path.is_dir():
        datasets = _import_datasets(source, "a `datasets` directory")
        return _pick_split(datasets.load_from_disk(str(path)), source, split)
    if path.is_file():
        if split is not None:
            raise DataError(
                f"{source}: --split {split} applies to a datasets directory or a hub dataset; a single file has no "
                "splits, so leave --split out."
            )
        if path.suffix in (".jsonl", ".json"):
            records = _read_json(path, source)
        elif path.suffix in (".csv", ".tsv"):
            records = _read_csv(path, source)
        elif path.suffix == ".parquet":
            records = _read_parquet(path, source)
        else:
            return [{text_field: line} for line in read_text(path, source).splitlines() if line.strip()]
        for i, rec in enumerate(records):
            if not isinstance(rec, dict):
                raise DataError(f"{source}: row {i} is a JSON {type(rec).__name__}, not an object with fields.")
        return records
    if not looks_like_hub_id(source):
        raise DataError(f"{source}: no such file or directory.")
    if hub_offline():
        raise DataError(f"{source}: no such local file, and HF_HUB_OFFLINE is set, so the hub is not asked.")
    datasets = _import_datasets(source, "a hub dataset")
    try:
        ds = datasets.load_dataset(source, split=split or "train")
    except Exception as err:  # network, missing dataset, missing split
        raise DataError(f"{source}: not a local file, and the hub dataset cannot be loaded ({err}).") from err
    return [dict(r) for r in ds]


def _text(rec: dict, field: str, source: str, i: int) -> str:
    value = rec[field]
    if not isinstance(value, str):
        raise DataError(
            f"{source}: row {i} field {field!r} is {type(value).__name__} ({value!r:.40}), not a string; "
            "fix or drop the row."
        )
    return value


def _loss_start(tokenizer, prompt: str, ids: list[int]) -> int:
    """Tokens of the prompt at the start of `ids`: the shared prefix of the pair's and the
    prompt's tokens, so special tokens a tokenizer appends to the prompt alone (EOS) do not count."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    n = 0
    for a, b in zip(prompt_ids, ids, strict=False):
        if a != b:
            break
        n += 1
    return min(n, len(ids) - 1)


def source_path(source: str) -> str:
    """The absolute path of a local data source (what an index records); hub names as given."""
    path = Path(source)
    return str(path.resolve()) if path.exists() else source


def check_token_ids(examples: list[Example], vocab_size: int, source: str) -> None:
    """Every token id must be an embedding row of the model: an error naming the first row that is not."""
    for ex in examples:
        bad = [t for t in ex.input_ids if t < 0 or t >= vocab_size]
        if bad:
            raise DataError(
                f"{source}: row {ex.index} has token id {bad[0]}, outside the model's vocabulary "
                f"(0..{vocab_size - 1}); the input_ids were made with another tokenizer."
            )


def load_examples(
    source: str,
    tokenizer=None,
    text_field: str = "text",
    max_length: int | None = None,
    truncate: bool = False,
    split: str | None = None,
) -> list[Example]:
    """Read and tokenize a dataset: JSONL, a `.json` array of objects, CSV/TSV (header line),
    Parquet, plain text (one example per line), a `datasets` directory or a hub name (`org/name`;
    `split` picks the split of the last two, default train). A pretokenized `input_ids` column
    is used as is; a record with `prompt` and `completion` fields is attributed through the
    completion's tokens only. A text field that is not a string is an error naming the row."""
    records = _read_records(source, text_field, split)
    if not records:
        raise DataError(f"{source}: the dataset is empty; nothing to attribute.")
    examples = []
    for i, rec in enumerate(records):
        loss_start = 0
        used = {"input_ids", text_field}
        if "input_ids" in rec:
            try:
                ids = [int(t) for t in rec["input_ids"]]
            except (TypeError, ValueError) as err:
                raise DataError(f"{source}: row {i} input_ids is not a list of integers ({err}).") from err
            text = rec.get(text_field)
            text = text if isinstance(text, str) else None
        elif "prompt" in rec and "completion" in rec:
            if tokenizer is None:
                raise DataError(f"{source}: row {i} has text but there is no tokenizer; {NO_TOKENIZER}")
            prompt, completion = _text(rec, "prompt", source, i), _text(rec, "completion", source, i)
            if not completion.strip():
                raise DataError(f"{source}: row {i} has an empty completion; nothing to attribute. Fill or drop it.")
            text = f"{prompt} {completion}"
            used |= {"prompt", "completion"}
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
            loss_start = _loss_start(tokenizer, prompt, ids)
        elif text_field in rec:
            if tokenizer is None:
                raise DataError(f"{source}: row {i} has text but there is no tokenizer; {NO_TOKENIZER}")
            text = _text(rec, text_field, source, i)
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
            if loss_start >= len(ids):
                raise DataError(
                    f"{source}: row {i}'s prompt fills --max_length {max_length}, so truncating leaves no completion "
                    "to attribute; raise --max_length or shorten the prompt."
                )
        fields = {k: v for k, v in rec.items() if k not in used and isinstance(v, SCALARS)}
        examples.append(Example(i, ids, text, loss_start, fields))
    return examples


def context_length(model) -> int | None:
    """The longest row the model was made for (`max_position_embeddings` of its config), None if unknown."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(
    examples: list[Example], context: int | None, source: str, truncate: bool, can_truncate: bool = True
) -> None:
    """Every row fits the model's `context` (positions): a `DataError` naming the first that does not,
    or with `truncate` each longer row cut at `context` tokens (in place). A prompt/completion row
    whose completion would be cut away entirely is an error either way. `can_truncate`: whether the
    command has `--truncate` (the message offers it)."""
    if context is None:
        return
    for ex in examples:
        if len(ex.input_ids) <= context:
            continue
        if not truncate:
            raise DataError(
                f"{source}: row {ex.index} has {len(ex.input_ids)} tokens, more than the model's context "
                f"({context} positions, max_position_embeddings); shorten the row"
                + (f", or pass --truncate to cut rows at {context} tokens." if can_truncate else ".")
            )
        if ex.loss_start >= context:
            raise DataError(
                f"{source}: row {ex.index}'s prompt fills the model's context ({context} positions), so cutting "
                "the row there leaves no completion to attribute; shorten the prompt."
            )
        ex.input_ids = ex.input_ids[:context]


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
