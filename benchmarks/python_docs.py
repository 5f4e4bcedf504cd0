"""A real-text language-modelling corpus from text that ships with Python, for the LDS benchmark.

Three domains, each cut into chunks of `words` consecutive words (plain-text rows: the loss is on
every token):

- `reference`: the language reference as `pydoc` shows it (`pydoc_data.topics`);
- `text`: the docstrings of the standard library's text and data modules (`re`, `json`, `csv`, ...);
- `system`: the docstrings of its system and concurrency modules (`os`, `subprocess`, `threading`, ...).

Queries are held-out chunks of the same domains (loss on every token too). The text depends on the
Python version that generates it, so `lds.py` writes the corpus into its cache once and reads it back
from there (a cache made by one Python is scored by another unchanged).
"""

from __future__ import annotations

import importlib
import inspect
import random

TEXT_MODULES = ("re", "json", "csv", "string", "textwrap", "difflib", "html", "base64", "struct", "codecs",
                "unicodedata", "decimal", "fractions", "statistics", "datetime", "calendar", "collections",
                "heapq", "bisect", "itertools", "functools", "operator", "pprint", "enum", "dataclasses")  # fmt: skip
SYSTEM_MODULES = ("os", "io", "shutil", "pathlib", "glob", "tempfile", "subprocess", "signal", "socket", "select",
                  "selectors", "threading", "multiprocessing", "queue", "sched", "logging", "argparse", "zipfile",
                  "tarfile", "gzip", "sqlite3", "urllib.parse", "http.client", "email.message", "asyncio")  # fmt: skip


def docstrings(modules: tuple[str, ...]) -> list[str]:
    """The module docstring and every public function's, class's and method's docstring, in a fixed order."""
    out = []
    for name in modules:
        module = importlib.import_module(name)
        seen: set[int] = set()
        items = [module] + [getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_")]
        for obj in items:
            members = [obj]
            if inspect.isclass(obj):
                members += [vars(obj)[a] for a in sorted(vars(obj)) if not a.startswith("_")]
            for m in members:
                doc = inspect.getdoc(m) if callable(m) or inspect.ismodule(m) or inspect.isclass(m) else None
                if doc and id(doc) not in seen and len(doc.split()) >= 8:
                    seen.add(id(doc))
                    out.append(doc)
    return out


def chunks(documents: list[str], words: int) -> list[str]:
    """Consecutive `words`-word pieces of each document (a shorter tail is dropped)."""
    out = []
    for doc in documents:
        w = doc.split()
        out += [" ".join(w[i : i + words]) for i in range(0, len(w) - words + 1, words)]
    return out


def python_docs_corpus(
    train_per_domain: int, queries_per_domain: int, words: int = 40, seed: int = 0
) -> tuple[list[dict], list[dict]]:
    """Training rows `{"text", "domain"}` and held-out query rows of the same form, drawn per domain."""
    import pydoc_data.topics

    sources = {
        "reference": [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)],
        "text": docstrings(TEXT_MODULES),
        "system": docstrings(SYSTEM_MODULES),
    }
    rng = random.Random(seed)
    train: list[dict] = []
    queries: list[dict] = []
    for domain, docs in sources.items():
        pieces = chunks(docs, words)
        need = train_per_domain + queries_per_domain
        if len(pieces) < need:
            raise ValueError(f"python_docs_corpus: domain {domain!r} has {len(pieces)} chunks of {words} words, "
                             f"fewer than the {need} asked for; lower train_per_domain or words")  # fmt: skip
        rng.shuffle(pieces)
        train += [{"text": t, "domain": domain} for t in pieces[:train_per_domain]]
        queries += [{"text": t, "domain": domain} for t in pieces[train_per_domain:need]]
    return train, queries
