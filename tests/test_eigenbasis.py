"""Eigenbasis index rows against exact per-example gradients rotated by hand, elementwise
preconditioning against `Factor.precondition`, the budget, and the build/score round trip."""

import json

import numpy as np
import pytest
import torch

import moe_attrib as ma
from moe_attrib.collect.projection import projection_matrix
from moe_attrib.curvature import eigenbasis
from moe_attrib.curvature.eigenbasis import (
    allocate,
    direction_order,
    factors_fingerprint,
    fit_floors,
    parse_bytes,
    plan_eigenbasis,
)
from moe_attrib.curvature.ekfac import fit_ekfac
from moe_attrib.curvature.precondition import EXPERT_BLOCK, ScoreError, precondition_queries
from moe_attrib.data import collate
from moe_attrib.indexing.index import load_index
from moe_attrib.model.zoo import tiny_model
from moe_attrib.scoring.score import query_gradients, score
from moe_attrib.workflows.build import build_index
from tests.conftest import rel_err
from tests.test_ekfac import examples


def exact_grads(model, exs):
    ids, mask = collate(exs, list(range(len(exs))))
    return ma.per_example_gradients(model, ids, mask, projection_dim=None)


def factor_of(name):
    """(factor name, expert or None, parameter stem) of an index block name."""
    m = EXPERT_BLOCK.match(name)
    if m:
        return f"{m['layer']}.{m['proj']}", int(m["i"]), name[: -len(".weight")]
    return name[: -len(".weight")], None, name[: -len(".weight")]


def expected_block(grads, ek, block, sketch=None):
    """Block rows by hand: the exact gradient (sketched with `projection_matrix` when the factors were
    fitted sketched), bias folded in, rotated by the expert's full eigenbases, truncated to the block's
    leading directions in `direction_order`."""
    factor, expert, stem = factor_of(block.name)
    f = ek.factors[factor]
    w = grads[f"{stem}.weight"].double()
    b = grads.get(f"{stem}.bias")
    if sketch is not None:
        p, seed, own = sketch
        p = own.get(factor, p)
        out_f, in_f = (w.shape[2], w.shape[1]) if f.transposed else (w.shape[1], w.shape[2])

        def side(name, features):
            if features <= p:
                return torch.eye(features, dtype=torch.float64)
            m = projection_matrix(f"{factor}/{name}", p, features, seed, batch=f.experts).double()
            return m[expert] if expert is not None else m

        po, pi = side("out", out_f), side("in", in_f)
        w = pi @ w @ po.T if f.transposed else po @ w @ pi.T
        b = None if b is None else b.double() @ po.T
    if f.bias:
        w = f.augment(w, b.double())
    qr, qc = f.rows_cols
    rows, cols = direction_order(f)
    if expert is not None:
        qr, qc, rows, cols = qr[expert], qc[expert], rows[expert], cols[expert]
    rotated = qr.T @ w @ qc
    return keep_cells(rotated[:, rows[: block.shape[0]]][:, :, cols[: block.shape[1]]], block.shape)


def keep_cells(rect, shape):
    """`[N, kr, kc]` rows flattened to the cells a block's shape keeps: the rectangle, or for `(kr, kc, k)` the
    leading k rows and leading k columns (an L), row-major."""
    n = rect.shape[0]
    if len(shape) == 2:
        return rect.reshape(n, -1)
    k = shape[2]
    return torch.stack([rect[:, i, j] for i in range(shape[0]) for j in range(shape[1]) if i < k or j < k], 1)


