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

import numpy as np
import torch

from moe_attrib.checks import (
    UsageError,
    check_collection_args,
    check_device,
    check_ekfac_dirs,
    check_model_spec,
    check_out_dir,
    check_parent_writable,
    nonnegative_int,
    positive_int,
)
from moe_attrib.distributed import teardown
from moe_attrib.loading import load_model, load_tokenizer, model_name, resolve_precision
from moe_attrib.settings import (
    DEFAULT_PROJECTION_DIM,
    CollectSettings,
    EkfacSettings,
    RefineSettings,
    ScoreSettings,
    add_flags,
    from_args,
)


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
    from moe_attrib.discovery import discover

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
        from moe_attrib.index import DEFAULT_INDEX_DTYPE, DEFAULT_PROJECTION_DIM, INDEX_DTYPES, column_plan

        columns = column_plan(report, DEFAULT_PROJECTION_DIM, "separate")[-1].stop
        size = np.dtype(INDEX_DTYPES[DEFAULT_INDEX_DTYPE]).itemsize
        print(f"\ndefault index (p={DEFAULT_PROJECTION_DIM}, {DEFAULT_INDEX_DTYPE}): {columns} columns per example")
        print(f"index bytes per example: {columns * size}")
    return 0


def inspected_model(spec: str, precision: str) -> torch.nn.Module:
    """The model `inspect` reports on: a directory holding a `config.json` but no weights is built on
    the meta device (shapes only, nothing allocated), so a model can be planned before it is downloaded."""
    path = Path(spec)
    weights = ("*.safetensors", "*.bin", "*.pt", "*.pth")
    if path.is_dir() and (path / "config.json").exists() and not any(any(path.glob(w)) for w in weights):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=resolve_precision(precision, torch.device("cpu")))
    return load_model(spec, precision)


def load_inputs(args: argparse.Namespace, dist):
    """Tokenizer, examples and model (on the rank's device) for `build` and `ekfac`. Rows longer than
    the model's context are an error naming the row, or with `--truncate` cut there (`--max_length`
    then records the cut, so that `score` reads the same rows again)."""
    from moe_attrib.data import check_context, check_token_ids, context_length, load_examples

    tokenizer = load_tokenizer(args.model, args.tokenizer)
    examples = load_examples(args.data, tokenizer, args.text_field, args.max_length, args.truncate, args.split)
    dtype = resolve_precision(args.precision, dist.device)
    if dist.fsdp:
        from moe_attrib.sharding import load_sharded

        model = load_sharded(args.model, dtype, dist)
    else:
        model = load_model(args.model, dtype).to(dist.device)
    check_token_ids(examples, model.get_input_embeddings().num_embeddings, args.data)
    context = context_length(model)
    check_context(examples, context, args.data, args.truncate)
    if args.truncate and context is not None and (args.max_length is None or args.max_length > context):
        args.max_length = context
    return tokenizer, examples, model, getattr(tokenizer, "pad_token_id", None) or 0


def fit_model(args: argparse.Namespace, dist, command: str):
    """Before loading: does the model fit one device? A local safetensors checkpoint's size (from its
    headers) against the device's free memory; under torchrun a model that does not fit is sharded
    (`--fsdp`) automatically, without torchrun the error says how to launch it. Returns the `Dist`."""
    from moe_attrib.distributed import setup
    from moe_attrib.loading import checkpoint_numel, device_free_bytes
    from moe_attrib.plan import choose_sharding

    numel, free = checkpoint_numel(args.model), device_free_bytes(dist.device)
    if numel is None or free is None:
        return dist
    if torch.distributed.is_initialized() and dist.world > 1:  # one decision for every rank: the tightest device
        least = torch.tensor([free], dtype=torch.int64, device=dist.device)
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        free = int(least.item())
    size = torch.empty((), dtype=resolve_precision(args.precision, dist.device)).element_size()
    torchrun = "MASTER_ADDR" in os.environ
    shard, note = choose_sharding(numel * size, free, dist.world, dist.fsdp, torchrun, command)
    if shard and not dist.fsdp:
        if dist.is_main:
            print(f"moe-attrib {command}: {note}", flush=True)
        args.fsdp = True
        dist = setup(args.device, fsdp=True)
    return dist


