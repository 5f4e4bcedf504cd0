"""Typed settings of the three steps (collect gradients, fit EK-FAC factors, score) and their defaults.

Each setting is one field of a frozen dataclass carrying its command-line help (`field(metadata=...)`):
`add_flags` adds a class's flags to an `argparse` parser and `Settings.from_args` builds the object back from
the parsed arguments, so the CLI and the Python API share one list of names and defaults. An index
manifest stores them flat (`to_dict`) and `IndexSettings.from_dict` reads them back (`Index.settings`);
manifests and `ekfac.json` record `SETTINGS_VERSION`, so a layout this code cannot read is refused.

This module imports neither torch nor transformers: `moe-attrib --help` builds its parser from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moe_attrib.errors import MoeAttribError

SETTINGS_VERSION = 1  # the settings layout new manifests record; one without the key is version 1 (0.1.0)

# collection
DEFAULT_PROJECTION_DIM = 32  # per side: a p x p block per weight (docs/quality.md)
# the output layer's own p; None: DEFAULT_PROJECTION_DIM's, like every block (512 was measured and not adopted:
# docs/quality.md#output-layer-width)
DEFAULT_OUTPUT_PROJECTION_DIM = None
PROJECTION = "rademacher-hash-v2"  # the projection kind new indexes and EK-FAC factors use
LEGACY_PROJECTION = "gaussian-cpu-v0"  # what settings without a "projection" key were made with
DEFAULT_INDEX_DTYPE = "float32"
DEFAULT_TOKEN_BATCH_SIZE = 8192
DEFAULT_BUDGET = 2**20  # bytes per example of an eigenbasis index: 1 MiB (docs/build.md: the LDS frontier)
# the factors a default `build` fits for its eigenbasis rows: every side sketched to 128, the output layer to 1024,
# rows stored in bfloat16 (the settings the LDS frontier measured: docs/build.md, docs/quality.md)
EIGENBASIS_SKETCH = 128
EIGENBASIS_OUTPUT_SKETCH = 1024
EIGENBASIS_INDEX_DTYPE = "bfloat16"
AUTO_MIN_BATCHES = 32  # batches of one shape that earn it a CUDA graph under cuda_graphs=None (auto)
PRECISIONS = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}  # a model dtype's --precision
MAX_PROJECTION_DIM = 4096  # a p x p block per weight: 16M values at this p
# EK-FAC
DEFAULT_DAMPING = 0.1  # x the mean corrected eigenvalue over DEFAULT_DAMPING_SCOPE (docs/quality.md: Damping)
DEFAULT_DAMPING_SCOPE = "module"  # each module's own mean: its damping scales with its own curvature
DAMPING_SCOPES = ("expert", "module", "model")
DEFAULT_SAMPLED_LABELS = True  # the true Fisher (labels drawn from the model), not the empirical one
DEFAULT_FOLD_BIAS = True  # bias preconditioned with its weight (docs/quality.md)
# scoring
DEFAULT_UNIT_NORMALIZE = True  # cosine after preconditioning (docs/quality.md)
DEFAULT_COUPLING = "auto"  # fit the cross-module coupling with its defaults (docs/quality.md)
DEFAULT_BALANCE = "auto"  # balance the output layer's vote against the whole model's (docs/quality.md)
DEFAULT_GAMMA = 30.0
DEFAULT_RANK = 64
DEFAULT_SAMPLE = 512
DEFAULT_BLOCK_BYTES = 256 << 20  # stored bytes per block (H200: 32.1 GB/s vs 27.6 at 64 MiB, docs/scoring.md)
READERS = ("copy", "pread")  # np.copyto from the memmap / os.preadv from the file (docs/scoring.md)
DEFAULT_READER = "copy"
DEFAULT_REFINE_ITERATIONS = 4
DEFAULT_REFINE_DAMPING = 1.0  # x the mean eigenvalue of G, as EK-FAC's (it ranked better than 0.1: docs/scoring.md)


class SettingsVersionError(MoeAttribError, ValueError):
    """Settings recorded by a newer moe-attrib, in a layout this one cannot read."""


# argument types of the flags (pure Python: `moe_attrib.workflows.checks` re-exports them)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def projection_size(text: str) -> int:
    """`--projection_dim`: a positive integer up to `MAX_PROJECTION_DIM`."""
    value = positive_int(text)
    if value > MAX_PROJECTION_DIM:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_PROJECTION_DIM} (each weight becomes a p x p block), got {text!r}; "
            "for exact, unprojected rows pass --no_projection instead"
        )
    return value


def finite_float(text: str, ok, must: str) -> float:
    """`text` as a finite float for which `ok(value)` holds, else an argparse error saying it `must` be."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return finite_float(text, lambda v: v > 0, "a positive number")