@pytest.mark.parametrize(
    "family,sketch,output",
    [("qwen3_moe", None, None), ("gpt_oss", None, None), ("qwen3_moe", 8, None), ("qwen3_moe", 8, 48)],
    ids=["qwen3_moe-exact-factors", "gpt_oss-biases", "qwen3_moe-sketched", "qwen3_moe-sketched-output-layer-at-48"],
)
def test_rows_equal_exact_gradient_rotated_and_truncated(tmp_path, monkeypatch, family, sketch, output):
    """Eigenbasis rows against the exact gradient (sketched by hand where the factors were: the output layer at
    its own width with `output_projection_dim`) rotated into the factors' eigenbases and truncated."""
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 2)  # small floors: the experts get columns too
    model = tiny_model(family)
    exs = examples(8)
    ek = fit_ekfac(model, exs, projection_dim=sketch, output_projection_dim=output, token_batch_size=48,
                   progress=False)  # fmt: skip
    total = sum(f.lam.numel() for f in ek.factors.values())  # columns of every direction pair
    path = build_index(model, exs, tmp_path / "ix", ekfac=ek, budget=4 * total // 3, progress=False)
    index = load_index(path)
    rows = torch.from_numpy(index.read_rows(slice(None)))
    grads = exact_grads(model, exs)
    blocks = index.blocks
    assert any(EXPERT_BLOCK.match(b.name) for b in blocks)
    assert len({b.shape for b in blocks}) > 1  # the budget gives blocks different rectangles
    for b in blocks:
        want = expected_block(
            grads, ek, b, None if sketch is None else (sketch, 0, {"lm_head": output} if output else {})
        )
        assert rel_err(rows[:, b.start : b.stop], want) < 2e-4, b.name
    assert index.gradients.shape[1] * 4 <= 4 * total // 3
    assert index.manifest["settings"]["output_projection_dim"] == output
    if output:
        assert ek.factors["lm_head"].G.shape == (output, output)  # vocabulary 128 sketched to 48, not 8
    q = query_gradients(model, exs[:3], index)  # queries collected from the index alone
    assert rel_err(q, rows[:3]) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_elementwise_preconditioning_equals_ekfac_restricted(tmp_path, family):
    model = tiny_model(family)
    exs = examples(10)
    ek = fit_ekfac(model, exs, projection_dim=None, token_batch_size=48, progress=False, damping_scope="expert")
    total = sum(f.lam.numel() for f in ek.factors.values())
    index = load_index(build_index(model, exs, tmp_path / "ix", ekfac=ek, budget=total, progress=False))
    q = torch.from_numpy(index.read_rows(slice(0, 4)))
    got = precondition_queries(q, index.blocks, ek, index.manifest["settings"])
    grads = exact_grads(model, exs[:4])
    for b in index.blocks:
        factor, expert, stem = factor_of(b.name)
        f = ek.factors[factor]
        w = grads[f"{stem}.weight"].double()
        if f.bias:
            w = f.augment(w, grads[f"{stem}.bias"].double())
        qr, qc = f.rows_cols
        lam, damp = f.lam, f.damping
        if expert is not None:
            qr, qc, lam, damp = qr[expert], qc[expert], lam[expert], damp[expert]
        pre = qr @ ((qr.T @ w @ qc) / (lam + damp)) @ qc.T  # Factor.precondition on one expert's slice
        if expert is None:
            assert rel_err(f.precondition(w), pre) < 1e-10
        rows, cols = direction_order(f)
        rows, cols = (rows[expert], cols[expert]) if expert is not None else (rows, cols)
        kr, kc = b.shape
        want = (qr.T @ pre @ qc)[:, rows[:kr]][:, :, cols[:kc]].reshape(4, -1)
        assert rel_err(got[:, b.start : b.stop], want) < 2e-4, b.name


def test_precondition_refuses_other_factors(tmp_path):
    model = tiny_model("qwen3_moe")
    exs = examples(10)
    ek = fit_ekfac(model, exs, projection_dim=8, token_batch_size=48, progress=False)
    other = fit_ekfac(model, examples(10, seed=1), projection_dim=8, token_batch_size=48, progress=False)
    index = load_index(build_index(model, exs, tmp_path / "ix", ekfac=ek, budget="8KiB", progress=False))
    assert factors_fingerprint(ek) != factors_fingerprint(other)
    q = torch.from_numpy(index.read_rows(slice(0, 2)))
    with pytest.raises(ScoreError, match="not the ones"):
        precondition_queries(q, index.blocks, other, index.manifest["settings"])
    redamped = ek.with_damping(0.1)  # the same factors with another damping are accepted
    precondition_queries(q, index.blocks, redamped, index.manifest["settings"])
    s = score(index, q, ekfac=ek, top_k=3, per_module=True, coupling=None, balance=None)
    assert np.allclose(s.parts.sum(-1), s.values, rtol=1e-4, atol=1e-6)
    assert s.rows[:, 0].tolist() == [0, 1]  # an example's own row ranks first under cosine


def test_budget_and_allocation():
    assert parse_bytes("256KiB") == 256 * 1024 and parse_bytes("1MB") == 10**6 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="budget"):
        parse_bytes("12 parsecs")
    g = torch.Generator().manual_seed(0)
    weights = [torch.sort(torch.rand(r, c, generator=g), descending=True)[0] for r, c in [(5, 7), (3, 3), (8, 2)]]
    for columns in (1, 2, 10, 30, 200):
        shapes = allocate(weights, columns)
        used = sum(kr * kc for kr, kc in shapes)
        assert used <= columns
        full = sum(w.numel() for w in weights)
        assert used == min(columns, full) or used >= columns - 8  # stops only when no move fits
    # with one block the greedy rectangle is the best of all rectangles of its size reached by growing
    w = torch.tensor([[9.0, 1.0, 1.0], [5.0, 0.1, 0.1], [4.0, 0.1, 0.1]])
    assert allocate([w], 3) == [(3, 1)]