def print_sharding_plan(args: argparse.Namespace, model, dist, factors: bool = False) -> None:
    """`--fsdp`: the memory plan per rank (parameters, activations, routed grid, factors) before the run."""
    if not dist.fsdp or not dist.is_main:
        return
    from moe_attrib.plan import format_memory_plan, memory_plan
    from moe_attrib.projection import PROJECTION

    kind = getattr(args, "projection_kind", PROJECTION)
    plan = memory_plan(
        model, dist.world, args.token_batch_size, projection(args), args.track_moe_experts, factors, kind,
        args.recompute_layers,
    )  # fmt: skip
    print(format_memory_plan(plan), flush=True)


def data_settings(args: argparse.Namespace, tokenizer) -> dict:
    """What an index / factors record so that the data can be read again exactly, from any directory."""
    from moe_attrib.data import source_path
    from moe_attrib.fingerprint import tokenizer_fingerprint

    return {
        "data": source_path(str(args.data)),
        "text_field": args.text_field,
        "split": args.split,
        "tokenizer": source_path(args.tokenizer) if args.tokenizer else None,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "max_length": args.max_length,
        "truncate": args.truncate,
    }


def resume_command(argv: list[str]) -> str:
    argv = list(argv) + ([] if "--resume" in argv else ["--resume"])
    return "moe-attrib " + shlex.join(argv)


def cmd_build(args: argparse.Namespace) -> int:
    from moe_attrib.build import build_index, check_graphable
    from moe_attrib.data import DataError
    from moe_attrib.distributed import setup
    from moe_attrib.experts import LayoutError
    from moe_attrib.index import IndexFileError, check_index_target, part_dir

    try:
        check_collection_args(args)
        if args.projection_dim is None:
            from moe_attrib.index import DEFAULT_PROJECTION_DIM

            args.projection_dim = DEFAULT_PROJECTION_DIM
        if not args.resume:
            check_index_target(args.index, args.overwrite)
        check_parent_writable(Path(args.index), "--index")
        factors, budget = eigenbasis_args(args)
    except (UsageError, IndexFileError, ValueError) as err:
        print(f"moe-attrib build: error: {err}", file=sys.stderr)
        return 2
    try:
        dist = fit_model(args, setup(args.device, fsdp=args.fsdp), "build")
        if args.cuda_graphs == "on":
            check_graphable(dist.device, args.recompute_layers, args.fsdp)
    except (RuntimeError, UsageError, ValueError) as err:
        print(f"moe-attrib build: error: {err}", file=sys.stderr)
        return 2
    try:
        with notes():
            tokenizer, examples, model, pad = load_inputs(args, dist)
            print_sharding_plan(args, model, dist)
            path = build_index(
                model,
                examples,
                args.index,
                from_args(CollectSettings, args, projection_dim=projection(args), budget=budget),
                model_name=model_name(args.model),
                ekfac=factors,
                resume=args.resume,
                overwrite=args.overwrite,
                pad_id=pad,
                extra_settings=data_settings(args, tokenizer),
                dist=dist,
                progress=not args.quiet,
            )
    except KeyboardInterrupt:
        if part_dir(args.index).exists():
            print(f"\ninterrupted; continue with: {resume_command(args.argv)}", file=sys.stderr)
        else:
            print("\ninterrupted before anything was written; run the command again.", file=sys.stderr)
        return 130
    except (DataError, IndexFileError, LayoutError, UsageError, ValueError) as err:  # OptimizerStateError
        print(f"moe-attrib build: error: {err}", file=sys.stderr)
        return 2
    if dist.is_main:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        print(f"index written to {path} ({manifest['rows']:,} rows for {manifest['examples']:,} examples)")
    return 0


