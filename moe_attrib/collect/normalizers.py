"""Optimizer-state normalisation of per-example gradients, fused experts sliced per expert.

Training with Adam or Adafactor moves each parameter by `grad / sqrt(v)`; attribution that
follows the optimizer's geometry scales gradients the same way. moe-attrib never forms full
gradients, so the scaling must act on the captured rows: the second moments are used in
rank-1 (Adafactor) form `v ~ r c^T / mean(r)`, so `G / sqrt(v) = diag(1/sqrt(r)) G
diag(1/sqrt(c)) * sqrt(mean(r))` and the row scalings fold into the projection matrices.
Adafactor's factored state is used as stored; Adam's `exp_avg_sq` (bias-corrected) is reduced to
its row and column means, as bergson does. A fused `[E, a, b]` parameter gets per-expert factors.
Biases share the output-side scaling of their weight (an approximation; bias rows are the same
output-gradient rows).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from moe_attrib.collect.projection import PROJECTION, Projections
from moe_attrib.errors import MoeAttribError
from moe_attrib.model.discovery import CoverageReport, iter_entries


class OptimizerStateError(MoeAttribError, ValueError):
    """An optimizer state that does not match the model."""


def load_optimizer_state(path: str | Path, model: nn.Module) -> dict[str, dict]:
    """`{param name: state}` from a torch optimizer `state_dict()` file or an HF Trainer checkpoint dir.

    State entries are matched to `model.named_parameters()` (trainable ones, in order), which is
    how `torch.optim` and the HF Trainer number them; every shape is checked.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "optimizer.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise OptimizerStateError(f"{path}: cannot read an optimizer state ({err}).") from err
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise OptimizerStateError(f"{path}: not a torch optimizer state_dict (no 'state' / 'param_groups').")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ids = [i for g in state["param_groups"] for i in g["params"]]
    if len(ids) != len(named):
        raise OptimizerStateError(
            f"{path}: the optimizer holds {len(ids)} parameters, the model {len(named)} trainable ones."
        )
    out = {}
    for i, (name, p) in zip(sorted(ids), named, strict=True):
        entry = state["state"].get(i)
        if entry is None:
            continue
        for key in ("exp_avg_sq", "variance"):
            if key in entry and tuple(entry[key].shape) != tuple(p.shape):
                raise OptimizerStateError(f"{path}: state {i} ({key} {tuple(entry[key].shape)}) does not fit {name} "
                                          f"{tuple(p.shape)}; was the state saved for this model?")  # fmt: skip
        out[name] = entry
    return out


def rank1_second_moment(entry: dict, betas: tuple[float, float] = (0.9, 0.999)) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column factors `(r, c)` with `v ~ r c^T / mean(r)` over the last two axes."""
    if "row_var" in entry:
        r, c = entry["row_var"].squeeze(-1), entry["col_var"].squeeze(-2)
    elif "exp_avg_sq" in entry:
        v = entry["exp_avg_sq"].double()
        step = float(entry.get("step", 1))
        v = v / (1 - betas[1] ** max(step, 1))
        r, c = v.mean(dim=-1), v.mean(dim=-2)
    else:
        raise OptimizerStateError(f"no second moments in optimizer state entry (keys {sorted(entry)})")
    return r.double(), c.double()


class Normalizer:
    """Per-target row scalings; `projector(...)` plugs them into a `GradientCollector`."""

    def __init__(self, model: nn.Module, report: CoverageReport, states: dict[str, dict], eps: float = 1e-30):
        self.scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (in-side, out-side)
        names = {id(p): n for n, p in model.named_parameters()}
        for e in iter_entries(report.targets):
            if e.kind != "weight":
                continue
            name, param, transposed = e.block, e.param, e.target.transposed
            entry = states.get(names.get(id(param), ""))
            if entry is None:
                raise OptimizerStateError(f"no optimizer state for {name}'s weight")
            r, c = rank1_second_moment(entry)
            mean = r.mean(dim=-1, keepdim=True)
            s_rows, s_cols = (mean / (r + eps)).sqrt(), 1 / (c + eps).sqrt()
            s_in, s_out = (s_rows, s_cols) if transposed else (s_cols, s_rows)
            self.scales[name] = (s_in.float(), s_out.float())

    def projector(
        self, projection_dim: int | None, seed: int = 0, kind: str = PROJECTION, target_dims: dict | None = None
    ):
        """A `projector` for `GradientCollector`: scaling then (optionally) the seeded projection."""
        cache: dict = {}

        def get(name, side, features, like, batch):
            key = (name, side, like.device, like.dtype)
            if key not in cache:
                s = self.scales[name][0 if side == "in" else 1].to(like.device)
                proj = None
                if projection_dim:  # None where the kind keeps this side exact
                    proj = Projections(projection_dim, seed, like.device, torch.float32, kind, target_dims).get(
                        name, side, features, batch
                    )
                mat = s.unsqueeze(-1) * proj if proj is not None else torch.diag_embed(s)
                cache[key] = mat.to(like.dtype)
            return cache[key]

        return get
