"""The three steps from files, one Python call each: what `moe-attrib build`, `ekfac` and `score` run.

`build_from_files` and `fit_from_files` read the model and the data (checked before any compute),
decide whether the model must be sharded, and build an index (`moe_attrib.workflows.build.build_index`) or fit
EK-FAC factors (`moe_attrib.curvature.ekfac.fit_ekfac`), recording how the data were read so that `score` reads
the same rows again. `score_queries` loads the index, the model and the queries, checks them against
each other, takes the queries' gradients, re-damps the factors if asked, fits the cross-module coupling
and the output-layer balance, optionally refines the queries, scores (top-k, or the whole matrix with
`all_scores` / `average_with`) and returns the result records that `moe_attrib.scoring.results.write_results`
writes. The CLI only parses its arguments into these calls and prints what they return
(docs/build.md, docs/ekfac.md, docs/scoring.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_attrib.curvature.ekfac import EKFAC
from moe_attrib.data import (
    DataError,
    Example,
    check_context,
    check_token_ids,
    context_length,
    fingerprint,
    load_examples,
)
from moe_attrib.indexing.index import Index, load_index
from moe_attrib.scoring.balance import Balance
from moe_attrib.scoring.coupling import Coupling
from moe_attrib.scoring.score import Scores
from moe_attrib.settings import (
    DEFAULT_BUDGET,
    DEFAULT_PROJECTION_DIM,
    EIGENBASIS_OUTPUT_SKETCH,
    EIGENBASIS_SKETCH,
    PRECISIONS,
    CollectSettings,
    DataSettings,
    EkfacSettings,
    RefineSettings,
    ScoreSettings,
    own_output_dim,
)
from moe_attrib.workflows.checks import (
    UsageError,
    check_device,
    check_ekfac_dirs,
    check_model_spec,
    check_out_dir,
    check_parent_writable,
)
from moe_attrib.workflows.loading import load_model, load_tokenizer, model_name, resolve_precision


def build_from_files(
    model: str,
    data: str | Path,
    index: str | Path,
    settings: CollectSettings | None = None,
    *,
    reading: DataSettings | None = None,
    ekfac: str | Path | None = None,
    fit: EkfacSettings | None = None,
    precision: str = "auto",
    device: str | None = None,
    fsdp: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build the index directory `index` of the training data file `data` for `model` (`tiny:<family>`, a
    `save_pretrained` directory or a hub id); returns its path.

    `settings` is how rows are collected (`moe_attrib.settings.CollectSettings`), `reading` how the data
    are read (`DataSettings`: text field, split, tokenizer, `max_length`/`truncate`; recorded in the
    manifest). With `ekfac` (a directory of fitted factors) rows are stored in their eigenbasis, `budget`
    bytes per example (`CollectSettings.budget`, default 1 MiB). With `fit` instead (how to fit them:
    `EkfacSettings`; what `moe-attrib build` does by default) the factors are fitted first, on the same model
    and data, at the eigenbasis sketch (`eigenbasis_collection`), and kept in the index directory; a resumed
    build reads them back from `INDEX.part` instead of fitting again. `precision` ("auto", "fp32", "bf16",
    "fp16") is the model's dtype. Under torchrun, `fsdp` shards the model over the ranks; a model that does
    not fit one device is sharded without it. `resume` continues an interrupted build in `INDEX.part`,
    `overwrite` replaces an existing index. Everything is checked before any compute. `log` receives
    the sharding decision and plan, e.g. `print`."""
    from moe_attrib.indexing.index import check_index_target
    from moe_attrib.workflows.build import build_index

    st = settings or CollectSettings()
    say = log or (lambda line: None)
    st = checked_collection(model, device, st)
    if not resume:
        check_index_target(index, overwrite)
    check_parent_writable(Path(index), "--index")
    factors, st = eigenbasis_factors(ekfac, st, fitting=fit is not None)
    dist = placed(model, precision, device, fsdp, "build", say)
    if st.cuda_graphs:
        from moe_attrib.workflows.build import check_graphable

        with as_usage_error():
            check_graphable(dist.device, st.recompute, dist.fsdp)
    tokenizer, examples, net, pad, reading = load_inputs(model, data, reading or DataSettings(), precision, dist)
    sharding_plan(net, dist, st, False, say)
    record = data_record(data, reading, tokenizer)
    if fit is not None:
        factors = own_factors(net, examples, index, st, fit, resume, pad, dist, progress, say)
        factors.settings.update(factors_record(model, net, examples, record))
    return build_index(net, examples, index, st, model_name=model_name(model), ekfac=factors,
                       keep_factors=fit is not None, resume=resume, overwrite=overwrite, pad_id=pad,
                       extra_settings=record, dist=dist, progress=progress)  # fmt: skip


