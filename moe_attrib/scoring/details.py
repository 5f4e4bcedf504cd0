"""What a score result carries beyond its top-k rows: the query's expert routing and, for a token
index, every token's share of a hit example's score.

Both are computed next to `score` (same model, same index settings, same scoring transform), so
that the results file holds everything a reader or the HTML report needs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.data import Example
from moe_attrib.indexing.index import Index
from moe_attrib.scoring.balance import Balance, resolve_balance
from moe_attrib.scoring.coupling import Coupling, resolve_coupling
from moe_attrib.scoring.score import (
    DEFAULT_BALANCE,
    DEFAULT_COUPLING,
    DEFAULT_UNIT_NORMALIZE,
    query_gradients,
    score_matrix,
)


def query_expert_counts(
    model: torch.nn.Module, examples: list[Example], index: Index, *, pad_id: int = 0, token_batch_size: int = 8192
) -> np.ndarray | None:
    """Tokens each query routes to each expert, `[Q, layers, E]` in the index's `expert_layers`
    order; None for an index without expert layers. A pass of its own: when the query rows are
    needed too, `query_gradients(..., with_counts=True)` gives both from one pass."""
    return query_gradients(model, examples, index, pad_id=pad_id, token_batch_size=token_batch_size, with_counts=True)[
        1
    ]


def token_scores(
    index: Index,
    queries: torch.Tensor,
    examples: list[int],
    *,
    ekfac: EKFAC | None = None,
    unit_normalize: bool = DEFAULT_UNIT_NORMALIZE,
    modules: str | None = None,
    coupling: Coupling | str | None = DEFAULT_COUPLING,
    balance: Balance | str | None = DEFAULT_BALANCE,
) -> dict[int, np.ndarray]:
    """Scores of every query against every token row of the given example positions of a token
    index (`--attribute_tokens`): `{position: [Q, tokens]}`. Computed by `score_matrix` on a view of
    those rows, so the values are exactly the ones a ranking over the whole index would give."""
    if index.token_offsets is None:
        raise ValueError(f"{index.path} is not a token index (build --attribute_tokens): it has no token rows.")
    offsets = index.token_offsets
    positions = sorted(set(examples))
    if not positions:
        return {}
    coupling = resolve_coupling(index, coupling, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules)
    balance = resolve_balance(  # fitted on the whole index, not on the view below
        index, balance, ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, coupling=coupling
    )
    rows = np.concatenate([np.arange(offsets[p], offsets[p + 1]) for p in positions])
    view = replace(index, gradients=np.asarray(index.gradients[rows]), token_offsets=None)
    opts = dict(ekfac=ekfac, unit_normalize=unit_normalize, modules=modules, coupling=coupling, balance=balance)
    full = score_matrix(view, queries, device="cpu", **opts)
    out, start = {}, 0
    for p in positions:
        n = int(offsets[p + 1] - offsets[p])
        out[p] = full[:, start : start + n]
        start += n
    return out


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's piece of the decoded text (spaces included), so the pieces join to the text;
    token ids as strings when there is no tokenizer."""
    if tokenizer is None:
        return [str(i) for i in ids]
    pieces = []
    for n in range(len(ids)):
        window = ids[max(0, n - 6) : n]  # a few tokens of context give the piece its leading space
        before = tokenizer.decode(window, skip_special_tokens=False)
        text = tokenizer.decode([*window, ids[n]], skip_special_tokens=False)
        pieces.append(text[len(before) :] if text.startswith(before) else tokenizer.decode([ids[n]]))
    return pieces
