"""LDS against index bytes per example: seeded projections, summed experts, bfloat16 storage and
eigenbasis rows at several budgets, on the cached LDS configurations.

Every variant is scored with the library's default pipeline (EK-FAC preconditioning, coupling,
output balance, cosine) except where its name says otherwise, and reported with its bytes per
example (stored columns x bytes per value), its LDS with a bootstrap CI, and the paired bootstrap
CIs of its difference to today's default index (seeded projections, p=32, float32) and to exact
rows. Eigenbasis rows (`build_index(ekfac=, budget=)`) use factors fitted with the sketch
`--sketch` (128: every side of these models is kept exact) and budgets given as fractions of the
default index's bytes, or scaled from the Qwen3-30B-A3B shape, and 1 MiB itself (more than every
direction of these small models). A scaled budget without floors (`--dense 0`) is the same columns per
weight block as there; with the allocation's floors (`--dense 32`, the library's, with `--output_floors`) it
is the same floors per dense block and the same columns per expert block (`scaled_budget`):

    nice -n 10 python benchmarks/lds_budget.py cpu cpu-shared
    nice -n 10 python benchmarks/lds_budget.py NAMES --core --scaled 1MiB --dtypes bfloat16 --output_widths 512
    python benchmarks/lds_budget.py NAMES --summary TAGS    # table and means over the result files of TAGS

Reads the caches `lds.py` left (`lds.load_cached`); writes benchmarks/results/issue32/lds-budget-NAME[TAG].json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import lds  # noqa: E402
import numpy as np  # noqa: E402
from lds_damping import mean_over  # noqa: E402

import moe_attrib as ma  # noqa: E402
from moe_attrib.curvature import eigenbasis, precondition  # noqa: E402
from moe_attrib.curvature.eigenbasis import parse_bytes  # noqa: E402
from moe_attrib.curvature.ekfac import DAMPING_SCOPES  # noqa: E402
from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM  # noqa: E402
from moe_attrib.model.discovery import iter_entries  # noqa: E402
from moe_attrib.scoring import balance as balance_module  # noqa: E402
from moe_attrib.settings import EIGENBASIS_OUTPUT_SKETCH, EIGENBASIS_SKETCH  # noqa: E402

PS = (8, 16, 32, 64, 128)
FRACTIONS = (1 / 64, 1 / 16, 1 / 4)  # eigenbasis budgets, as fractions of the default index's bytes
# eigenbasis budgets scaled from a large model: the same stored columns per weight block as a budget of
# `bytes` per example on the Qwen3-30B-A3B shape (12,529 weight blocks: `inspect benchmarks/shapes/qwen3-30b-a3b`)
QWEN3_BLOCKS = 12529
QWEN3_EXPERT_BLOCKS = 12288  # 48 layers x 128 experts x (gate_up_proj, down_proj); the other 241 are dense blocks
SCALED = ("256KiB", "1MiB")  # Qwen3-30B-A3B budgets the eigenbasis budgets are scaled from (--scaled)
OUT = Path(__file__).parent / "results" / "issue32"
DEFAULT = f"default: projected p={DEFAULT_PROJECTION_DIM}, float32"
EXACT = "exact rows"
WHOLE_LABELS = {"model": ", whole vote over the model", "rest": ", whole vote without the output layer"}
SEEDED_DAMPING = (0.01, "model")  # the seeded default as it was scored (the library's damping before session 19)


def bytes_per_example(index) -> int:
    return int(index.gradients.shape[1] * index.gradients.dtype.itemsize)


def run(
    name: str,
    root: Path,
    sketch: int,
    fractions: tuple[float, ...],
    core: bool = False,
    scaled: tuple = SCALED,
    allocations: tuple[tuple[float, str], ...] = ((eigenbasis.ALLOCATION_DAMPING, eigenbasis.ALLOCATION_SCOPE),),
    output_widths: tuple[int | None, ...] = (None,),
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    dense: tuple[int, ...] = (0,),
    output_floors: tuple[int, ...] = (0,),
    exact: bool = True,
    groups: bool = False,
    output_shapes: tuple[str, ...] = ("square",),
    seeded: bool = True,
    expert_weights: tuple[float, ...] = (),
    unbalanced: bool = False,
    wholes: tuple[str, ...] = (),
    block_weights: tuple[str, ...] = (),
) -> dict:
    """Every variant of configuration `name` (`core`: only the default, exact rows and the eigenbasis
    budgets scaled from Qwen3-30B-A3B and 1 MiB, for the larger configurations). The scaled eigenbasis
    budgets are measured for each allocation damping and scope of `allocations` (x the mean Lambda over the
    scope, `eigenbasis.ALLOCATION_DAMPING` and `ALLOCATION_SCOPE` while the index is planned) and each
    output-layer sketch width of
    `output_widths` (the factors' `output_projection_dim`; None: the output layer sketched like every side)
    and each dense floor of `dense` (`eigenbasis.DENSE_DIRECTIONS`: r x r leading directions for every
    dense block before the greedy; the budget is then scaled per kind of block: the floors, plus each
    expert block's share of what the floors leave of the budget on Qwen3-30B-A3B, whose dense blocks
    all have sides wider than r). `groups`: each scaled eigenbasis index also scored through each module group
    alone (`score --modules`, `lds.groups`), and the same budget built without `--track_moe_experts` (factors
    fitted untracked): the rows docs/quality.md compares the default with."""
    cached = lds.load_cached(name, root)
    model = cached.model()
    subsets, losses, examples, queries = cached.subsets, cached.losses, cached.examples, cached.queries
    results: dict[str, dict] = {}
    factors: dict = {}

    def ekfac(p, width=None, tracked=True):
        if (p, width, tracked) not in factors:
            factors[p, width, tracked] = ma.fit_ekfac(
                model,
                examples,
                projection_dim=p,
                output_projection_dim=width,
                track_moe_experts=tracked,
                progress=False,
            )
        return factors[p, width, tracked]

    with tempfile.TemporaryDirectory() as tmp:

        def add(
            label: str,
            ek,
            allocation: float | None = None,
            floor: int = 0,
            out_floor: int = 0,
            shape: str | None = None,
            alone=None,
            expert_weight: float | None = None,
            scope: str | None = None,
            **build,
        ) -> None:
            t0 = time.perf_counter()
            path = Path(tmp) / f"index-{len(results)}"
            with allocation_rule(floor, out_floor, allocation, shape, expert_weight, scope):
                ma.build_index(model, examples, path, progress=False, **build)
            index = ma.load_index(path)
            q = ma.query_gradients(model, queries, index)
            scored = {label: {}, **{f"{label}, {g} alone": {"modules": glob} for g, glob in (alone or {}).items()}}
            if unbalanced and alone is not None:
                scored[f"{label}, no output balance"] = {"balance": None}
            for whole in wholes:  # the output balance's whole-model vote (`balance.BALANCE_WHOLE`)
                scored[f"{label}{WHOLE_LABELS[whole]}"] = {"whole": whole}
            for weights in block_weights:  # the truncation weights (`precondition.BLOCK_WEIGHTS`)
                scored[f"{label}, block weights {weights}"] = {"block_weights": weights}
            for mine, how in scored.items():
                how, kept = dict(how), (balance_module.BALANCE_WHOLE, precondition.BLOCK_WEIGHTS)
                balance_module.BALANCE_WHOLE = how.pop("whole", kept[0])
                precondition.BLOCK_WEIGHTS = how.pop("block_weights", kept[1])
                try:
                    scores = ma.score_matrix(index, q, ekfac=ek, device="cpu", **how)
                finally:
                    balance_module.BALANCE_WHOLE, precondition.BLOCK_WEIGHTS = kept
                values = lds.per_query_lds(scores, subsets, losses)
                results[mine] = {"bytes": bytes_per_example(index), "values": values}
                print(f"  {name}: {mine}: {results[mine]['bytes']} B/example, LDS {values.mean():.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip

        p0 = DEFAULT_PROJECTION_DIM
        if seeded or not core:
            add(DEFAULT, ekfac(p0).with_damping(*SEEDED_DAMPING), projection_dim=p0)
        if exact:
            add(EXACT, ekfac(None), projection_dim=None)
        for p in () if core else PS:
            if p != p0:
                add(f"projected p={p}, float32", ekfac(p), projection_dim=p)
        if not core:
            add(f"projected p={p0}, bfloat16", ekfac(p0), projection_dim=p0, index_dtype="bfloat16")
            add("projected p=64, bfloat16", ekfac(64), projection_dim=64, index_dtype="bfloat16")
            # summed experts cannot be preconditioned per expert: scored without EK-FAC
            add(f"projected p={p0}, expert_blocks=sum, no EK-FAC", None, projection_dim=p0, expert_blocks="sum")
        default_bytes = results[DEFAULT]["bytes"] if DEFAULT in results else 0
        for frac in () if core else fractions:
            budget = int(default_bytes * frac)
            for dtype in ("float32", "bfloat16"):
                add(f"eigenbasis, budget {budget} B ({frac:g} x default), {dtype}", ekfac(sketch),
                    ekfac=ekfac(sketch), budget=budget, index_dtype=dtype)  # fmt: skip
        report = ma.discover(model, track_moe_experts=True, warn=False)
        blocks = weight_blocks(report)
        for qwen3_bytes, dtype in ((parse_bytes(b), dt) for b in scaled for dt in dtypes):
            for width in output_widths:
                ek = ekfac(sketch, width)
                floors = [(0, 0, None)] * (0 in dense)
                floors += [(r, ro, sh) for r in dense if r for ro in output_floors for sh in output_shapes]
                for r, ro, shape in floors:
                    budget = scaled_budget(qwen3_bytes, dtype, r, ro, report, blocks, sketch, width, shape)
                    for a, a_scope in allocations:
                        label = f"eigenbasis, budget {budget} B (as {qwen3_bytes // 2**10} KiB on Qwen3-30B-A3B)"
                        label += f", {dtype}"
                        same = (a, a_scope) == (eigenbasis.ALLOCATION_DAMPING, eigenbasis.ALLOCATION_SCOPE)
                        label += "" if same else f", allocation {a:g} x {a_scope} mean"
                        label += "" if width is None else f", output sketch {width}"
                        label += "" if r == 0 else f", dense floor {r}"
                        label += "" if ro == 0 else f", output floor {floor_label(ro)}"
                        label += "" if shape in (None, "square") else f", {shape}"
                        add(label, ek, allocation=a, scope=a_scope, floor=r, out_floor=ro, shape=shape,
                            alone=lds.groups(model) if groups else None, ekfac=ek, budget=budget,
                            index_dtype=dtype)  # fmt: skip
                        for ew in expert_weights:
                            add(f"{label}, experts x{ew:g}", ek, allocation=a, scope=a_scope, floor=r, out_floor=ro,
                                shape=shape, expert_weight=ew, ekfac=ek, budget=budget, index_dtype=dtype)  # fmt: skip
                        if groups:
                            lone = ekfac(sketch, width, tracked=False)
                            add(f"{label}, untracked", lone, allocation=a, scope=a_scope, floor=r, out_floor=ro,
                                shape=shape, ekfac=lone, budget=budget, index_dtype=dtype,
                                track_moe_experts=False)  # fmt: skip
        for width in output_widths if exact else ():
            label = "eigenbasis, budget 1 MiB (every direction here), bfloat16"
            label += "" if width is None else f", output sketch {width}"
            add(label, ekfac(sketch, width), ekfac=ekfac(sketch, width), budget=2**20, index_dtype="bfloat16")
    return summarise(name, cached, results)


QWEN3_VOCAB = 151936


@contextmanager
def allocation_rule(
    floor: int,
    out_floor: int,
    allocation: float | None = None,
    shape: str | None = None,
    expert_weight: float | None = None,
    scope: str | None = None,
):
    """The eigenbasis allocation with dense floor `floor`, output floor `out_floor` (`floor_rule`) and, if given,
    allocation damping `allocation`, output floor shape `shape` and the experts' direction weight
    `eigenbasis.EXPERT_WEIGHT` in the greedy and the allocation damping's scope `scope`, while the block runs (the
    library's module settings, restored after)."""
    kept = (eigenbasis.ALLOCATION_DAMPING, eigenbasis.DENSE_DIRECTIONS, eigenbasis.output_floor,
            eigenbasis.OUTPUT_FLOOR_SHAPE, eigenbasis.EXPERT_WEIGHT, eigenbasis.ALLOCATION_SCOPE)  # fmt: skip
    eigenbasis.ALLOCATION_DAMPING = kept[0] if allocation is None else allocation
    eigenbasis.DENSE_DIRECTIONS, eigenbasis.output_floor = floor, floor_rule(out_floor)
    eigenbasis.OUTPUT_FLOOR_SHAPE = kept[3] if shape is None else shape
    eigenbasis.EXPERT_WEIGHT = kept[4] if expert_weight is None else expert_weight
    eigenbasis.ALLOCATION_SCOPE = kept[5] if scope is None else scope
    try:
        yield
    finally:
        (eigenbasis.ALLOCATION_DAMPING, eigenbasis.DENSE_DIRECTIONS, eigenbasis.output_floor,
         eigenbasis.OUTPUT_FLOOR_SHAPE, eigenbasis.EXPERT_WEIGHT, eigenbasis.ALLOCATION_SCOPE) = kept  # fmt: skip


def allocation_arg(text: str) -> tuple[float, str]:
    """`--allocations` item: `A` (x the library's `ALLOCATION_SCOPE` mean) or `A:SCOPE` (model, module, expert)."""
    a, _, scope = text.partition(":")
    scope = scope or eigenbasis.ALLOCATION_SCOPE
    if scope not in DAMPING_SCOPES:
        raise argparse.ArgumentTypeError(f"{text!r}: the scope must be one of {', '.join(DAMPING_SCOPES)}")
    return float(a), scope


def floor_rule(out_floor: int):
    """`eigenbasis.output_floor` for an output floor given on the command line: `k > 0` directions, 0 the
    dense floor, `-k` the vocabulary-scaled clamp(V / k, dense floor, 256) (`-8`: the library's rule)."""
    if out_floor < 0:
        return lambda vocab, dense: min(eigenbasis.OUTPUT_DIRECTIONS_MAX, max(dense, vocab // -out_floor))
    return lambda vocab, dense: out_floor or dense


def floor_label(out_floor: int) -> str:
    return f"V/{-out_floor} in [dense, 256]" if out_floor < 0 else str(out_floor)


def scaled_budget(
    qwen3_bytes: int,
    dtype: str,
    floor: int,
    out_floor: int,
    report,
    blocks: int,
    sketch: int,
    width: int | None,
    shape: str | None = None,
) -> int:
    """Bytes per example on the model of `report` (`blocks` weight blocks; factors sketched at `sketch`, the
    output layer at `width`) that buy what `qwen3_bytes` buy on Qwen3-30B-A3B: the same columns per weight block
    (`floor` 0), or this model's floors (`eigenbasis.plan_floors` under `allocation_rule`) and each expert
    block's share of what the 241 dense floors leave of the Qwen3-30B-A3B budget (whose dense blocks all have
    sides wider than the floors: 2048 hidden, 151k words)."""
    if floor == 0:
        return qwen3_bytes * blocks // QWEN3_BLOCKS
    size = eigenbasis.DTYPE_BYTES[dtype]
    with allocation_rule(floor, out_floor, shape=shape):
        big = eigenbasis.output_floor(QWEN3_VOCAB, floor)
        mine = eigenbasis.plan_floors(report, sketch, width)
    taken = (QWEN3_BLOCKS - QWEN3_EXPERT_BLOCKS - 1) * floor**2 + big**2
    taken += QWEN3_EXPERT_BLOCKS * eigenbasis.EXPERT_DIRECTIONS**2
    per_expert = (qwen3_bytes // size - taken) / QWEN3_EXPERT_BLOCKS
    return int((mine.columns + per_expert * mine.expert_blocks) * size)


def weight_blocks(report) -> int:
    """Weight blocks of an eigenbasis index of `report`'s targets (each expert's its own)."""
    return sum(e.layout.num_experts if e.layout else 1 for e in iter_entries(report.targets) if e.kind == "weight")


def build_default_index(model, examples, directory, ekfac=None, qwen3_budget: str = "1MiB", **rule):
    """Build the default eigenbasis index of `model` on `examples` at `directory`, as `lds_budget.py --core`
    measures it: bfloat16 rows, `qwen3_budget` as it is spent on Qwen3-30B-A3B (`scaled_budget`), the library's
    floors and output-floor shape, factors fitted at the eigenbasis sketches unless `ekfac` is given; `rule`
    overrides `allocation_rule`'s other settings (`shape=`, `expert_weight=`, `allocation=`, `scope=`). Returns
    the factors (to score with)."""
    report = ma.discover(model, track_moe_experts=True, warn=False)
    sketch, width = EIGENBASIS_SKETCH, EIGENBASIS_OUTPUT_SKETCH
    if ekfac is None:
        ekfac = ma.fit_ekfac(model, examples, projection_dim=sketch, output_projection_dim=width, progress=False)
    floor, out_floor = eigenbasis.DENSE_DIRECTIONS, -eigenbasis.OUTPUT_VOCAB_FRACTION
    shape = rule.pop("shape", eigenbasis.OUTPUT_FLOOR_SHAPE)
    budget = scaled_budget(parse_bytes(qwen3_budget), "bfloat16", floor, out_floor, report, weight_blocks(report),
                           sketch, width, shape)  # fmt: skip
    with allocation_rule(floor, out_floor, shape=shape, **rule):
        ma.build_index(model, examples, directory, progress=False, ekfac=ekfac, budget=budget, index_dtype="bfloat16")
    return ekfac


def summarise(name: str, cached, results: dict) -> dict:
    base = results[DEFAULT if DEFAULT in results else next(iter(results))]["values"]  # --no_seeded: the first
    exact = results[EXACT]["values"] if EXACT in results else None  # --no_exact: no differences to exact rows
    out = {"config": name, "title": cached.title, "variants": {}}
    print(f"== {cached.title}")
    print(f"  {'variant':58s} {'B/example':>10s}  LDS [95% CI]            this - default      this - exact")
    for label, r in results.items():
        v = r["values"]
        ci, d0 = lds.bootstrap(v), lds.bootstrap(v - base)
        d1 = lds.bootstrap(v - exact) if exact is not None else (float("nan"), float("nan"))
        out["variants"][label] = {
            "bytes_per_example": r["bytes"],
            "lds": float(v.mean()),
            "ci95": ci,
            "minus_default": float((v - base).mean()),
            "minus_default_ci95": d0,
            "minus_exact": float((v - exact).mean()) if exact is not None else None,
            "minus_exact_ci95": d1,
            "per_query": v.tolist(),
        }
        print(f"  {label:58s} {r['bytes']:10d}  {v.mean():.3f} [{ci[0]:.3f}, {ci[1]:.3f}]  "
              f"[{d0[0]:+.3f}, {d0[1]:+.3f}]  [{d1[0]:+.3f}, {d1[1]:+.3f}]", flush=True)  # fmt: skip
    return out


def markdown(result: dict) -> str:
    """One configuration's variants as a Markdown table (docs/build.md)."""
    lines = [
        "| variant | bytes / example | LDS (95% CI) | this - default (95% CI) | this - exact (95% CI) |",
        "|---|---|---|---|---|",
    ]
    for label, r in result["variants"].items():
        (lo, hi), (a, b), (c, d) = r["ci95"], r["minus_default_ci95"], r["minus_exact_ci95"]
        vs_exact = "-" if r["minus_exact"] is None else f"{r['minus_exact']:+.3f} [{c:+.3f}, {d:+.3f}]"
        lines.append(
            f"| {label} | {r['bytes_per_example']:,} | {r['lds']:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{r['minus_default']:+.3f} [{a:+.3f}, {b:+.3f}] | {vs_exact} |"
        )
    return "\n".join(lines)


AS_1MIB = "eigenbasis, (as 1024 KiB on Qwen3-30B-A3B), bfloat16"
FLOORS = AS_1MIB + ", output sketch 512, dense floor 32, output floor V/8 in [dense, 256]"
TABLE = {  # the docs' columns: short label -> variant (budgets left out)
    "eigenbasis, floors (today)": FLOORS,
    "eigenbasis, no floors (before)": AS_1MIB,
    "every direction (output sketch 512)": "eigenbasis, budget 1 MiB (every direction here), bfloat16, "
    "output sketch 512",
}


def output_floor_label(label: str) -> str | None:
    """`"<shape>, sketch <W>"` of a scaled eigenbasis variant with dense floor 32 and the V/8 output floor."""
    pattern = r", output sketch (\d+), dense floor 32, output floor V/8 in \[dense, 256\](, area)?"
    m = re.fullmatch(re.escape(AS_1MIB) + pattern, re.sub(r"budget \d+ B ", "", label))
    return m and f"{'area' if m[2] else 'square'}, sketch {m[1]}"


def allocation_label(label: str) -> str | None:
    """`"<a> x <scope>, <shape>"` of a scaled eigenbasis variant with the library's floors at sketch 1024
    (`--allocations`, `--output_shapes`); the allocation left out of a label is the library's."""
    pattern = (
        r"(, allocation ([0-9.e-]+) x (\w+) mean)?, output sketch 1024, dense floor 32, "
        r"output floor V/8 in \[dense, 256\](, (area|fill|hidden|cross))?(, whole vote (over the model|without the "
        r"output layer))?(, block weights (dense|all|output))?"
    )
    m = re.fullmatch(re.escape(AS_1MIB) + pattern, re.sub(r"budget \d+ B ", "", label))
    if not m:
        return None
    a, scope = (m[2], m[3]) if m[1] else (f"{eigenbasis.ALLOCATION_DAMPING:g}", eigenbasis.ALLOCATION_SCOPE)
    rest = ", rest" if m[7] == "without the output layer" else ""
    return f"{a} x {scope}, {m[5] or 'square'}{rest}" + (f", weights {m[9]}" if m[9] else "")


def candidate_tables(names: list[str], tag: str, sets: list[tuple[str, list[str]]], label_of, base: str) -> None:
    """The candidates of the result files of `tag`, named by `label_of` (None: not a candidate): per configuration
    each candidate's bytes per example and LDS with the paired CI against `base`, then the means over each set of
    `sets` (docs/build.md)."""
    from lds_damping import mean_over

    per_config, rows = {}, {}
    for name in names:
        path = OUT / f"lds-budget-{name}{tag}.json"
        if path.exists():
            got = {label_of(k): r for k, r in json.loads(path.read_text())["variants"].items()}
            rows[name] = {k: r for k, r in got.items() if k}
            per_config[name] = {k: np.array(r["per_query"]) for k, r in rows[name].items()}
    labels = sorted({k for r in rows.values() for k in r}, key=lambda k: (k != base, len(k), k))
    print("| configuration | " + " | ".join(labels) + " |\n" + "|---" * (1 + len(labels)) + "|")
    for name, got in rows.items():
        cells = []
        for k in labels:
            x, b = per_config[name][k], per_config[name][base]
            lo, hi = lds.bootstrap(x - b)
            ci = "" if k == base else f" [{lo:+.3f}, {hi:+.3f}]"
            cells.append(f"{got[k]['bytes_per_example']:,} B: {x.mean():.3f}{ci}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for title, group in sets:
        have = [n for n in group if n in per_config]
        if have:
            print(f"\nMeans over {title} ({', '.join(have)}):")
            mean_over(per_config, have, base)


def merged(names: list[str], tags: list[str]) -> dict[str, dict[str, dict]]:
    """`{config: {variant without its budget: result}}` from the result files of `tags` (first tag first)."""
    out: dict[str, dict[str, dict]] = {}
    for name in names:
        for tag in tags:
            path = OUT / f"lds-budget-{name}{tag}.json"
            if path.exists():
                for label, r in json.loads(path.read_text())["variants"].items():
                    out.setdefault(name, {}).setdefault(re.sub(r"budget \d+ B ", "", label), r)
    return out


def table(names: list[str], tags: list[str]) -> str:
    """Per configuration: bytes per example and LDS of the default index, exact rows and the `TABLE` variants,
    each with the paired CI of this - default (docs/build.md)."""
    got = merged(names, tags)
    head = "| configuration | default p=32, float32 | exact rows | " + " | ".join(TABLE) + " |"
    lines = [head, "|---" * (3 + len(TABLE)) + "|"]
    for name in names:
        v = got.get(name, {})
        if DEFAULT not in v:
            continue
        base = np.array(v[DEFAULT]["per_query"])
        cells = [f"{v[DEFAULT]['bytes_per_example']:,} B: {base.mean():.3f}"]
        for key in [EXACT, *TABLE.values()]:
            if key not in v:
                cells.append("-")
                continue
            x = np.array(v[key]["per_query"])
            lo, hi = lds.bootstrap(x - base)
            cells.append(f"{v[key]['bytes_per_example']:,} B: {x.mean():.3f} [{lo:+.3f}, {hi:+.3f}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def groups_table(names: list[str], tag: str) -> None:
    """`--groups_table TAG`: per configuration, the default index (what 1 MiB buys on Qwen3-30B-A3B) against the
    same budget untracked and through each module group alone (`--groups`), each with the paired CI of this -
    default; then the configurations where a row is ahead of the default by a CI that excludes 0, those where the
    default is not ahead of it by such a CI (issue 31 asks it to beat each), and each row's mean difference."""
    rows = ["untracked", *(f"{g} alone" for g in lds.GROUPS)]
    print("| configuration | default | " + " | ".join(rows) + " |\n" + "|---" * (2 + len(rows)) + "|")
    ahead, tied, diffs = [], [], {r: [] for r in rows}
    for name in names:
        path = OUT / f"lds-budget-{name}{tag}.json"
        if not path.exists():
            continue
        got = {re.sub(r"budget \d+ B ", "", k): np.array(v["per_query"]) for k, v in json.loads(path.read_text())[
            "variants"].items()}  # fmt: skip
        base_label = next(k for k in got if allocation_label(k) is not None)
        base, cells = got[base_label], []
        for r in rows:
            x = got[f"{base_label}, {r}"]
            lo, hi = lds.bootstrap(x - base)
            diffs[r].append(x - base)
            cells.append(f"{x.mean():.3f} [{lo:+.3f}, {hi:+.3f}]")
            if lo > 0:
                ahead.append(f"{name}: {r} {x.mean() - base.mean():+.3f} [{lo:+.3f}, {hi:+.3f}]")
            elif hi >= 0:
                tied.append(f"{name}: {r} {x.mean() - base.mean():+.3f} [{lo:+.3f}, {hi:+.3f}]")
        print(f"| {name} | **{base.mean():.3f}** | " + " | ".join(cells) + " |")
    print("\nahead of the default by a CI that excludes 0: " + ("; ".join(ahead) if ahead else "none"))
    print("not behind it by a CI that excludes 0: " + ("; ".join(tied) if tied else "none"))
    for r, d in diffs.items():
        if d:
            print(f"mean over {len(d)}: {r} - default {np.mean([x.mean() for x in d]):+.4f}")


def summary(names: list[str], tags: list[str]) -> None:
    """Each variant's mean over the tuning and the held-out configurations among `names` (from the result files
    of `tags`, merged per configuration; a variant's budget in bytes left out of its label, since it differs per
    configuration), with paired CIs against the default index and against exact rows."""
    per_config = {
        name: {label: np.array(r["per_query"]) for label, r in got.items()} for name, got in merged(names, tags).items()
    }
    held = set(lds.HELDOUT) | set(lds.HELDOUT_HEAD)
    for title, group in (
        ("tuning", [n for n in names if n not in held]),
        ("held-out", [n for n in names if n in held]),
    ):
        have = [n for n in group if n in per_config]
        if have:
            for base in (DEFAULT, EXACT, AS_1MIB):
                print(f"== mean over the {title} configurations ({', '.join(have)}), against {base}")
                mean_over(per_config, have, base)


def main() -> None:
    parser = lds.cached_configs_parser(__doc__.splitlines()[0])
    parser.add_argument("--sketch", type=int, default=128, help="EK-FAC projection_dim of the eigenbasis factors")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--markdown", action="store_true", help="print the saved results as Markdown tables")
    parser.add_argument("--core", action="store_true", help="only default, exact and the scaled eigenbasis budgets")
    parser.add_argument("--scaled", nargs="+", default=list(SCALED), help="Qwen3-30B-A3B budgets to scale from")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--allocations", type=allocation_arg, nargs="+",
                        default=[(eigenbasis.ALLOCATION_DAMPING, eigenbasis.ALLOCATION_SCOPE)],
                        help="allocation dampings of the scaled budgets: A (x the library's scope's mean Lambda) or "
                        "A:SCOPE (model, module, expert)")  # fmt: skip
    parser.add_argument("--output_widths", type=int, nargs="+", default=[0],
                        help="the factors' output-layer sketch widths (0: as every side)")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="dtypes of the scaled budgets")
    parser.add_argument("--dense", type=int, nargs="+", default=[0, eigenbasis.DENSE_DIRECTIONS],
                        help="dense floors r (r x r directions; 0: no floors)")  # fmt: skip
    parser.add_argument(
        "--output_floors",
        type=int,
        nargs="+",
        default=[-eigenbasis.OUTPUT_VOCAB_FRACTION],
        help="output-layer floors (0: as dense; -k: clamp(V/k, dense, 256); -8, the default, is the library's)",
    )
    parser.add_argument(
        "--groups", action="store_true", help="also each module group alone and untracked, per scaled eigenbasis index"
    )
    parser.add_argument("--output_shapes", nargs="+", default=[eigenbasis.OUTPUT_FLOOR_SHAPE],
                        choices=eigenbasis.OUTPUT_FLOOR_SHAPES, help="the output floor's shapes (square r x r, or "
                        "r * r cells shaped by the allocation's greedy)")  # fmt: skip
    parser.add_argument("--no_seeded", action="store_true", help="with --core: skip the seeded p=32 index")
    parser.add_argument("--balance_wholes", nargs="*", default=[], choices=balance_module.BALANCE_WHOLES,
                        help="also each scaled index scored with the output balance's whole-model vote over these "
                        "columns (rest: every column but the output layer's)")  # fmt: skip
    parser.add_argument("--truncation_weights", nargs="*", default=[], choices=precondition.BLOCK_WEIGHTS_CHOICES,
                        help="also each scaled index scored with these blocks' truncation weights "
                        "(precondition.block_weight)")  # fmt: skip
    parser.add_argument("--unbalanced", action="store_true",
                        help="with --groups: also each scaled index scored without the output balance")  # fmt: skip
    parser.add_argument("--expert_weights", type=float, nargs="*", default=[],
                        help="also each scaled index with the experts' direction weight w in the greedy "
                        "(the library's: eigenbasis.EXPERT_WEIGHT)")  # fmt: skip
    parser.add_argument("--no_exact", action="store_true", help="skip exact rows (the summary takes them from "
                        "another tag's file)")  # fmt: skip
    parser.add_argument("--summary", nargs="+", default=None, metavar="TAG", help="means over configs of these tags")
    parser.add_argument("--output_floor_tables", default=None, metavar="TAG",
                        help="the output floor's shapes and widths measured under TAG, as tables")  # fmt: skip
    parser.add_argument("--allocation_tables", default=None, metavar="TAG",
                        help="the allocation dampings, scopes and output-floor shapes measured under TAG (session 20's "
                        "rule, benchmarks/heldout.json heldout_s20), as tables")  # fmt: skip
    parser.add_argument("--fill_tables", default=None, metavar="TAG",
                        help="the output floor's 'fill' shape against the default measured under TAG "
                        "(heldout_s20b)")  # fmt: skip
    parser.add_argument("--groups_table", default=None, metavar="TAG",
                        help="the default against untracked and each module group alone, measured under TAG "
                        "(--groups)")  # fmt: skip
    parser.add_argument("--shape_tables", default=None, metavar="TAG",
                        help="the output floor's 'hidden' and 'cross' shapes (heldout_s21), or the truncation weights "
                        "(heldout_s22), against the default measured under TAG")  # fmt: skip
    args = parser.parse_args()
    if args.groups_table is not None:
        groups_table(args.configs, "-" + args.groups_table.lstrip("-"))
        return
    seen = [*lds.TUNING, *lds.HELDOUT, *lds.HELDOUT_HEAD, *lds.HELDOUT_NEXT]
    if args.output_floor_tables is not None:
        sets = [("the thirteen measured before", seen), ("HELDOUT_S18", list(lds.HELDOUT_S18))]
        candidate_tables(args.configs, "-" + args.output_floor_tables.lstrip("-"), sets,
                         output_floor_label, "square, sketch 512")  # fmt: skip
        return
    for tag, earlier, title, frozen in (
        (args.allocation_tables, (lds.HELDOUT_S18, lds.HELDOUT_S19), "seventeen", "HELDOUT_S20"),
        (args.fill_tables, (lds.HELDOUT_S18, lds.HELDOUT_S19, lds.HELDOUT_S20), "nineteen", "HELDOUT_S20B"),
        (
            args.shape_tables,
            (lds.HELDOUT_S18, lds.HELDOUT_S19, lds.HELDOUT_S20, lds.HELDOUT_S20B),
            "twenty-one",
            "HELDOUT_S21",
        ),
    ):
        if tag is not None:
            measured = seen + [n for names in earlier for n in names]
            sets = [(f"the {title} measured before", measured), (frozen, list(getattr(lds, frozen)))]
            candidate_tables(args.configs, "-" + tag.lstrip("-"), sets, allocation_label, "1 x model, area")
            return
    if args.summary is not None:
        tags = [t if t.startswith("-") or not t else f"-{t}" for t in args.summary]
        print(table(args.configs, tags) + "\n")
        summary(args.configs, tags)
        return
    if args.markdown:
        for name in args.configs:
            print(f"\n{name}\n\n" + markdown(json.loads((OUT / f"lds-budget-{name}.json").read_text())))
        return
    torch.set_num_threads(2)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.configs:
        widths = tuple(w or None for w in args.output_widths)
        result = run(name, Path(args.cache), args.sketch, tuple(args.fractions), args.core, tuple(args.scaled),
                     tuple(args.allocations), widths, tuple(args.dtypes), tuple(args.dense),
                     tuple(args.output_floors), not args.no_exact, args.groups, tuple(args.output_shapes),
                     not args.no_seeded, tuple(args.expert_weights), args.unbalanced,
                     tuple(args.balance_wholes), tuple(args.truncation_weights))  # fmt: skip
        (OUT / f"lds-budget-{name}{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