def eigenbasis_args(args: argparse.Namespace):
    """`build --ekfac DIR [--budget SIZE]`: the factors (on the CPU) and the budget in bytes, checked
    before any work; `(None, None)` for an index of seeded projections."""
    from moe_attrib.eigenbasis import DEFAULT_BUDGET, parse_bytes
    from moe_attrib.ekfac import load_ekfac
    from moe_attrib.index import DEFAULT_PROJECTION_DIM

    if not args.ekfac:
        if args.budget is not None:
            raise UsageError("--budget allocates the eigen-directions of EK-FAC factors: give them with --ekfac DIR.")
        return None, None
    budget = parse_bytes(args.budget or DEFAULT_BUDGET)
    if args.expert_blocks != "separate" or args.optimizer_state:
        raise UsageError("--ekfac (an eigenbasis index) needs --expert_blocks separate and no --optimizer_state.")
    factors = load_ekfac(args.ekfac)
    sketch = factors.projection_dim
    if (
        args.no_projection
        or args.projection_dim not in (DEFAULT_PROJECTION_DIM, sketch)
        or args.seed not in (0, factors.seed)
    ):
        raise UsageError(
            f"--ekfac {args.ekfac}: an eigenbasis index uses the factors' sketch (projection_dim {sketch}, seed "
            f"{factors.seed}); leave out --projection_dim, --no_projection and --seed."
        )
    return factors, budget


def index_projection(args: argparse.Namespace):
    """`ekfac --index DIR`: the index whose projection settings the factors must share (or None)."""
    if not args.index:
        return None
    from moe_attrib.index import load_index
    from moe_attrib.projection import projection_kind

    index = load_index(args.index)
    st = index.manifest["settings"]
    if args.projection_dim is None and not args.no_projection:
        args.projection_dim = st["projection_dim"]
        args.no_projection = st["projection_dim"] is None
    if args.seed is None:
        args.seed = st["seed"]
    args.projection_kind = projection_kind(st)
    if args.precision == "auto":  # the index's weights fingerprint is of the model in the index's dtype
        args.precision = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(
            st.get("dtype"), "auto"
        )
    if (projection(args), args.seed) != (st["projection_dim"], st["seed"]):
        raise UsageError(
            f"--projection_dim {args.projection_dim} --seed {args.seed} differ from the index {args.index} "
            f"(projection_dim {st['projection_dim']}, seed {st['seed']}); leave them out to use the index's."
        )
    if args.track_moe_experts != bool(st.get("track_moe_experts")):
        if args.track_moe_experts:
            raise UsageError(
                f"--track_moe_experts: the index {args.index} was built without it, so its rows have no expert "
                "blocks; leave it out (or rebuild the index with it)."
            )
        args.track_moe_experts = True
        print(f"NOTE: the index {args.index} tracks the experts; fitting their factors too (--track_moe_experts).",
              file=sys.stderr)  # fmt: skip
    if args.filter_modules != st.get("filter_modules"):
        if args.filter_modules is not None:
            raise UsageError(
                f"--filter_modules {args.filter_modules!r} differs from the index {args.index}'s "
                f"({st.get('filter_modules')!r}); leave it out to use the index's."
            )
        args.filter_modules = st.get("filter_modules")
    return index