def nonnegative_float(text: str) -> float:
    return finite_float(text, lambda v: v >= 0, "a number >= 0")


def own_output_dim(projection_dim: int | None, output_projection_dim: int | None) -> int | None:
    """The output layer's own dimension where it differs from every other block's (None: it has none:
    exact rows, no `output_projection_dim`, or one equal to `projection_dim`)."""
    if projection_dim is None or output_projection_dim is None or output_projection_dim == projection_dim:
        return None
    return int(output_projection_dim)


def output_dims(
    output_layer: str | None, projection_dim: int | None, output_projection_dim: int | None
) -> dict[str, int]:
    """`target_dims` giving the output layer `output_projection_dim` (`own_output_dim`): empty where
    the model has no output-layer target or the layer has no dimension of its own."""
    own = own_output_dim(projection_dim, output_projection_dim)
    return {output_layer: own} if own is not None and output_layer is not None else {}


def setting(default: Any, help: str | None = None, flag: str | None = None, parse=None, **cli: Any) -> Any:
    """A settings field: its Python `default`, its `--flag` (default: the field's name; "" for no flag),
    the flag's `help` and other `argparse` keywords (`cli`, e.g. `type`, `choices`, `action`, and
    `cli_default` where the command line's default differs from Python's), and `parse`, turning the
    flag's value into the field's."""
    if "cli_default" in cli:
        cli["default"] = cli.pop("cli_default")
    meta = {"help": help, "flag": flag, "parse": parse, "cli": cli}
    return field(default=default, metadata=meta)


def switched_off_by(flag: str, help: str, default: bool = True) -> Any:
    """A setting on by `default` that the command-line switch `flag` turns off (`--no_fold_bias`)."""
    return setting(default, help, flag=flag, parse=operator.not_, action="store_true", cli_default=False)


S = TypeVar("S", bound="Settings")


class Settings:
    """Shared behaviour of the settings dataclasses: stored as a dict, loaded back, replaced."""

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-ready (what a manifest or `ekfac.json` records)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[S], data: dict[str, Any], legacy: dict[str, str] | None = None) -> S:
        """The settings a dict records: its known keys (renamed from `legacy` names first); a missing
        key takes the default, keys of other classes are left to them."""
        data = {(legacy or {}).get(k, k): v for k, v in data.items()}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def replace(self: S, **changes: Any) -> S:
        """A copy with `changes` (unknown names are a TypeError naming them)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls: type[S], args: argparse.Namespace, **changes: Any) -> S:
        """The settings of parsed arguments: each field with a flag read from `args` (through its
        `parse`), the others at their defaults; `changes` override both."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in changes or _flag(f) is None or not hasattr(args, _dest(f)):
                continue
            value = getattr(args, _dest(f))
            values[f.name] = f.metadata["parse"](value) if f.metadata["parse"] else value
        return cls(**{**values, **changes})


def resolve(where: str, overrides: dict[str, Any], *given: Settings | None, kinds: tuple[type, ...]) -> tuple:
    """The settings objects a function runs with: each of `given` (None: `kinds`' defaults) with the
    keyword shortcuts `overrides` (field names of any of `kinds`) applied; an unknown name is a
    `TypeError` naming `where` and the fields it takes."""
    names = [{f.name for f in dataclasses.fields(k)} for k in kinds]
    unknown = sorted(set(overrides) - set().union(*names))
    if unknown:
        known = ", ".join(sorted(set().union(*names)))
        raise TypeError(
            f"{where}() got unknown settings {unknown}; it takes settings objects or these fields: {known}."
        )
    out = []
    for obj, kind, own in zip(given, kinds, names, strict=True):
        if obj is not None and not isinstance(obj, kind):
            raise TypeError(f"{where}(): expected {kind.__name__}, got {type(obj).__name__}.")
        mine = {k: v for k, v in overrides.items() if k in own}
        out.append((obj or kind()).replace(**mine) if mine else obj or kind())
    return tuple(out)


