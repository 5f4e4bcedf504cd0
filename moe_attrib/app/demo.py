"""`moe-attrib demo`: plant facts in a tiny MoE, then trace each back to the training row that taught it.

Offline and on CPU: a three-domain corpus (`moe_attrib.synthetic`: facts about made-up people,
modular arithmetic, sequence reversal; the domains use disjoint words, so the routers send them to
different experts), a word-level tokenizer trained on it, a tiny Qwen3-MoE trained briefly, an
index built with every expert tracked (EK-FAC factors fitted first, rows stored in their eigenbasis: the
default `build`), and scores for
queries that restate some facts. A query is a hit at k when the fact it restates is among
the top k training examples. Each answer word is shared by about a sixth of the people, so the
answer alone (what `lm_head`'s gradient mostly encodes) cannot identify the fact: the person's
name has to be matched inside the model, where attention and the experts carry it.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from moe_attrib.errors import MoeAttribError
from moe_attrib.outputs import write_text
from moe_attrib.synthetic import multi_domain_corpus

MODULE_GROUPS = {
    "lm_head alone": "lm_head.*",
    "attention alone": "*.self_attn.*",
    "experts alone": "*.experts.*",
    "routers alone": "*.mlp.gate.*",
}
OUTPUTS = (
    "train.jsonl",
    "queries.jsonl",
    "model",
    "index",
    "index-no-experts",
    "results.json",
    "scores.jsonl",
    "report.html",
)


class DemoError(MoeAttribError, ValueError):
    """The demo's output directory holds files the demo did not write."""


