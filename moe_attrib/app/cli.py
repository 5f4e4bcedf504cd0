"""The `moe-attrib` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from moe_attrib.settings import (
    DEFAULT_INDEX_DTYPE,
    DEFAULT_OUTPUT_PROJECTION_DIM,
    DEFAULT_PROJECTION_DIM,
    EIGENBASIS_INDEX_DTYPE,
    EIGENBASIS_OUTPUT_SKETCH,
    EIGENBASIS_SKETCH,
    PRECISIONS,
    CollectSettings,
    DataSettings,
    EkfacSettings,
    IndexSettings,
    RefineSettings,
    ScoreSettings,
    add_flags,
    nonnegative_int,
    own_output_dim,
    positive_int,
)

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def notes():
    """moe-attrib's own warnings (coverage, dense model) print at once as one `NOTE:` line each,
    so they come before the work they are about; other warnings follow the usual filters."""
    shown = set()
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "moe-attrib" not in text:
            return previous(message, category, filename, lineno, file, line)
        if text not in shown:
            shown.add(text)
            print(f"NOTE: {text}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*moe-attrib")
        warnings.showwarning = show
        yield


def cmd_inspect(args: argparse.Namespace) -> int:
    from moe_attrib.model.discovery import discover

    model = inspected_model(args.model, args.precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = discover(model, track_moe_experts=args.track_moe_experts)
    for w in caught:
        print(f"WARNING: {w.message}", file=sys.stderr)
    print(report)
    if report.experts:
        print("\nfused experts modules:")
        for lay in report.experts:
            flags = [
                "gated" if lay.has_gate else "non-gated",
                "transposed" if lay.transposed else "[E, out, in]",
                "bias" if lay.has_bias else "no bias",
                lay.family,
            ]
            print(f"  {lay.name}: {lay.num_experts} experts, {', '.join(lay.projections)} ({', '.join(flags)})")
    if report.routers:
        print("\nrouters: " + ", ".join(report.routers))
    if report.targets:
        from moe_attrib.curvature.eigenbasis import DTYPE_BYTES, EXPERT_DIRECTIONS, OUTPUT_FLOOR_SHAPE, plan_floors
        from moe_attrib.indexing.index import column_plan
        from moe_attrib.settings import DEFAULT_BUDGET

        fl = plan_floors(report, EIGENBASIS_SKETCH, EIGENBASIS_OUTPUT_SKETCH)
        stored = fl.stored(DEFAULT_BUDGET, EIGENBASIS_INDEX_DTYPE)
        print(
            f"\ndefault index (eigenbasis rows, --budget {DEFAULT_BUDGET // 2**20}MiB in {EIGENBASIS_INDEX_DTYPE}; "
            f"build fits EK-FAC factors at --projection_dim {EIGENBASIS_SKETCH} --output_projection_dim "
            f"{EIGENBASIS_OUTPUT_SKETCH} first): {stored} columns per example"
        )
        print(f"index bytes per example: {stored * DTYPE_BYTES[EIGENBASIS_INDEX_DTYPE]}")
        if stored == fl.directions:
            rest = f"; the budget holds every direction pair ({fl.directions} columns)"
        elif fl.expert_blocks:
            each = fl.per_expert(DEFAULT_BUDGET, EIGENBASIS_INDEX_DTYPE)
            rest = f"; the greedy spends the rest, at most {each:.1f} columns an expert block on average"
        else:
            rest = "; the greedy spends the rest"
        cells = fl.output * fl.output
        head = {
            "area": f"the output layer's {cells} cells ({fl.output} x {fl.output}, shaped by its eigenvalues)",
            "fill": f"the output layer's {cells} cells ({fl.output} x {fl.output}, or its short side whole)",
            "hidden": f"the output layer's {cells} cells (its hidden side whole, the vocabulary side filled)",
            "cross": f"the output layer's {cells} cells or fewer (an L of each side's leading {fl.output // 4} "
            f"directions over {2 * fl.output} of the other's)",
        }.get(OUTPUT_FLOOR_SHAPE, f"the output layer at {fl.output}")
        experts = f", {fl.expert_blocks} expert blocks at {EXPERT_DIRECTIONS}" if fl.expert_blocks else ""
        print(f"eigenbasis floors: {fl.columns} columns ({fl.dense_blocks} dense blocks at {fl.dense} directions a "
              f"side, {head}{experts}){rest}")  # fmt: skip
        st = CollectSettings()
        dims = st.target_dims(report.output_layer)
        columns = column_plan(report, st.projection_dim, "separate", st.projection, dims)[-1].stop
        own = "".join(f", {name} at {dim}" for name, dim in dims.items())
        print(
            f"seeded index (build --projection_dim {st.projection_dim}{own}, {DEFAULT_INDEX_DTYPE}): {columns} "
            f"columns, {columns * DTYPE_BYTES[DEFAULT_INDEX_DTYPE]} bytes per example"
        )
    return 0


def inspected_model(spec: str, precision: str) -> torch.nn.Module:
    """The model `inspect` reports on: a directory holding a `config.json` but no weights is built on
    the meta device (shapes only, nothing allocated), so a model can be planned before it is downloaded."""
    import torch

    from moe_attrib.workflows.loading import load_model, resolve_precision

    path = Path(spec)
    weights = ("*.safetensors", "*.bin", "*.pt", "*.pth")
    if path.is_dir() and (path / "config.json").exists() and not any(any(path.glob(w)) for w in weights):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=resolve_precision(precision, torch.device("cpu")))
    return load_model(spec, precision)


def resume_command(argv: list[str]) -> str:
    argv = list(argv) + ([] if "--resume" in argv else ["--resume"])
    return "moe-attrib " + shlex.join(argv)


def cmd_build(args: argparse.Namespace) -> int:
    from moe_attrib.indexing.index import part_dir
    from moe_attrib.workflows.attribution import build_from_files

    check_projection_flags(args)
    fitting = not args.ekfac and not seeded_flags(args)  # the default: an eigenbasis index, its factors fitted here
    if args.index_dtype is None:
        args.index_dtype = EIGENBASIS_INDEX_DTYPE if fitting or args.ekfac else DEFAULT_INDEX_DTYPE
    if args.projection_dim is None:
        args.projection_dim = DEFAULT_PROJECTION_DIM
    settings = CollectSettings.from_args(args, projection_dim=projection(args))
    try:
        with value_errors(), notes():
            path = build_from_files(
                args.model, args.data, args.index, settings, reading=DataSettings.from_args(args), ekfac=args.ekfac,
                fit=EkfacSettings() if fitting else None, precision=args.precision, device=args.device,
                fsdp=args.fsdp, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet, log=say,
            )  # fmt: skip
    except KeyboardInterrupt:
        if part_dir(args.index).exists():
            print(f"\ninterrupted; continue with: {resume_command(args.argv)}", file=sys.stderr)
        else:
            print("\ninterrupted before anything was written; run the command again.", file=sys.stderr)
        return 130
    if is_main_process():
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        print(f"index written to {path} ({manifest['rows']:,} rows for {manifest['examples']:,} examples)")
        if fitting:
            print(f"with the EK-FAC factors it was built on: `moe-attrib score --index {path} ...` preconditions "
                  "with them")  # fmt: skip
    return 0


def seeded_flags(args: argparse.Namespace) -> list[str]:
    """The `build` flags given that ask for rows of seeded projections instead of the default eigenbasis rows."""
    given = {
        "--projection_dim": args.projection_dim is not None,
        "--no_projection": args.no_projection,
        "--output_projection_dim": args.output_projection_dim is not None,
        "--optimizer_state": bool(args.optimizer_state),
        "--expert_blocks sum": args.expert_blocks == "sum",
    }
    return [flag for flag, on in given.items() if on]


def say(line: str) -> None:
    """A line of what a command is doing, shown at once (before the work it is about)."""
    print(line, flush=True)


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or the only process."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def check_projection_flags(args: argparse.Namespace) -> None:
    """`--projection_dim` and `--no_projection` together contradict each other."""
    from moe_attrib.workflows.checks import UsageError

    if args.no_projection and args.projection_dim is not None:
        raise UsageError(
            f"--projection_dim {args.projection_dim} and --no_projection contradict each other; pass one of them."
        )


def index_projection(args: argparse.Namespace):
    """`ekfac --index DIR`: the index whose projection settings the factors must share (or None)."""
    from moe_attrib.workflows.checks import UsageError

    if not args.index:
        return None
    from moe_attrib.collect.projection import projection_kind
    from moe_attrib.indexing.index import load_index

    index = load_index(args.index)
    made = index.settings
    st = made.collect
    if args.projection_dim is None and not args.no_projection:
        args.projection_dim = st.projection_dim
        args.no_projection = st.projection_dim is None
    if args.seed is None:
        args.seed = st.seed
    args.projection_kind = projection_kind(index.manifest["settings"])
    if args.precision == "auto":  # the index's weights fingerprint is of the model in the index's dtype
        args.precision = PRECISIONS.get(made.dtype, "auto")
    if (projection(args), args.seed) != (st.projection_dim, st.seed):
        raise UsageError(
            f"--projection_dim {args.projection_dim} --seed {args.seed} differ from the index {args.index} "
            f"(projection_dim {st.projection_dim}, seed {st.seed}); leave them out to use the index's."
        )
    index_output = own_output_dim(st.projection_dim, st.output_projection_dim)
    if args.output_projection_dim is None:  # the index's; none of its own: like every block
        args.output_projection_dim = index_output or projection(args)
    if own_output_dim(projection(args), args.output_projection_dim) != index_output:
        raise UsageError(
            f"--output_projection_dim {args.output_projection_dim} differs from the index {args.index}'s "
            f"({index_output or 'that of every block'}); leave it out to use the index's."
        )
    if args.track_moe_experts != st.track_moe_experts:
        if args.track_moe_experts:
            raise UsageError(
                f"--track_moe_experts: the index {args.index} was built without it, so its rows have no expert "
                "blocks; leave it out (or rebuild the index with it)."
            )
        args.track_moe_experts = True
        print(f"NOTE: the index {args.index} tracks the experts; fitting their factors too (--track_moe_experts).",
              file=sys.stderr)  # fmt: skip
    if args.filter_modules != st.filter_modules:
        if args.filter_modules is not None:
            raise UsageError(
                f"--filter_modules {args.filter_modules!r} differs from the index {args.index}'s "
                f"({st.filter_modules!r}); leave it out to use the index's."
            )
        args.filter_modules = st.filter_modules
    return index


def cmd_ekfac(args: argparse.Namespace) -> int:
    from moe_attrib.collect.projection import PROJECTION
    from moe_attrib.workflows.attribution import fit_from_files
    from moe_attrib.workflows.checks import check_device, check_model_spec, check_out_dir

    check_projection_flags(args)
    check_model_spec(args.model)  # before the index is read
    check_device(args.device)
    check_device(args.factor_device, "--factor_device")
    check_out_dir(args.out, args.overwrite, "--out")
    index_projection(args)
    args.seed = 0 if args.seed is None else args.seed
    if args.projection_dim is None and not args.no_projection:  # no --index: factors for eigenbasis builds
        args.projection_dim = EIGENBASIS_SKETCH
        if args.output_projection_dim is None:
            args.output_projection_dim = EIGENBASIS_OUTPUT_SKETCH
    if args.output_projection_dim is None:
        args.output_projection_dim = DEFAULT_OUTPUT_PROJECTION_DIM
    collect = CollectSettings.from_args(args, projection_dim=projection(args))
    with value_errors(), notes():
        fit_from_files(
            args.model, args.data, args.out, EkfacSettings.from_args(args),
            collect=collect.replace(projection=getattr(args, "projection_kind", PROJECTION)), index=args.index,
            reading=DataSettings.from_args(args), precision=args.precision, device=args.device, fsdp=args.fsdp,
            overwrite=args.overwrite, progress=not args.quiet, log=say,
        )  # fmt: skip
    if is_main_process():
        print(f"EK-FAC factors written to {args.out}")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from moe_attrib.scoring.results import results_format, write_results
    from moe_attrib.workflows.attribution import QueryReading, score_queries

    if args.run:
        return cmd_score_run(args)

    def check_files(index) -> None:  # before any compute: new outputs, none of them an input
        check_score_outputs(args, index.settings)
        results_format(args.out)

    reading = QueryReading(args.text_field, args.tokenizer, not args.no_texts, args.id_field)
    with value_errors():
        done = score_queries(
            args.index, args.model, args.queries, ScoreSettings.from_args(args), ekfac=args.ekfac,
            refine=RefineSettings.from_args(args), refine_ekfac=args.refine_ekfac, all_scores=args.all_scores,
            average_with=args.average_with, reading=reading, device=args.device, fsdp=args.fsdp,
            before_work=check_files, log=print,
        )  # fmt: skip
    if done is None:  # another rank than 0 of an --fsdp run
        return 0
    write_results(done.records, args.out)
    print(f"scores for {len(done.queries)} queries written to {args.out}")
    if args.report:
        from moe_attrib.app.report import write_report

        print(f"report written to {write_report(done.records, done.index, args.report)}")
    return 0


@contextlib.contextmanager
def value_errors():
    """A plain `ValueError` raised by the library for what a command line asked (an argument no module
    matches, a budget that buys nothing) reaches `main()` as a `UsageError`: one line, exit status 2."""
    from moe_attrib.workflows.checks import UsageError

    try:
        yield
    except ValueError as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from err


def index_inputs(path: str, settings: IndexSettings) -> dict[str, str | None]:
    """The files an index records (and the index itself): no command's output may replace them."""
    recorded = {
        "the index": path,
        "the training data the index records": settings.data,
        "the tokenizer the index records": settings.reading.tokenizer,
        "the optimizer state the index records": settings.collect.optimizer_state,
        "the model the index records": settings.model,
    }
    return {what: p for what, p in recorded.items() if p and Path(p).exists()}