def _flag(f: dataclasses.Field) -> str | None:
    flag = f.metadata.get("flag")
    return None if flag == "" else flag or f"--{f.name}"


def _dest(f: dataclasses.Field) -> str:
    """The attribute the field's flag parses into (argparse's: the flag's name)."""
    return _flag(f)[2:].replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, cls: type[Settings], names: list[str], **overrides: dict) -> None:
    """Add the flags of `cls`'s fields `names` to `parser`, in that order: the field's help and
    argparse keywords, the command line's default where it has its own, else the field's; `overrides`
    (by field name) replace keywords for one command (e.g. `score`'s re-damping defaults to None)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = fields[name]
        kwargs = {"default": f.default, "help": f.metadata["help"], **f.metadata["cli"], **overrides.get(name, {})}
        parser.add_argument(_flag(f), **kwargs)


def check_version(recorded: dict, what: str) -> None:
    """Refuse settings written in a newer layout (`settings_version` above `SETTINGS_VERSION`)."""
    version = recorded.get("settings_version", 1)
    if not isinstance(version, int) or version > SETTINGS_VERSION:
        raise SettingsVersionError(
            f"{what} records settings version {version}, newer than this moe-attrib reads ({SETTINGS_VERSION}); "
            "upgrade moe-attrib (pip install -U moe-attrib) to read it, or rebuild it with this version."
        )


CUDA_GRAPHS = {"on": True, "off": False, "auto": None}


@dataclass(frozen=True)
class CollectSettings(Settings):
    """How per-example gradients are collected: which modules, how projected, batched and stored
    (`build_index`; `fit_ekfac` and `query_gradients` use the fields that shape the rows)."""

    track_moe_experts: bool = setting(
        True, "attribute every expert of fused MoE layers", action="store_true", cli_default=False
    )
    filter_modules: str | None = setting(None, "glob over module names, e.g. '*.mlp.*'")
    token_batch_size: int = setting(DEFAULT_TOKEN_BATCH_SIZE, "padded tokens per batch", type=positive_int)
    recompute: bool = setting(
        False,
        "keep only each decoder layer's inputs and run it again in the backward: far less activation "
        "memory (same rows) for one more forward per batch",
        flag="--recompute_layers",
        action="store_true",
    )
    projection_dim: int | None = setting(
        DEFAULT_PROJECTION_DIM,
        f"p: each weight block is p x p (default {DEFAULT_PROJECTION_DIM})",
        type=projection_size,
        cli_default=None,
    )
    output_projection_dim: int | None = setting(
        DEFAULT_OUTPUT_PROJECTION_DIM,
        "the output layer's (lm_head's) own p: its sides are projected to this many columns, a side no "
        "wider kept exact (default: p, like every block; 512 for a large vocabulary: docs/quality.md)",
        type=projection_size,
        metavar="W",
    )
    seed: int = setting(0, "projection seed (and EK-FAC label sampling)", type=int)
    projection: str = setting(PROJECTION, flag="")  # the projection kind (moe_attrib.collect.projection)
    expert_blocks: str = setting(
        "separate",
        "separate: columns per expert (per-expert scores); sum: one block per layer, experts summed",
        choices=["separate", "sum"],
    )
    attribute_tokens: bool = setting(False, "one row per token instead of per example", action="store_true")
    optimizer_state: str | None = setting(
        None, "torch optimizer state / HF Trainer checkpoint: Adam/Adafactor normalisation"
    )
    index_dtype: str = setting(
        DEFAULT_INDEX_DTYPE,
        f"how rows are stored: 16-bit halves the index and scoring time (effect on scores: docs/build.md); "
        f"default {EIGENBASIS_INDEX_DTYPE} for an eigenbasis index, {DEFAULT_INDEX_DTYPE} for seeded projections",
        choices=["float32", "float16", "bfloat16"],
        cli_default=None,
    )
    cuda_graphs: bool | None = setting(
        None,
        "replay unpadded batches of a repeated shape from CUDA graphs: the same rows, faster at small "
        f"--token_batch_size (host-bound steps). auto (default): on CUDA, for shapes of >= {AUTO_MIN_BATCHES} "
        "batches; on (or the bare flag): every repeated shape, an error where it cannot run; off: never "
        "(docs/build.md)",
        parse=CUDA_GRAPHS.__getitem__,
        nargs="?",
        const="on",
        cli_default="auto",
        choices=["auto", "on", "off"],
    )
    budget: int | str | None = setting(
        None,
        "bytes per example of an eigenbasis index, e.g. 256KiB or 1MiB (default 1MiB: docs/build.md)",
    )

    def target_dims(self, output_layer: str | None) -> dict[str, int]:
        """The targets projected to their own dimension (`output_dims`), given the output layer's name."""
        return output_dims(output_layer, self.projection_dim, self.output_projection_dim)

    def recorded(self) -> dict[str, Any]:
        """The fields an index manifest records (how its rows were made; not how they were computed)."""
        keep = ("projection_dim", "output_projection_dim", "seed", "projection", "expert_blocks", "track_moe_experts",
                "filter_modules", "token_batch_size", "attribute_tokens", "optimizer_state")  # fmt: skip
        return {k: getattr(self, k) for k in keep}