def cmd_ekfac(args: argparse.Namespace) -> int:
    from moe_attrib.data import DataError, fingerprint
    from moe_attrib.distributed import setup
    from moe_attrib.ekfac import FactorMemoryError, fit_ekfac
    from moe_attrib.experts import LayoutError
    from moe_attrib.fingerprint import FingerprintError, check_model
    from moe_attrib.index import IndexFileError
    from moe_attrib.projection import PROJECTION

    try:
        check_collection_args(args)
        check_device(args.factor_device, "--factor_device")
        check_out_dir(args.out, args.overwrite, "--out")
        index = index_projection(args)
    except (UsageError, IndexFileError) as err:
        print(f"moe-attrib ekfac: error: {err}", file=sys.stderr)
        return 2
    args.seed = 0 if args.seed is None else args.seed
    if args.projection_dim is None:
        from moe_attrib.index import DEFAULT_PROJECTION_DIM

        args.projection_dim = DEFAULT_PROJECTION_DIM
    try:
        dist = fit_model(args, setup(args.device, fsdp=args.fsdp), "ekfac")
    except (RuntimeError, UsageError) as err:
        print(f"moe-attrib ekfac: error: {err}", file=sys.stderr)
        return 2
    try:
        with notes():
            tokenizer, examples, model, pad = load_inputs(args, dist)
            print_sharding_plan(args, model, dist, factors=True)
            if index is not None:
                check_model(index.manifest["settings"], model, tokenizer, what=f"index {args.index}")
            collect = from_args(CollectSettings, args, projection_dim=projection(args))
            result = fit_ekfac(
                model,
                examples,
                from_args(EkfacSettings, args, factor_device=args.factor_device or dist.device),
                collect=collect.replace(projection=getattr(args, "projection_kind", PROJECTION)),
                pad_id=pad,
                dist=dist,
                progress=not args.quiet,
            )
    except (DataError, LayoutError, FactorMemoryError, FingerprintError, UsageError, ValueError) as err:
        print(f"moe-attrib ekfac: error: {err}", file=sys.stderr)
        return 2
    if dist.is_main:
        settings = data_settings(args, tokenizer)
        settings.update(
            model=model_name(args.model),
            data_fingerprint=fingerprint(examples),
            dtype=str(next(model.parameters()).dtype),
        )
        result.settings.update(settings)
        result.save(args.out)
        print(f"EK-FAC factors written to {args.out}")
    dist.barrier()  # every rank leaves together, after rank 0 has written
    return 0


def training_examples(settings: dict, tokenizer, text_field: str) -> list:
    """The index's training examples (texts, record fields), read again from the recorded data; an
    error when the data no longer tokenize to what the index was built from (texts would land on
    the wrong rows)."""
    from moe_attrib.data import DataError, fingerprint, load_examples

    source = settings["data"]
    try:
        train = load_examples(
            source,
            tokenizer,
            settings.get("text_field", text_field),
            settings.get("max_length"),
            bool(settings.get("truncate")),
            settings.get("split"),
        )
    except DataError as err:
        raise DataError(
            f"cannot read the index's training data again for its texts: {err} (or pass --no_texts)."
        ) from err
    if fingerprint(train) != settings["data_fingerprint"]:
        raise DataError(
            f"the training data {source} changed since the index was built (its token fingerprint differs), so "
            "texts would be attached to the wrong rows; restore it, or pass --no_texts to score without texts."
        )
    return train