def eigenbasis_collection(st: CollectSettings) -> CollectSettings:
    """How a default build's factors are fitted: every side sketched to `EIGENBASIS_SKETCH`, the output layer
    to `EIGENBASIS_OUTPUT_SKETCH` (the settings `docs/build.md`'s LDS frontier measured), with the build's
    seed, tracking, modules and batching."""
    return CollectSettings(
        track_moe_experts=st.track_moe_experts, filter_modules=st.filter_modules, token_batch_size=st.token_batch_size,
        recompute=st.recompute, projection_dim=EIGENBASIS_SKETCH, output_projection_dim=EIGENBASIS_OUTPUT_SKETCH,
        seed=st.seed,
    )  # fmt: skip


def own_factors(net, examples, index, st: CollectSettings, fit: EkfacSettings, resume: bool, pad, dist, progress, say):
    """The factors of a build that fits its own: read back from an interrupted build's `INDEX.part` when
    resuming one that had kept them, else fitted now."""
    from moe_attrib.curvature.ekfac import fit_ekfac, load_ekfac
    from moe_attrib.indexing.index import part_dir

    kept = part_dir(index)
    if resume and (kept / "manifest.json").exists() and not (kept / "ekfac.json").exists():
        raise UsageError(
            f"{kept} holds an interrupted build that did not fit its own factors (seeded projections, or --ekfac "
            "DIR); resume it with the flags it was started with."
        )
    if resume and (kept / "ekfac.json").exists():
        say(f"resuming: the EK-FAC factors the interrupted build fitted ({kept}), not fitted again")
        return load_ekfac(kept)
    collect = eigenbasis_collection(st)
    say(f"fitting EK-FAC factors for the eigenbasis rows first (sides sketched to {collect.projection_dim}, the "
        f"output layer to {collect.output_projection_dim}; kept in {index}): two passes over the data, then "
        "the rows' pass")  # fmt: skip
    fitted = fit_ekfac(net, examples, fit.replace(factor_device=fit.factor_device or dist.device), collect=collect,
                       pad_id=pad, dist=dist, progress=progress)  # fmt: skip
    return fitted.to("cpu")  # the rows' pass needs only the kept eigenvectors on the device