@dataclass(frozen=True)
class DataSettings(Settings):
    """How a training data file is read into examples (recorded by indexes and factors, so that `score`
    reads the same rows again)."""

    max_length: int | None = setting(None, "longest example (see --truncate)", type=positive_int)
    truncate: bool = setting(False, "cut examples longer than --max_length", action="store_true")
    text_field: str = setting("text", "field of each record that holds its text")
    split: str | None = setting(None, "split of a datasets directory / hub dataset (default: train)")
    tokenizer: str | None = setting(None, "tokenizer directory, for a model directory without one")


@dataclass(frozen=True)
class EkfacSettings(Settings):
    """How EK-FAC factors are fitted (`fit_ekfac`) besides the collection settings they share."""

    damping: float = setting(
        DEFAULT_DAMPING, "relative damping: x mean(corrected eigenvalue) over --damping_scope", type=nonnegative_float
    )
    damping_scope: str = setting(
        DEFAULT_DAMPING_SCOPE, "mean over each expert, each module (all its experts) or the whole model",
        choices=DAMPING_SCOPES,
    )  # fmt: skip
    sampled_labels: bool = switched_off_by(
        "--empirical_fisher",
        "use the data's labels (empirical Fisher) instead of labels drawn from the model (true Fisher)",
        DEFAULT_SAMPLED_LABELS,
    )
    fold_bias: bool = switched_off_by(
        "--no_fold_bias",
        "leave biases unpreconditioned instead of folding each into its weight's factors (a ones column)",
        DEFAULT_FOLD_BIAS,
    )
    max_memory_gib: float | None = setting(
        None, "GiB; refuse to fit above it", flag="--max_factor_memory", type=positive_float
    )
    factor_device: str | None = setting(None, "where factors live (default: the model's device)")


@dataclass(frozen=True)
class ScoreSettings(Settings):
    """How queries are scored against an index (`score`, `score_matrix`, `score_run`, `score_queries`)."""

    unit_normalize: bool = setting(
        DEFAULT_UNIT_NORMALIZE,
        "cosine after preconditioning (--no-unit_normalize: inner product)",
        action=argparse.BooleanOptionalAction,
    )
    modules: str | None = setting(None, "score through the blocks matching this glob only, e.g. '*.experts.*'")
    damping: float | None = setting(
        None,
        "relative damping: x mean(corrected eigenvalue) over --damping_scope (default: the factors' own)",
        type=nonnegative_float,
    )  # re-damps fitted EK-FAC factors (EKFAC.with_damping); None: as fitted
    damping_scope: str | None = setting(
        None, "mean over each expert, each module (all its experts) or the whole model", choices=DAMPING_SCOPES
    )
    coupling_gamma: float = setting(
        DEFAULT_GAMMA,
        "strength of the cross-module coupling fitted from the index's own rows (0: off)",
        type=nonnegative_float,
    )
    coupling_rank: int = setting(DEFAULT_RANK, "its rank", type=positive_int)
    coupling_sample: int = setting(DEFAULT_SAMPLE, "index rows it is fitted from", type=positive_int)
    output_balance: bool = setting(
        True,
        "count the output layer's (lm_head's) vote as much as the whole model's (default: on; never with "
        "--modules; docs/scoring.md)",
        action=argparse.BooleanOptionalAction,
    )
    top_k: int = setting(10, "training rows kept per query", type=positive_int)
    per_module: bool = setting(False, "per-layer and per-expert breakdown of each score", action="store_true")
    block_bytes: int = setting(DEFAULT_BLOCK_BYTES, flag="")  # stored bytes of index rows per streamed block
    block_rows: int | None = setting(None, flag="")  # or rows per block
    reader: str = setting(DEFAULT_READER, flag="")  # how blocks are read (moe_attrib.indexing.stream)
    threads: int | None = setting(None, flag="")  # reader threads

    @property
    def coupling(self) -> dict | None:
        """The coupling's settings (None: off): part of how a score matrix was scored."""
        if self.coupling_gamma == 0:
            return None
        return {"gamma": self.coupling_gamma, "rank": self.coupling_rank, "sample": self.coupling_sample}

    @property
    def balanced(self) -> bool:
        """Whether the output layer's vote is balanced: asked for, and never for a `modules` score."""
        return self.output_balance and self.modules is None


