"""EK-FAC factors for every tracked module, each expert separately, routers and dense modules.

Pass 1 accumulates, per target, the activation covariance `A = E[x x^T]` and the
output-gradient covariance `G = E[g g^T]` over real tokens; an expert's factors use only the
rows routed to it. Both are eigendecomposed in float64. Pass 2 rotates every example's gradient
into the Kronecker eigenbasis (the rotation is applied to the captured rows, so no full
per-example gradient is ever formed) and averages its squares: the corrected eigenvalues
`Lambda`. A gradient `W` (stored orientation `[rows, cols]`) is preconditioned as
`Q_r [(Q_r^T W Q_c) / (Lambda + damping)] Q_c^T`.

With `projection_dim=p` the factors live in the projected space (the covariances of the
projected rows, p x p each, or a side's own width where the projection kind keeps it exact:
`moe_attrib.collect.projection.side_width`), matching the rows of an index built with the same projection.

A module with a bias has its bias folded into the weight's factors, as Kronfluence does: the
activations get a ones column (`x' = [x, 1]`, so `A` is `(a + 1) x (a + 1)`), the bias gradient
`sum_t g_t` is the extra column of the weight gradient `sum_t g_t x'_t^T`, and weight and bias
are preconditioned together (`fold_bias=False`: the bias is left unpreconditioned).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_attrib.collect.capture import BatchInfo, CaptureRecord
from moe_attrib.collect.collector import GradientCollector
from moe_attrib.collect.loop import CollectionLoop, Progress, Step
from moe_attrib.collect.projection import (
    PROJECTION,
    Projections,
    check_kind,
    projection_kind,
    side_width,
)
from moe_attrib.data import Example, token_batches
from moe_attrib.errors import MoeAttribError
from moe_attrib.fingerprint import model_fingerprint
from moe_attrib.model.discovery import CoverageReport, discover, iter_entries
from moe_attrib.model.distributed import Dist
from moe_attrib.model.layouts import Kernels
from moe_attrib.settings import (  # noqa: F401 (re-exported)
    DAMPING_SCOPES,
    DEFAULT_DAMPING,
    DEFAULT_DAMPING_SCOPE,
    DEFAULT_FOLD_BIAS,
    DEFAULT_SAMPLED_LABELS,
    SETTINGS_VERSION,
    CollectSettings,
    EkfacSettings,
    check_version,
    output_dims,
    own_output_dim,
    resolve,
)


class FactorMemoryError(MoeAttribError, MemoryError):
    """The factors of the requested modules do not fit the memory budget."""


@dataclass
class Factor:
    """EK-FAC factors of one target (an experts projection carries a leading expert axis)."""

    name: str
    transposed: bool
    experts: int | None
    A: torch.Tensor  # [(E,) a, a] input side
    G: torch.Tensor  # [(E,) g, g] output side
    tokens: torch.Tensor  # [(E,)]
    QA: torch.Tensor | None = None
    QG: torch.Tensor | None = None
    eigA: torch.Tensor | None = None
    eigG: torch.Tensor | None = None
    lam: torch.Tensor | None = None  # [(E,) rows, cols] corrected eigenvalues, stored orientation
    examples: int = 0
    damping: torch.Tensor | None = None  # [(E,)]
    bias: bool = False  # the bias is folded in: the input side has a trailing ones column

    def augment(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The folded gradient: `weight` `[..., rows, cols]` (stored orientation) with `bias` `[..., out]`
        as the input side's extra column (a row for transposed storage)."""
        return torch.cat([weight, bias.unsqueeze(-2 if self.transposed else -1)], dim=-2 if self.transposed else -1)

    def split(self, folded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `augment`: `(weight, bias)`."""
        if self.transposed:
            return folded[..., :-1, :], folded[..., -1, :]
        return folded[..., :-1], folded[..., -1]

    @property
    def rows_cols(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eigenbases for the stored orientation's rows and columns."""
        return (self.QA, self.QG) if self.transposed else (self.QG, self.QA)

    def kfac_eigenvalues(self) -> torch.Tensor:
        """K-FAC's eigenvalues in the stored orientation, scaled to per-example gradients."""
        per_example = (self.tokens / max(self.examples, 1)).view(*self.tokens.shape, 1, 1)
        a, g = self.eigA.unsqueeze(-2), self.eigG.unsqueeze(-1)  # g x a
        lam = g * a
        lam = lam.transpose(-1, -2) if self.transposed else lam
        return lam * per_example

    def precondition(self, grad: torch.Tensor, eigenvalues: torch.Tensor | None = None) -> torch.Tensor:
        """Preconditioned gradient(s) `[..., (E,) rows, cols]` in the stored orientation."""
        qr, qc = self.rows_cols
        lam = self.lam if eigenvalues is None else eigenvalues
        damp = self.damping.view(*self.damping.shape, 1, 1)
        g = grad.to(qr.dtype)
        rotated = qr.transpose(-1, -2) @ g @ qc
        return (qr @ (rotated / (lam + damp)) @ qc.transpose(-1, -2)).to(grad.dtype)


@dataclass
class EKFAC:
    factors: dict[str, Factor] = field(default_factory=dict)
    projection_dim: int | None = None
    seed: int = 0
    settings: dict = field(default_factory=dict)

    @property
    def projection(self) -> str:
        """The projection kind the factors were fitted with (legacy when the settings predate the key)."""
        return projection_kind(self.settings)

    @property
    def output_projection_dim(self) -> int | None:
        """The output layer's own projection dimension (None: `projection_dim`, as before the key existed)."""
        return self.settings.get("output_projection_dim")

    def target_dims(self, report: CoverageReport) -> dict[str, int]:
        """The targets of `report` the factors project to their own dimension (`output_dims`)."""
        return output_dims(report.output_layer, self.projection_dim, self.output_projection_dim)

    def precondition(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return self.factors[name].precondition(grad)

    def to(self, device: str | torch.device) -> EKFAC:
        """A copy with every factor's tensors on `device` (a build's rows pass keeps only the kept eigenvectors on
        the GPU, so the full factors, 8 GB at sketch 128 on Qwen3-30B-A3B, can leave it)."""
        moved = {
            name: dataclasses.replace(f, **{k: v.to(device) for k, v in vars(f).items() if isinstance(v, torch.Tensor)})
            for name, f in self.factors.items()
        }
        return EKFAC(moved, self.projection_dim, self.seed, {**self.settings})

    def with_damping(self, damping: float, scope: str = DEFAULT_DAMPING_SCOPE) -> EKFAC:
        """A copy sharing the factors, damped with `damping x mean(Lambda)` over `scope`.

        `scope="expert"`: each expert (and each dense module) by its own mean; `"module"`: every
        expert of a fused projection by the projection's mean over all experts (an expert that
        saw few tokens is not amplified by its own tiny eigenvalues); `"model"`: one damping for
        every factor, the mean over all of them (the damped Fisher `F + lambda I` of the whole model).
        """
        out = EKFAC(dict(self.factors), self.projection_dim, self.seed, {**self.settings})
        set_damping(out.factors, damping, scope)
        out.settings.update(damping=damping, damping_scope=scope)
        return out

    def redamped(self, damping: float | None, scope: str | None) -> EKFAC:
        """`with_damping` where `damping` or `scope` is given (the other as fitted), else these factors."""
        if damping is None and scope is None:
            return self
        damping = self.settings.get("damping") if damping is None else damping
        return self.with_damping(damping, scope or self.settings.get("damping_scope", "expert"))

    def save(self, path: str | Path) -> None:
        """Write `factors.safetensors`, then `ekfac.json`, each under a temporary name renamed into place
        when complete. An earlier `ekfac.json` is removed first, so an interrupted save leaves no
        description that could pair old settings with new factors (`--ekfac` then refuses the directory)."""
        from safetensors.torch import save_file

        from moe_attrib.outputs import temporary, write_text

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "ekfac.json").unlink(missing_ok=True)
        tensors, meta = {}, {}
        for name, f in self.factors.items():
            meta[name] = {"transposed": f.transposed, "experts": f.experts, "examples": f.examples, "bias": f.bias}
            for key in ("A", "G", "tokens", "QA", "QG", "eigA", "eigG", "lam", "damping"):
                value = getattr(f, key)
                if value is not None:
                    tensors[f"{name}::{key}"] = value.contiguous().cpu()
        with temporary(path / "factors.safetensors") as tmp:
            save_file(tensors, str(tmp))
        info = {"settings_version": SETTINGS_VERSION, "projection_dim": self.projection_dim, "seed": self.seed}
        info.update(settings=self.settings, factors=meta)
        write_text(path / "ekfac.json", json.dumps(info, indent=2))


def load_ekfac(path: str | Path | list, device: str | torch.device = "cpu") -> EKFAC:
    """Load factors saved by `fit_ekfac(..., out=...)` / `moe-attrib ekfac`.

    A list of directories merges module partitions fitted separately (`--filter_modules`); they
    must share the projection settings and may not overlap.
    """
    if isinstance(path, (list, tuple)):
        parts = [load_ekfac(p, device) for p in path]
        merged = EKFAC(projection_dim=parts[0].projection_dim, seed=parts[0].seed, settings=parts[0].settings)
        for p, part in zip(path, parts, strict=True):
            key = (part.projection_dim, part.seed, part.projection, part.output_projection_dim)
            if key != (merged.projection_dim, merged.seed, merged.projection, merged.output_projection_dim):
                raise ValueError(f"{p}: projection settings differ from {path[0]}; partitions must share them.")
            overlap = set(part.factors) & set(merged.factors)
            if overlap:
                raise ValueError(f"{p}: modules fitted twice: {sorted(overlap)[:3]}")
            merged.factors.update(part.factors)
        damping = {(p.settings.get("damping"), p.settings.get("damping_scope", "expert")) for p in parts}
        if len(damping) > 1:
            raise ValueError(f"{list(path)}: partitions were fitted with different damping settings {sorted(damping)}.")
        value, scope = damping.pop()
        if value is not None and scope == "model":  # the model-wide mean is over every partition's factors
            set_damping(merged.factors, value, scope)
        return merged
    from safetensors.torch import load_file

    path = Path(path)
    try:
        info = json.loads((path / "ekfac.json").read_text())
        tensors = load_file(str(path / "factors.safetensors"), device=str(device))
    except (OSError, json.JSONDecodeError) as err:
        raise FileNotFoundError(f"{path}: not an EK-FAC directory ({err}).") from err
    check_version(info, f"EK-FAC factors {path / 'ekfac.json'}")
    out = EKFAC(projection_dim=info["projection_dim"], seed=info["seed"], settings=info["settings"])
    for name, meta in info["factors"].items():
        get = {k.split("::", 1)[1]: v for k, v in tensors.items() if k.split("::", 1)[0] == name}
        out.factors[name] = Factor(
            name, meta["transposed"], meta["experts"], get["A"], get["G"], get["tokens"],
            get.get("QA"), get.get("QG"), get.get("eigA"), get.get("eigG"), get.get("lam"),
            meta["examples"], get.get("damping"), meta.get("bias", False),
        )  # fmt: skip
    return out


def factor_dims(
    report: CoverageReport,
    p: int | None,
    fold_bias: bool = False,
    kind: str = PROJECTION,
    target_dims: dict[str, int] | None = None,
) -> list[tuple]:
    """(name, transposed, experts, input dim, output dim, bias folded) of every factor, each side's
    dim its width in the projected space of `kind` (a target of `target_dims` at its own dimension);
    a folded bias adds the ones column to the input dim."""
    biased = {e.block for e in iter_entries(report.targets) if e.kind == "bias"} if fold_bias else set()
    dims = target_dims or {}
    out = []

    def width(features: int, name: str) -> int:
        return side_width(kind, features, dims.get(name, p))

    for t in report.targets:
        if t.kind == "experts":
            lay = t.layout
            for proj in lay.projections:
                fin, fout = lay.features(proj)
                name = f"{lay.name}.{proj}"
                fold = name in biased
                out.append((name, lay.transposed, lay.num_experts, width(fin, name) + fold, width(fout, name), fold))
        else:
            rows, cols = t.module.weight.shape
            fin, fout = (rows, cols) if t.transposed else (cols, rows)
            fold = t.name in biased
            out.append((t.name, t.transposed, None, width(fin, t.name) + fold, width(fout, t.name), fold))
    return out


def memory_plan(
    report: CoverageReport,
    projection_dim: int | None,
    fold_bias: bool = DEFAULT_FOLD_BIAS,
    projection: str = PROJECTION,
    target_dims: dict[str, int] | None = None,
) -> dict:
    """Bytes of float64 factors (A, G, eigenbases, eigenvalues, Lambda) per module kind and in total."""
    kinds = {t.name if t.kind != "experts" else f"{t.layout.name}": t.kind for t in report.targets}
    per_kind: dict[str, int] = {}
    for name, _transposed, experts, a, g, _fold in factor_dims(
        report, projection_dim, fold_bias, projection, target_dims
    ):
        e = experts or 1
        size = 8 * e * (2 * a * a + 2 * g * g + a + g + a * g)
        kind = "experts" if experts else kinds.get(name, "linear")
        per_kind[kind] = per_kind.get(kind, 0) + size
    return {"per_kind": per_kind, "total": sum(per_kind.values())}


def format_plan(plan: dict) -> str:
    lines = ["EK-FAC factor memory (float64):"]
    for kind, size in sorted(plan["per_kind"].items()):
        lines.append(f"  {kind:<10s} {size / 2**30:10.3f} GiB")
    lines.append(f"  {'total':<10s} {plan['total'] / 2**30:10.3f} GiB")
    return "\n".join(lines)


class _Accumulator:
    """Row sink for pass 1: sums of x x^T and g g^T over real tokens, per expert for experts.

    An expert's routed rows are one contiguous segment, so its sums come from one float64
    `Kernels.segment_mm` per side, sized by the routed rows (no padded grid, no host sync).
    """

    def __init__(self, factors: dict[str, Factor]):
        self.factors = factors
        self.kernels = Kernels()

    def __call__(self, records: list[CaptureRecord], batch: BatchInfo) -> None:
        for c in records:
            if c.g is None or c.name not in self.factors:
                continue
            f = self.factors[c.name]
            if c.grid is None:
                x, g = c.x.reshape(-1, c.x.shape[-1]).double(), c.g.reshape(-1, c.g.shape[-1]).double()
                x = _with_ones(x) if f.bias else x
                real = c.row_mask(batch)
                real = torch.ones(x.shape[0], device=x.device) if real is None else real
                real = real.double()[:, None]
                f.A += ((x * real).T @ x).to(f.A.device)
                f.G += ((g * real).T @ g).to(f.G.device)
                f.tokens += real.sum().to(f.tokens.device)
                continue
            rows, e = c.grid.rows, c.layout.num_experts
            real = (rows.expert < e).double()  # rows of zero-compute experts (past offsets[e - 1]) count nothing
            mask = c.row_mask(batch)
            if mask is not None:
                real = real * mask.double()
            for cov, values in ((f.A, _with_ones(c.x) if f.bias else c.x), (f.G, c.g)):
                values = values.double()
                cov += self.kernels.segment_mm(values * real[:, None], values, rows.offsets[:e]).to(cov.device)
            counts = torch.zeros(e + 1, dtype=torch.float64, device=real.device)
            f.tokens += counts.index_add_(0, rows.expert.clamp(max=e), real)[:e].to(f.tokens.device)


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    """Rows with the folded bias's ones column appended."""
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def set_damping(factors: dict[str, Factor], damping: float, scope: str = DEFAULT_DAMPING_SCOPE) -> None:
    """Set every factor's damping to `damping x mean(Lambda)` over `scope` (see `EKFAC.with_damping`).

    A scope whose eigenvalues are all zero (a module that never received a gradient) falls back
    to the model-wide mean, so no damping is ever zero and no score becomes 0/0.
    """
    check_damping(damping, scope)
    sums = [f.lam.sum() for f in factors.values()]
    sizes = [f.lam.numel() for f in factors.values()]
    model_mean = float(sum(sums) / max(sum(sizes), 1)) if sums else 0.0
    floor = damping * model_mean if model_mean > 0 else 1.0
    floor = max(floor, torch.finfo(torch.float64).tiny)
    for name, f in list(factors.items()):
        lead = f.lam.shape[:-2]
        if scope == "model":
            value = torch.full(lead, damping * model_mean, dtype=f.lam.dtype, device=f.lam.device)
        elif scope == "module":
            value = torch.full(lead, damping * float(f.lam.mean()), dtype=f.lam.dtype, device=f.lam.device)
        else:
            value = damping * f.lam.mean(dim=(-1, -2))
        value = torch.where(value > 0, value, torch.full_like(value, floor))
        factors[name] = Factor(**{**f.__dict__, "damping": value})


def check_damping(damping: float, scope: str) -> None:
    """A damping >= 0 and a known scope, checked before any work (fit) or re-damping."""
    if scope not in DAMPING_SCOPES:
        raise ValueError(f"damping scope must be one of {DAMPING_SCOPES}, not {scope!r}")
    if damping < 0:
        raise ValueError(f"damping must be >= 0, not {damping}")


def fit_ekfac(
    model: nn.Module,
    examples: list[Example],
    settings: EkfacSettings | None = None,
    *,
    collect: CollectSettings | None = None,
    pad_id: int = 0,
    dist: Dist | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    **overrides: Any,
) -> EKFAC:
    """Fit EK-FAC factors on `examples`: covariances, float64 eigendecompositions, corrected eigenvalues.

    How is `settings` (`moe_attrib.settings.EkfacSettings`) and, for the gradients, `collect` (the
    `CollectSettings` fields that shape rows: projection, seed, modules, batching, recompute); any field
    of either may be given as a keyword shortcut (`projection_dim=16`, `damping=0.1`). `factor_device`
    None keeps the factors on the CPU. The fields are described below by name.

    `damping` is relative: `damping x mean(Lambda)` over `damping_scope` (see `EKFAC.with_damping`,
    which also re-damps fitted factors without refitting). `projection` is the projection kind
    (`moe_attrib.collect.projection`): the index's own, `projection_kind(index.manifest["settings"])`.
    `fold_bias` preconditions each bias with its weight (a ones column on the input side).
    Refuses with `FactorMemoryError` when the factors exceed `max_memory_gib`.
    Under torchrun the sums are all-reduced, so every rank ends with the same factors. `recompute`:
    decoder layers run again in the backward instead of keeping their activations (`moe_attrib.model.recompute`).
    """
    ek, st = resolve("fit_ekfac", overrides, settings, collect, kinds=(EkfacSettings, CollectSettings))
    track_moe_experts, filter_modules, token_batch_size = st.track_moe_experts, st.filter_modules, st.token_batch_size
    projection_dim, seed, projection, recompute = st.projection_dim, st.seed, st.projection, st.recompute
    damping, damping_scope, sampled_labels, fold_bias = ek.damping, ek.damping_scope, ek.sampled_labels, ek.fold_bias
    max_memory_gib, factor_device = ek.max_memory_gib, ek.factor_device or "cpu"
    check_damping(damping, damping_scope)
    check_kind(projection)
    device = next(model.parameters()).device
    dist = dist or Dist(0, 1, device)
    weights = model_fingerprint(model)  # before any expansion; recorded in ekfac.json
    report = discover(model, track_moe_experts=track_moe_experts, filter_modules=filter_modules, warn=dist.is_main)
    target_dims = output_dims(report.output_layer, projection_dim, st.output_projection_dim)
    plan = memory_plan(report, projection_dim, fold_bias, projection, target_dims)
    if dist.is_main and progress:
        print(format_plan(plan))
    if max_memory_gib is not None and plan["total"] > max_memory_gib * 2**30:
        raise FactorMemoryError(
            f"EK-FAC factors need {plan['total'] / 2**30:.2f} GiB, over the {max_memory_gib} GiB budget. "
            "Use --projection_dim P (factors in the projected space, P x P each), --filter_modules GLOB "
            "to fit a subset (fit the rest in further runs), or raise --max_factor_memory."
        )
    fdev = torch.device(factor_device)
    factors: dict[str, Factor] = {}
    for name, transposed, experts, a, g, fold in factor_dims(
        report, projection_dim, fold_bias, projection, target_dims
    ):
        lead = (experts,) if experts else ()
        factors[name] = Factor(
            name,
            transposed,
            experts,
            torch.zeros(*lead, a, a, dtype=torch.float64, device=fdev),
            torch.zeros(*lead, g, g, dtype=torch.float64, device=fdev),
            torch.zeros(lead, dtype=torch.float64, device=fdev),
            bias=fold,
        )
    loop = CollectionLoop(examples, token_batches(examples, token_batch_size), dist, pad_id=pad_id)

    def run(collector: GradientCollector, desc: str, consume) -> None:
        # labels: the loss of the index and query rows, or drawn from the model alike in any world size (reseed)
        loop.run(collector, consume, progress=Progress(desc) if progress else None, reseed=seed,
                 fused_experts=True, sample_labels=sampled_labels)  # fmt: skip

    sink = _Accumulator(factors)
    with GradientCollector(
        model,
        report,
        projection_dim=projection_dim,
        seed=seed,
        row_sink=lambda records, batch: sink(records, batch) if loop.step.real else None,  # filler: nothing
        projection=projection,
        recompute=recompute,
        target_dims=target_dims,
    ) as collector:
        gen_state = torch.random.get_rng_state()
        run(collector, "ekfac covariances", lambda step, out: None)  # the row sink accumulates
    for f in factors.values():
        for t in (f.A, f.G, f.tokens):
            dist.all_reduce_(t)
        n = f.tokens.clamp(min=1).view(*f.tokens.shape, 1, 1)
        f.A /= n
        f.G /= n
        f.eigA, f.QA = torch.linalg.eigh(f.A)
        f.eigG, f.QG = torch.linalg.eigh(f.G)
        shape = (f.QA.shape[-1], f.QG.shape[-1]) if f.transposed else (f.QG.shape[-1], f.QA.shape[-1])
        f.lam = torch.zeros(*f.tokens.shape, *shape, dtype=torch.float64, device=fdev)

    proj = (
        Projections(projection_dim, seed, dist.device, torch.float32, projection, target_dims)
        if projection_dim
        else None
    )

    rotations: dict[tuple, torch.Tensor] = {}

    def rotator(name, side, features, like, batch):
        key = (name, side, like.device, like.dtype)
        if key not in rotations:  # built once per target, not in every hook call
            f = factors[name]
            q = (f.QA if side == "in" else f.QG).to(like.device, torch.float32)
            if side == "in" and f.bias:
                q = q[..., :-1, :]  # the ones column's row enters through the bias gradient (`add`)
            mat = proj.get(name, side, features, batch) if proj is not None else None  # None: side kept exact
            if mat is not None:
                q = mat.float() @ q
            rotations[key] = q.to(like.dtype)
        return rotations[key]

    total = torch.zeros((), dtype=torch.float64)

    def add(step: Step, out) -> None:
        nonlocal total
        total += out.losses.shape[0]
        for name, f in factors.items():
            if name in out.missing:  # off the loss path in this batch: a zero gradient adds nothing
                continue
            key = f"{name}.weight"
            rotated = out[key].double().to(fdev)  # [N, (E,) rows, cols]
            if f.bias:  # + the ones column: bias gradient (rotated) x the last row of QA
                ones = f.QA[..., -1, :].unsqueeze(0)  # [1, (E,), a + 1]
                bias = out[f"{name}.bias"].double().to(fdev)  # [N, (E,), g]
                rotated = rotated + (
                    ones.unsqueeze(-1) * bias.unsqueeze(-2) if f.transposed else bias.unsqueeze(-1) * ones.unsqueeze(-2)
                )
            f.lam += (rotated**2).sum(dim=0)

    with GradientCollector(model, report, projector=rotator, recompute=recompute) as collector:
        run(collector, "ekfac eigenvalue correction", add)
    torch.random.set_rng_state(gen_state)
    dist.all_reduce_(total)
    for f in factors.values():
        dist.all_reduce_(f.lam)
        f.examples = int(total)
        f.lam /= max(float(total), 1.0)
    set_damping(factors, damping, damping_scope)
    result = EKFAC(
        factors,
        projection_dim,
        seed,
        {"damping": damping, "damping_scope": damping_scope, "sampled_labels": sampled_labels, "fold_bias": fold_bias,
         "examples": int(total), "track_moe_experts": track_moe_experts, "filter_modules": filter_modules,
         "model_fingerprint": weights, "projection": projection,
         "output_projection_dim": own_output_dim(projection_dim, st.output_projection_dim)},
    )  # fmt: skip
    if out is not None and dist.is_main:
        result.save(out)
    return result