def cmd_score(args: argparse.Namespace) -> int:
    from moe_attrib.balance import check_memory as check_balance_memory
    from moe_attrib.balance import resolve_balance
    from moe_attrib.coupling import check_memory as check_coupling_memory
    from moe_attrib.coupling import fit_coupling
    from moe_attrib.data import DataError, check_context, check_token_ids, context_length, fingerprint, load_examples
    from moe_attrib.eigenbasis import check_factors
    from moe_attrib.ekfac import load_ekfac
    from moe_attrib.ensemble import info_path, load_matrices, matrix_info
    from moe_attrib.fingerprint import FingerprintError, check_model
    from moe_attrib.index import IndexFileError, load_index
    from moe_attrib.outputs import scratch, write_text
    from moe_attrib.results import results_format, write_results
    from moe_attrib.score import ScoreError, query_gradients, score

    if args.run:
        return cmd_score_run(args)
    try:
        check_model_spec(args.model)
        check_device(args.device)
        if (args.damping is not None or args.damping_scope is not None) and not args.ekfac:
            raise UsageError("--damping / --damping_scope re-damp EK-FAC factors; give --ekfac DIR (without it "
                             "nothing is preconditioned and they would change nothing).")  # fmt: skip
        for path in args.average_with or []:
            if args.all_scores and Path(path).resolve() == Path(args.all_scores).resolve():
                raise UsageError(f"--all_scores {args.all_scores} is also given to --average_with.")
        index = load_index(args.index)
        settings = index.manifest["settings"]
        check_score_outputs(args, settings)
        results_format(args.out)
        ekfac_dirs = args.ekfac or []
        check_ekfac_dirs(ekfac_dirs, settings, args.index)
        if settings.get("eigenbasis") and ekfac_dirs:  # the factors its rows were rotated with, before any work
            check_factors(settings, load_ekfac(ekfac_dirs if len(ekfac_dirs) > 1 else ekfac_dirs[0]), args.index)
        tokenizer = load_tokenizer(args.model, args.tokenizer or settings.get("tokenizer"))
        check_model(settings, None, tokenizer, what=f"index {args.index}")
        train = None if args.no_texts else training_examples(settings, tokenizer, args.text_field)
        queries = load_examples(args.queries, tokenizer, args.text_field, settings.get("max_length"), True)
        if args.id_field:  # before any work: every query and training row must carry it
            check_id_field(queries, args.id_field, args.queries)
            if train is not None:
                check_id_field(train, args.id_field, settings["data"])
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))  # --fsdp: its rank's
        coupled = coupling_args(args)
        if args.refine:  # the refined IHVP replaces EK-FAC, coupling and balance (docs/scoring.md#refinement)
            coupled, ekfac_dirs, args.output_balance = check_refine(args, index), [], False
        if coupled:  # before the model is loaded
            check_coupling_memory(index, args.coupling_sample, device, args.coupling_rank)
        balanced = args.output_balance and args.modules is None  # a --modules score is never balanced
        if balanced:
            check_balance_memory(index)
        scored_with = (args.unit_normalize, args.modules, bool(ekfac_dirs), coupled, balanced)
        own = matrix_info(index, fingerprint(queries), len(queries), *scored_with)
        others = load_matrices(args.average_with, own) if args.average_with else []  # checked before any work
        dtype = getattr(torch, settings["dtype"].removeprefix("torch."))
        if args.fsdp:  # query gradients with the model sharded over torchrun's ranks; rank 0 scores
            from moe_attrib.distributed import setup
            from moe_attrib.sharding import load_sharded

            try:
                dist = setup(args.device, fsdp=True)
            except RuntimeError as err:
                raise UsageError(str(err)) from err
            device, model = dist.device, load_sharded(args.model, dtype, dist)
        else:
            dist, model = None, load_model(args.model, dtype)
        check_model(settings, model, what=f"index {args.index}")
        check_token_ids(queries, model.get_input_embeddings().num_embeddings, args.queries)
        check_context(queries, context_length(model), args.queries, truncate=False, can_truncate=False)
        if dist is None:
            model = model.to(device)
        ekfac = load_ekfac(ekfac_dirs if len(ekfac_dirs) > 1 else ekfac_dirs[0]) if ekfac_dirs else None
        pad = getattr(tokenizer, "pad_token_id", None) or 0
        longest = max(len(ex.input_ids) for ex in queries)
        q, query_counts = query_gradients(
            model, queries, index, pad_id=pad, with_counts=True, token_batch_size=max(8192, longest)
        )
        if args.refine:
            q = refine_cli(args, model, index, training_examples(settings, tokenizer, args.text_field), queries, pad)
        if dist is not None and not dist.is_main:
            return 0
        if ekfac is not None and (args.damping is not None or args.damping_scope is not None):
            damping = ekfac.settings.get("damping") if args.damping is None else args.damping
            ekfac = ekfac.with_damping(damping, args.damping_scope or ekfac.settings.get("damping_scope", "expert"))
        opts = dict(ekfac=ekfac, unit_normalize=args.unit_normalize, modules=args.modules, device=device)
        opts["coupling"] = fit_coupling(index, **opts, **coupled, progress=True) if coupled else None
        if opts["coupling"] is not None:
            st = opts["coupling"].settings
            print(f"cross-module coupling: gamma {st['gamma']:g}, rank {st['rank']}, from {st['sample']} of "
                  f"{st['rows']} index rows (--coupling_gamma 0 turns it off)")  # fmt: skip
        opts["balance"] = resolve_balance(index, "auto" if balanced else None, **opts, progress=True)
        if opts["balance"] is not None:
            print(f"output-layer balance: lm_head's vote counted as much as the whole model's, spreads from "
                  f"{opts['balance'].settings['sample']} index rows (--no-output_balance turns it off)")  # fmt: skip
        with scratch(args.all_scores) as matrix:  # --all_scores's temporary name, renamed into place below
            if others or args.all_scores:  # one pass over the index: the top-k is read back from the matrix
                result = matrix_scores(args, index, q, others, opts, matrix)
            else:
                result = score(index, q, top_k=args.top_k, per_module=args.per_module, progress=True, **opts)
            records = result_records(args, index, queries, train, tokenizer, q, query_counts, ekfac, opts, result)
            if args.all_scores:  # no moment where the old description sits beside the new matrix
                info_path(args.all_scores).unlink(missing_ok=True)
                os.replace(matrix, args.all_scores)
                write_text(info_path(args.all_scores), json.dumps(own, indent=2))
    except (DataError, IndexFileError, ScoreError, FingerprintError, UsageError, FileNotFoundError, ValueError) as err:
        print(f"moe-attrib score: error: {err}", file=sys.stderr)
        return 2
    write_results(records, args.out)
    print(f"scores for {len(queries)} queries written to {args.out}")
    if args.report:
        from moe_attrib.report import write_report

        print(f"report written to {write_report(records, index, args.report)}")
    return 0