def check_score_outputs(args: argparse.Namespace, settings: IndexSettings) -> None:
    """`score`'s output files: new (or `--overwrite`), distinct, and none of the run's inputs."""
    from moe_attrib.outputs import check_outputs
    from moe_attrib.workflows.ensemble import info_path

    inputs = {"the queries": args.queries, **index_inputs(args.index, settings)}
    if Path(args.model).exists():
        inputs["the model"] = args.model
    if args.tokenizer:
        inputs["the tokenizer"] = args.tokenizer
    for d in args.ekfac or []:
        inputs[f"the EK-FAC factors {d}"] = d
    for m in args.average_with or []:
        inputs[f"the --average_with matrix {m}"] = m
        inputs[f"the --average_with description {info_path(m)}"] = info_path(m)
    outs = {"--out": args.out, "--report": args.report, "--all_scores": args.all_scores}
    if args.all_scores:
        outs["--all_scores's description"] = info_path(args.all_scores)
    check_outputs(outs, overwrite=args.overwrite, inputs=inputs)


def cmd_score_run(args: argparse.Namespace) -> int:
    """`score --run RUN_DIR MODEL QUERIES`: every checkpoint of a training run (`moe_attrib.workflows.trainer`),
    ranked by the mean of their scores (`moe_attrib.workflows.ensemble.score_run`); MODEL gives the tokenizer."""
    from moe_attrib.data import load_examples
    from moe_attrib.outputs import check_outputs
    from moe_attrib.scoring.results import results_format, score_records, write_results
    from moe_attrib.workflows.attribution import training_examples
    from moe_attrib.workflows.checks import UsageError, check_device, check_model_spec
    from moe_attrib.workflows.ensemble import score_run
    from moe_attrib.workflows.loading import load_tokenizer

    for flag in ("ekfac", "all_scores", "average_with", "per_module", "fsdp"):
        if getattr(args, flag):
            raise UsageError(f"--{flag} does not go with --run (each checkpoint is scored with its own factors).")
    check_model_spec(args.model)
    check_device(args.device)
    results_format(args.out)
    inputs = {"the queries": args.queries, "the run": args.run, "the tokenizer": args.tokenizer}
    if Path(args.model).exists():
        inputs["the model"] = args.model
    check_outputs({"--out": args.out, "--report": args.report}, overwrite=args.overwrite, inputs=inputs)
    tokenizer = load_tokenizer(args.model, args.tokenizer)
    queries = load_examples(args.queries, tokenizer, args.text_field, None, True)
    run = score_run(
        args.run, queries, ScoreSettings.from_args(args), tokenizer=tokenizer,
        pad_id=getattr(tokenizer, "pad_token_id", None) or 0, device=args.device, progress=True,
    )  # fmt: skip
    settings = run.index.manifest["settings"]
    train = None if args.no_texts else training_examples(settings, tokenizer, args.text_field)
    print(f"ranked by the mean of {len(run.checkpoints)} checkpoints: {', '.join(p.name for p in run.checkpoints)}")
    records = score_records(
        queries, run.scores, run.index, train, id_field=args.id_field, query_counts=run.query_counts,
        tokenizer=tokenizer, query_source=args.queries,
    )  # fmt: skip
    write_results(records, args.out)
    print(f"scores for {len(queries)} queries written to {args.out}")
    if args.report:
        from moe_attrib.app.report import write_report

        print(f"report written to {write_report(records, run.index, args.report)}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from moe_attrib.app.report import show_text
    from moe_attrib.scoring.results import read_results

    records = read_results(args.scores)
    print(show_text(records, top=args.top, experts=args.experts))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from moe_attrib.app.report import write_report
    from moe_attrib.indexing.index import load_index
    from moe_attrib.outputs import check_output
    from moe_attrib.scoring.results import ResultsError, index_fingerprint, read_results

    index = load_index(args.index)
    inputs = {"the scores file being read": args.scores, **index_inputs(args.index, index.settings)}
    check_output(args.out, "--out", overwrite=args.overwrite, inputs=inputs)
    records = read_results(args.scores)
    own = index_fingerprint(index)
    carried = sorted({r["index_fingerprint"] for r in records if "index_fingerprint" in r})
    if carried and carried != [own]:
        raise ResultsError(
            f"{args.scores}: computed against another index than {args.index} (index fingerprint "
            f"{', '.join(carried)} vs {own}: another model, training data or build settings), so its routing "
            "and summary would be another model's; give the --index these scores were computed against."
        )
    if not carried and records:
        print(f"NOTE: {args.scores} carries no index fingerprint (written by an older moe-attrib); only its "
              "example numbers are checked against the index.", file=sys.stderr)  # fmt: skip
    unknown = sorted({h["example"] for r in records for h in r["results"]} - set(index.manifest["example_ids"]))
    if unknown:
        raise ResultsError(
            f"{args.scores}: examples {unknown[:5]} are not in the index {args.index}; "
            "give the index these scores were computed against."
        )
    print(f"report written to {write_report(records, index, args.out, top=args.top)}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from moe_attrib.app.info import format_summary, summarize

    print(format_summary(summarize(args.dir)))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from moe_attrib.app.demo import run_demo

    warnings.filterwarnings("ignore", message=".*--track_moe_experts.*")
    run_demo(args.out, steps=args.steps, seed=args.seed, projection_dim=args.projection_dim,
             progress=not args.quiet, overwrite=args.overwrite)  # fmt: skip
    return 0


def add_collection_args(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by `build` and `ekfac`: model, data and how they are batched."""
    parser.add_argument("model", help="tiny:<family>, a save_pretrained directory, or a hub id")
    parser.add_argument(
        "data", help="JSONL / JSON / text / CSV / Parquet file, a datasets directory, or a hub dataset (org/name)"
    )
    add_flags(parser, CollectSettings, ["track_moe_experts", "filter_modules"])
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="dtype the model runs in (auto: bf16 on a CUDA device that has it, else fp32)",
    )
    add_flags(parser, CollectSettings, ["token_batch_size"])
    add_flags(parser, DataSettings, ["max_length", "truncate", "text_field", "split", "tokenizer"])
    parser.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if available, else cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--fsdp", action="store_true", help=FSDP_HELP)
    add_flags(parser, CollectSettings, ["recompute"])


OVERWRITE_HELP = "replace output files that exist (never an input of the run, nor a file the index records)"
FSDP_HELP = "under torchrun: shard the model over the ranks with FSDP2 (models larger than one device)"


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after every option's help, except unset (None) and off (False) defaults and a
    help text that already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Shows defaults in `--help` (also of options without help text); subcommands get the same class.
    An argument error is one line, `moe-attrib <command>: error: ...`, and exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not action.help and action.option_strings and not unset:
            action.help = "(default: %(default)s)"
        return action


def add_projection_args(parser: argparse.ArgumentParser, from_index: bool = False) -> None:
    """`--projection_dim`/`--no_projection`/`--seed`, shared by `build` and `ekfac` (they must agree).

    With `from_index` (ekfac's `--index DIR`) both default to None: the index's, else the defaults."""
    index = {
        "help": f"p: each weight block is p x p (default: the index's; without --index {EIGENBASIS_SKETCH}, the "
        "sketch of factors for eigenbasis builds: docs/build.md)"
    }
    add_flags(parser, CollectSettings, ["projection_dim"], projection_dim=index if from_index else {})
    output = {
        "default": None,
        "help": f"the output layer's (lm_head's) own p (default: the index's; without --index and --projection_dim "
        f"{EIGENBASIS_OUTPUT_SKETCH})",
    }
    add_flags(parser, CollectSettings, ["output_projection_dim"], output_projection_dim=output if from_index else {})
    parser.add_argument("--no_projection", action="store_true", help="exact, unprojected rows (small models)")
    add_flags(parser, CollectSettings, ["seed"], seed={"default": None} if from_index else {})


def add_damping_args(parser: argparse.ArgumentParser, override: bool = False) -> None:
    """`--damping`/`--damping_scope`: the fit's damping, or (`override`, for score) a re-damping of fitted factors."""
    add_flags(parser, ScoreSettings if override else EkfacSettings, ["damping", "damping_scope"])


def add_coupling_args(parser: argparse.ArgumentParser) -> None:
    """`--coupling_gamma/_rank/_sample`: the cross-module coupling of the scores, and `--output_balance`
    (docs/scoring.md)."""
    add_flags(parser, ScoreSettings, ["coupling_gamma", "coupling_rank", "coupling_sample", "output_balance"])


def projection(args: argparse.Namespace) -> int | None:
    return None if args.no_projection else args.projection_dim


def build_parser() -> argparse.ArgumentParser:
    from moe_attrib import __version__

    parser = _Parser(
        prog="moe-attrib", description="Per-example gradient attribution for Mixture-of-Experts language models."
    )
    parser.add_argument("--version", action="version", version=f"moe-attrib {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="coverage table: what will be attributed, what not and why")
    inspect.add_argument("model", help="tiny:<family>, a save_pretrained directory, or a hub id")
    inspect.add_argument("--track_moe_experts", action="store_true", help="attribute every expert of fused MoE layers")
    inspect.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    inspect.set_defaults(func=cmd_inspect)

    build = sub.add_parser(
        "build",
        help="per-example gradients of a dataset, written to an index (by default in the EK-FAC eigenbasis, "
        "the factors fitted first and kept with it; --projection_dim P for seeded projections)",
    )
    add_collection_args(build)
    build.add_argument("--index", required=True, help="output directory (written as DIR.part, renamed when done)")
    add_projection_args(build)
    add_flags(
        build, CollectSettings, ["expert_blocks", "attribute_tokens", "optimizer_state", "index_dtype", "cuda_graphs"]
    )
    build.add_argument(
        "--ekfac",
        default=None,
        metavar="DIR",
        help="EK-FAC factors fitted already (moe-attrib ekfac --out DIR): rows in their eigenbasis, not fitted "
        f"again (default: fitted by this build, at --projection_dim {EIGENBASIS_SKETCH} --output_projection_dim "
        f"{EIGENBASIS_OUTPUT_SKETCH}; docs/build.md)",
    )
    add_flags(build, CollectSettings, ["budget"])
    build.add_argument("--resume", action="store_true", help="continue an interrupted build in DIR.part")
    build.add_argument("--overwrite", action="store_true", help="replace an existing index in DIR (only its files)")
    build.set_defaults(func=cmd_build)

    ekfac = sub.add_parser("ekfac", help="fit EK-FAC factors (per expert, routers, dense modules)")
    add_collection_args(ekfac)
    ekfac.add_argument("--out", required=True, help="output directory (safetensors + ekfac.json)")
    add_projection_args(ekfac, from_index=True)
    ekfac.add_argument("--index", default=None, help="index the factors are for: check model, take its projection")
    ekfac.add_argument("--overwrite", action="store_true", help="replace the factor files in a non-empty --out")
    add_damping_args(ekfac)
    add_flags(ekfac, EkfacSettings, ["sampled_labels", "fold_bias", "max_memory_gib", "factor_device"])
    ekfac.set_defaults(func=cmd_ekfac)

    sc = sub.add_parser("score", help="top training examples of an index for each query")
    source = sc.add_mutually_exclusive_group(required=True)
    source.add_argument("--index", help="the index to rank (a `moe-attrib build --index` directory)")
    source.add_argument("--run", help="a training run's directory: score every checkpoint-N (docs/trainer.md)")
    sc.add_argument(
        "model",
        help="the model the index was built from (its weights fingerprint is checked); with --run, its tokenizer",
    )
    sc.add_argument("queries", help="JSONL / text file of queries (same formats as build's DATA)")
    sc.add_argument(
        "--ekfac", action="append", default=None, help="EK-FAC dir fitted for the index (repeat for partitions)"
    )
    add_flags(sc, ScoreSettings, ["unit_normalize", "modules"])
    add_damping_args(sc, override=True)
    add_coupling_args(sc)
    sc.add_argument(
        "--all_scores",
        default=None,
        help="also write every score, a [queries, rows] .npy matrix (and FILE.json: what it scores)",
    )
    sc.add_argument(
        "--average_with",
        nargs="+",
        default=None,
        metavar="FILE",
        help="rank by the mean of this run's scores and these --all_scores matrices of other checkpoints "
        "(same data and queries): docs/scoring.md",
    )
    add_flags(sc, ScoreSettings, ["top_k"])
    add_flags(sc, RefineSettings, ["iterations"])
    sc.add_argument(
        "--refine_ekfac",
        default=None,
        metavar="DIR",
        help="EK-FAC fitted with --no_projection: the refinement's preconditioner (default: none, plain CG)",
    )
    add_flags(sc, RefineSettings, ["damping", "examples"])
    add_flags(sc, ScoreSettings, ["per_module"])
    sc.add_argument("--text_field", default="text", help="text field of the queries (the index records its own)")
    sc.add_argument("--tokenizer", default=None, help="default: the index's --tokenizer, else the model's")
    sc.add_argument("--no_texts", action="store_true", help="do not re-read the training data; hits have no text")
    sc.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    sc.add_argument("--fsdp", action="store_true", help=FSDP_HELP + " (query gradients; rank 0 scores)")
    sc.add_argument("--out", required=True, help="results file: .jsonl, .csv or .tsv (by extension)")
    sc.add_argument("--id_field", default=None, help="carry only this field of the records as `id` (default: all)")
    sc.add_argument("--report", default=None, metavar="FILE", help="also write the HTML report to FILE")
    sc.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    sc.set_defaults(func=cmd_score)

    show = sub.add_parser("show", help="terminal view of a results file: each query's top training examples")
    show.add_argument("scores", help="results of `moe-attrib score` (.jsonl, .csv or .tsv)")
    show.add_argument("--top", type=positive_int, default=5, help="training examples per query")
    show.add_argument(
        "--experts", type=nonnegative_int, default=3, help="largest per-expert parts per hit (with --per_module)"
    )
    show.set_defaults(func=cmd_show)

    rep = sub.add_parser("report", help="self-contained HTML report of a results file")
    rep.add_argument("--index", required=True, help="the index the scores were computed against")
    rep.add_argument("scores", help="results of `moe-attrib score` (.jsonl, .csv or .tsv)")
    rep.add_argument("--out", required=True, help="HTML file to write")
    rep.add_argument(
        "--top", type=positive_int, default=None, help="training examples per query (default: all in the file)"
    )
    rep.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    rep.set_defaults(func=cmd_report)

    info = sub.add_parser("info", help="summary of an index or EK-FAC directory")
    info.add_argument("dir", help="an index (build --index) or EK-FAC (ekfac --out) directory")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="offline end-to-end demo on a tiny MoE with planted facts")
    demo.add_argument("--out", default="moe-attrib-demo")
    demo.add_argument("--steps", type=positive_int, default=300, help="training steps of the tiny model")
    demo.add_argument("--projection_dim", type=positive_int, default=32)
    demo.add_argument("--overwrite", action="store_true", help="replace the demo's own files in a non-empty --out")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure a user can act on is one line on stderr and exit status 2;
    Ctrl-C is one line and 130 (no output file is left half-written: `moe_attrib.outputs`); a closed
    pipe (`show ... | head`) ends quietly. `moe_attrib.errors.exit_code` says which is which; anything
    else is a bug and keeps its traceback. MOE_ATTRIB_TRACEBACK=1 shows the tracebacks instead."""
    from moe_attrib.errors import error_text, exit_code

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    name = f"moe-attrib {args.command}"
    try:
        return args.func(args)
    except (KeyboardInterrupt, Exception) as err:
        code = exit_code(err)
        if code is None:
            raise
        if isinstance(err, BrokenPipeError):  # the reader went away (`show ... | head`): stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return code
        if os.environ.get("MOE_ATTRIB_TRACEBACK"):
            raise
        if isinstance(err, KeyboardInterrupt):
            print(f"\n{name}: interrupted; files it writes are left as they were.", file=sys.stderr)
        else:
            print(f"{name}: error: {error_text(err)}", file=sys.stderr)
        return code
    finally:
        if "torch.distributed" in sys.modules:  # a command that ran may have joined a process group
            from moe_attrib.model.distributed import teardown

            teardown()


if __name__ == "__main__":
    sys.exit(main())