def fit_from_files(
    model: str,
    data: str | Path,
    out: str | Path,
    settings: EkfacSettings | None = None,
    *,
    collect: CollectSettings | None = None,
    index: str | Path | None = None,
    reading: DataSettings | None = None,
    precision: str = "auto",
    device: str | None = None,
    fsdp: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> EKFAC:
    """Fit EK-FAC factors of `model` on the training data file `data` and write them to the directory
    `out`; returns the `EKFAC` (on every rank under torchrun; rank 0 writes).

    `settings` is how (`moe_attrib.settings.EkfacSettings`: damping, labels, bias folding, memory cap,
    `factor_device`, default the model's device), `collect` how the gradients are taken
    (`CollectSettings`: projection, seed, modules, batching). With `index` (an index directory the factors
    are for) the model is checked against it and `collect` defaults to the index's settings (given, its
    projection, seed, tracking and modules must match them); "auto" precision is then the index's.
    `reading`, `precision`, `device`, `fsdp`, `log` as for `build_from_files`; `overwrite` replaces the
    factor files in a non-empty `out`."""
    from moe_attrib.curvature.ekfac import fit_ekfac
    from moe_attrib.fingerprint import check_model

    ek = settings or EkfacSettings()
    say = log or (lambda line: None)
    checked_collection(model, device, collect or CollectSettings())
    check_device(ek.factor_device, "--factor_device")
    check_out_dir(str(out), overwrite, "--out")
    idx, st, precision = index_collection(index, collect, precision)
    dist = placed(model, precision, device, fsdp, "ekfac", say)
    tokenizer, examples, net, pad, reading = load_inputs(model, data, reading or DataSettings(), precision, dist)
    sharding_plan(net, dist, st, True, say)
    if idx is not None:
        check_model(idx.manifest["settings"], net, tokenizer, what=f"index {index}")
    result = fit_ekfac(net, examples, ek.replace(factor_device=ek.factor_device or dist.device), collect=st,
                       pad_id=pad, dist=dist, progress=progress)  # fmt: skip
    if dist.is_main:
        result.settings.update(factors_record(model, net, examples, data_record(data, reading, tokenizer)))
        result.save(out)
    dist.barrier()  # every rank leaves together, after rank 0 has written
    return result


def factors_record(model: str, net, examples: list[Example], record: dict) -> dict:
    """What factors fitted from files record besides their fit, for `score` to check them against an index: how
    the data were read (`record`, `data_record`'s), the model's name, the data's fingerprint and the model's dtype."""
    return {**record, "model": model_name(model), "data_fingerprint": fingerprint(examples),
            "dtype": str(next(net.parameters()).dtype)}  # fmt: skip


def checked_collection(model: str, device: str | None, st: CollectSettings) -> CollectSettings:
    """The model spec, device and optimizer state checked before loading anything; the optimizer state's
    path made absolute (`score` re-reads it from anywhere)."""
    check_model_spec(model)
    check_device(device)
    if st.optimizer_state:
        if not Path(st.optimizer_state).exists():
            raise UsageError(f"--optimizer_state {st.optimizer_state}: no such file or directory.")
        st = st.replace(optimizer_state=str(Path(st.optimizer_state).resolve()))
    return st


def eigenbasis_factors(ekfac: str | Path | None, st: CollectSettings, fitting: bool = False):
    """An eigenbasis build's factors (on the CPU) and the settings with the budget in bytes, checked
    before any work; `(None, st)` for an index of seeded projections, or (`fitting`) one whose factors
    the build fits itself."""
    from moe_attrib.curvature.eigenbasis import parse_bytes
    from moe_attrib.curvature.ekfac import load_ekfac

    if ekfac and fitting:
        raise UsageError("give fitted factors (--ekfac DIR) or let the build fit them, not both.")
    if not ekfac and not fitting:
        if st.budget is not None:
            raise UsageError(
                "--budget allocates the eigen-directions of EK-FAC factors, which --projection_dim / "
                "--no_projection / --output_projection_dim / --optimizer_state / --expert_blocks sum leave out; drop "
                "those flags (build then fits the factors) or give fitted ones with --ekfac DIR."
            )
        return None, st
    budget = parse_bytes(st.budget or DEFAULT_BUDGET)
    if st.expert_blocks != "separate" or st.optimizer_state:
        raise UsageError("an eigenbasis index needs --expert_blocks separate and no --optimizer_state.")
    if fitting:
        return None, st.replace(budget=budget)
    factors = load_ekfac(ekfac)
    sketch = factors.projection_dim
    given = st.projection_dim is None or st.projection_dim not in (DEFAULT_PROJECTION_DIM, sketch)
    if given or st.seed not in (0, factors.seed):
        raise UsageError(
            f"--ekfac {ekfac}: an eigenbasis index uses the factors' sketch (projection_dim {sketch}, seed "
            f"{factors.seed}); leave out --projection_dim, --no_projection and --seed."
        )
    return factors, st.replace(budget=budget)


def index_collection(index: str | Path | None, collect: CollectSettings | None, precision: str):
    """`(index, collection settings, precision)` of factors fitted for `index`: its projection, seed,
    tracking and modules (those of `collect` must match them), and "auto" precision made its dtype."""
    if index is None:
        return None, collect or CollectSettings(), precision
    from moe_attrib.collect.projection import projection_kind

    idx = load_index(index)
    recorded = idx.manifest["settings"]
    st = idx.settings.collect
    own = {"projection_dim": st.projection_dim, "seed": st.seed, "projection": projection_kind(recorded),
           "track_moe_experts": bool(st.track_moe_experts), "filter_modules": st.filter_modules,
           "output_projection_dim": own_output_dim(st.projection_dim, st.output_projection_dim)}  # fmt: skip
    collect = collect or CollectSettings(**own)
    given = {**collect.to_dict(), "output_projection_dim": own_output_dim(collect.projection_dim,
                                                                          collect.output_projection_dim)}  # fmt: skip
    differ = [k for k, v in own.items() if given[k] != v]
    if differ:
        raise UsageError(f"{', '.join(differ)} differ from the index {index}'s; fit its factors with its settings.")
    if precision == "auto":  # the index's weights fingerprint is of the model in the index's dtype
        precision = PRECISIONS.get(idx.settings.dtype, "auto")
    return idx, collect, precision


def placed(model: str, precision: str, device: str | None, fsdp: bool, command: str, say):
    """The `Dist` of this process, after asking: does the model fit one device? A local safetensors
    checkpoint's size (from its headers) against the device's free memory; under torchrun a model that
    does not fit is sharded (as `fsdp`) automatically, without torchrun the error says how to launch it."""
    from moe_attrib.model.distributed import setup
    from moe_attrib.workflows.loading import checkpoint_numel, device_free_bytes
    from moe_attrib.workflows.plan import choose_sharding

    with as_usage_error():
        dist = setup(device, fsdp=fsdp)
        numel, free = checkpoint_numel(model), device_free_bytes(dist.device)
        if numel is None or free is None:
            return dist
        if torch.distributed.is_initialized() and dist.world > 1:  # one decision for every rank: the tightest one
            least = torch.tensor([free], dtype=torch.int64, device=dist.device)
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
            free = int(least.item())
        size = torch.empty((), dtype=resolve_precision(precision, dist.device)).element_size()
        torchrun = "MASTER_ADDR" in os.environ
        shard, note = choose_sharding(numel * size, free, dist.world, dist.fsdp, torchrun, command)
        if shard and not dist.fsdp:
            if dist.is_main:
                say(f"moe-attrib {command}: {note}")
            dist = setup(device, fsdp=True)
    return dist


@contextlib.contextmanager
def as_usage_error():
    """Device and process-group failures (`RuntimeError`s: no such device, no torchrun) are a
    `UsageError`: what to run differently."""
    try:
        yield
    except RuntimeError as err:
        raise UsageError(str(err)) from err


def load_inputs(model: str, data: str | Path, reading: DataSettings, precision: str, dist):
    """Tokenizer, examples, model (on the rank's device), pad id and the reading as done. Rows longer
    than the model's context are an error naming the row, or with `truncate` cut there (`max_length`
    then records the cut, so that `score` reads the same rows again)."""
    tokenizer = load_tokenizer(model, reading.tokenizer)
    examples = load_examples(data, tokenizer, reading.text_field, reading.max_length, reading.truncate, reading.split)
    dtype = resolve_precision(precision, dist.device)
    if dist.fsdp:
        from moe_attrib.model.sharding import load_sharded

        net = load_sharded(model, dtype, dist)
    else:
        net = load_model(model, dtype).to(dist.device)
    check_token_ids(examples, net.get_input_embeddings().num_embeddings, str(data))
    context = context_length(net)
    check_context(examples, context, str(data), reading.truncate)
    if reading.truncate and context is not None and (reading.max_length is None or reading.max_length > context):
        reading = reading.replace(max_length=context)
    return tokenizer, examples, net, getattr(tokenizer, "pad_token_id", None) or 0, reading


def sharding_plan(model, dist, st: CollectSettings, factors: bool, say) -> None:
    """A sharded run's memory plan per rank (parameters, activations, routed grid, factors), said before it."""
    if not dist.fsdp or not dist.is_main:
        return
    from moe_attrib.workflows.plan import format_memory_plan, memory_plan

    plan = memory_plan(model, dist.world, st.token_batch_size, st.projection_dim, st.track_moe_experts, factors,
                       st.projection, st.recompute, st.output_projection_dim)  # fmt: skip
    say(format_memory_plan(plan))


def data_record(data: str | Path, reading: DataSettings, tokenizer) -> dict:
    """What an index / factors record so that the data can be read again exactly, from any directory."""
    from moe_attrib.data import source_path
    from moe_attrib.fingerprint import tokenizer_fingerprint

    return {
        "data": source_path(str(data)),
        "text_field": reading.text_field,
        "split": reading.split,
        "tokenizer": source_path(reading.tokenizer) if reading.tokenizer else None,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "max_length": reading.max_length,
        "truncate": reading.truncate,
    }


@dataclass
class ScoredQueries:
    """What `score_queries` returns: the result `records` (one per query), the `scores` they were made
    from, the `index`, the `queries` and the coupling and balance that were applied (None: none)."""

    records: list[dict]
    scores: Scores
    index: Index
    queries: list[Example]
    coupling: Coupling | None = None
    balance: Balance | None = None


def score_queries(
    index: str | Path,
    model: str,
    queries: str | Path,
    settings: ScoreSettings | None = None,
    *,
    ekfac: str | list[str] | None = None,
    refine: RefineSettings | None = None,
    refine_ekfac: str | None = None,
    all_scores: str | Path | None = None,
    average_with: list[str] | None = None,
    reading: QueryReading | None = None,
    device: str | None = None,
    fsdp: bool = False,
    before_work: Callable[[Index], None] | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> ScoredQueries | None:
    """Score the queries in the file `queries` against the index directory `index` built from `model`.

    `settings` is how (`moe_attrib.settings.ScoreSettings`: normalisation, modules, re-damping, coupling,
    balance, top-k, per-module parts). `ekfac`: the EK-FAC directory (or partitions) fitted for the index;
    None: the factors kept in the index directory, if its build fitted them (`build`'s default), else none.
    `refine` (with `iterations` > 0) replaces EK-FAC, coupling and balance by CG on the exact Gauss-Newton
    matrix, preconditioned by `refine_ekfac` factors (unprojected) if given. `all_scores` (a `.npy` path)
    also keeps every score, with its description beside it; `average_with` ranks by the mean with other
    checkpoints' such matrices. `reading` says how queries and training texts are read (`QueryReading`).
    Everything is checked before any compute; `before_work(index)` runs then (the CLI checks its output
    files there). `fsdp` shards the model over torchrun's ranks for the query gradients: only rank 0
    scores, the others return None. `progress` shows progress bars; `log` receives one line per step
    taken (coupling, balance, refinement), e.g. `print`."""
    st = settings or ScoreSettings()
    reading = reading or QueryReading()
    refining = refine is not None and refine.iterations != 0
    ekfac_dirs = [ekfac] if isinstance(ekfac, str | Path) else list(ekfac or [])
    say = log or (lambda line: None)
    if not ekfac_dirs and not refining and (Path(index) / "ekfac.json").exists():
        ekfac_dirs = [str(index)]  # the factors a default build fitted and kept with its rows
        say(f"preconditioning with the EK-FAC factors kept in the index ({index})")
    check_model_spec(model)
    check_device(device)
    if (st.damping is not None or st.damping_scope is not None) and not ekfac_dirs:
        raise UsageError("--damping / --damping_scope re-damp EK-FAC factors; give --ekfac DIR (without it "
                         "nothing is preconditioned and they would change nothing).")  # fmt: skip
    for path in average_with or []:
        if all_scores and Path(path).resolve() == Path(all_scores).resolve():
            raise UsageError(f"--all_scores {all_scores} is also given to --average_with.")
    from moe_attrib.curvature.eigenbasis import check_factors
    from moe_attrib.curvature.ekfac import load_ekfac
    from moe_attrib.fingerprint import check_model
    from moe_attrib.outputs import scratch, write_text
    from moe_attrib.scoring.score import query_gradients, score
    from moe_attrib.workflows.ensemble import info_path, load_matrices, matrix_info

    idx = load_index(index)
    recorded, made = idx.manifest["settings"], idx.settings  # raw: for the checks that take either kind
    if before_work is not None:
        before_work(idx)
    check_ekfac_dirs(ekfac_dirs, recorded, str(index))
    if made.eigenbasis and ekfac_dirs:  # the factors its rows were rotated with, before any work
        check_factors(recorded, load_ekfac(ekfac_dirs if len(ekfac_dirs) > 1 else ekfac_dirs[0]), str(index))
    tokenizer = load_tokenizer(model, reading.tokenizer or made.reading.tokenizer)
    check_model(recorded, None, tokenizer, what=f"index {index}")
    train = training_examples(recorded, tokenizer, reading.text_field) if reading.texts else None
    examples = load_examples(queries, tokenizer, reading.text_field, made.reading.max_length, True)
    if reading.id_field:  # before any work: every query and training row must carry it
        check_id_field(examples, reading.id_field, str(queries))
        if train is not None:
            check_id_field(train, reading.id_field, made.data)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))  # under fsdp: its rank's
    coupled = st.coupling
    if refining:  # the refined IHVP replaces EK-FAC, coupling and balance (docs/scoring.md#refinement)
        check_refine(refine, ekfac=ekfac_dirs, fsdp=fsdp, average_with=average_with)
        coupled, ekfac_dirs, st = {}, [], st.replace(output_balance=False)
    if coupled:  # before the model is loaded
        from moe_attrib.scoring.coupling import check_memory

        check_memory(idx, st.coupling_sample, dev, st.coupling_rank)
    if st.balanced:
        from moe_attrib.scoring.balance import check_memory

        check_memory(idx)
    own = matrix_info(idx, fingerprint(examples), len(examples), st.unit_normalize, st.modules, bool(ekfac_dirs),
                      coupled, st.balanced)  # fmt: skip
    others = load_matrices(average_with, own) if average_with else []  # checked before any work
    dtype = getattr(torch, made.torch_dtype_name)
    dist = None
    if fsdp:  # query gradients with the model sharded over torchrun's ranks; rank 0 scores
        from moe_attrib.model.distributed import setup
        from moe_attrib.model.sharding import load_sharded

        try:
            dist = setup(device, fsdp=True)
        except RuntimeError as err:
            raise UsageError(str(err)) from err
        dev, net = dist.device, load_sharded(model, dtype, dist)
    else:
        net = load_model(model, dtype)
    check_model(recorded, net, what=f"index {index}")
    check_token_ids(examples, net.get_input_embeddings().num_embeddings, str(queries))
    check_context(examples, context_length(net), str(queries), truncate=False, can_truncate=False)
    if dist is None:
        net = net.to(dev)
    factors = load_ekfac(ekfac_dirs if len(ekfac_dirs) > 1 else ekfac_dirs[0]) if ekfac_dirs else None
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    longest = max(len(ex.input_ids) for ex in examples)
    q, query_counts = query_gradients(
        net, examples, idx, pad_id=pad, with_counts=True, token_batch_size=max(8192, longest)
    )
    if refining:
        q = refined_rows(net, idx, training_examples(recorded, tokenizer, reading.text_field), examples, pad,
                         refine, refine_ekfac, progress, say)  # fmt: skip
    if dist is not None and not dist.is_main:
        return None
    if factors is not None:
        factors = factors.redamped(st.damping, st.damping_scope)
    coupling, balance = fit_corrections(idx, factors, st, coupled, dev, progress, say)
    opts = dict(ekfac=factors, unit_normalize=st.unit_normalize, modules=st.modules, coupling=coupling,
                balance=balance, device=dev)  # fmt: skip
    with scratch(all_scores) as matrix:  # all_scores's temporary name, renamed into place below
        if others or all_scores:  # one pass over the index: the top-k is read back from the matrix
            result = matrix_top_k(idx, q, others, opts, st, matrix if all_scores else None, progress, say)
        else:
            result = score(idx, q, top_k=st.top_k, per_module=st.per_module, progress=progress, **opts)
        records = result_records(idx, examples, train, tokenizer, q, query_counts, opts, result, reading, queries)
        if all_scores:  # no moment where the old description sits beside the new matrix
            info_path(all_scores).unlink(missing_ok=True)
            os.replace(matrix, all_scores)
            write_text(info_path(all_scores), json.dumps(own, indent=2))
    return ScoredQueries(records, result, idx, examples, coupling, balance)