def index_inputs(path: str, settings: dict) -> dict[str, str | None]:
    """The files an index records (and the index itself): no command's output may replace them."""
    recorded = {
        "the index": path,
        "the training data the index records": settings.get("data"),
        "the tokenizer the index records": settings.get("tokenizer"),
        "the optimizer state the index records": settings.get("optimizer_state"),
        "the model the index records": settings.get("model"),
    }
    return {what: p for what, p in recorded.items() if p and Path(p).exists()}


def check_score_outputs(args: argparse.Namespace, settings: dict) -> None:
    """`score`'s output files: new (or `--overwrite`), distinct, and none of the run's inputs."""
    from moe_attrib.ensemble import info_path
    from moe_attrib.outputs import check_outputs

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


def check_id_field(examples: list, id_field: str, source: str) -> None:
    """`--id_field` names a scalar field of every row of `source` (checked before any compute)."""
    from moe_attrib.results import ResultsError

    for ex in examples:
        if id_field not in ex.fields:
            raise ResultsError(
                f"{source}: row {ex.index} has no scalar field {id_field!r} to use as --id_field "
                f"(its fields: {sorted(ex.fields) or 'none besides the text'})."
            )


def check_refine(args: argparse.Namespace, index) -> dict:
    """`score --refine`: what it cannot be combined with, refused before the model is loaded; no coupling."""
    if args.refine < 0 or args.refine_damping <= 0:
        raise UsageError(f"--refine {args.refine} / --refine_damping {args.refine_damping}: need N >= 0, D > 0.")
    for flag, given in (("--ekfac", args.ekfac), ("--fsdp", args.fsdp), ("--average_with", args.average_with)):
        if given:
            raise UsageError(f"--refine replaces EK-FAC scoring and cannot be combined with {flag}.")
    return {}


def refine_cli(args: argparse.Namespace, model, index, train: list, queries: list, pad: int):
    """`score --refine N`: the refined query rows (`moe_attrib.ihvp.refine_queries`), cost printed."""
    import numpy as np

    from moe_attrib.ekfac import load_ekfac
    from moe_attrib.ihvp import refine_queries

    ekfac = load_ekfac(args.refine_ekfac) if args.refine_ekfac else None
    refined = refine_queries(
        model, train, queries, index, from_args(RefineSettings, args), ekfac=ekfac, pad_id=pad, progress=True
    )
    print(f"refined {len(queries)} queries: {args.refine} CG iterations, {refined.products} GGN products per query "
          f"over {refined.settings['examples']} training rows, median relative residual "
          f"{float(np.median(refined.residuals[-1])):.3g}")  # fmt: skip
    return refined


