"""EK-FAC preconditioning of query rows and module selection, in an index's column layout.

Kept apart from scoring so that what transforms a query (`score`) and what is fitted from the
index's own rows in the same metric (`coupling`) share one implementation.
"""

from __future__ import annotations

import fnmatch
import re

import torch

from moe_attrib.collect.projection import projection_kind
from moe_attrib.curvature.eigenbasis import EigenbasisError, cell_mask, check_factors, direction_order
from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.errors import MoeAttribError
from moe_attrib.indexing.index import Block

EXPERT_BLOCK = re.compile(r"^(?P<layer>.+)\.expert_(?P<i>\d+)\.(?P<proj>[^.]+)\.(?P<key>weight|bias)$")
OUTPUT_LAYER = "lm_head.*"  # block-name glob of the output layer (Hugging Face causal LMs)
# Which eigenbasis blocks get the truncation weight `block_weight` at query time: "none" (the default), "dense"
# (every block but the experts'), "all", "output" (the output layer alone). Measured under rule heldout_s22.
BLOCK_WEIGHTS = "none"
BLOCK_WEIGHTS_CHOICES = ("none", "dense", "all", "output")


class ScoreError(MoeAttribError, ValueError):
    """Queries, index and factors that do not belong together."""


def precondition_queries(
    queries: torch.Tensor, blocks: list[Block], ekfac: EKFAC, index_settings: dict
) -> torch.Tensor:
    """Apply EK-FAC (fitted in the index's projected space) to query rows `[Q, dim]`, block by block.

    Weight blocks are preconditioned with their module's factors (an expert block with its
    expert's slice); a bias block together with its weight where the factors fold it in
    (`fit_ekfac(fold_bias=True)`), else left as it is. An eigenbasis index (`moe_attrib.curvature.eigenbasis`)
    is preconditioned elementwise (`precondition_eigen`).
    """
    if index_settings.get("eigenbasis"):
        return precondition_eigen(queries, blocks, ekfac, index_settings)
    projected = index_settings["projection_dim"] is not None
    if ekfac.projection_dim != index_settings["projection_dim"] or (projected and ekfac.seed != index_settings["seed"]):
        raise ScoreError(
            f"EK-FAC factors were fitted with projection_dim={ekfac.projection_dim}, seed={ekfac.seed} but the index "
            f"uses projection_dim={index_settings['projection_dim']}, seed={index_settings['seed']}; refit with "
            "`moe-attrib ekfac --projection_dim P --seed S` matching the index."
        )
    if projected and ekfac.output_projection_dim != index_settings.get("output_projection_dim"):
        raise ScoreError(
            f"EK-FAC factors were fitted with output_projection_dim={ekfac.output_projection_dim} but the index uses "
            f"{index_settings.get('output_projection_dim')} (None: the output layer projected like every block); "
            "refit with `moe-attrib ekfac --index DIR` (it takes the index's)."
        )
    if projected and ekfac.projection != projection_kind(index_settings):
        raise ScoreError(
            f"EK-FAC factors were fitted with projection {ekfac.projection!r} but the index uses "
            f"{projection_kind(index_settings)!r}; refit with `moe-attrib ekfac --index DIR` (it takes the index's)."
        )
    out = queries.clone().double()
    by_name = {b.name: b for b in blocks}
    for b in blocks:
        if not b.name.endswith(".weight"):
            continue
        m = EXPERT_BLOCK.match(b.name)
        factor, expert = (f"{m['layer']}.{m['proj']}", int(m["i"])) if m else (b.name[: -len(".weight")], None)
        if factor not in ekfac.factors:
            raise ScoreError(f"no EK-FAC factor for {b.name}: fit EK-FAC with the index's modules and settings.")
        f = ekfac.factors[factor]
        if f.experts and expert is None:
            raise ScoreError(
                f"{b.name} sums a layer's experts (--expert_blocks sum), which cannot be preconditioned per "
                "expert: build the index with --expert_blocks separate to use EK-FAC."
            )
        grad = out[:, b.start : b.stop].reshape(-1, *b.shape)
        bias = by_name.get(b.name[: -len(".weight")] + ".bias") if f.bias else None
        if f.bias:
            if bias is None:
                raise ScoreError(f"the EK-FAC factor of {b.name} folds a bias that the index has no block for.")
            grad = f.augment(grad, out[:, bias.start : bias.stop])
        if expert is not None:
            qr, qc = (q[expert] for q in f.rows_cols)
            lam, damp = f.lam[expert], f.damping[expert]
        else:
            (qr, qc), lam, damp = f.rows_cols, f.lam, f.damping
        qr, qc, lam = qr.to(grad.device), qc.to(grad.device), lam.to(grad.device)
        rotated = qr.T @ grad @ qc
        result = qr @ (rotated / (lam + damp.to(grad.device))) @ qc.T
        if bias is not None:
            result, out[:, bias.start : bias.stop] = f.split(result)
        out[:, b.start : b.stop] = result.reshape(grad.shape[0], -1)
    return out.float()