@dataclass(frozen=True)
class QueryReading:
    """How `score_queries` reads the queries and the index's training texts: the queries' `text_field`,
    a `tokenizer` directory (default: the index's, else the model's), whether hits carry the training
    `texts` (re-read from the data the index records) and the `id_field` records carry as `id`
    (default: all fields)."""

    text_field: str = "text"
    tokenizer: str | None = None
    texts: bool = True
    id_field: str | None = None


def fit_corrections(index: Index, factors, st: ScoreSettings, coupled: dict | None, device, progress: bool, say):
    """The cross-module coupling (fitted when `coupled`) and the output-layer balance (`st.balanced`)."""
    from moe_attrib.scoring.balance import resolve_balance
    from moe_attrib.scoring.coupling import fit_coupling

    opts = dict(ekfac=factors, unit_normalize=st.unit_normalize, modules=st.modules, device=device)
    coupling = fit_coupling(index, **opts, **coupled, progress=progress) if coupled else None
    if coupling is not None:
        c = coupling.settings
        say(f"cross-module coupling: gamma {c['gamma']:g}, rank {c['rank']}, from {c['sample']} of "
            f"{c['rows']} index rows (--coupling_gamma 0 turns it off)")  # fmt: skip
    balance = resolve_balance(index, "auto" if st.balanced else None, **opts, coupling=coupling, progress=progress)
    if balance is not None:
        say(f"output-layer balance: lm_head's vote counted as much as the whole model's, spreads from "
            f"{balance.settings['sample']} index rows (--no-output_balance turns it off)")  # fmt: skip
    return coupling, balance