def cmd_score_run(args: argparse.Namespace) -> int:
    """`score --run RUN_DIR MODEL QUERIES`: every checkpoint of a training run (`moe_attrib.trainer`), ranked by
    the mean of their scores (`moe_attrib.ensemble.score_run`); MODEL gives the tokenizer."""
    from moe_attrib.data import load_examples
    from moe_attrib.ensemble import score_run
    from moe_attrib.outputs import check_outputs
    from moe_attrib.results import results_format, score_records, write_results

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
        args.run, queries, from_args(ScoreSettings, args), tokenizer=tokenizer,
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
        from moe_attrib.report import write_report

        print(f"report written to {write_report(records, run.index, args.report)}")
    return 0


def matrix_scores(args: argparse.Namespace, index, q, others: list, opts: dict, matrix: Path):
    """`score --all_scores` / `--average_with`: the top-k of this run's score matrix (written to
    `matrix`, `--all_scores`'s temporary name, else a temporary file), or of its mean with `others`
    (other checkpoints', checked by `load_matrices`), in one pass over the index; per-module parts, if
    asked, are this checkpoint's part of each hit."""
    import tempfile

    from moe_attrib.ensemble import mean_top_k
    from moe_attrib.score import Scores, hit_parts, score_matrix

    with tempfile.TemporaryDirectory(prefix="moe-attrib-scores-") as tmp:
        out = matrix if args.all_scores else Path(tmp) / "scores.npy"
        mine = score_matrix(index, q, out=out, progress=True, **opts)
        values, rows = mean_top_k([mine, *others], args.top_k)
        del mine
    parts = hit_parts(index, q, rows, **opts) if args.per_module else None
    if others:
        print(f"ranked by the mean of {len(others) + 1} score matrices (this run's and --average_with's)")
    return Scores(values, rows, parts)


def result_records(args, index, queries, train, tokenizer, q, query_counts, ekfac, opts, result) -> list[dict]:
    """Score records with the query's routing and, for a token index, the hit examples' token shares."""
    import numpy as np

    from moe_attrib.details import token_scores
    from moe_attrib.results import score_records

    shares = None
    if index.token_offsets is not None:
        positions = np.searchsorted(index.token_offsets, result.rows.reshape(-1), side="right") - 1
        shares = token_scores(
            index,
            q,
            positions.tolist(),
            ekfac=ekfac,
            unit_normalize=args.unit_normalize,
            modules=args.modules,
            coupling=opts["coupling"],
            balance=opts["balance"],
        )
    return score_records(
        queries,
        result,
        index,
        train,
        id_field=args.id_field,
        query_counts=query_counts,
        token_scores=shares,
        tokenizer=tokenizer,
        query_source=args.queries,
    )


