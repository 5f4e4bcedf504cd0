"""Score results as records, and their files: `.jsonl` (one line per query, exact), `.csv` and `.tsv`
(one row per query and hit, for spreadsheets and pandas), chosen by the file's extension.

A record is `{"query", "query_text", "query_fields" | "query_id", ["query_expert_counts"], "index_fingerprint",
"results": [hit]}`
and a hit `{"rank", "row", "example", ["token"], "score", "text", "fields" | "id", ["per_module"],
["tokens", "token_scores"]}`. `fields` carry the data record's scalar fields (ids, metadata) into the results;
with `id_field` only that one field is carried, as `id` / `query_id`. `index_fingerprint` names the index the
scores were computed against (`index_fingerprint()`), so that a report is never drawn from another index.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from pathlib import Path

import numpy as np

from moe_attrib.data import Example
from moe_attrib.errors import MoeAttribError
from moe_attrib.indexing.index import Index
from moe_attrib.outputs import replacing
from moe_attrib.scoring.score import Scores, group_parts

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}
_INT = ("query", "rank", "row", "example", "token")
_JSON = ("per_module", "tokens", "token_scores", "query_expert_counts")


class ResultsError(MoeAttribError, ValueError):
    """A results file or record that cannot be read or written as asked; the message names it."""


def results_format(path: str | Path) -> str:
    """`jsonl`, `csv` or `tsv` from the file's extension (an unknown extension is an error)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ResultsError(f"{path}: unknown results format {suffix!r}; use one of {', '.join(sorted(FORMATS))}.")
    return FORMATS[suffix]