@dataclass(frozen=True)
class RefineSettings(Settings):
    """How queries are refined by CG on the exact Gauss-Newton matrix (`refine_queries`, `score --refine`)."""

    iterations: int = setting(
        DEFAULT_REFINE_ITERATIONS,
        "refine each query by N CG iterations of exact Gauss-Newton products over the training data "
        "(docs/scoring.md#refinement); 0: off",
        flag="--refine",
        type=int,
        metavar="N",
        cli_default=0,
    )
    damping: float = setting(DEFAULT_REFINE_DAMPING, "x the mean eigenvalue of G", flag="--refine_damping", type=float)
    examples: int | None = setting(
        None, "training rows the GGN averages over (all)", flag="--refine_examples", type=int
    )  # drawn with `seed`
    seed: int = setting(0, flag="")
    token_batch_size: int = setting(4096, flag="")  # padded tokens per forward of the GGN sweeps
    query_batch: int = setting(16, flag="")  # queries solved together (sharing the sweeps' forwards)
    vector_batch: int = setting(8, flag="")  # vectors per vmapped backward


@dataclass(frozen=True)
class IndexSettings(Settings):
    """What an index manifest's "settings" record, read back (`Index.settings`): how the rows were
    collected (`collect`), how the data were read (`reading`) and what the rows came from: the model
    (`model`, its weights fingerprint and dtype), the data (absolute path, token fingerprint) and the
    tokenizer's fingerprint; `eigenbasis` for an index of eigenbasis rows. Keys older manifests lack
    take what they meant then: projection kind `LEGACY_PROJECTION`, experts untracked, float32 rows, the output
    layer projected like every block."""

    collect: CollectSettings = field(default_factory=CollectSettings)
    reading: DataSettings = field(default_factory=DataSettings)
    model: str = ""
    model_fingerprint: str | None = None
    dtype: str | None = None  # the model's, e.g. "torch.float32"
    data: str | None = None
    data_fingerprint: str | None = None
    tokenizer_fingerprint: str | None = None
    rows: int | None = None
    eigenbasis: dict | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], legacy: dict[str, str] | None = None) -> IndexSettings:
        """The settings of a manifest's flat "settings" dict."""
        old = {"track_moe_experts": False, "projection": LEGACY_PROJECTION, "index_dtype": DEFAULT_INDEX_DTYPE,
               "output_projection_dim": None}  # fmt: skip
        data = {**old, **{k: v for k, v in data.items() if v is not None or k != "projection"}}
        own = {f.name for f in dataclasses.fields(cls)} - {"collect", "reading"}
        return cls(
            collect=CollectSettings.from_dict(data, legacy),
            reading=DataSettings.from_dict(data, legacy),
            **{k: v for k, v in data.items() if k in own},
        )

    def to_dict(self) -> dict[str, Any]:
        """The flat dict a manifest records (collection and reading fields beside the provenance)."""
        flat = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("collect", "reading")}
        return {**self.collect.to_dict(), **self.reading.to_dict(), **flat}

    @property
    def torch_dtype_name(self) -> str:
        """The model's dtype as a `torch` attribute name ("float32", "bfloat16", ...)."""
        return (self.dtype or "torch.float32").removeprefix("torch.")