def test_allocation_floors():
    """A floor is spent first and clipped to its block; the greedy goes on from it (worked out by hand)."""
    big = torch.tensor([[9.0, 8.0, 0.2], [7.0, 0.1, 0.1], [6.0, 0.1, 0.1]])
    small = torch.tensor([[0.5, 0.4], [0.3, 0.2]])
    # no floors: big opens (9, against small's 0.5), grows by its next column (8 per cell, against its next
    # row's 7), then by its next row [7, 0.1] (3.55 per cell, against column [0.2] and small's 0.5): 2x2
    assert allocate([big, small], 4) == [(2, 2), (0, 0)]
    # small floored at 2x2 (clipped from 3x3): 4 of 7 cells spent; big opens (9), grows by a column (8), and
    # with 1 cell left its next row (2 cells) does not fit: its next column (0.2, 1 cell) does
    assert allocate([big, small], 7, floors=[(0, 0), (3, 3)]) == [(1, 3), (2, 2)]
    with pytest.raises(ValueError, match="floors"):
        allocate([big, small], 3, floors=[(0, 0), (2, 2)])


@pytest.mark.parametrize("expert_weight", [0.25, 1.0])
def test_allocation_ignores_the_factors_damping(monkeypatch, expert_weight):
    """The budget is spent by `Lambda / (Lambda + m)`, `m` the model-wide mean of every corrected eigenvalue
    (worked out here from the factors' own `lam`), an expert's times `EXPERT_WEIGHT` (0.25, the default; 1
    counts it as a dense block's), whatever damping the factors carry: fitted with the default, re-damped 1 x
    model-wide or 0.5 x per module, the plan keeps the same rectangles (no floors here: `test_plan_floors`)."""
    assert eigenbasis.EXPERT_WEIGHT == 0.25
    monkeypatch.setattr(eigenbasis, "EXPERT_WEIGHT", expert_weight)
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 0)
    monkeypatch.setattr(eigenbasis, "EXPERT_DIRECTIONS", 0)
    model = tiny_model("qwen3_moe")
    report = ma.discover(model, track_moe_experts=True)
    ek = fit_ekfac(model, examples(6), projection_dim=8, token_batch_size=48, progress=False)
    lams = [f.lam.double() for f in ek.factors.values()]
    mean = float(sum(lam.sum() for lam in lams) / sum(lam.numel() for lam in lams))
    plans = [plan_eigenbasis(report, e, "8KiB") for e in (ek, ek.with_damping(1.0), ek.with_damping(0.5, "module"))]
    shapes = [[s for t in plan.targets for s in t.shapes] for plan in plans]
    assert shapes[0] == shapes[1] == shapes[2]
    weights = []
    for target in plans[0].targets:
        f = ek.factors[target.block]
        rows, cols = direction_order(f)
        lam = f.lam.double()
        for e in range(len(target.shapes)):
            le, r, c = (lam[e], rows[e], cols[e]) if lam.dim() == 3 else (lam, rows, cols)
            weights.append((le / (le + mean))[r][:, c] * (expert_weight if lam.dim() == 3 else 1.0))
    assert shapes[0] == allocate(weights, parse_bytes("8KiB") // 4)


def test_experts_weight_moves_columns_to_dense_blocks(monkeypatch):
    """At the same budget, the default weight (0.25) gives the experts fewer columns than weight 1 and the dense
    blocks more (each plan checked against its hand-computed weights above)."""
    model = tiny_model("qwen3_moe")
    report = ma.discover(model, track_moe_experts=True)
    ek = fit_ekfac(model, examples(6), projection_dim=8, token_batch_size=48, progress=False)
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 0)
    monkeypatch.setattr(eigenbasis, "EXPERT_DIRECTIONS", 0)
    cells = {}
    for w in (0.25, 1.0):
        monkeypatch.setattr(eigenbasis, "EXPERT_WEIGHT", w)
        plan = plan_eigenbasis(report, ek, "8KiB")
        cells[w] = sum(kr * kc for t in plan.targets if t.experts for kr, kc in t.shapes)
    assert 0 < cells[0.25] < cells[1.0]


def test_every_tracked_expert_keeps_its_leading_pair(monkeypatch):
    """With the default floors every expert block stores its leading direction pair, also where the greedy
    would give the experts nothing (a budget of the floors alone), so per-expert answers never vanish from a
    tracked index; without the expert floor they do."""
    model = tiny_model("qwen3_moe")  # 2 layers x (gate_up_proj, down_proj) x 8 experts
    report = ma.discover(model, track_moe_experts=True)
    ek = fit_ekfac(model, examples(6), projection_dim=8, token_batch_size=48, progress=False)
    for floor, want in ((1, (1, 1)), (0, (0, 0))):
        monkeypatch.setattr(eigenbasis, "EXPERT_DIRECTIONS", floor)
        budget = 4 * eigenbasis.plan_floors(report, 8, 8).columns
        with pytest.warns(UserWarning, match="output_projection_dim"):
            plan = plan_eigenbasis(report, ek, budget)
        shapes = [s for t in plan.targets if t.experts for s in t.shapes]
        assert len(shapes) == 32 and set(shapes) == {want}


