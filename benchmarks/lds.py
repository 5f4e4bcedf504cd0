"""Linear Datamodeling Score (LDS) of moe-attrib's rankings on a small MoE trained from a transformers config.

    python benchmarks/lds.py                      # 2 CPU cores, about 15 minutes the first time
    python benchmarks/lds.py --config gpu --device cuda
    python benchmarks/lds.py --config smoke       # seconds; what the test suite runs

1. A tiny qwen3_moe (2 layers, 8 experts, top-2) is trained on a 3-domain prompt/completion corpus
   (`moe_attrib.synthetic`); M more copies are trained from the same initial weights on random 50%
   subsets, and again with another data-order seed (test-retest). Their query losses are cached in
   `--cache`, so a rerun of the attribution part takes seconds.
2. Every variant scores each (query, training example) pair with the full model's gradients.
3. LDS = mean over queries of Spearman(predicted, actual) over the M subsets, where the predicted loss
   of subset S is `-sum_{i in S} score(q, i)`; 95% CIs by bootstrap over queries, and the CI of each
   variant's difference to the default (paired bootstrap).

Results go to `benchmarks/results/lds-<config>.json`; `docs/quality.md` reports them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # python_docs, when imported from elsewhere

import moe_attrib as ma  # noqa: E402
from moe_attrib.collect.collector import example_losses  # noqa: E402
from moe_attrib.collect.projection import PROJECTION, PROJECTION_V1  # noqa: E402
from moe_attrib.curvature.ekfac import DAMPING_SCOPES, DEFAULT_DAMPING, DEFAULT_DAMPING_SCOPE  # noqa: E402
from moe_attrib.data import collate, labels_for, load_examples  # noqa: E402
from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM  # noqa: E402
from moe_attrib.model.zoo import tiny_model, train_tokenizer  # noqa: E402
from moe_attrib.scoring.score import DEFAULT_UNIT_NORMALIZE  # noqa: E402
from moe_attrib.settings import DEFAULT_OUTPUT_PROJECTION_DIM  # noqa: E402
from moe_attrib.synthetic import multi_domain_corpus, texts  # noqa: E402


@dataclass(frozen=True)
class Config:
    family: str = "qwen3_moe"
    hidden: int = 64
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 32
    heads: int = 4
    people: int = 40
    arithmetic: int = 72
    sequences: int = 64
    queries_per_domain: int = 16
    models: int = 128
    epochs: int = 10
    batch: int = 16
    lr: float = 3e-3  # peak; linear decay to 0 over the run
    seed: int = 0
    shared_vocab: bool = False  # every domain answers with the same words (moe_attrib.synthetic)
    # fields added with the plain-text and real-text configurations; at their defaults they leave a
    # configuration's cache key as it was (`cache_dir`)
    corpus: str = "synthetic"  # "synthetic" (moe_attrib.synthetic) or "python_docs" (benchmarks/python_docs.py)
    plain_text: bool = False  # synthetic training rows as plain text, the loss on every token
    vocab: int = 512  # the trained word-level tokenizer's size
    chunks_per_domain: int = 100  # python_docs: training chunks per domain
    words: int = 40  # python_docs: words per chunk


CONFIGS = {
    "cpu": Config(),
    "cpu-gpt_oss": Config(family="gpt_oss"),
    "cpu-shared": Config(
        shared_vocab=True
    ),  # the output layer cannot tell the domains apart  # biases on attention, experts and router: bias folding
    # deeper, more experts, one output vocabulary for every domain: where the prompts and the routing,
    # not the output layer, tell the domains apart
    "cpu-deep": Config(layers=4, experts=16, shared_vocab=True),
    # held out: added after the coupling's gamma was chosen on the four above, to check it on another
    # family (OLMoE), depth, expert count and corpus seed
    "cpu-heldout": Config(family="olmoe", layers=3, experts=12, shared_vocab=True, seed=1),
    # held out again (sixth session): added before the output-layer balance was measured on it, to
    # check that rule (chosen on the five above) on another family (Mixtral: no biases, experts in
    # `intermediate_size`), expert count and corpus seed
    "cpu-heldout2": Config(family="mixtral", layers=3, experts=8, shared_vocab=True, seed=2),
    # plain-text training rows (the loss on every token), prompt/completion queries: where the rows'
    # gradients are mostly the shared templates, not the answers
    "text-plain": Config(people=64, arithmetic=84, sequences=128, plain_text=True),
    # a language model on real text that ships with Python, 3 domains, a 2.6k-word vocabulary
    "text-pydoc": Config(corpus="python_docs", vocab=4096, models=100),
    # plain text, 4 layers, 16 experts, one output vocabulary for every domain
    "text-deep": Config(
        layers=4, experts=16, people=64, arithmetic=84, sequences=128, plain_text=True, shared_vocab=True, seed=3
    ),
    # held out (HELDOUT, benchmarks/heldout.json): frozen before anything of issue 31 was tuned
    "heldout-plain": Config(
        family="olmoe",
        layers=4,
        experts=16,
        people=56,
        arithmetic=84,
        sequences=112,
        plain_text=True,
        seed=4,
        models=48,  # 96 models: trainable on this 2-core machine in the time left (no GPU could be started)
    ),
    "heldout-pydoc": Config(
        family="mixtral", layers=3, experts=8, corpus="python_docs", vocab=4096, models=100, epochs=10, seed=5
    ),
    # held out again (session 15, HELDOUT_HEAD in benchmarks/heldout.json): frozen before the output layer's
    # projection width was chosen; another family, depth, expert count, vocabulary and seed than any above
    "heldout-qa": Config(
        family="gpt_oss", layers=3, experts=12, people=48, arithmetic=80, sequences=96, models=96, seed=7
    ),
    "heldout-docs": Config(
        family="olmoe",
        layers=2,
        experts=16,
        corpus="python_docs",
        vocab=8192,
        chunks_per_domain=150,
        words=32,
        models=96,
        seed=6,
    ),
    # held out again (session 16, HELDOUT_NEXT in benchmarks/heldout.json): frozen before any further choice (the
    # eigenbasis index as the default flow, its floors, the output layer); families not measured before
    # (qwen2_moe: a dense shared expert beside the routed ones; granitemoe), another vocabulary and seeds
    "heldout-shared": Config(
        family="qwen2_moe",
        layers=3,
        experts=8,
        people=48,
        arithmetic=80,
        sequences=96,
        shared_vocab=True,
        models=96,
        seed=8,
    ),
    "heldout-text": Config(
        family="granitemoe",
        layers=3,
        experts=12,
        corpus="python_docs",
        vocab=6144,
        chunks_per_domain=120,
        models=64,
        seed=9,
    ),
    # held out again (session 18, HELDOUT_S18 in benchmarks/heldout.json): frozen before the output layer's floor
    # shape and sketch width were measured; families new to the benchmark (deepseek_v3: sigmoid routing with a shared
    # expert; ernie4_5_moe), another vocabulary and seeds
    "heldout-ds": Config(
        family="deepseek_v3",
        layers=2,
        experts=16,
        corpus="python_docs",
        vocab=5120,
        chunks_per_domain=100,
        models=48,
        seed=10,
    ),
    "heldout-ernie": Config(
        family="ernie4_5_moe",
        layers=3,
        experts=8,
        people=48,
        arithmetic=80,
        sequences=96,
        plain_text=True,
        models=48,
        seed=11,
    ),
    # held out again (session 19, HELDOUT_S19 in benchmarks/heldout.json): frozen before the experts' weight in the
    # allocation and an adaptive output balance were chosen; families new to the benchmark (glm4_moe: sigmoid routing
    # with a shared expert; hunyuan_v1_moe), shaped like the two where the default fell below the seeded index
    # (prompt/completion rows as heldout-qa; plain text, 4 layers, 16 experts, one vocabulary as text-deep)
    "heldout-glm": Config(
        family="glm4_moe", layers=3, experts=12, people=48, arithmetic=80, sequences=96, models=48, seed=12
    ),
    "heldout-hunyuan": Config(
        family="hunyuan_v1_moe",
        layers=4,
        experts=16,
        people=64,
        arithmetic=84,
        sequences=128,
        plain_text=True,
        shared_vocab=True,
        models=48,
        seed=13,
    ),
    # held out again (session 20, HELDOUT_S20 in benchmarks/heldout.json): frozen before the allocation's damping
    # scope and the output floor's shape were measured on the seventeen above; families new to the benchmark (dots1:
    # sigmoid routing with a shared expert; flex_olmo), shaped like the plain-text configurations where the default
    # is below exact rows and the seeded index (text-plain: 2 layers, 8 experts; text-deep: 4 layers, 16 experts,
    # one vocabulary)
    "heldout-dots": Config(
        family="dots1", layers=2, experts=8, people=48, arithmetic=80, sequences=96, plain_text=True, models=48, seed=14
    ),
    "heldout-flex": Config(
        family="flex_olmo",
        layers=4,
        experts=16,
        people=64,
        arithmetic=84,
        sequences=128,
        plain_text=True,
        shared_vocab=True,
        models=48,
        seed=15,
    ),
    # held out again (session 20, HELDOUT_S20B in benchmarks/heldout.json): frozen before the output floor's "fill"
    # shape was measured; deepseek_v2 (multi-head latent attention, a shared expert) on prompt/completion rows and
    # gpt_oss on plain text, both with output layers wider than the floor on both sides (where its shape matters)
    "heldout-dsv2": Config(
        family="deepseek_v2", layers=2, experts=8, people=48, arithmetic=80, sequences=96, models=48, seed=16
    ),
    "heldout-oss-text": Config(
        family="gpt_oss",
        layers=3,
        experts=12,
        people=48,
        arithmetic=80,
        sequences=96,
        plain_text=True,
        models=48,
        seed=17,
    ),
    # held out again (session 21, HELDOUT_S21 in benchmarks/heldout.json): frozen before the output floor's "hidden"
    # shape was measured in the whole pipeline; families new to the benchmark (minimax: linear attention in every
    # other layer; llama4_text: chunked attention, a shared expert), plain text and prompt/completion rows, one with
    # a hidden side of 128 (where the shapes differ most)
    "heldout-minimax": Config(
        family="minimax",
        layers=3,
        experts=8,
        people=48,
        arithmetic=80,
        sequences=96,
        plain_text=True,
        models=48,
        seed=18,
    ),
    "heldout-llama4": Config(
        family="llama4_text",
        hidden=128,
        layers=2,
        experts=16,
        people=48,
        arithmetic=80,
        sequences=96,
        models=48,
        seed=19,
    ),
    "smoke": Config(people=8, arithmetic=16, sequences=16, queries_per_domain=4, models=20, epochs=4),
    "gpu": Config(
        hidden=256,
        layers=4,
        experts=16,
        moe_intermediate=128,
        people=160,
        arithmetic=100,
        sequences=240,
        queries_per_domain=32,
        models=200,
        epochs=30,
        batch=32,
        lr=2e-3,
    ),
}

# configurations frozen before any choice of issue 31 (damping, inverse-Hessian products) was made: reported apart
HELDOUT = ("heldout-plain", "heldout-pydoc")
# frozen before the output layer's projection width (`output_projection_dim`) was chosen: reported apart from
# both sets above (HELDOUT's two were looked at by benchmarks/probes/head_width.py)
HELDOUT_HEAD = ("heldout-qa", "heldout-docs")
# frozen in session 16 before anything was measured on them: for the next choices (benchmarks/heldout.json)
HELDOUT_NEXT = ("heldout-shared", "heldout-text")
# frozen in session 18 before anything was trained or measured on them: for the output layer's floor and width
HELDOUT_S18 = ("heldout-ds", "heldout-ernie")
# frozen in session 19 before anything was trained or measured on them: for the experts' weight and the balance
HELDOUT_S19 = ("heldout-glm", "heldout-hunyuan")
# frozen in session 20 before anything was trained or measured on them: for the allocation's damping scope and the
# output floor's shape
HELDOUT_S20 = ("heldout-dots", "heldout-flex")
# frozen in session 20 before anything was trained or measured on them: for the output floor's "fill" shape
HELDOUT_S20B = ("heldout-dsv2", "heldout-oss-text")
# frozen in session 21 before anything was trained or measured on them: for the output floor's "hidden" shape
HELDOUT_S21 = ("heldout-minimax", "heldout-llama4")
# the configurations every default is chosen over (the mean with a paired CI), and the held-out ones
TUNING = ("cpu", "cpu-gpt_oss", "cpu-shared", "cpu-deep", "text-plain", "text-pydoc", "text-deep")


# -- data and training --------------------------------------------------------------------------
def corpus(cfg: Config, root: Path):
    """Training and query records and the tokenizer of `cfg`, written to `root` the first time and read back
    from there after (so that a cache made on one machine, whose Python's text may differ, is reused as is)."""
    from transformers import AutoTokenizer

    files = [root / "train.jsonl", root / "queries.jsonl", root / "tokenizer"]
    if all(f.exists() for f in files):
        train, queries = ([json.loads(line) for line in f.read_text().splitlines()] for f in files[:2])
        return train, queries, AutoTokenizer.from_pretrained(files[2])
    if cfg.corpus == "python_docs":
        from python_docs import python_docs_corpus

        train, queries = python_docs_corpus(cfg.chunks_per_domain, cfg.queries_per_domain, cfg.words, cfg.seed)
    elif cfg.corpus == "synthetic":
        train, queries = multi_domain_corpus(
            cfg.people,
            cfg.arithmetic,
            cfg.sequences,
            cfg.queries_per_domain,
            cfg.seed,
            fact_queries="statement",
            shared_vocab=cfg.shared_vocab,
        )
        if cfg.plain_text:
            train = [{"text": f"{r['prompt']} {r['completion']}", "domain": r["domain"]} for r in train]
    else:
        raise ValueError(f"lds.py: unknown corpus {cfg.corpus!r} (synthetic or python_docs)")
    for name, rows in (("train.jsonl", train), ("queries.jsonl", queries)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_tokenizer([r["text"] if "text" in r else texts([r])[0] for r in train + queries], cfg.vocab)
    tokenizer.save_pretrained(files[2])
    return train, queries, tokenizer


def make_model(cfg: Config, vocab: int, device: str):
    sizes = (
        {"intermediate_size": cfg.moe_intermediate}
        if cfg.family in ("gpt_oss", "olmoe", "mixtral", "granitemoe")
        else {}
    )
    return tiny_model(
        cfg.family,
        seed=cfg.seed,
        vocab_size=vocab,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_experts=cfg.experts,
        num_local_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.moe_intermediate,
        **sizes,
        num_attention_heads=cfg.heads,
        # multi-head latent attention (deepseek_v2, deepseek_v3): the zoo's head dimensions and key/value heads
        **(
            {}
            if cfg.family in ("deepseek_v2", "deepseek_v3")
            else {"num_key_value_heads": cfg.heads // 2, "head_dim": cfg.hidden // cfg.heads}
        ),
    ).to(device)


def train(cfg: Config, examples, subset: np.ndarray, order_seed: int, vocab: int, device: str, on_epoch=None):
    """A model trained from the shared initial weights on `examples[subset]`: AdamW, `epochs` passes,
    learning rate decayed linearly to 0 (so the last batches' order matters little). `on_epoch(epoch,
    model)` is called after each pass (1-based), e.g. to keep checkpoints."""
    model = make_model(cfg, vocab, device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(order_seed)
    rows = [int(i) for i in np.flatnonzero(subset)]
    steps = cfg.epochs * -(-len(rows) // cfg.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
    for epoch in range(cfg.epochs):
        rng.shuffle(rows)
        for start in range(0, len(rows), cfg.batch):
            batch = rows[start : start + cfg.batch]
            ids, mask = collate(examples, batch)
            labels = labels_for(examples, batch, ids, mask)
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = example_losses(logits, labels).sum() / (labels[:, 1:] != -100).sum()
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if on_epoch is not None:
            on_epoch(epoch + 1, model)
    return model.eval(), opt


@torch.no_grad()
def query_losses(model, queries, device: str) -> np.ndarray:
    positions = list(range(len(queries)))
    ids, mask = collate(queries, positions)
    labels = labels_for(queries, positions, ids, mask)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    return example_losses(out, labels.to(device)).cpu().numpy()


def _train_one(args) -> None:
    """Train one subset model and save its query losses to `path` (a finished model is never retrained)."""
    cfg, examples, queries, subset, order_seed, vocab, device, path = args
    torch.set_num_threads(1)
    losses = query_losses(train(cfg, examples, subset, order_seed, vocab, device)[0], queries, device)
    np.save(path.with_suffix(".tmp.npy"), losses)
    path.with_suffix(".tmp.npy").replace(path)


def subset_losses(cfg: Config, examples, queries, vocab: int, device: str, workers: int, parts: Path):
    """Subsets `[M, N]` and query losses `[M, Q]` for two data orders (LDS and test-retest). Each finished
    model's losses are kept in `parts/`, so an interrupted run continues where it stopped."""
    rng = np.random.default_rng(cfg.seed + 1)
    n = len(examples)
    subsets = np.zeros((cfg.models, n), dtype=bool)
    for m in range(cfg.models):
        subsets[m, rng.choice(n, n // 2, replace=False)] = True
    parts.mkdir(parents=True, exist_ok=True)
    path = {(o, m): parts / f"order{o}-model{m}.npy" for o in (0, 1) for m in range(cfg.models)}
    jobs = [(cfg, examples, queries, subsets[m], 10_000 * (o + 1) + m, vocab, device, p)
            for (o, m), p in path.items() if not p.exists()]  # fmt: skip
    if len(jobs) < len(path):
        print(f"lds: {len(path) - len(jobs)} of {len(path)} subset models already trained ({parts})")
    if workers > 1 and jobs:
        import multiprocessing as mp

        with mp.get_context("fork" if device == "cpu" else "spawn").Pool(workers) as pool:
            for done, _ in enumerate(pool.imap_unordered(_train_one, jobs), 1):
                if done % 50 == 0:
                    print(f"lds: {done}/{len(jobs)} subset models trained", flush=True)
    else:
        for job in jobs:
            _train_one(job)
    losses = [np.stack([np.load(path[o, m]) for m in range(cfg.models)]) for o in (0, 1)]
    return subsets, losses[0], losses[1]


# -- LDS ----------------------------------------------------------------------------------------
def spearman_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of each row of `a` with the same row of `b` (`[Q, M]` each)."""
    ra = a.argsort(1).argsort(1).astype(np.float64)
    rb = b.argsort(1).argsort(1).astype(np.float64)
    ra -= ra.mean(1, keepdims=True)
    rb -= rb.mean(1, keepdims=True)
    return (ra * rb).sum(1) / np.sqrt((ra**2).sum(1) * (rb**2).sum(1)).clip(1e-30)


def per_query_lds(scores: np.ndarray, subsets: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """`[Q]` Spearman between predicted (`-scores @ subsets^T`) and actual subset losses."""
    predicted = -(scores.astype(np.float64) @ subsets.T.astype(np.float64))  # [Q, M]
    return spearman_rows(predicted, losses.T)


def bootstrap(values: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (reps, len(values)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


# -- attribution variants -----------------------------------------------------------------------
GROUPS = ("attention", "experts", "routers", "lm_head")


def groups(model) -> dict[str, str]:
    """Module-group globs over index block names; the routers' from discovery (`mlp.gate`, gpt_oss's `mlp.router`,
    granitemoe's `block_sparse_moe.router`). A dense shared expert (qwen2_moe) is in no group."""
    routers = ma.discover(model, track_moe_experts=True, warn=False).routers
    router = ".".join(routers[0].split(".")[-2:]) if routers else "mlp.gate"
    return {
        "attention": "*.self_attn.*",
        "experts": "*.experts.*",
        "routers": f"*.{router}.*",
        "lm_head": "lm_head.*",
    }


OUT = DEFAULT_OUTPUT_PROJECTION_DIM  # the output layer's own p in `Attribution` unless given


class Attribution:
    """Indexes, factors and query rows of the full model, built once per setting through the public API."""

    def __init__(self, model, examples, queries, root: Path, device: str, optimizer_state: Path):
        self.model, self.examples, self.queries, self.root = model, examples, queries, root
        self.device, self.optimizer_state = device, optimizer_state  # where scores are computed
        self.cache: dict = {}

    def get(self, p: int | None, tracked: bool = True, opt: bool = False, kind: str = PROJECTION, out=OUT):
        """Index, query rows and rows at p (`out`: the output layer's own p; the library's default)."""
        key = (p, tracked, opt, kind, out)
        if key not in self.cache:
            path = self.root / f"index-{p}-{tracked}-{opt}-{kind}-{out}"
            ma.build_index(self.model, self.examples, path, projection_dim=p, track_moe_experts=tracked,
                           optimizer_state=str(self.optimizer_state) if opt else None, projection=kind,
                           output_projection_dim=out, progress=False)  # fmt: skip
            index = ma.load_index(path)
            q = ma.query_gradients(self.model, self.queries, index)
            self.cache[key] = (index, q, np.asarray(index.gradients))
        return self.cache[key]

    def ekfac(
        self,
        p: int | None,
        tracked: bool = True,
        sampled: bool | None = None,
        damping=None,
        scope=None,
        fold=None,
        kind: str = PROJECTION,
        out=OUT,
    ):
        """Factors fitted with the library's defaults except where given; damping re-applied without refitting."""
        key = ("ekfac", p, tracked, sampled, fold, kind, out)
        if key not in self.cache:
            kwargs = {} if sampled is None else {"sampled_labels": sampled}
            if fold is not None:
                kwargs["fold_bias"] = fold
            self.cache[key] = ma.fit_ekfac(self.model, self.examples, projection_dim=p, track_moe_experts=tracked,
                                           projection=kind, output_projection_dim=out, progress=False,
                                           **kwargs)  # fmt: skip
        ek = self.cache[key]
        if damping is not None or scope is not None:
            ek = ek.with_damping(DEFAULT_DAMPING if damping is None else damping, scope or DEFAULT_DAMPING_SCOPE)
        return ek

    def scores(
        self,
        p=None,
        tracked=True,
        opt=False,
        ekfac=None,
        unit=False,
        group=None,
        per_module_unit=False,
        kind=PROJECTION,
        coupling="auto",
        balance="auto",
        out=OUT,
    ):
        index, q, rows = self.get(p, tracked, opt, kind, out)
        modules = groups(self.model)[group] if group else None
        if not per_module_unit:
            return ma.score_matrix(
                index, q, ekfac=ekfac, unit_normalize=unit, modules=modules, coupling=coupling, balance=balance,
                device=self.device,
            )  # fmt: skip
        pre = ma.prepare_queries(index, q, ekfac=ekfac).double().numpy()
        total = np.zeros((pre.shape[0], rows.shape[0]))
        for b in index.blocks:  # every module block normalised to unit norm on both sides, then summed
            qa, ra = pre[:, b.start : b.stop], rows[:, b.start : b.stop].astype(np.float64)
            total += _unit(qa) @ _unit(ra).T
        return total


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-30)


def variants(att: Attribution, ps: list[int]) -> dict[str, np.ndarray]:
    """Score matrices `[Q, N]` of every variant, by name; the first is the documented default pipeline."""
    v: dict[str, np.ndarray] = {}
    p0, unit0 = DEFAULT_PROJECTION_DIM, DEFAULT_UNIT_NORMALIZE
    ek = att.ekfac(p0)
    v[f"default pipeline (p={p0}, experts tracked, EK-FAC)"] = att.scores(p0, ekfac=ek, unit=unit0)
    v1 = {"kind": PROJECTION_V1}  # every side projected to p, narrow ones too (the default before issue 11)
    v[f"default pipeline, v1 projection (every side to p={p0})"] = att.scores(
        p0, ekfac=att.ekfac(p0, **v1), unit=unit0, **v1
    )
    v[f"default pipeline, no output balance (p={p0})"] = att.scores(p0, ekfac=ek, unit=unit0, balance=None)
    v[f"default pipeline, no coupling (p={p0})"] = att.scores(p0, ekfac=ek, unit=unit0, coupling=None)
    v[f"default pipeline, neither coupling nor balance (p={p0})"] = att.scores(
        p0, ekfac=ek, unit=unit0, coupling=None, balance=None
    )
    v[f"default pipeline, not tracked (p={p0})"] = att.scores(
        p0, tracked=False, ekfac=att.ekfac(p0, tracked=False), unit=unit0
    )
    ek_exact = att.ekfac(None)
    v["exact rows, otherwise default"] = att.scores(None, ekfac=ek_exact, unit=unit0)
    v["exact rows, no output balance"] = att.scores(None, ekfac=ek_exact, unit=unit0, balance=None)
    v["exact rows, no coupling"] = att.scores(None, ekfac=ek_exact, unit=unit0, coupling=None)
    v["exact, not tracked, EK-FAC"] = att.scores(None, tracked=False, ekfac=att.ekfac(None, tracked=False), unit=unit0)
    v["exact, no preconditioning"] = att.scores(None)
    v["exact, no preconditioning, cosine"] = att.scores(None, unit=True)
    v[f"exact, EK-FAC, unit_normalize={not unit0}"] = att.scores(None, ekfac=ek_exact, unit=not unit0)
    for group in GROUPS:
        v[f"exact, {group} alone, EK-FAC"] = att.scores(None, ekfac=ek_exact, group=group, unit=unit0)
        v[f"exact, {group} alone, EK-FAC, no coupling"] = att.scores(
            None, ekfac=ek_exact, group=group, unit=unit0, coupling=None
        )
        v[f"exact, {group} alone, no preconditioning"] = att.scores(None, group=group, unit=unit0)
    for group in GROUPS:  # what `score --modules` gives on the default index: like for like with the default
        v[f"p={p0}, {group} alone, EK-FAC (the default index, --modules)"] = att.scores(
            p0, ekfac=ek, group=group, unit=unit0
        )
    for p in ps:
        v[f"projected p={p}, EK-FAC"] = att.scores(p, ekfac=att.ekfac(p), unit=unit0)
    for p in ps:
        v[f"projected p={p}, v1 projection, EK-FAC"] = att.scores(p, ekfac=att.ekfac(p, **v1), unit=unit0, **v1)
    for sampled in (False, True):
        fisher = "sampled-label" if sampled else "empirical"
        for scope in DAMPING_SCOPES:
            for d in (1e-3, 0.1, 1.0, 10.0):
                ek = att.ekfac(None, sampled=sampled, damping=d, scope=scope)  # as measured before the coupling
                v[f"exact, {fisher} Fisher, damping {d:g} x mean over {scope}, no coupling"] = att.scores(
                    None, ekfac=ek, unit=unit0, coupling=None, balance=None
                )
    v["exact, EK-FAC, per-module unit norm"] = att.scores(None, ekfac=ek_exact, per_module_unit=True)
    v["exact, no preconditioning, per-module unit norm"] = att.scores(None, per_module_unit=True)
    if any(name.endswith((".bias", "_bias")) for name, _ in att.model.named_parameters()):  # bias folding
        v[f"default pipeline, biases not folded (p={p0})"] = att.scores(p0, ekfac=att.ekfac(p0, fold=False), unit=unit0)
        v["exact rows, biases not folded"] = att.scores(None, ekfac=att.ekfac(None, fold=False), unit=unit0)
    v["TrackStar: Adam-normalised, unit"] = att.scores(None, opt=True, unit=True)
    v[f"TrackStar: Adam-normalised p={p0}, unit"] = att.scores(p0, opt=True, unit=True)
    return v


LATER_FIELDS = ("family", "shared_vocab", "corpus", "plain_text", "vocab", "chunks_per_domain", "words")


def core_variants(att: Attribution) -> dict[str, np.ndarray]:
    """The rows docs/quality.md reports for every configuration (`--core`): the default pipeline, the same
    untracked, exact rows, each module group alone through the default index and `lm_head` alone on exact rows."""
    p0, unit0 = DEFAULT_PROJECTION_DIM, DEFAULT_UNIT_NORMALIZE
    ek = att.ekfac(p0)
    v = {f"default pipeline (p={p0}, experts tracked, EK-FAC)": att.scores(p0, ekfac=ek, unit=unit0)}
    v[f"default pipeline, not tracked (p={p0})"] = att.scores(
        p0, tracked=False, ekfac=att.ekfac(p0, tracked=False), unit=unit0
    )
    ek_exact = att.ekfac(None)
    v["exact rows, otherwise default"] = att.scores(None, ekfac=ek_exact, unit=unit0)
    for group in GROUPS:
        v[f"p={p0}, {group} alone, EK-FAC (the default index, --modules)"] = att.scores(
            p0, ekfac=ek, group=group, unit=unit0
        )
    v["exact, lm_head alone, EK-FAC"] = att.scores(None, ekfac=ek_exact, group="lm_head", unit=unit0)
    return v


def cache_dir(name: str, root: Path) -> Path:
    """Where configuration `name` caches its corpus, subset losses and full model (keyed by its settings)."""
    fields = asdict(CONFIGS[name])
    for later in LATER_FIELDS:  # at their defaults, fields added after a cache was made leave its key unchanged
        if fields[later] == getattr(Config, later):
            del fields[later]
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return root / f"lds-{name}-{key}"


GROUND_TRUTH = ROOT / "benchmarks" / "ground_truth"
# what a configuration's retrained subset models leave, tracked in git (`GROUND_TRUTH/<cache dir's name>/`): the
# corpus and tokenizer the models saw and their query losses. A fresh clone restores them into the cache and trains
# only the full model (seconds to a minute) instead of every subset model (minutes to an hour per configuration).
GROUND_TRUTH_FILES = (
    "train.jsonl",
    "queries.jsonl",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "subset_losses.npz",
)


def _copy_ground_truth(source: Path, target: Path) -> None:
    """Copy each of `GROUND_TRUTH_FILES` that `source` has and `target` lacks (a file already there is kept)."""
    import shutil

    for name in GROUND_TRUTH_FILES:
        src, dst = source / name, target / name
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def restore_ground_truth(cache: Path) -> bool:
    """Copy the tracked ground truth of the configuration cached at `cache` into it, where the cache lacks it;
    True when the cache then holds the subset losses."""
    _copy_ground_truth(GROUND_TRUTH / cache.name, cache)
    return (cache / "subset_losses.npz").exists()


def keep_ground_truth(cache: Path) -> Path:
    """Copy the configuration's corpus, tokenizer and subset losses from `cache` into the tracked ground truth
    (files already kept are left as they are: the tracked copy is the reference)."""
    _copy_ground_truth(cache, GROUND_TRUTH / cache.name)
    return GROUND_TRUTH / cache.name


@dataclass
class Cached:
    """What `lds.py` left for a configuration, as the attribution scripts read it back."""

    name: str
    dir: Path
    subsets: np.ndarray
    losses: np.ndarray
    tokenizer: object
    examples: list
    queries: list
    domains: list[str]

    @property
    def title(self) -> str:
        return f"{self.name} ({len(self.queries)} queries, {len(self.subsets)} subset models)"

    def model(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.dir / "full-model").eval()


def load_cached(name: str, root: Path) -> Cached:
    """The cached subset losses, tokenizer, data and query domains of configuration `name`; a clear
    exit when `python benchmarks/lds.py --config NAME` has not run yet."""
    from transformers import AutoTokenizer

    c = cache_dir(name, root)
    if not restore_ground_truth(c):
        raise SystemExit(f"{c}: no cached subset losses; run `python benchmarks/lds.py --config {name}` first")
    if not (c / "full-model").exists():
        raise SystemExit(
            f"{c}: subset losses restored from {GROUND_TRUTH / c.name}, but no full model; run "
            f"`python benchmarks/lds.py --config {name} --train_only` (it trains the full model alone) first"
        )
    saved = np.load(c / "subset_losses.npz")
    tokenizer = AutoTokenizer.from_pretrained(c / "full-model")
    examples = load_examples(str(c / "train.jsonl"), tokenizer)
    queries = load_examples(str(c / "queries.jsonl"), tokenizer)
    domains = [json.loads(line)["domain"] for line in (c / "queries.jsonl").read_text().splitlines()]
    return Cached(name, c, saved["subsets"], saved["losses"], tokenizer, examples, queries, domains)


def cached_configs_parser(description: str) -> argparse.ArgumentParser:
    """The command line of the scripts that read `lds.py`'s caches: the configurations and the cache."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("configs", nargs="+", choices=sorted(CONFIGS))
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / ".cache"))
    return parser


def accumulate(path: Path, configs: list[str], run_one) -> dict[str, dict[str, np.ndarray]]:
    """Per-query LDS of each configuration in `configs` (`run_one(name) -> {label: values}`), saved into
    the `.npz` at `path` after each one and merged with what other runs saved there meanwhile; returns
    every configuration's values in the file as `{config: {label: values}}` (what the summaries read)."""
    saved = dict(np.load(path).items()) if path.exists() else {}
    for name in configs:
        for label, values in run_one(name).items():
            saved[f"{name}|{label}"] = values
        if path.exists():
            saved = {**dict(np.load(path).items()), **{k: v for k, v in saved.items() if k.startswith(f"{name}|")}}
        np.savez(path, **saved)
    per_config: dict[str, dict[str, np.ndarray]] = {}
    for key, values in saved.items():
        name, label = key.split("|")
        per_config.setdefault(name, {})[label] = values
    return per_config


def print_variants(title: str, variants: dict[str, np.ndarray], domains: list[str], against: str, width: int) -> None:
    """Per-query LDS of each variant: its mean, the paired bootstrap CI of its difference to the first
    variant (`this - {against}`) and its per-domain means (what lds_groups.py and lds_checkpoints.py print)."""
    base = next(iter(variants.values()))
    print(f"== {title}")
    for label, values in variants.items():
        lo, hi = bootstrap(values - base)
        per = " ".join(
            f"{d}={np.mean([v for v, dd in zip(values, domains, strict=True) if dd == d]):.3f}"
            for d in sorted(set(domains))
        )
        print(f"  {label:{width}s} {values.mean():.3f}  this - {against} [{lo:+.3f}, {hi:+.3f}]  {per}", flush=True)


def markdown(result: dict) -> str:
    """The variants of one result file as a Markdown table (what docs/quality.md shows)."""
    domains = sorted(next(iter(result["per_domain"].values())))
    lines = [
        "| variant | LDS | 95% CI | default - this (95% CI) | " + " | ".join(domains) + " |",
        "|---|---|---|---|" + "---|" * len(domains),
    ]
    for name, r in result["variants"].items():
        lo, hi = r["ci95"]
        dlo, dhi = r["default_minus_this_ci95"]
        per = " | ".join(f"{result['per_domain'][name][d]:.3f}" for d in domains)
        lines.append(f"| {name} | {r['lds']:.3f} | [{lo:.3f}, {hi:.3f}] | [{dlo:+.3f}, {dhi:+.3f}] | {per} |")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2, help="CPU processes training subset models")
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / ".cache"))
    parser.add_argument("--projections", default="8,16,32,64")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/lds-<config>.json")
    parser.add_argument("--markdown", default=None, help="print a result file as a Markdown table and exit")
    parser.add_argument("--train_only", action="store_true", help="train and cache the models, then exit")
    parser.add_argument("--no_keep", action="store_true", help=f"do not copy the subset losses, corpus and "
                        f"tokenizer into {GROUND_TRUTH.relative_to(ROOT)}/ (tracked)")  # fmt: skip
    parser.add_argument("--core", action="store_true", help="only the rows reported for every configuration")
    parser.add_argument("--score_device", default=None, help="where scores are computed (default: --device; cpu for "
                        "exact rows too wide for the GPU's coupling sample)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    cfg = CONFIGS[args.config]
    torch.set_num_threads(max(1, args.workers))
    cache = cache_dir(args.config, Path(args.cache))
    cache.mkdir(parents=True, exist_ok=True)
    restore_ground_truth(cache)
    t0 = time.perf_counter()
    train_records, query_records, tokenizer = corpus(cfg, cache)
    examples = load_examples(str(cache / "train.jsonl"), tokenizer)
    queries = load_examples(str(cache / "queries.jsonl"), tokenizer)
    vocab = len(tokenizer)
    losses_file = cache / "subset_losses.npz"
    if losses_file.exists():
        saved = np.load(losses_file)
        subsets, losses, retest = saved["subsets"], saved["losses"], saved["retest"]
        train_seconds = float(saved["seconds"])
        print(f"lds: cached subset losses from {losses_file}")
    else:
        print(f"lds: training {2 * cfg.models} subset models ({len(examples)} examples, {cfg.epochs} epochs) ...")
        subsets, losses, retest = subset_losses(
            cfg, examples, queries, vocab, args.device, args.workers, cache / "subset-parts"
        )
        train_seconds = time.perf_counter() - t0
        np.savez(losses_file, subsets=subsets, losses=losses, retest=retest, seconds=train_seconds)
    if not args.no_keep:
        print(f"lds: ground truth kept in {keep_ground_truth(cache)} (commit it)")
    model_dir = cache / "full-model"
    if not model_dir.exists():
        torch.set_num_threads(max(1, args.workers))
        model, opt = train(cfg, examples, np.ones(len(examples), bool), 0, vocab, args.device)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        torch.save(opt.state_dict(), model_dir / "optimizer.pt")
    if args.train_only:
        print(f"lds: cached {cache}")
        return 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(args.device).eval()
    t1 = time.perf_counter()
    ps = [int(p) for p in args.projections.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        score_device = args.score_device or args.device
        att = Attribution(model, examples, queries, Path(tmp), score_device, model_dir / "optimizer.pt")
        scores = core_variants(att) if args.core else variants(att, ps)
    rng = np.random.default_rng(0)
    scores["random scores"] = rng.standard_normal(next(iter(scores.values())).shape)
    per_query = {name: per_query_lds(s, subsets, losses) for name, s in scores.items()}
    per_query["test-retest (same subsets, another data order)"] = spearman_rows(losses.T, retest.T)
    default = next(iter(per_query))
    rows = {}
    for name, values in per_query.items():
        lo, hi = bootstrap(values)
        dlo, dhi = bootstrap(per_query[default] - values)
        rows[name] = {
            "lds": float(values.mean()),
            "ci95": [lo, hi],
            "default_minus_this_ci95": [dlo, dhi],
            "per_query": values.tolist(),  # for the paired CIs of means over configurations (lds_summary.py)
        }
    attribution_seconds = time.perf_counter() - t1
    domains = [r["domain"] for r in query_records]
    result = {
        "config": args.config,
        "settings": asdict(cfg),
        "core": args.core,  # only core_variants
        "examples": len(examples),
        "queries": len(queries),
        "device": args.device,
        "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "train_seconds": train_seconds,
        "attribution_seconds": attribution_seconds,
        "per_domain": {
            name: {
                d: float(np.mean([v for v, dd in zip(vals, domains, strict=True) if dd == d]))
                for d in sorted(set(domains))
            }
            for name, vals in per_query.items()
        },
        "variants": rows,
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"lds-{args.config}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nLDS over {len(queries)} queries, {cfg.models} subset models ({len(examples)} training examples):")
    print(f"  {'variant':58s} {'LDS':>7s}  {'95% CI':>17s}  {'default - this (95% CI)':>24s}")
    for name, r in rows.items():
        lo, hi = r["ci95"]
        dlo, dhi = r["default_minus_this_ci95"]
        print(f"  {name:58s} {r['lds']:7.3f}  [{lo:6.3f}, {hi:6.3f}]  [{dlo:+7.3f}, {dhi:+7.3f}]")
    print(f"\ntraining {train_seconds:.0f} s (cached: 0 on rerun), attribution {attribution_seconds:.0f} s; -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
