"""Output-layer balance: the output layer's vote counted as much as the rest of the model's.

A whole-model score sums every module block's part. Preconditioned and coupled, the blocks that
are many (attention and experts in every layer) still decide most of the ranking, and the output
layer, one block, adds a small share, although on its own it ranks training rows about as well
as the whole model or better (docs/quality.md). The balance scores each query with the sum of two
prepared queries, the whole model's `a` (EK-FAC, coupling, unit norm: what `score` uses without
it) and the output layer's `o` (its columns only, EK-FAC, its own coupling, unit norm), each
divided by the spread of its scores over the index's rows:

    q = a / sigma_a + o / sigma_o        (rescaled to the norm of `a`)

so that each votes with unit spread. With `whole="rest"` (`BALANCE_WHOLE`) `a` has the output layer's columns
zeroed: the output layer then votes once, through `o`, whatever share of each row's norm its kept columns take
(which an eigenbasis index's output floor shape changes: docs/build.md). `sigma_x` is the standard deviation of
`x . g` over `s` sampled index rows `g` as they are scored (unit-normalised with `unit_normalize`). It is a query
transform: the index is read as it is, rows keep their own norm, and a score's per-module parts
still add up to it (the output layer's part then carries its extra vote).

On the LDS benchmark it raised the default on five of six configurations and lowered none, most
where the whole model ranked below the output layer alone (docs/quality.md#output-layer-balance).
"""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass

import torch

from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.curvature.precondition import OUTPUT_LAYER, ScoreError, check_fitted, module_columns
from moe_attrib.indexing.index import Index
from moe_attrib.scoring.coupling import Coupling, ekfac_identity, fit_coupling, memory_available, sampled_rows

DEFAULT_BALANCE_SAMPLE = 256  # rows the spreads are measured on
BALANCE_WHOLES = ("model", "rest")  # the whole-model vote: every column, or every column but the output layer's
BALANCE_WHOLE = "model"


