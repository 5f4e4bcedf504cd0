"""`moe-attrib demo`: plant facts in a tiny MoE, then find them again from paraphrased queries.

Offline and on CPU: a synthetic corpus of facts about made-up people, a word-level tokenizer
trained on it, a tiny Qwen3-MoE trained briefly, an index built with every expert tracked,
EK-FAC fitted in the projected space, and scores for held-out paraphrases of some facts. A query
is a hit at k when the fact it paraphrases is among the top k training examples.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

SYLLABLES = ["ka", "lo", "mi", "ru", "ze", "to", "va", "ne", "shi", "po", "ga", "di", "fu", "xe", "bo", "qui"]
COLOURS = ["teal", "amber", "crimson", "ivory", "olive", "violet", "indigo", "coral", "saffron", "slate"]
CITIES = ["Velmora", "Ostrin", "Caldera", "Pyxis", "Marrow", "Tessel", "Quorra", "Lumen", "Ashby", "Dunmere"]
JOBS = ["baker", "pilot", "weaver", "chemist", "sculptor", "ferryman", "archivist", "glazier", "botanist", "cooper"]
PETS = ["heron", "ferret", "tortoise", "lynx", "parrot", "gecko", "otter", "raven", "hound", "mare"]

TEMPLATES = {
    "colour": ("The favourite colour of {p} is {v} .", "Which colour does {p} love most ? {v}"),
    "city": ("{p} was born in the town of {v} .", "Where is the birthplace of {p} ? {v}"),
    "job": ("By trade {p} works as a {v} .", "What does {p} do for a living ? {v}"),
    "pet": ("{p} keeps a pet {v} at home .", "Which animal lives with {p} ? {v}"),
}
VALUES = {"colour": COLOURS, "city": CITIES, "job": JOBS, "pet": PETS}
OUTPUTS = ("train.jsonl", "queries.jsonl", "model", "index", "index-no-experts", "results.json")


class DemoError(ValueError):
    """The demo's output directory holds files the demo did not write."""


def check_out(out: Path, overwrite: bool) -> None:
    """`out` is absent or empty, or (with `overwrite`) holds nothing the demo would clobber but its own files."""
    from moe_attrib.index import IndexFileError, check_index_target, part_dir

    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out}: is a file, not a directory.")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise DemoError(
            f"--out {out}: the directory is not empty; pass --overwrite to replace the demo's own files "
            f"({', '.join(OUTPUTS)}) or choose another directory."
        )
    for name in ("index", "index-no-experts"):
        for path in (out / name, part_dir(out / name)):
            try:
                check_index_target(path, overwrite=True)
            except IndexFileError as err:
                raise DemoError(str(err)) from err