def test_output_floor_area_is_shaped_by_the_greedy(monkeypatch):
    """The output floor's r * r cells under `OUTPUT_FLOOR_SHAPE = "area"` (the default) take the shape the greedy
    gives them on the output layer's own direction weights; "square" keeps r x r. Worked out by hand:
    weights [[1, .9, .8, .7], [.3, .2, .1, .1]], r = 2 (16 words / 8): open (0, 0); a column (.9) beats a row
    (.3); a column (.8, 1 cell) beats a row (.25 a cell); only a column (.7) still fits: 1 x 4."""
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 2)
    w = torch.tensor([[1.0, 0.9, 0.8, 0.7], [0.3, 0.2, 0.1, 0.1]])
    dense = torch.ones(3, 3)
    assert eigenbasis.OUTPUT_FLOOR_SHAPE == "area"
    assert fit_floors([(False, False), (False, True)], [dense, w], 100, vocab=16) == (2, 2, 1, [(2, 2), (1, 4)])
    monkeypatch.setattr(eigenbasis, "OUTPUT_FLOOR_SHAPE", "square")
    assert fit_floors([(False, False), (False, True)], [dense, w], 100, vocab=16) == (2, 2, 1, [(2, 2), (2, 2)])


def test_output_floor_fill_shape(monkeypatch):
    """The "fill" shape: the output floor's r * r cells as the r x r square where the block holds r on both sides,
    else the short side whole and the long side filled to r * r cells. By hand, r = 4 (32 words / 8): a 6 x 5
    block keeps 4 x 4; 2 x 40 keeps 2 x 8 (16 cells); 40 x 2 keeps 8 x 2; 3 x 5 keeps 3 x 5 (16 // 3 = 5, the
    whole block)."""
    assert eigenbasis.filled(4, 6, 5) == (4, 4)
    assert eigenbasis.filled(4, 2, 40) == (2, 8)
    assert eigenbasis.filled(4, 40, 2) == (8, 2)
    assert eigenbasis.filled(4, 3, 5) == (3, 5)
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 2)
    monkeypatch.setattr(eigenbasis, "OUTPUT_FLOOR_SHAPE", "fill")
    dense, head = torch.ones(3, 3), torch.rand(2, 40)
    assert fit_floors([(False, False), (False, True)], [dense, head], 100, vocab=32) == (2, 4, 1, [(2, 2), (2, 8)])
    head = torch.rand(6, 5)
    assert fit_floors([(False, False), (False, True)], [dense, head], 100, vocab=32) == (2, 4, 1, [(2, 2), (4, 4)])


def test_output_floor_hidden_shape(monkeypatch):
    """The "hidden" shape: the output floor's r * r cells as the output layer's input (hidden) side whole and its
    vocabulary side filled to r * r cells. By hand, r = 4 (32 words / 8): 6 inputs x 20 words keeps 6 x 2 (16 // 6);
    40 inputs keep 16 x 1 (at most r * r inputs, at least one word); 3 inputs x 4 words keep the block, 3 x 4. In
    the stored orientation a `[out, in]` weight's rectangle is (words, inputs), a transposed one's (inputs, words).
    On a tiny model the plan keeps the output layer's every input direction of the factors."""
    assert eigenbasis.hidden_whole(4, 6, 20) == (6, 2)
    assert eigenbasis.hidden_whole(4, 40, 20) == (16, 1)
    assert eigenbasis.hidden_whole(4, 3, 4) == (3, 4)
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 2)
    monkeypatch.setattr(eigenbasis, "OUTPUT_FLOOR_SHAPE", "hidden")
    dense = torch.ones(3, 3)
    kinds = [(False, False), (False, True)]
    assert fit_floors(kinds, [dense, torch.rand(20, 6)], 100, vocab=32) == (2, 4, 1, [(2, 2), (2, 6)])
    assert fit_floors(kinds, [dense, torch.rand(6, 20)], 100, vocab=32, head_transposed=True)[3] == [(2, 2), (6, 2)]
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 32)
    model = tiny_model("qwen3_moe")  # 128 words x hidden 64: output floor 32, 1,024 cells: 16 words x 64 inputs
    report = ma.discover(model, track_moe_experts=True)
    ek = fit_ekfac(model, examples(6), projection_dim=8, output_projection_dim=256, token_batch_size=48, progress=False)
    assert ek.factors["lm_head"].lam.shape == (128, 64) and not ek.factors["lm_head"].transposed
    (head,) = [t.shapes[0] for t in plan_eigenbasis(report, ek, "8KiB").targets if t.block == "lm_head"]
    assert head[1] == 64 and head[0] >= 16  # the greedy may add words to the floor's 16
    monkeypatch.setattr(eigenbasis, "OUTPUT_FLOOR_SHAPE", "area")
    (head,) = [t.shapes[0] for t in plan_eigenbasis(report, ek, "8KiB").targets if t.block == "lm_head"]
    assert head[1] < 64  # the greedy's own shape keeps fewer inputs here