def training_examples(recorded: dict, tokenizer, text_field: str) -> list:
    """The index's training examples (texts, record fields), read again from the data its settings
    `recorded`; an error when the data no longer tokenize to what the index was built from (texts would
    land on the wrong rows)."""
    source = recorded["data"]
    try:
        train = load_examples(
            source,
            tokenizer,
            recorded.get("text_field", text_field),
            recorded.get("max_length"),
            bool(recorded.get("truncate")),
            recorded.get("split"),
        )
    except DataError as err:
        raise DataError(
            f"cannot read the index's training data again for its texts: {err} (or pass --no_texts)."
        ) from err
    if fingerprint(train) != recorded["data_fingerprint"]:
        raise DataError(
            f"the training data {source} changed since the index was built (its token fingerprint differs), so "
            "texts would be attached to the wrong rows; restore it, or pass --no_texts to score without texts."
        )
    return train


def check_id_field(examples: list, id_field: str, source: str) -> None:
    """`id_field` names a scalar field of every row of `source` (checked before any compute)."""
    from moe_attrib.scoring.results import ResultsError

    for ex in examples:
        if id_field not in ex.fields:
            raise ResultsError(
                f"{source}: row {ex.index} has no scalar field {id_field!r} to use as --id_field "
                f"(its fields: {sorted(ex.fields) or 'none besides the text'})."
            )