def make_corpus(people: int = 40, queries: int = 40, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Training facts (one per person and relation) and paraphrased queries with their source fact."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < people:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize())
    train, facts = [], []
    for name in sorted(names):
        for rel, (stmt, _) in TEMPLATES.items():
            value = rng.choice(VALUES[rel])
            facts.append((len(train), name, rel, value))
            prompt, _, rest = stmt.format(p=name, v="\0").partition("\0")
            train.append({"prompt": prompt.strip(), "completion": value + rest, "person": name, "relation": rel})
    chosen = rng.sample(facts, queries)
    qs = []
    for row, name, rel, value in chosen:
        prompt = TEMPLATES[rel][1].format(p=name, v="").strip()
        qs.append({"prompt": prompt, "completion": value, "source": row})
    return train, qs


def train_model(model, examples, steps: int, lr: float, seed: int, progress: bool) -> list[float]:
    from moe_attrib.collector import example_losses
    from moe_attrib.data import collate, labels_for

    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    order = list(range(len(examples)))
    rng = random.Random(seed)
    for _ in tqdm(range(steps), desc="demo: training the tiny MoE", disable=not progress):
        batch = rng.sample(order, 16)
        ids, mask = collate(examples, batch)
        out = model(input_ids=ids, attention_mask=mask)
        labels = labels_for(examples, batch, ids, mask)
        loss = example_losses(out.logits, labels).sum() / (labels[:, 1:] != -100).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    model.eval()
    return losses


def run_demo(
    out: str | Path = "moe-attrib-demo",
    steps: int = 300,
    seed: int = 0,
    projection_dim: int = 32,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Run the whole demo; returns (and writes to `out/results.json`) the recall table.

    A non-empty `out` is refused (`DemoError`) unless `overwrite`, which replaces only the
    files the demo writes (`OUTPUTS`)."""
    from moe_attrib.build import build_index
    from moe_attrib.data import load_examples
    from moe_attrib.ekfac import fit_ekfac
    from moe_attrib.index import load_index, part_dir, remove_index
    from moe_attrib.score import group_parts, query_gradients, score
    from moe_attrib.zoo import tiny_model, train_tokenizer

    start = time.perf_counter()
    out = Path(out)
    check_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    train, queries = make_corpus(seed=seed)
    for name, rows in (("train.jsonl", train), ("queries.jsonl", queries)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_tokenizer([f"{r['prompt']} {r['completion']}" for r in train + queries])
    model = tiny_model("qwen3_moe", seed=seed, vocab_size=len(tokenizer), num_hidden_layers=2)
    examples = load_examples(str(out / "train.jsonl"), tokenizer)
    qexamples = load_examples(str(out / "queries.jsonl"), tokenizer)
    losses = train_model(model, examples, steps, 3e-3, seed, progress)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    print(f"demo: {len(examples)} training facts, {len(qexamples)} paraphrased queries; "
          f"training loss {losses[0]:.2f} -> {np.mean(losses[-20:]):.2f} per token")  # fmt: skip

    p = projection_dim
    sources = np.array([q["source"] for q in queries])
    results: dict = {"queries": len(queries), "train": len(train), "chance_at_1": 1 / len(train), "variants": {}}
    indexes = {}
    for tracked in (True, False):
        path = out / ("index" if tracked else "index-no-experts")
        remove_index(part_dir(path))  # a demo's own interrupted build (check_out refused anything else)
        build_index(model, examples, path, model_name=str(out / "model"), track_moe_experts=tracked,
                    projection_dim=p, seed=seed, token_batch_size=1024, progress=progress, overwrite=True,
                    extra_settings={"data": str(out / "train.jsonl")})  # fmt: skip
        index = load_index(path)
        ek = fit_ekfac(model, examples, track_moe_experts=tracked, projection_dim=p, seed=seed,
                       token_batch_size=1024, progress=progress)  # fmt: skip
        q = query_gradients(model, qexamples, index)
        indexes[tracked] = (index, q, ek)
        for use_ekfac in (True, False):
            res = score(index, q, ekfac=ek if use_ekfac else None, unit_normalize=True, top_k=10, device="cpu")
            hit1 = float(np.mean(res.rows[:, 0] == sources))
            hit10 = float(np.mean((res.rows == sources[:, None]).any(1)))
            name = f"{'experts tracked' if tracked else 'attention only (no --track_moe_experts)'}, " + (
                "EK-FAC" if use_ekfac else "no preconditioning"
            )
            results["variants"][name] = {"recall@1": hit1, "recall@10": hit10, "coverage": index.manifest["coverage"]}

    index, q, ek = indexes[True]
    res = score(index, q, unit_normalize=True, top_k=3, per_module=True, device="cpu")
    print("\nTop training examples for the first queries (experts tracked, cosine):")
    for qi in range(5):
        mark = "HIT " if res.rows[qi, 0] == sources[qi] else "miss"
        query = f"{queries[qi]['prompt']} -> {queries[qi]['completion']}"
        print(f"  [{mark}] query: {query!r}  (planted: {examples[sources[qi]].text!r})")
        for rank in range(3):
            row = res.rows[qi, rank]
            print(f"         {rank + 1}. {res.values[qi, rank]:+.2e}  {examples[row].text}")
    share: dict[str, float] = {}
    for qi in range(len(queries)):
        parts = group_parts(res.parts[qi, 0], index.blocks)["experts"]
        for key, value in parts.items():
            share[key] = share.get(key, 0.0) + value
    total = sum(abs(v) for v in share.values()) or 1.0
    top = sorted(share.items(), key=lambda kv: -abs(kv[1]))[:6]
    print("\nPer-expert influence (sum over queries of each expert's part of the top-1 score):")
    for key, value in top:
        print(f"  {key:40s} {value / total:+.1%}")
    results["expert_influence_top"] = {k: v / total for k, v in top}
    print(f"\nRecall over {len(queries)} queries ({len(train)} training facts; chance@1 = {1 / len(train):.1%}):")
    print(f"  {'variant':62s} {'recall@1':>9s} {'recall@10':>10s}")
    for name, r in results["variants"].items():
        print(f"  {name:62s} {r['recall@1']:9.1%} {r['recall@10']:10.1%}")
    results["seconds"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\ndemo finished in {results['seconds']:.0f} s; files in {out}/ (model, index, results.json)")
    return results