def check_out(out: Path, overwrite: bool) -> None:
    """`out` is absent or empty, or (with `overwrite`) holds nothing the demo would clobber but its own files."""
    from moe_attrib.indexing.index import IndexFileError, check_index_target, part_dir

    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out}: is a file, not a directory.")
    parent = out if out.exists() else next(p for p in out.resolve().parents if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DemoError(f"--out {out}: cannot write in {parent} (read-only or no permission); choose another --out.")
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


def make_corpus(
    people: int = 40, queries: int = 40, seed: int = 0, fact_queries: str = "statement"
) -> tuple[list[dict], list[dict]]:
    """Training records of three domains and fact queries with their `source` row: each restates a
    trained fact (`"statement"`, answer without the final period) or asks it as a question never
    seen in training (`"question"`, much harder for a model this small)."""
    train, qs = multi_domain_corpus(
        people=people, queries_per_domain=0, fact_query_count=queries, seed=seed, fact_queries=fact_queries
    )
    return train, [q for q in qs if q["domain"] == "facts"]


def train_model(model, examples, steps: int, lr: float, seed: int, progress: bool) -> list[float]:
    from moe_attrib.collect.collector import example_losses
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
    projection_dim: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Run the whole demo with the default pipeline; returns (and writes to `out/results.json`) the recall table.

    The default pipeline is `build`'s: EK-FAC factors fitted first (`eigenbasis_collection`: sides sketched to
    `EIGENBASIS_SKETCH`, the output layer to `EIGENBASIS_OUTPUT_SKETCH`), rows stored in their eigenbasis under
    the default budget in bfloat16, the factors kept in the index; `projection_dim` builds seeded projections of
    that p instead.
    A non-empty `out` is refused (`DemoError`) unless `overwrite`, which replaces only the
    files the demo writes (`OUTPUTS`)."""
    from moe_attrib.curvature.ekfac import fit_ekfac
    from moe_attrib.data import load_examples
    from moe_attrib.indexing.index import load_index, part_dir, remove_index
    from moe_attrib.model.zoo import tiny_model, train_tokenizer
    from moe_attrib.scoring.score import DEFAULT_UNIT_NORMALIZE, group_parts, query_gradients, score
    from moe_attrib.settings import EIGENBASIS_INDEX_DTYPE, CollectSettings
    from moe_attrib.workflows.attribution import eigenbasis_collection
    from moe_attrib.workflows.build import build_index

    start = time.perf_counter()
    eigen = projection_dim is None
    out = Path(out).resolve()  # the index records absolute paths: it scores from any directory
    check_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    train, queries = make_corpus(seed=seed)
    for name, rows in (("train.jsonl", train), ("queries.jsonl", queries)):
        write_text(out / name, "".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_tokenizer([f"{r['prompt']} {r['completion']}" for r in train + queries])
    model = tiny_model("qwen3_moe", seed=seed, vocab_size=len(tokenizer), num_hidden_layers=2)
    examples = load_examples(str(out / "train.jsonl"), tokenizer)
    qexamples = load_examples(str(out / "queries.jsonl"), tokenizer)
    losses = train_model(model, examples, steps, 3e-3, seed, progress)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    facts = [r for r in train if r["domain"] == "facts"]
    shared = np.mean([sum(f["completion"] == g["completion"] for f in facts) for g in facts])
    print(f"demo: {len(examples)} training rows in 3 domains ({len(facts)} facts), {len(qexamples)} fact queries; "
          f"training loss {losses[0]:.2f} -> {np.mean(losses[-20:]):.2f} per token; "
          f"each answer is shared by {shared:.1f} facts on average")  # fmt: skip

    sources = np.array([q["source"] for q in queries])
    unit = DEFAULT_UNIT_NORMALIZE
    results: dict = {"queries": len(queries), "train": len(train), "chance_at_1": 1 / len(train),
                     "answer_shared_by": float(shared), "rows": "eigenbasis" if eigen else f"p={projection_dim}",
                     "variants": {}}  # fmt: skip

    def recall(name: str, res, coverage: float) -> None:
        hit1 = float(np.mean(res.rows[:, 0] == sources))
        hit10 = float(np.mean((res.rows == sources[:, None]).any(1)))
        results["variants"][name] = {"recall@1": hit1, "recall@10": hit10, "coverage": coverage}

    indexes = {}
    for tracked in (True, False):
        path = out / ("index" if tracked else "index-no-experts")
        remove_index(part_dir(path))  # a demo's own interrupted build (check_out refused anything else)
        common = {"track_moe_experts": tracked, "seed": seed, "token_batch_size": 1024, "progress": progress}
        if eigen:  # build's default: the factors first, the rows in their eigenbasis, the factors kept with them
            how = eigenbasis_collection(CollectSettings(track_moe_experts=tracked, seed=seed, token_batch_size=1024))
            ek = fit_ekfac(model, examples, collect=how, progress=progress)
            build_index(model, examples, path, model_name=str(out / "model"), ekfac=ek, keep_factors=True,
                        index_dtype=EIGENBASIS_INDEX_DTYPE, overwrite=True,
                        extra_settings={"data": str(out / "train.jsonl")}, **common)  # fmt: skip
        else:
            build_index(model, examples, path, model_name=str(out / "model"), projection_dim=projection_dim,
                        overwrite=True, extra_settings={"data": str(out / "train.jsonl")}, **common)  # fmt: skip
            ek = fit_ekfac(model, examples, projection_dim=projection_dim, **common)
        index = load_index(path)
        q, counts = query_gradients(model, qexamples, index, with_counts=True)
        indexes[tracked] = (index, q, ek, counts)
        cov = index.manifest["coverage"]
        if tracked:
            recall(
                "default: experts tracked, EK-FAC", score(index, q, ekfac=ek, unit_normalize=unit, device="cpu"), cov
            )
            recall("experts tracked, no preconditioning", score(index, q, unit_normalize=unit, device="cpu"), cov)
            for name, glob in MODULE_GROUPS.items():
                res = score(index, q, ekfac=ek, unit_normalize=unit, modules=glob, device="cpu")
                recall(f"{name}, EK-FAC", res, cov)
        else:
            recall("attention + lm_head (no --track_moe_experts), EK-FAC",
                   score(index, q, ekfac=ek, unit_normalize=unit, device="cpu"), cov)  # fmt: skip

    index, q, ek, counts = indexes[True]
    res = score(index, q, ekfac=ek, unit_normalize=unit, top_k=3, per_module=True, device="cpu")
    print("\nTop training examples for the first queries (default pipeline):")
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
    print(f"\nRecall over {len(queries)} fact queries ({len(train)} training rows; chance@1 = {1 / len(train):.1%};"
          f" answer word alone: about 1/{shared:.0f}):")  # fmt: skip
    print(f"  {'variant':58s} {'recall@1':>9s} {'recall@10':>10s}")
    for name, r in results["variants"].items():
        print(f"  {name:58s} {r['recall@1']:9.1%} {r['recall@10']:10.1%}")
    from moe_attrib.app.report import write_report
    from moe_attrib.scoring.results import score_records, write_results

    records = score_records(qexamples, res, index, examples, query_counts=counts)
    write_results(records, out / "scores.jsonl")
    print(f"\nreport: {write_report(records, index, out / 'report.html').resolve()} (open it in a browser)")
    results["seconds"] = time.perf_counter() - start
    write_text(out / "results.json", json.dumps(results, indent=2))
    print(f"demo finished in {results['seconds']:.0f} s; files in {out}/ (model, index, scores.jsonl, report.html)")
    return results