def check_refine(refine: RefineSettings, *, ekfac, fsdp: bool, average_with) -> None:
    """Refinement: what it cannot be combined with, refused before the model is loaded."""
    if refine.iterations < 0 or refine.damping <= 0:
        raise UsageError(f"--refine {refine.iterations} / --refine_damping {refine.damping}: need N >= 0, D > 0.")
    for flag, given in (("--ekfac", ekfac), ("--fsdp", fsdp), ("--average_with", average_with)):
        if given:
            raise UsageError(f"--refine replaces EK-FAC scoring and cannot be combined with {flag}.")


def refined_rows(model, index: Index, train: list, queries: list, pad: int, refine: RefineSettings,
                 refine_ekfac: str | None, progress: bool, say):  # fmt: skip
    """The refined query rows (`moe_attrib.curvature.ihvp.refine_queries`), their cost said."""
    from moe_attrib.curvature.ekfac import load_ekfac
    from moe_attrib.curvature.ihvp import refine_queries

    factors = load_ekfac(refine_ekfac) if refine_ekfac else None
    refined = refine_queries(model, train, queries, index, refine, ekfac=factors, pad_id=pad, progress=progress)
    say(f"refined {len(queries)} queries: {refine.iterations} CG iterations, {refined.products} GGN products per "
        f"query over {refined.settings['examples']} training rows, median relative residual "
        f"{float(np.median(refined.residuals[-1])):.3g}")  # fmt: skip
    return refined