def cmd_show(args: argparse.Namespace) -> int:
    from moe_attrib.report import show_text
    from moe_attrib.results import ResultsError, read_results

    try:
        records = read_results(args.scores)
    except ResultsError as err:
        print(f"moe-attrib show: error: {err}", file=sys.stderr)
        return 2
    print(show_text(records, top=args.top, experts=args.experts))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from moe_attrib.index import IndexFileError, load_index
    from moe_attrib.outputs import check_output
    from moe_attrib.report import write_report
    from moe_attrib.results import ResultsError, index_fingerprint, read_results

    try:
        index = load_index(args.index)
        inputs = {"the scores file being read": args.scores, **index_inputs(args.index, index.manifest["settings"])}
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
    except (ResultsError, IndexFileError, UsageError) as err:
        print(f"moe-attrib report: error: {err}", file=sys.stderr)
        return 2
    print(f"report written to {write_report(records, index, args.out, top=args.top)}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from moe_attrib.info import InfoError, format_summary, summarize

    try:
        print(format_summary(summarize(args.dir)))
    except InfoError as err:
        print(f"moe-attrib info: error: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from moe_attrib.demo import DemoError, run_demo

    warnings.filterwarnings("ignore", message=".*--track_moe_experts.*")
    try:
        run_demo(args.out, steps=args.steps, seed=args.seed, projection_dim=args.projection_dim,
                 progress=not args.quiet, overwrite=args.overwrite)  # fmt: skip
    except DemoError as err:
        print(f"moe-attrib demo: error: {err}", file=sys.stderr)
        return 2
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
    parser.add_argument("--max_length", type=positive_int, default=None, help="longest example (see --truncate)")
    parser.add_argument("--truncate", action="store_true", help="cut examples longer than --max_length")
    parser.add_argument("--text_field", default="text", help="field of each record that holds its text")
    parser.add_argument("--split", default=None, help="split of a datasets directory / hub dataset (default: train)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory, for a model directory without one")
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
    index = {"help": f"p: each weight block is p x p (default {DEFAULT_PROJECTION_DIM}, or the index's)"}
    add_flags(parser, CollectSettings, ["projection_dim"], projection_dim=index if from_index else {})
    parser.add_argument("--no_projection", action="store_true", help="exact, unprojected rows (small models)")
    add_flags(parser, CollectSettings, ["seed"], seed={"default": None} if from_index else {})


def add_damping_args(parser: argparse.ArgumentParser, override: bool = False) -> None:
    """`--damping`/`--damping_scope`: the fit's damping, or (`override`, for score) a re-damping of fitted factors."""
    add_flags(parser, ScoreSettings if override else EkfacSettings, ["damping", "damping_scope"])


def add_coupling_args(parser: argparse.ArgumentParser) -> None:
    """`--coupling_gamma/_rank/_sample`: the cross-module coupling of the scores, and `--output_balance`
    (docs/scoring.md)."""
    add_flags(parser, ScoreSettings, ["coupling_gamma", "coupling_rank", "coupling_sample", "output_balance"])


def coupling_args(args: argparse.Namespace) -> dict | None:
    """The coupling's settings as given (None: off); they are part of how a score matrix was scored."""
    if args.coupling_gamma == 0:
        return None
    return {"gamma": args.coupling_gamma, "rank": args.coupling_rank, "sample": args.coupling_sample}


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

    build = sub.add_parser("build", help="per-example projected gradients of a dataset, written to an index")
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
        help="EK-FAC factors (moe-attrib ekfac --out DIR): store rows in their eigenbasis, columns allocated by "
        "--budget; the factors' sketch replaces --projection_dim/--seed (docs/build.md)",
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


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user can act on: `MoeAttribError` and the older classes of the modules that raise them."""
    from moe_attrib.build import NonFiniteGradientError
    from moe_attrib.ekfac import FactorMemoryError
    from moe_attrib.ensemble import EnsembleError
    from moe_attrib.errors import MoeAttribError
    from moe_attrib.experts import LayoutError
    from moe_attrib.fingerprint import FingerprintError
    from moe_attrib.index import IndexDtypeError, IndexFileError
    from moe_attrib.normalizers import OptimizerStateError
    from moe_attrib.precondition import ScoreError

    return (
        MoeAttribError, EnsembleError, FactorMemoryError, FingerprintError, IndexDtypeError, IndexFileError,
        LayoutError, NonFiniteGradientError, OptimizerStateError, ScoreError,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure a user can act on is one line on stderr and exit status 2;
    Ctrl-C is one line and 130 (no output file is left half-written: `moe_attrib.outputs`); a closed
    pipe (`show ... | head`) ends quietly. MOE_ATTRIB_TRACEBACK=1 shows the tracebacks instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    name = f"moe-attrib {args.command}"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if os.environ.get("MOE_ATTRIB_TRACEBACK"):
            raise
        print(f"\n{name}: interrupted; files it writes are left as they were.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`show ... | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (*user_errors(), OSError) as err:
        if os.environ.get("MOE_ATTRIB_TRACEBACK"):
            raise
        text = str(err) if not isinstance(err, OSError) or err.filename is None else f"{err.filename}: {err.strerror}"
        print(f"{name}: error: {text}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    finally:
        teardown()


if __name__ == "__main__":
    sys.exit(main())