@dataclass
class Balance:
    """What balancing one index's scores needs: the output layer's columns, its own coupling, and
    the sampled rows (`[s, columns]`, as scored, kept on the host) the spreads are measured on.

    `settings` says what it was fitted for (and, as `"whole"`, the whole-model vote's columns, `BALANCE_WHOLES`);
    `resolve_balance` refuses queries prepared any other way."""

    columns: torch.Tensor
    coupling: Coupling | None
    rows: torch.Tensor
    settings: dict

    def apply(self, whole: torch.Tensor, preconditioned: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """Balanced query rows from the whole model's prepared rows `whole` (coupled, unit-normalised
        as scored) and `preconditioned` (EK-FAC applied, nothing else), on `whole`'s device; `weight` scales
        the output layer's unit-spread vote (1: an equal vote)."""
        output = preconditioned.to(whole.device) * self.columns.to(whole.device)
        if self.coupling is not None:
            output = self.coupling.apply(output)
        if self.settings.get("whole") == "rest":
            whole = whole * ~self.columns.to(whole.device)
        rows = self.rows.to(whole.device)
        spread_whole = (whole @ rows.T).std(dim=1, keepdim=True).clamp_min(1e-30)
        spread_output = (output @ rows.T).std(dim=1, keepdim=True).clamp_min(1e-30)
        q = whole / spread_whole + weight * output / spread_output
        return q * (whole.norm(dim=1, keepdim=True) / q.norm(dim=1, keepdim=True).clamp_min(1e-30))


def check_memory(index: Index, sample: int = DEFAULT_BALANCE_SAMPLE) -> None:
    """Refuse, before any work, a balance whose sampled rows (held on the host) would not fit there."""
    need = min(int(index.gradients.shape[0]), int(sample)) * int(index.gradients.shape[1]) * 4
    have = memory_available(torch.device("cpu"))
    if need > have:
        raise ScoreError(
            f"the output-layer balance of index {index.path} holds {need / 2**30:.1f} GiB of sampled rows on the "
            f"host, more than the {have / 2**30:.1f} GiB it may use: pass --no-output_balance (balance=None)."
        )


def has_output_layer(index: Index) -> bool:
    """Whether the index has an output-layer block and blocks besides it (else there is nothing to balance)."""
    inside = sum(fnmatch.fnmatchcase(b.name, OUTPUT_LAYER) for b in index.blocks)
    return 0 < inside < len(index.blocks)


def fit_balance(
    index: Index,
    *,
    ekfac: EKFAC | None = None,
    unit_normalize: bool = True,
    coupling: dict | Coupling | None = None,
    sample: int = DEFAULT_BALANCE_SAMPLE,
    seed: int = 0,
    whole: str | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> Balance | None:
    """Fit the balance of `index` for queries prepared with `ekfac` and `unit_normalize`; the output
    layer gets its own coupling fitted with the keyword arguments `coupling` (`fit_coupling`'s
    `gamma`, `rank`, `sample`, `seed`; `{}` its defaults, None: no coupling, as when the whole model's
    scoring has none), or the whole model's fitted `Coupling`, whose gamma, rank and sample it reuses.
    `whole`: the whole-model vote's columns, "model" (every one) or "rest" (the output layer's zeroed); None:
    `BALANCE_WHOLE`.
    None, with a warning, when the index has no output-layer block besides others; None when fewer
    than two sampled rows are finite."""
    coupling = coupling_arguments(coupling)
    whole = BALANCE_WHOLE if whole is None else whole
    if whole not in BALANCE_WHOLES:
        raise ScoreError(f"fit_balance(whole={whole!r}): pass one of {', '.join(BALANCE_WHOLES)}.")
    if not has_output_layer(index):
        warnings.warn(
            f"moe-attrib: index {index.path} has no output-layer block ({OUTPUT_LAYER}) besides other blocks; "
            "its scores are not balanced.",
            UserWarning,
            stacklevel=2,
        )
        return None
    if sample < 2:
        raise ScoreError(f"the output-layer balance needs at least 2 sampled rows (got {sample}).")
    check_memory(index, sample)
    rows = sampled_rows(index, sample, seed, mask=None, unit_normalize=unit_normalize, device=torch.device("cpu"))
    if rows.shape[0] < 2:
        return None
    output_coupling = None
    if coupling is not None:
        output_coupling = fit_coupling(
            index, ekfac=ekfac, unit_normalize=unit_normalize, modules=OUTPUT_LAYER, device=device, progress=progress,
            **coupling,
        )  # fmt: skip
    settings = {
        "modules": OUTPUT_LAYER,
        "sample": int(rows.shape[0]),
        "seed": int(seed),
        "data_fingerprint": index.manifest["settings"].get("data_fingerprint"),
        "columns": int(index.gradients.shape[1]),
        "unit_normalize": bool(unit_normalize),
        "ekfac": ekfac_identity(ekfac),
        "coupled": coupling is not None,
        "whole": whole,
    }
    return Balance(module_columns(index.blocks, OUTPUT_LAYER), output_coupling, rows, settings)


_COUPLING_ARGUMENTS = ("gamma", "rank", "sample", "seed")


def coupling_arguments(coupling: dict | Coupling | None) -> dict | None:
    """`fit_balance`'s `coupling` as `fit_coupling` keyword arguments, checked before any work: a
    fitted `Coupling` gives the gamma, rank and sample it was asked for (what `balance="auto"` uses)."""
    if coupling is None:
        return None
    if isinstance(coupling, Coupling):
        return {"gamma": coupling.settings["gamma"], **coupling.settings["requested"]}
    if not isinstance(coupling, dict):
        raise TypeError(
            f"fit_balance(coupling=...) takes fit_coupling's keyword arguments as a dict ({{}} for its defaults), "
            f"a fitted Coupling, or None; got {type(coupling).__name__}."
        )
    unknown = sorted(set(coupling) - set(_COUPLING_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"fit_balance(coupling=...): unknown keys {unknown}; the output layer's coupling takes "
            f"{list(_COUPLING_ARGUMENTS)} (its index, EK-FAC factors, unit_normalize and device are fit_balance's own)."
        )
    return dict(coupling)


def resolve_balance(
    index: Index,
    balance: Balance | str | None,
    *,
    ekfac: EKFAC | None,
    unit_normalize: bool,
    modules: str | None,
    coupling: Coupling | None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> Balance | None:
    """`"auto"`: fit with the defaults (the output layer coupled like the whole model: with
    `coupling`'s gamma, rank and sample, or not at all when `coupling` is None); None: no balance;
    a `Balance`: checked against how the queries are prepared. A score restricted to `modules` is
    never balanced: the restriction says which blocks score."""
    if balance is None or modules is not None:
        return None
    if isinstance(balance, str):
        if balance != "auto":
            raise ScoreError(f"balance={balance!r}: pass 'auto', None or a Balance from fit_balance.")
        return fit_balance(
            index, ekfac=ekfac, unit_normalize=unit_normalize, coupling=coupling, device=device, progress=progress
        )
    want = {
        "data_fingerprint": index.manifest["settings"].get("data_fingerprint"),
        "columns": int(index.gradients.shape[1]),
        "unit_normalize": bool(unit_normalize),
        "ekfac": ekfac_identity(ekfac),
        "coupled": coupling is not None,
    }
    check_fitted("the output-layer balance", balance.settings, want, "fit_balance(index, ...)")
    return balance