def precondition_eigen(queries: torch.Tensor, blocks: list[Block], ekfac: EKFAC, index_settings: dict) -> torch.Tensor:
    """EK-FAC preconditioning of query rows `[Q, dim]` of an eigenbasis index: each column, one
    eigen-direction pair (i, j) of one block, divided by `Lambda[i, j] + damping` of that block's
    factor (the factors the index was built with, `check_factors`; re-damped ones allowed).
    `blocks`: the index blocks to precondition (others are left as they are)."""
    try:
        check_factors(index_settings, ekfac)
    except EigenbasisError as err:
        raise ScoreError(str(err)) from err
    scale = torch.ones(queries.shape[1], dtype=torch.float64)
    for b in blocks:
        scale[b.start : b.stop] = eigen_denominators(b, ekfac) / block_weight(b, ekfac)
    return (queries.double() / scale.to(queries.device)).float()


def _block_spectrum(block: Block, ekfac: EKFAC) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(Lambda, damping, kept)` of an eigenbasis block's factor (its expert's, for an expert block; float64):
    every direction pair's corrected eigenvalue, and the kept pairs' eigenvalues flattened as the block's columns."""
    m = EXPERT_BLOCK.match(block.name)
    factor, expert = (f"{m['layer']}.{m['proj']}", int(m["i"])) if m else (block.name[: -len(".weight")], None)
    f = ekfac.factors.get(factor)
    if f is None:
        raise ScoreError(
            f"no EK-FAC factor for the index block {block.name}: score with the factors it was built from."
        )
    rows, cols = direction_order(f)
    lam, damp = f.lam.detach().double().cpu(), f.damping.detach().double().cpu()
    if expert is not None:
        rows, cols, lam, damp = rows[expert], cols[expert], lam[expert], damp[expert]
    kr, kc = block.shape[:2]
    return lam, damp, lam[rows[:kr]][:, cols[:kc]][cell_mask(tuple(block.shape))]


def eigen_denominators(block: Block, ekfac: EKFAC) -> torch.Tensor:
    """`Lambda + damping` of the directions kept in an eigenbasis block, flattened as its columns (float64)."""
    _, damp, kept = _block_spectrum(block, ekfac)
    return kept + damp


def block_weight(block: Block, ekfac: EKFAC, which: str | None = None) -> float:
    """The truncation weight of an eigenbasis block under `which` (`BLOCK_WEIGHTS` when None; 1 for a block it
    leaves out): `r = sum_all lambda / (lambda + d) / sum_kept lambda / (lambda + d)`. A direction pair holds
    `lambda = E[g_ij^2]`, so a block's part of the preconditioned inner product `g' P g` between two rows is
    `sum_kept lambda / (lambda + d)` in expectation, against `sum_all` for exact rows; multiplying the block's
    preconditioned query columns by `r` gives it the exact rows' expected weight in the whole-model vote."""
    which = BLOCK_WEIGHTS if which is None else which
    if which not in BLOCK_WEIGHTS_CHOICES:
        raise ValueError(f"block weights {which!r}: one of {BLOCK_WEIGHTS_CHOICES}")
    expert = EXPERT_BLOCK.match(block.name) is not None
    output = fnmatch.fnmatchcase(block.name, OUTPUT_LAYER)
    if which == "none" or (which == "dense" and expert) or (which == "output" and not output):
        return 1.0
    lam, damp, kept = _block_spectrum(block, ekfac)
    held = float((kept / (kept + damp)).sum())
    return float((lam / (lam + damp)).sum()) / held if held > 0 else 1.0


def check_fitted(what: str, settings: dict, want: dict, refit: str) -> None:
    """Refuse something fitted from an index (`settings`) for queries prepared another way (`want`):
    a `ScoreError` naming the first setting that differs and how to fit it again (`refit`)."""
    for key, value in want.items():
        if settings.get(key) != value:
            raise ScoreError(
                f"{what} was fitted with {key}={settings.get(key)!r} but these queries are scored with "
                f"{key}={value!r}; fit it again with {refit} for this scoring."
            )


def module_blocks(blocks: list[Block], modules: str | None) -> list[Block]:
    """The blocks a `modules` restriction needs preconditioned: those matching the glob and the
    weight or bias block of the same module (a folded bias is preconditioned with its weight).
    Columns of other blocks are masked out afterwards, so leaving them out saves their work."""
    if modules is None:
        return blocks
    stems = {b.name.rsplit(".", 1)[0] for b in blocks if fnmatch.fnmatchcase(b.name, modules)}
    return [b for b in blocks if b.name.rsplit(".", 1)[0] in stems]


def module_columns(blocks: list[Block], modules: str | None) -> torch.Tensor | None:
    """Boolean column mask of the blocks whose name matches the glob `modules` (None: every column).

    Block names are parameter names (`model.layers.0.mlp.experts.expert_3.down_proj.weight`), so
    `*.experts.*` selects every expert, `lm_head.*` the output layer, `*.self_attn.*` attention.
    """
    if modules is None:
        return None
    mask = torch.zeros(blocks[-1].stop, dtype=torch.bool)
    for b in blocks:
        if fnmatch.fnmatchcase(b.name, modules):
            mask[b.start : b.stop] = True
    if not mask.any():
        raise ScoreError(f"--modules {modules!r} matches no block of the index (e.g. {blocks[0].name}).")
    return mask
