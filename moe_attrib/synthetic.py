"""Synthetic multi-domain prompt/completion corpora, generated offline, for the demo and the LDS benchmark.

Three domains with disjoint vocabularies, so that a MoE's routers send them to different experts:
facts about made-up people (answers shared across many people, so the answer token alone does not
identify the source), modular arithmetic and sequence reversal. Every record is a
`{"prompt", "completion", "domain"}` dict; queries also carry `source` (the training row that
states the same fact) where there is one.
"""

from __future__ import annotations

import random

SYLLABLES = ["ka", "lo", "mi", "ru", "ze", "to", "va", "ne", "shi", "po", "ga", "di", "fu", "xe", "bo", "qui"]
VALUES = {
    "colour": ["teal", "amber", "crimson", "ivory", "olive", "violet"],
    "city": ["Velmora", "Ostrin", "Caldera", "Pyxis", "Marrow", "Tessel"],
    "job": ["baker", "pilot", "weaver", "chemist", "sculptor", "glazier"],
}
STATEMENTS = {
    "colour": "The favourite colour of {p} is",
    "city": "{p} was born in the town of",
    "job": "By trade {p} works as a",
}
QUESTIONS = {
    "colour": "Which colour does {p} love most ?",
    "city": "Where is the birthplace of {p} ?",
    "job": "What does {p} do for a living ?",
}
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
LETTERS = list("abcdefgh")


def _people(n: int, rng: random.Random) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize())
    return sorted(names)


def multi_domain_corpus(
    people: int = 40,
    arithmetic: int = 72,
    sequences: int = 64,
    queries_per_domain: int = 16,
    seed: int = 0,
    fact_queries: str = "question",
    fact_query_count: int | None = None,
    shared_vocab: bool = False,
) -> tuple[list[dict], list[dict]]:
    """Training records and held-out queries over three domains.

    facts: one statement per (person, relation); a query asks the same fact, as a question
    (`fact_queries="question"`, a paraphrase) or as the statement itself (`"statement"`, fact
    recall), so its source is one training row; its answer is shared by about a sixth of the people.
    `fact_query_count` (default `queries_per_domain`) sets how many facts are queried.
    arithmetic: `add three and four mod ten :` -> `seven`; queries are unseen pairs.
    sequences: `reverse a c f :` -> `f c a`; queries are unseen sequences.
    `shared_vocab=True`: every domain answers with the same ten digit words (a fact's value is a
    digit word, sequences are of digit words), so the output tokens no longer tell the domains
    apart; only the prompts do.
    """
    values = {rel: DIGITS[2 * i : 2 * i + 6] for i, rel in enumerate(VALUES)} if shared_vocab else VALUES
    symbols = DIGITS[:8] if shared_vocab else LETTERS
    rng = random.Random(seed)
    train: list[dict] = []
    facts = []
    for name in _people(people, rng):
        for rel, stmt in STATEMENTS.items():
            value = rng.choice(values[rel])
            facts.append((len(train), name, rel, value))
            train.append(
                {
                    "prompt": stmt.format(p=name),
                    "completion": f"{value} .",
                    "domain": "facts",
                    "person": name,
                    "relation": rel,
                }
            )
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    for a, b in pairs[:arithmetic]:
        train.append(_arith(a, b))
    seqs = set()
    while len(seqs) < sequences + queries_per_domain:
        seqs.add(tuple(rng.sample(symbols, rng.randint(3, 5))))
    seqs = sorted(seqs)
    rng.shuffle(seqs)
    for s in seqs[:sequences]:
        train.append(_reverse(s))
    queries = []
    for row, name, rel, value in rng.sample(facts, fact_query_count or queries_per_domain):
        prompt = (QUESTIONS if fact_queries == "question" else STATEMENTS)[rel].format(p=name)
        queries.append(
            {"prompt": prompt, "completion": value, "domain": "facts", "source": row, "person": name, "relation": rel}
        )
    for a, b in pairs[arithmetic : arithmetic + queries_per_domain]:
        queries.append(_arith(a, b))
    for s in seqs[sequences : sequences + queries_per_domain]:
        queries.append(_reverse(s))
    return train, queries


def _arith(a: int, b: int) -> dict:
    return {
        "prompt": f"add {DIGITS[a]} and {DIGITS[b]} mod ten :",
        "completion": DIGITS[(a + b) % 10],
        "domain": "arithmetic",
    }


def _reverse(seq: tuple[str, ...]) -> dict:
    return {"prompt": f"reverse {' '.join(seq)} :", "completion": " ".join(reversed(seq)), "domain": "sequences"}


def texts(records: list[dict]) -> list[str]:
    """`prompt completion` of every record (what a tokenizer is trained on)."""
    return [f"{r['prompt']} {r['completion']}" for r in records]
