"""Data as users have it: file formats, splits, a separate tokenizer, bad rows, prompt/completion loss."""

import json
import shutil

import pytest
import torch
from tokenizers import processors

from moe_attrib.data import DataError, collate, labels_for, load_examples
from moe_attrib.indexing.index import load_index
from moe_attrib.model.zoo import save_tiny, train_tokenizer
from tests.test_build import CORPUS, texts
from tests.test_integrity import cli, fails, inproc, ok

ROWS = [{"text": t} for t in texts()[:5]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data_model")
    save_tiny(str(path), "qwen3_moe", texts())
    return path


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(texts())


def ids_of(examples):
    return [ex.input_ids for ex in examples]


def test_json_array_csv_tsv_parquet_and_jsonl_read_alike(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS, indent=1))
    (tmp_path / "d.csv").write_text("id,text\n" + "".join(f'{i},"{r["text"]}"\n' for i, r in enumerate(ROWS)))
    (tmp_path / "d.tsv").write_text("text\tid\n" + "".join(f"{r['text']}\t{i}\n" for i, r in enumerate(ROWS)))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    expected = [tok(r["text"])["input_ids"] for r in ROWS]
    for name in ("d.jsonl", "d.json", "d.csv", "d.tsv", "d.parquet"):
        examples = load_examples(str(tmp_path / name), tok)
        assert ids_of(examples) == expected, name
        assert [ex.text for ex in examples] == [r["text"] for r in ROWS], name
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot read as Parquet"):
        load_examples(str(tmp_path / "bad.parquet"), tok)
    (tmp_path / "scalars.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="scalars.json: row 0 is a JSON int"):
        load_examples(str(tmp_path / "scalars.json"), tok)


def test_datasets_directory_with_split(model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS), validation=datasets.Dataset.from_list(ROWS[:3]))
    dd.save_to_disk(str(tmp_path / "ds"))
    args = ["build", model_dir, tmp_path / "ds", "--projection_dim", 4, "--quiet", "--track_moe_experts"]
    ok(cli(*args, "--index", tmp_path / "val", "--split", "validation"))
    assert load_index(tmp_path / "val").manifest["examples"] == 3
    assert load_index(tmp_path / "val").manifest["settings"]["split"] == "validation"
    fails(inproc(*args, "--index", tmp_path / "nope", "--split", "test"), "no split 'test'", "validation")
    assert not (tmp_path / "nope").exists() and not (tmp_path / "nope.part").exists()


def test_text_that_is_not_a_string_names_the_row(model_dir, tmp_path, tok):
    for value, kind in ((None, "NoneType"), (3, "int"), (["a", "b"], "list")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(DataError, match=f"{kind}.jsonl: row 1 field 'text' is {kind}"):
            load_examples(str(path), tok)
    res = inproc("build", model_dir, tmp_path / "NoneType.jsonl", "--index", tmp_path / "idx", "--quiet")
    fails(res, "row 1 field 'text' is NoneType")
    assert not (tmp_path / "idx").exists() and not (tmp_path / "idx.part").exists()


def test_out_of_vocabulary_ids_name_the_row(model_dir, tmp_path):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": [3, 4, 5]}) + "\n" + json.dumps({"input_ids": [3, 99999, 5]}) + "\n")
    res = inproc("build", model_dir, data, "--index", tmp_path / "idx", "--quiet", "--projection_dim", 4)
    fails(res, "ids.jsonl: row 1 has token id 99999, outside the model's vocabulary")
    assert not (tmp_path / "idx").exists() and not (tmp_path / "idx.part").exists()


def test_tokenizer_flag_for_a_model_directory_without_one(model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model_dir.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, bare / f.name)
    args = ["build", bare, CORPUS, "--quiet", "--projection_dim", 4, "--track_moe_experts", "--precision", "fp32"]
    fails(inproc(*args, "--index", tmp_path / "no"), "row 0 has text but there is no tokenizer", "--tokenizer")
    assert not (tmp_path / "no").exists() and not (tmp_path / "no.part").exists()
    fails(inproc(*args, "--index", tmp_path / "no", "--tokenizer", tmp_path / "nothere"), "--tokenizer", "no such")
    ok(cli(*args, "--index", tmp_path / "idx", "--tokenizer", model_dir))
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"text": texts()[2]}) + "\n")
    out = tmp_path / "s.jsonl"  # score finds the tokenizer the index recorded
    ok(cli("score", "--index", tmp_path / "idx", bare, queries, "--out", out, "--top_k", 2))
    assert json.loads(out.read_text())["results"][0]["text"] in texts()


@pytest.mark.parametrize("template", ["$A </s>", "<s> $A </s>", "<s> $A", "$A"])
def test_prompt_completion_first_token_carries_loss_with_any_special_tokens(tmp_path, template):
    tokenizer = train_tokenizer(texts())
    specials = [(t, tokenizer.convert_tokens_to_ids(t)) for t in ("<s>", "</s>") if t in template]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    prompt, completion = "Ada was born in", "Lisbon ."
    data = tmp_path / "pc.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    (ex,) = load_examples(str(data), tokenizer)
    vocab = tokenizer.get_vocab()
    bos = 1 if template.startswith("<s>") else 0
    words = [vocab[w] for w in f"{prompt} {completion}".split()]
    assert ex.input_ids[bos : bos + len(words)] == words
    first = bos + len(prompt.split())  # position of "Lisbon"
    ids, mask = collate([ex], [0])
    labels = labels_for([ex], [0], ids, mask)[0]
    assert labels[first] == vocab["Lisbon"]  # predicted from the last prompt token: it carries loss
    assert (labels[:first] == -100).all()
    assert torch.equal(labels[first:], ids[0, first:])