def matrix_top_k(index: Index, q, others: list, opts: dict, st: ScoreSettings, matrix: Path | None, progress: bool,
                 say) -> Scores:  # fmt: skip
    """The top-k of this run's score matrix (written to `matrix`, else a temporary file), or of its mean
    with `others` (other checkpoints', checked by `load_matrices`), in one pass over the index;
    per-module parts, if asked, are this checkpoint's part of each hit."""
    from moe_attrib.scoring.score import hit_parts, score_matrix
    from moe_attrib.workflows.ensemble import mean_top_k

    with tempfile.TemporaryDirectory(prefix="moe-attrib-scores-") as tmp:
        out = matrix if matrix is not None else Path(tmp) / "scores.npy"
        mine = score_matrix(index, q, out=out, progress=progress, **opts)
        values, rows = mean_top_k([mine, *others], st.top_k)
        del mine
    parts = hit_parts(index, q, rows, **opts) if st.per_module else None
    if others:
        say(f"ranked by the mean of {len(others) + 1} score matrices (this run's and --average_with's)")
    return Scores(values, rows, parts)


def result_records(index, queries, train, tokenizer, q, query_counts, opts, result, reading, source) -> list[dict]:
    """Score records with the query's routing and, for a token index, the hit examples' token shares."""
    from moe_attrib.scoring.details import token_scores
    from moe_attrib.scoring.results import score_records

    shares = None
    if index.token_offsets is not None:
        positions = np.searchsorted(index.token_offsets, result.rows.reshape(-1), side="right") - 1
        shares = token_scores(index, q, positions.tolist(), ekfac=opts["ekfac"], unit_normalize=opts["unit_normalize"],
                              modules=opts["modules"], coupling=opts["coupling"], balance=opts["balance"])  # fmt: skip
    return score_records(queries, result, index, train, id_field=reading.id_field, query_counts=query_counts,
                         token_scores=shares, tokenizer=tokenizer, query_source=str(source))  # fmt: skip