def index_fingerprint(index: Index) -> str:
    """What an index's rows are, in 16 hex digits: the model's weights, the training data's tokens, the
    tokenizer and every build setting that changes rows or columns (not paths, nor batch sizes)."""
    m, st = index.manifest, index.manifest["settings"]
    keys = ("model_fingerprint", "data_fingerprint", "tokenizer_fingerprint", "projection_dim", "seed", "projection",
            "expert_blocks", "track_moe_experts", "filter_modules", "attribute_tokens")  # fmt: skip
    what = {k: st.get(k) for k in keys}
    if st.get("output_projection_dim") is not None:  # absent before the output layer had a width of its own
        what["output_projection_dim"] = st["output_projection_dim"]
    what.update(optimizer_state=bool(st.get("optimizer_state")), index_dtype=st.get("index_dtype", "float32"))
    what.update(rows=m["rows"], dim=m["dim"], expert_layers=m.get("expert_layers", []))
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _finite(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _carried(ex: Example, id_field: str | None, source: str) -> dict:
    if id_field is None:
        return {"fields": dict(ex.fields)}
    if id_field not in ex.fields:
        raise ResultsError(
            f"{source}: row {ex.index} has no scalar field {id_field!r} to use as --id_field "
            f"(its fields: {sorted(ex.fields) or 'none besides the text'})."
        )
    return {"id": ex.fields[id_field]}


def score_records(
    queries: list[Example],
    scores: Scores,
    index: Index,
    train: list[Example] | None,
    *,
    id_field: str | None = None,
    query_counts: np.ndarray | None = None,
    token_scores: dict[int, np.ndarray] | None = None,
    tokenizer=None,
    query_source: str = "queries",
) -> list[dict]:
    """One record per query from a `Scores` over `index`, whose training examples are `train`
    (in index order; None: hits without texts or fields, `score --no_texts`). A non-finite score
    is written as null, never as a bare NaN. `query_counts` (`details.query_expert_counts`) and `token_scores`
    (`details.token_scores`, token indexes) add the routing and per-token views."""
    from moe_attrib.scoring.details import token_pieces

    offsets = index.token_offsets
    example_ids = index.manifest["example_ids"]
    source = index.manifest["settings"].get("data", "training data")
    pieces: dict[int, list[str]] = {}
    built_from = index_fingerprint(index)
    records = []
    for qi, ex in enumerate(queries):
        q_carried = _carried(ex, id_field, query_source)
        record = {"query": ex.index, "query_text": ex.text}
        record.update({"query_id": q_carried["id"]} if id_field else {"query_fields": q_carried["fields"]})
        if query_counts is not None:
            record["query_expert_counts"] = query_counts[qi].tolist()
        record["index_fingerprint"] = built_from
        hits = []
        for rank, (value, row) in enumerate(zip(scores.values[qi], scores.rows[qi], strict=True)):
            pos = int(np.searchsorted(offsets, row, side="right") - 1) if offsets is not None else int(row)
            hit = {"rank": rank + 1, "row": int(row), "example": int(example_ids[pos])}
            if offsets is not None:
                hit["token"] = int(row - offsets[pos])
            hit.update({"score": _finite(value), "text": train[pos].text if train is not None else None})
            if train is not None:
                hit.update(_carried(train[pos], id_field, source))
            if scores.parts is not None:
                parts = group_parts(scores.parts[qi, rank], index.blocks)
                hit["per_module"] = {k: {n: _finite(v) for n, v in d.items()} for k, d in parts.items()}
            if token_scores is not None and pos in token_scores and train is not None:
                if pos not in pieces:
                    pieces[pos] = token_pieces(tokenizer, train[pos].input_ids)
                hit["tokens"] = pieces[pos]
                hit["token_scores"] = [_finite(v) for v in token_scores[pos][qi]]
            hits.append(hit)
        record["results"] = hits
        records.append(record)
    return records


def write_results(records: list[dict], path: str | Path) -> Path:
    """Write records as JSONL, CSV or TSV (by extension), through a temporary file renamed into place
    when complete (`moe_attrib.outputs`): never a half-written file."""
    path = Path(path)
    fmt = results_format(path)
    if fmt == "jsonl":
        with replacing(path, encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        return path
    rows = [_flat(record, hit) for record in records for hit in record["results"]]
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    with replacing(path, newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, columns, delimiter="," if fmt == "csv" else "\t", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return path


def _cell(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _flat(record: dict, hit: dict) -> dict:
    row = {"query": record["query"]}
    if "query_id" in record:
        row["query_id"] = _cell(record["query_id"])
    row.update({f"query_fields.{k}": _cell(v) for k, v in record.get("query_fields", {}).items()})
    row["query_text"] = record["query_text"] or ""
    for key, value in hit.items():
        if key == "fields":
            row.update({f"fields.{k}": _cell(v) for k, v in value.items()})
        elif key == "text":
            row[key] = value or ""
        elif key in _JSON:
            row[key] = json.dumps(value)
        else:
            row[key] = _cell(value) if key == "id" else value
    if "query_expert_counts" in record:
        row["query_expert_counts"] = json.dumps(record["query_expert_counts"])
    if "index_fingerprint" in record:
        row["index_fingerprint"] = record["index_fingerprint"]
    return row


def _scalar(cell: str):
    """A record field read back from CSV: numbers and booleans parse, everything else stays text."""
    try:
        value = json.loads(cell)
    except ValueError:
        return cell
    return value if isinstance(value, int | float | bool) else cell


def read_results(path: str | Path) -> list[dict]:
    """Records from a JSONL, CSV or TSV results file (CSV/TSV: a text field that looks like a
    number reads back as a number; JSONL keeps every type)."""
    path = Path(path)
    fmt = results_format(path)
    if not path.is_file():
        raise ResultsError(f"{path}: no such results file (write one with `moe-attrib score --out {path.name}`).")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ResultsError(f"{path}: not a moe-attrib results file (not UTF-8 text).") from err
    if fmt == "jsonl":
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ResultsError(f"{path}:{lineno}: not valid JSON ({err.msg}).") from err
                _check_record(record, f"{path}:{lineno}")
                records.append(record)
        return records
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="," if fmt == "csv" else "\t")
    missing = sorted({"query", "rank", "example", "score"} - set(reader.fieldnames or []))
    if missing:
        raise ResultsError(
            f"{path}: not a moe-attrib results file (no column {', '.join(missing)}); give a file written by "
            "`moe-attrib score --out`."
        )
    rows = list(reader)
    records: list[dict] = []
    for lineno, row in enumerate(rows, 2):
        try:
            new = _unflat(row, records[-1] if records else None)
        except (KeyError, ValueError, TypeError) as err:
            raise ResultsError(f"{path}:{lineno}: not a moe-attrib results row ({err!r}).") from err
        if new is not None:
            records.append(new)
    return records


def _check_record(record, where: str) -> None:
    """A JSONL line is a results record: an object with a query number and a list of hits that each
    have a rank, an example and a score (what `show` and `report` read)."""
    hits = record.get("results") if isinstance(record, dict) else None
    ok = isinstance(hits, list) and isinstance(record.get("query"), int)
    ok = ok and all(isinstance(h, dict) and {"rank", "example", "score"} <= h.keys() for h in hits)
    if not ok:
        raise ResultsError(
            f'{where}: not a moe-attrib results record (it needs "query" and "results" with rank, example and '
            "score per hit); give a file written by `moe-attrib score --out`."
        )


def _unflat(row: dict, last: dict | None) -> dict | None:
    """Add one CSV row's hit to `last` (same query) or return a new record holding it."""
    query = int(row["query"])
    if last is None or last["query"] != query:
        record = {"query": query, "query_text": row["query_text"] or None}
        if "query_id" in row:
            record["query_id"] = _scalar(row["query_id"])
        else:
            record["query_fields"] = {
                k.split(".", 1)[1]: _scalar(v) for k, v in row.items() if k.startswith("query_fields.") and v != ""
            }
        if row.get("query_expert_counts"):
            record["query_expert_counts"] = json.loads(row["query_expert_counts"])
        if row.get("index_fingerprint"):
            record["index_fingerprint"] = row["index_fingerprint"]
        record["results"] = []
        new = record
    else:
        record, new = last, None
    hit: dict = {}
    for key, value in row.items():
        if key.startswith("query") or key == "index_fingerprint" or value == "" and key != "text":
            continue
        if key in _INT:
            hit[key] = int(value)
        elif key == "score":
            hit[key] = float(value)
        elif key == "text":
            hit[key] = value or None
        elif key == "id":
            hit[key] = _scalar(value)
        elif key.startswith("fields."):
            hit.setdefault("fields", {})[key.split(".", 1)[1]] = _scalar(value)
        elif key in _JSON:
            hit[key] = json.loads(value)
        else:
            hit[key] = value
    if "id" not in hit:
        hit.setdefault("fields", {})
    record["results"].append(hit)
    return new