def test_output_floor_cross_shape(tmp_path, monkeypatch):
    """The "cross" shape: where both of the output block's sides hold 2r directions, the L of the leading r/4 rows
    over 2r columns and the leading r/4 columns over 2r rows, else "fill". By hand: r = 32 in a 100 x 64 block:
    (64, 64, 8), 8 * 64 + 56 * 8 = 960 cells; in 60 x 64, 4 x 200 and r = 2 (no quarter): fill's 32 x 32, 4 x 200,
    2 x 2. On a tiny model (128 words x hidden 64, r = 16: the L (32, 32, 4), 240 cells) the output layer's
    columns equal its exact gradient rotated into the factors' eigenbases and kept on the L, the greedy adds
    nothing to it, and its elementwise preconditioning equals `Factor.precondition` restricted to those cells."""
    assert eigenbasis.crossed(32, 100, 64) == (64, 64, 8) and eigenbasis.cells_of((64, 64, 8)) == 960
    assert eigenbasis.crossed(32, 60, 64) == (32, 32)
    assert eigenbasis.crossed(32, 4, 200) == (4, 200) and eigenbasis.crossed(2, 8, 8) == (2, 2)
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 8)
    monkeypatch.setattr(eigenbasis, "OUTPUT_FLOOR_SHAPE", "cross")
    model = tiny_model("qwen3_moe")
    exs = examples(8)
    ek = fit_ekfac(model, exs, projection_dim=8, output_projection_dim=256, token_batch_size=48, progress=False)
    assert ek.factors["lm_head"].lam.shape == (128, 64)
    index = load_index(build_index(model, exs, tmp_path / "ix", ekfac=ek, budget="16KiB", progress=False))
    (head,) = [b for b in index.blocks if b.name == "lm_head.weight"]
    assert head.shape == (32, 32, 4) and head.stop - head.start == 4 * 32 + 28 * 4
    assert index.gradients.shape[1] <= parse_bytes("16KiB") // 4
    rows = torch.from_numpy(index.read_rows(slice(None)))
    grads = exact_grads(model, exs)
    for b in index.blocks:
        want = expected_block(grads, ek, b, (8, 0, {"lm_head": 256}))
        assert rel_err(rows[:, b.start : b.stop], want) < 2e-4, b.name
    got = precondition_queries(rows[:3], [head], ek, index.manifest["settings"])
    f = ek.factors["lm_head"]
    w = grads["lm_head.weight"].double()[:3]
    qr, qc = f.rows_cols
    pre = qr @ ((qr.T @ w @ qc) / (f.lam + f.damping)) @ qc.T
    assert rel_err(f.precondition(w), pre) < 1e-10
    r, c = direction_order(f)
    want = keep_cells((qr.T @ pre @ qc)[:, r[:32]][:, :, c[:32]], (32, 32, 4))
    assert rel_err(got[:, head.start : head.stop], want) < 2e-4


def test_plan_floors(monkeypatch):
    """Every dense block starts from its leading `r x r` directions and the output layer from
    clamp(vocabulary / 8, r, 256) (clipped to the factors' sides), the experts from none; the greedy spends
    the rest. Worked out by hand from the factors' shapes; floors a budget cannot hold are halved, with a
    warning, and recorded."""
    monkeypatch.setattr(eigenbasis, "DENSE_DIRECTIONS", 4)
    model = tiny_model("qwen3_moe")  # 128 words: output floor 128 / 8 = 16, clipped to the sketch's 8 + 1
    report = ma.discover(model, track_moe_experts=True)
    ek = fit_ekfac(model, examples(6), projection_dim=8, token_batch_size=48, progress=False)
    rects, weights = [], []
    for block, f in ek.factors.items():
        rows, cols = direction_order(f)
        lam = f.lam.double()
        mean = float(sum(g.lam.double().sum() for g in ek.factors.values()))
        mean /= sum(g.lam.numel() for g in ek.factors.values())
        for e in range(lam.shape[0] if lam.dim() == 3 else 1):
            le, r, c = (lam[e], rows[e], cols[e]) if lam.dim() == 3 else (lam, rows, cols)
            weights.append((le / (le + mean))[r][:, c] * (0.25 if lam.dim() == 3 else 1.0))  # EXPERT_WEIGHT
            side = 1 if lam.dim() == 3 else 16 if block == "lm_head" else 4  # an expert: its leading pair
            rects.append((min(side, le.shape[0]), min(side, le.shape[1])))
    assert ("lm_head" in ek.factors) and rects[list(ek.factors).index("lm_head")] != (4, 4)
    floor_cells = sum(r * c for r, c in rects)
    budget = 4 * (floor_cells + 200)
    with pytest.warns(UserWarning, match="output_projection_dim 1024"):  # the sketch clips the output floor
        plan = plan_eigenbasis(report, ek, budget)
    assert list(ek.factors) == [t.block for t in plan.targets]  # the factors' order is the plan's
    shapes = [s for t in plan.targets for s in t.shapes]
    assert shapes == allocate(weights, budget // 4, rects)
    assert all(s[0] >= r[0] and s[1] >= r[1] for s, r in zip(shapes, rects, strict=True))
    assert plan.floors == (4, 16, 1)
    assert plan.settings(budget, "x")["floors"] == {"dense": 4, "output": 16, "experts": 1}
    assert eigenbasis.plan_floors(report, 8, 8).columns == floor_cells  # planned from the shapes alone
    with pytest.warns(UserWarning, match="floors lowered to 2 .output layer 8."):
        small = plan_eigenbasis(report, ek, 4 * (floor_cells - 1))
    assert small.floors == (2, 8, 0)
    assert sum(kr * kc for t in small.targets for kr, kc in t.shapes) <= floor_cells - 1


def test_plan_refuses_unfolded_bias_and_missing_factor():
    model = tiny_model("gpt_oss")
    exs = examples(6)
    report = ma.discover(model, track_moe_experts=True)
    unfolded = fit_ekfac(model, exs, projection_dim=8, fold_bias=False, token_batch_size=48, progress=False)
    with pytest.raises(ValueError, match="no_fold_bias"):
        plan_eigenbasis(report, unfolded, "4KiB")
    partial = fit_ekfac(model, exs, projection_dim=8, filter_modules="*.experts*", token_batch_size=48, progress=False)
    with pytest.raises(ValueError, match="no EK-FAC factor"):
        plan_eigenbasis(report, partial, "4KiB")


def test_inspect_plans_from_config_alone(tmp_path, capsys):
    """`inspect` on a directory with only config.json: the meta-device model's coverage, the default index's bytes
    per example (equal to what a default build of the real model stores: factors at 128 / 1024, 1 MiB of
    bfloat16, here every direction pair) and the seeded index's (equal to its column plan)."""
    from moe_attrib.app.cli import main
    from moe_attrib.indexing.index import DEFAULT_PROJECTION_DIM, column_plan
    from moe_attrib.model.zoo import tiny_config
    from moe_attrib.settings import CollectSettings

    tiny_config("gpt_oss").save_pretrained(tmp_path / "config")
    assert sorted(p.name for p in (tmp_path / "config").iterdir()) == ["config.json"]
    assert main(["inspect", str(tmp_path / "config"), "--track_moe_experts"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = [x for x in out if x.startswith("index bytes per example: ")]
    model = tiny_model("gpt_oss")
    exs = examples(4)
    ek = fit_ekfac(model, exs, projection_dim=128, output_projection_dim=1024, token_batch_size=48, progress=False)
    built = load_index(build_index(model, exs, tmp_path / "ix", ekfac=ek, index_dtype="bfloat16", progress=False))
    assert line == [f"index bytes per example: {built.gradients.shape[1] * 2}"]
    report = ma.discover(model, track_moe_experts=True)
    dims = CollectSettings().target_dims(report.output_layer)
    seeded = column_plan(report, DEFAULT_PROJECTION_DIM, "separate", target_dims=dims)[-1].stop * 4
    assert [x for x in out if x.startswith("seeded index")][0].endswith(f", {seeded} bytes per example")


def test_inspect_plans_the_eigenbasis_floors_of_qwen3_30b_a3b(capsys):
    """On the Qwen3-30B-A3B shape (config only): 48 layers x (4 attention projections + the router) dense blocks
    at 32 x 32 and the output layer's min(151936 / 8, 256)^2 = 65,536 cells (hidden 2048, sketched to 1024), worked
    out from the config by hand, every expert block's leading pair; the greedy spends what 1 MiB of bfloat16 leaves."""
    from pathlib import Path

    from moe_attrib.app.cli import main

    shape = Path(__file__).parent.parent / "benchmarks" / "shapes" / "qwen3-30b-a3b"
    assert main(["inspect", str(shape), "--track_moe_experts"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = [x for x in out if x.startswith("eigenbasis floors")]
    assert "index bytes per example: 1048576" in out  # 1 MiB: 1/49 of the seeded p=32 index's 51,318,784
    floors = 48 * 5 * 32 * 32 + 256 * 256 + 48 * 128 * 2  # every expert block its leading pair
    per_expert = 1 + (2**20 // 2 - floors) / (48 * 128 * 2)
    assert len(line) == 1
    head = "the output layer's 65536 cells (256 x 256, shaped by its eigenvalues), 12288 expert blocks at 1"
    assert f"floors: {floors} columns (241 dense blocks at 32 directions a side, {head})" in line[0]
    assert line[0].endswith(f"at most {per_expert:.1f} columns an expert block on average")


def test_cli_flow_and_refused_factors(tmp_path, capsys):
    """ekfac -> build --ekfac --budget -> score --ekfac; other factors are refused before any work."""
    from moe_attrib.app.cli import main
    from moe_attrib.model.zoo import save_tiny
    from tests.test_build import CORPUS, texts

    model = tmp_path / "model"
    save_tiny(str(model), "qwen3_moe", texts())
    common = ["--track_moe_experts", "--quiet", "--precision", "fp32"]
    fit = ["ekfac", str(model), str(CORPUS), "--projection_dim", "16", *common]
    assert main([*fit, "--out", str(tmp_path / "f")]) == 0
    assert main([*fit, "--out", str(tmp_path / "g"), "--damping_scope", "expert", "--empirical_fisher"]) == 0
    ix = tmp_path / "ix"
    assert main(["build", str(model), str(CORPUS), "--index", str(ix), "--ekfac", str(tmp_path / "f"),
                 "--budget", "6KiB", *common]) == 0  # fmt: skip
    index = load_index(ix)
    assert index.manifest["settings"]["index_dtype"] == "bfloat16"  # an eigenbasis index's default
    assert 0 < index.gradients.shape[1] * 2 <= 6 * 1024
    assert index.manifest["settings"]["eigenbasis"]["budget_bytes"] == 6 * 1024
    out = tmp_path / "s.jsonl"
    args = ["score", "--index", str(ix), str(model), str(CORPUS), "--out", str(out), "--per_module", "--top_k", "2"]
    assert main([*args, "--ekfac", str(tmp_path / "f")]) == 0
    first = [json.loads(line) for line in out.read_text().splitlines()][0]
    assert first["results"][0]["row"] == 0  # the query is the first training example
    capsys.readouterr()
    kept = out.read_bytes()
    assert main([*args, "--ekfac", str(tmp_path / "g"), "--overwrite"]) == 2
    assert "not the ones" in capsys.readouterr().err
    assert out.read_bytes() == kept  # refused before any work: the earlier scores stay
    seeded = ["--index", str(tmp_path / "iy"), "--budget", "1KiB", "--projection_dim", "8"]
    assert main(["build", str(model), str(CORPUS), *seeded, *common]) == 2
    assert "--budget allocates the eigen-directions" in capsys.readouterr().err
    assert not (tmp_path / "iy").exists() and not (tmp_path / "iy.part").exists()


def test_default_build_fits_keeps_and_scores_with_its_factors(tmp_path, capsys):
    """`build` with no projection flag fits the factors itself (the sketch of `ekfac` without --index: 128 sides,
    the output layer at 1024), keeps them in the index and stores bfloat16 eigenbasis rows: the same rows as
    `ekfac` then `build --ekfac`; `score` without --ekfac preconditions with the kept factors (the same scores
    as `score --ekfac` with the separately fitted ones). A resumed build reads the kept factors back."""
    import shutil

    from moe_attrib.app.cli import main
    from moe_attrib.curvature.ekfac import load_ekfac
    from moe_attrib.model.zoo import save_tiny
    from tests.test_build import CORPUS, texts

    model = tmp_path / "model"
    save_tiny(str(model), "qwen3_moe", texts())
    common = ["--track_moe_experts", "--quiet", "--precision", "fp32", "--budget", "6KiB"]
    ix, iy = tmp_path / "ix", tmp_path / "iy"
    assert main(["build", str(model), str(CORPUS), "--index", str(ix), *common]) == 0
    assert "fitting EK-FAC factors for the eigenbasis rows first" in capsys.readouterr().out
    assert {"ekfac.json", "factors.safetensors", "eigenbasis.safetensors"} <= {p.name for p in ix.iterdir()}
    assert main(["ekfac", str(model), str(CORPUS), "--out", str(tmp_path / "f"), *common[:-2]]) == 0
    assert main(["build", str(model), str(CORPUS), "--index", str(iy), "--ekfac", str(tmp_path / "f"), *common]) == 0
    a, b = load_index(ix), load_index(iy)
    assert a.manifest["settings"]["index_dtype"] == "bfloat16" and a.gradients.shape[1] * 2 <= 6 * 1024
    assert np.array_equal(np.asarray(a.gradients), np.asarray(b.gradients))
    kept, fitted = load_ekfac(ix), load_ekfac(tmp_path / "f")
    assert (kept.projection_dim, kept.output_projection_dim) == (fitted.projection_dim, 1024) == (128, 1024)
    assert all(torch.equal(kept.factors[k].lam, fitted.factors[k].lam) for k in fitted.factors)
    out = {}
    for name, extra in (("kept", []), ("given", ["--ekfac", str(tmp_path / "f")])):
        out[name] = tmp_path / f"{name}.jsonl"
        args = ["score", "--index", str(ix), str(model), str(CORPUS), "--out", str(out[name]), "--top_k", "3"]
        assert main([*args, *extra]) == 0
    assert "preconditioning with the EK-FAC factors kept in the index" in capsys.readouterr().out
    assert out["kept"].read_bytes() == out["given"].read_bytes()
    plain = tmp_path / "plain.jsonl"  # the same rows without preconditioning rank differently
    assert main(["score", "--index", str(iy), str(model), str(CORPUS), "--out", str(plain), "--top_k", "3"]) == 0
    assert plain.read_bytes() != out["kept"].read_bytes()
    # an interrupted build: its rows not all written yet, its factors kept in INDEX.part
    part = tmp_path / "iz.part"
    shutil.copytree(ix, part)
    manifest = json.loads((part / "manifest.json").read_text())
    (part / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    np.save(part / "done.npy", np.zeros(manifest["num_batches"], dtype=np.uint8))
    (part / "gradients.npy").write_bytes(b"")  # rewritten below
    shutil.copy(ix / "gradients.npy", part / "gradients.npy")
    np.lib.format.open_memmap(part / "gradients.npy", mode="r+")[:] = 0
    capsys.readouterr()
    assert main(["build", str(model), str(CORPUS), "--index", str(tmp_path / "iz"), "--resume", *common]) == 0
    said = capsys.readouterr().out
    assert "not fitted again" in said and "fitting EK-FAC" not in said
    assert np.array_equal(np.asarray(load_index(tmp_path / "iz").gradients), np.asarray(a.gradients))
    # an interrupted build of seeded projections is not resumed by a default build (refused before any fit)
    shutil.copytree(ix, tmp_path / "iw.part")
    for name in ("ekfac.json", "factors.safetensors"):
        (tmp_path / "iw.part" / name).unlink()
    assert main(["build", str(model), str(CORPUS), "--index", str(tmp_path / "iw"), "--resume", *common]) == 2
    out, err = capsys.readouterr()
    assert "did not fit its own factors" in err and "fitting EK-FAC" not in out


def test_token_rows_sum_to_example_rows(tmp_path):
    """`attribute_tokens` on an eigenbasis index: an example's token rows sum to its example row (experts
    and a folded bias included), and per-token rows keep every expert's blocks."""
    model = tiny_model("gpt_oss")
    exs = examples(6)
    ek = fit_ekfac(model, exs, projection_dim=8, token_batch_size=48, progress=False)
    rows = load_index(build_index(model, exs, tmp_path / "ex", ekfac=ek, budget="3KiB", progress=False))
    tokens = load_index(
        build_index(model, exs, tmp_path / "tok", ekfac=ek, budget="3KiB", attribute_tokens=True, progress=False)
    )
    assert [b.name for b in tokens.blocks] == [b.name for b in rows.blocks]
    o = tokens.token_offsets
    summed = torch.stack([torch.from_numpy(tokens.read_rows(slice(o[i], o[i + 1]))).sum(0) for i in range(len(exs))])
    assert rel_err(summed, torch.from_numpy(rows.read_rows(slice(None)))) < 1e-4


@pytest.mark.parametrize("which", ["dense", "all", "output"])
def test_block_weights_restore_each_blocks_expected_share(tmp_path, monkeypatch, which):
    """`precondition.BLOCK_WEIGHTS` multiplies each chosen eigenbasis block's preconditioned query columns by
    `r = sum_all lambda / (lambda + d) / sum_kept lambda / (lambda + d)`, summed by hand here over the factor's
    corrected eigenvalues (its expert's, for an expert block) and the cells the block keeps; blocks it leaves out, and
    every block under "none", keep weight 1."""
    from moe_attrib.curvature import precondition

    model = tiny_model("qwen3_moe")
    exs = examples(8)
    ek = fit_ekfac(model, exs, projection_dim=8, output_projection_dim=256, token_batch_size=48, progress=False)
    index = load_index(build_index(model, exs, tmp_path / "ix", ekfac=ek, budget="16KiB", progress=False))
    q = torch.from_numpy(index.read_rows(slice(0, 3)))
    plain = precondition_queries(q, index.blocks, ek, index.manifest["settings"])
    monkeypatch.setattr(precondition, "BLOCK_WEIGHTS", which)
    got = precondition_queries(q, index.blocks, ek, index.manifest["settings"])
    weighted = 0
    for b in index.blocks:
        factor, expert, _ = factor_of(b.name)
        f = ek.factors[factor]
        lam, damp = f.lam.double(), f.damping.double()
        rows, cols = direction_order(f)
        if expert is not None:
            lam, damp, rows, cols = lam[expert], damp[expert], rows[expert], cols[expert]
        kr, kc = b.shape[:2]
        kept = lam[rows[:kr]][:, cols[:kc]]
        r = float((lam / (lam + damp)).sum() / (kept / (kept + damp)).sum())
        chosen = {"dense": expert is None, "all": True, "output": b.name == "lm_head.weight"}[which]
        want = plain[:, b.start : b.stop] * (r if chosen else 1.0)
        assert rel_err(got[:, b.start : b.stop], want) < 1e-6, b.name
        weighted += chosen and r > 1.0 + 1e-9
    assert weighted > 0  # some chosen block is truncated, so the test sees a weight
