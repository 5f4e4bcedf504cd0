"""GPU checks (skipped without CUDA): the grouped_mm path and device-independent projections."""

import warnings

import pytest
import torch

import moe_attrib as ma
from moe_attrib.model.zoo import tiny_model
from tests.conftest import rel_err
from tests.reference import reference_gradients

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4_text", "longcat_flash", "deepseek_v4"])
def test_cuda_projected_equals_cpu(family, padded_batch):
    ids, mask = padded_batch
    cpu = ma.per_example_gradients(tiny_model(family), ids, mask, projection_dim=8, seed=3)
    gpu_model = tiny_model(family).cuda()
    gpu = ma.per_example_gradients(gpu_model, ids.cuda(), mask.cuda(), projection_dim=8, seed=3)
    worst = max(rel_err(gpu[k].cpu(), cpu[k]) for k in cpu if cpu[k].norm() > 0)
    assert worst < 1e-3, worst  # tf32 may be on for CUDA matmuls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_cuda_exact_matches_cuda_autograd(family, dtype, padded_batch):
    """Exact gradients on the GPU (grouped_mm path) against per-sample autograd in the same dtype."""
    ids, mask = padded_batch
    model = tiny_model(family, dtype=dtype).cuda()
    report = ma.discover(model)
    grads = ma.per_example_gradients(model, ids.cuda(), mask.cuda())
    ref = reference_gradients(model, ids.cuda(), mask.cuda(), report.targets)
    errs = torch.tensor(
        [rel_err(grads[k][n], ref[n][k]) for k in grads for n in range(3) if ref[n][k].float().norm() > 0]
    )
    print(f"{family} {dtype}: median {errs.median():.2e} max {errs.max():.2e} over {errs.numel()}")
    if dtype == torch.float32:
        assert float(errs.max()) < 1e-3  # tf32 matmuls may be on
    else:
        assert float(errs.median()) < 5e-2


def test_fsdp_one_rank_matches_plain_path_and_step_time(tmp_path):
    """`--fsdp` with one rank on the GPU: the index of the plain path (bf16 tolerance); prints the step time ratio.

    Runs benchmarks/fsdp_step_time.py under `torchrun --nproc_per_node 1` (qwen3_moe-shaped bf16 model)."""
    import json
    import shutil
    import sys
    from pathlib import Path

    from tests.conftest import run_torchrun

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    script = Path(__file__).parents[1] / "benchmarks" / "fsdp_step_time.py"
    out = tmp_path / "fsdp_step_time.json"
    env = {**__import__("os").environ, "PYTHONPATH": str(script.parents[1])}
    res = run_torchrun(
        [torchrun, "--nproc_per_node=1", str(script), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert result["fingerprints_equal"]
    assert result["row_rel_err"]["median"] < 1e-2 and result["row_rel_err"]["max"] < 5e-2, result["row_rel_err"]
    # the step-time ratio is a benchmark number (docs/distributed.md), not a test assertion


@pytest.mark.parametrize("shape", [(8, 37, None), (32, 2048, 16), (16, 151_936, None)])
def test_cuda_projection_matrix_is_bitwise_the_cpu_one(shape):
    from moe_attrib.collect.projection import Projections, projection_matrix

    rows, cols, batch = shape
    cpu = projection_matrix("model.layers.3.mlp.experts.gate_up_proj/in", rows, cols, seed=5, batch=batch)
    gpu = projection_matrix("model.layers.3.mlp.experts.gate_up_proj/in", rows, cols, 5, batch, device="cuda")
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32 and torch.equal(gpu.cpu(), cpu)
    proj = Projections(rows, 5, "cuda", torch.bfloat16)
    bf16 = proj.get("model.layers.3.mlp.experts.gate_up_proj", "in", cols, batch)
    assert torch.equal(bf16.cpu(), cpu.transpose(-1, -2).bfloat16())


def test_cuda_build_pipeline_equals_cpu_build(tmp_path):
    """The pinned, asynchronous copy path and the writer thread on CUDA give the CPU build's rows."""
    import numpy as np

    from moe_attrib.data import Example

    gen = torch.Generator().manual_seed(3)
    ex = [Example(i, torch.randint(3, 120, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist())
          for i in range(24)]  # fmt: skip
    kw = {"projection_dim": 8, "seed": 2, "token_batch_size": 24, "progress": False}
    cpu = ma.load_index(ma.build_index(tiny_model("qwen3_moe"), ex, tmp_path / "cpu", **kw))
    gpu = ma.load_index(ma.build_index(tiny_model("qwen3_moe").cuda(), ex, tmp_path / "gpu", **kw))
    a, b = np.asarray(gpu.gradients), np.asarray(cpu.gradients)
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()  # tf32 may be on for CUDA matmuls
    assert np.allclose(gpu.losses, cpu.losses, rtol=1e-3) and np.array_equal(gpu.expert_counts, cpu.expert_counts)


def test_cuda_coupled_scores_equal_cpu_ones(tmp_path):
    """The coupling fitted and applied on CUDA (EK-FAC, sampled rows) gives the CPU's scores."""
    import numpy as np

    from moe_attrib.data import Example

    gen = torch.Generator().manual_seed(4)
    ex = [Example(i, torch.randint(3, 120, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist())
          for i in range(40)]  # fmt: skip
    model = tiny_model("qwen3_moe")
    kw = {"projection_dim": 8, "seed": 2, "progress": False}
    index = ma.load_index(ma.build_index(model, ex, tmp_path / "idx", **kw))
    ek = ma.fit_ekfac(model, ex, **kw)
    q = ma.query_gradients(model, ex[:5], index)
    scores = {}
    for device in ("cpu", "cuda"):
        c = ma.fit_coupling(index, ekfac=ek, sample=30, device=device)
        scores[device] = ma.score_matrix(index, q, ekfac=ek, coupling=c, device=device)
    a, b = scores["cuda"], scores["cpu"]
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()  # tf32 may be on for CUDA matmuls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_segment_sums_match_brute_force(dtype):
    """Per-segment sums on CUDA: bf16 through grouped_mm (offsets along the contracted rows), fp32 through
    the tiled batched matmuls; a skewed segment, empty segments and rows past the last segment."""
    from moe_attrib.model.layouts import Kernels
    from moe_attrib.model.layouts.kernels import tiled_segment_mm

    gen = torch.Generator().manual_seed(0)
    rows, segments, a, b = 4096, 256, 32, 16
    seg = torch.randint(4, segments - 1, (rows,), generator=gen)
    seg[: rows * 3 // 4] = 1  # one segment takes most rows
    seg[-5:] = segments  # past the last segment: ignored
    seg = seg.sort().values
    ends = torch.searchsorted(seg, torch.arange(1, segments + 1), out_int32=True)
    left = torch.randn(rows, a, generator=gen).to(dtype)
    right = torch.randn(rows, b, generator=gen).to(dtype)
    expected = torch.zeros(segments, a, b, dtype=torch.float64)
    for s in range(segments):
        expected[s] = left[seg == s].double().T @ right[seg == s].double()
    kernels = Kernels()
    got = kernels.segment_mm(left.cuda(), right.cuda(), ends.cuda()).cpu()
    assert kernels.fallbacks == {}
    assert got.shape == expected.shape
    assert all(torch.equal(got[s], torch.zeros_like(got[s])) for s in (0, 3, segments - 1))
    tol = 1e-3 if dtype == torch.float32 else 1e-2  # tf32 may be on; bf16 output rounding
    assert rel_err(got, expected) < tol
    tiled = tiled_segment_mm(left.cuda(), right.cuda(), ends.cuda()).cpu()
    assert rel_err(tiled, expected) < tol


def test_cuda_formation_peak_memory_sized_by_routed_rows(monkeypatch):
    """Peak memory of forming 64-expert per-example gradients stays a small multiple of the routed rows
    and outputs, well under the old padded `[E * N, L, p]` grid (one side: 8.4 MB here)."""
    import moe_attrib.collect.collector as collector_module

    experts, top_k, n, length, p = 64, 2, 8, 128, 8
    sizes = dict(num_experts=experts, num_local_experts=experts, n_routed_experts=experts)
    model = tiny_model("qwen3_moe", num_experts_per_tok=top_k, **sizes).cuda()
    ids = torch.randint(3, 128, (n, length), generator=torch.Generator().manual_seed(0)).cuda()
    peaks = []
    original = collector_module.form_examples

    def measured(records, *args, **kwargs):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = original(records, *args, **kwargs)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        return out

    monkeypatch.setattr(collector_module, "form_examples", measured)
    ma.per_example_gradients(model, ids, projection_dim=p)
    calls = 2 * model.config.num_hidden_layers
    rows = n * length * top_k
    old_grid_side = 4 * calls * experts * n * length * p
    bound = 4 * 4 * (calls * rows * p + calls * (experts * n + 1) * p * p) + 2**20
    print(f"formation peak {peaks[0] / 2**20:.2f} MiB, bound {bound / 2**20:.2f}, old grid {old_grid_side / 2**20:.2f}")
    assert bound < old_grid_side  # the old formation held two such sides at once
    assert peaks[0] <= bound


def test_cuda_recompute_same_rows_less_memory():
    """`recompute=True` on CUDA: the same projected rows (bf16, grouped_mm) for a smaller peak of memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=256, num_hidden_layers=8, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 512, (8, 1024), device="cuda")
    peaks, grads = [], []
    for recompute in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads.append(ma.per_example_gradients(model, ids, projection_dim=16, seed=1, recompute=recompute))
        peaks.append(torch.cuda.max_memory_allocated() - base)
    worst = max(rel_err(grads[1][k], grads[0][k]) for k in grads[0] if grads[0][k].float().norm() > 0)
    mib = [p / 2**20 for p in peaks]
    print(f"recompute: peak above weights {mib[0]:.0f} -> {mib[1]:.0f} MiB, worst rel err {worst:.1e}")
    assert worst < 1e-2, worst  # the same kernels on the same inputs, up to bf16 atomics' order
    assert peaks[1] < 0.6 * peaks[0], peaks


def test_cuda_fused_head_equals_eager_head(padded_batch, monkeypatch):
    """bf16 on the GPU: the output layer fused with the loss, 5 rows a chunk, against the eager loss."""
    import moe_attrib.collect.head as head

    ids, mask = (t.cuda() for t in padded_batch)
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16, vocab_size=4096).cuda()
    monkeypatch.setattr(head, "HEAD_CHUNK_BYTES", 4 * 4096 * 5)
    eager = ma.per_example_gradients(model, ids, mask, projection_dim=8, fused_head=False)
    fused = ma.per_example_gradients(model, ids, mask, projection_dim=8)
    assert head.fusable(model) is True
    errs = {k: rel_err(fused[k], eager[k]) for k in eager if eager[k].float().norm() > 0}
    print(f"fused vs eager head, bf16: max {max(errs.values()):.2e} (lm_head {errs['lm_head.weight']:.2e})")
    assert max(errs.values()) < 2e-2, errs
    assert torch.allclose(fused.losses, eager.losses, rtol=1e-5)


@pytest.mark.parametrize("width", [128, 2048, 2880])
@pytest.mark.parametrize("one_plus", [False, True, None])
def test_cuda_norm_backward_kernel_matches_autograd(width, one_plus):
    """The Triton RMSNorm backward against autograd of the eager formula, bf16 rows, float32 weights
    (`one_plus=None`: a weightless norm)."""
    from moe_attrib.model.norms import rms_norm_backward

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3000, width, generator=gen, device="cuda").bfloat16()
    dy = torch.randn(3000, width, generator=gen, device="cuda").bfloat16()
    w = torch.randn(width, generator=gen, device="cuda")
    ref_in = x.double().requires_grad_(True)
    scale = 1.0 if one_plus is None else (w.double() + 1 if one_plus else w.double())
    y = ref_in * torch.rsqrt(ref_in.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    (expected,) = torch.autograd.grad(y, ref_in, dy.double())
    got = rms_norm_backward(x, None if one_plus is None else w, dy, 1e-6, bool(one_plus))
    assert got.dtype == torch.bfloat16 and rel_err(got, expected) < 1e-2, rel_err(got, expected)


def graphed_and_eager(model, steps: int = 3):
    """Eager steps, then the same batches (and the second one again) through a `GraphedCollector`."""
    report = ma.discover(model)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, model.config.vocab_size, (3, 16), generator=gen).cuda() for _ in range(steps)]
    with ma.GradientCollector(model, report, projection_dim=8) as c:
        eager = [c.collect(ids, None, ids, fused_experts=True) for ids in batches]
        graphed = ma.GraphedCollector(c)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [graphed.collect(ids) for ids in batches]  # the first eager and captured, then replays
            again = graphed.collect(batches[1])
    for want, have in zip(eager, got, strict=True):
        assert torch.equal(have.expert_counts, want.expert_counts)
        assert rel_err(have.losses, want.losses) < 1e-6
        worst = max(rel_err(have[k], want[k]) for k in want if want[k].norm() > 0)
        assert worst < 1e-5, worst
    assert max(rel_err(again[k], got[1][k]) for k in again if again[k].norm() > 0) < 1e-5
    assert rel_err(got[2].losses, eager[2].losses) < 1e-6  # not overwritten by the replay after it
    return graphed, [str(w.message) for w in caught]


def test_cuda_graphed_collector_capture_after_waits_for_a_shapes_repeats():
    """`capture_after=2`: a shape's first batch runs eagerly with no capture (a one-off shape pays none),
    its second is captured, its third replayed; each gives the eager step's rows."""
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16).cuda()
    report = ma.discover(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, model.config.vocab_size, (2, 16), generator=gen).cuda() for _ in range(3)]
    once = torch.randint(3, model.config.vocab_size, (3, 8), generator=gen).cuda()
    with ma.GradientCollector(model, report, projection_dim=8) as c:
        eager = [c.collect(ids, None, ids, fused_experts=True) for ids in batches]
        graphed = ma.GraphedCollector(c, capture_after=2)
        graphed.collect(once)
        counts = []
        for ids, want in zip(batches, eager, strict=True):
            have = graphed.collect(ids)
            counts.append((graphed.captured, graphed.replayed))
            assert torch.equal(have.expert_counts, want.expert_counts)
            assert max(rel_err(have[k], want[k]) for k in want if want[k].norm() > 0) < 1e-5
    assert counts == [(0, 0), (1, 0), (1, 1)] and graphed.unsupported is None


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_cuda_graphed_collection_is_the_eager_step(family):
    """A replayed graph gives the eager step's gradients, losses and expert counts on new batches of its
    shape, and results already returned survive the next replay (bf16: the grouped kernels, no host wait)."""
    graphed, _ = graphed_and_eager(tiny_model(family, dtype=torch.bfloat16).cuda())
    assert graphed.captured == 1 and graphed.replayed == 3 and graphed.unsupported is None


def test_cuda_graphed_collector_float32_gives_the_eager_rows_and_says_when_it_cannot_capture():
    """float32 tiny models failed on an H100 (their experts take transformers' per-expert fallback on
    CUDA): whichever way the step runs, the rows are the eager ones, and a step that is not captured
    says why, once."""
    graphed, caught = graphed_and_eager(tiny_model("qwen3_moe").cuda())
    if graphed.captured == 0:
        assert graphed.unsupported and sum("cannot be captured" in m for m in caught) == 1


def test_cuda_graphed_collector_drops_a_capture_that_is_not_the_eager_step(monkeypatch):
    """A captured step that computes something else than the eager one (here its losses scaled inside the
    capture, as a model taking another path under capture would move them) is found on its first replay,
    dropped with a warning, and every batch runs eagerly."""
    real = ma.GradientCollector.collect

    def collect(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            out.losses.mul_(1.01)
        return out

    monkeypatch.setattr(ma.GradientCollector, "collect", collect)
    graphed, caught = graphed_and_eager(tiny_model("qwen3_moe", dtype=torch.bfloat16).cuda())
    assert graphed.captured == 0 and "losses differ" in graphed.unsupported
    assert sum("cannot be captured" in m for m in caught) == 1


@pytest.mark.parametrize("cuda_graphs, repeats", [(True, 5), (None, 33)])
def test_cuda_graphed_build_equals_eager_build(tmp_path, monkeypatch, cuda_graphs, repeats):
    """`build_index(cuda_graphs=True)` replays every repeated unpadded shape, the default (None) a shape of
    `AUTO_MIN_BATCHES` batches or more; padded batches run eagerly, and the index equals the eager build's
    (`cuda_graphs=False`)."""
    import numpy as np

    import moe_attrib.collect.loop as loop
    from moe_attrib.data import Example

    made = []

    class Counting(ma.GraphedCollector):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(loop, "GraphedCollector", Counting)
    gen = torch.Generator().manual_seed(5)
    lengths = [12] * (4 * repeats) + [9, 7, 11, 5]  # `repeats` batches of 4 x 12 tokens, then padded ones
    ex = [Example(i, torch.randint(3, 120, (n,), generator=gen).tolist()) for i, n in enumerate(lengths)]
    kw = {"projection_dim": 8, "seed": 2, "token_batch_size": 48, "progress": False}
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16).cuda()
    eager = ma.load_index(ma.build_index(model, ex, tmp_path / "eager", cuda_graphs=False, **kw))
    assert not made
    graphed = ma.load_index(ma.build_index(model, ex, tmp_path / "graphed", cuda_graphs=cuda_graphs, **kw))
    assert made and made[0].captured == 1 and made[0].replayed == repeats - 1
    a, b = np.asarray(graphed.gradients), np.asarray(eager.gradients)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert np.allclose(graphed.losses, eager.losses, rtol=1e-5)
    assert np.array_equal(graphed.expert_counts, eager.expert_counts)


def test_cuda_eigenbasis_build_equals_cpu_build(tmp_path):
    """An eigenbasis index built on CUDA (factors on the GPU, rows rotated there) holds the CPU build's rows with
    the same factors, and scores the same; factors fitted on CUDA give the CPU fit's allocation."""
    import numpy as np

    from moe_attrib.data import Example

    gen = torch.Generator().manual_seed(5)
    ex = [Example(i, torch.randint(3, 120, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist())
          for i in range(24)]  # fmt: skip
    model = tiny_model("qwen3_moe")
    ek = ma.fit_ekfac(model, ex, projection_dim=8, output_projection_dim=32, progress=False)
    kw = {"ekfac": ek, "budget": "8KiB", "token_batch_size": 48, "progress": False}
    cpu = ma.load_index(ma.build_index(model, ex, tmp_path / "cpu", **kw))
    gpu = ma.load_index(ma.build_index(tiny_model("qwen3_moe").cuda(), ex, tmp_path / "gpu", **kw))
    assert [b.shape for b in gpu.blocks] == [b.shape for b in cpu.blocks]
    a, b = np.asarray(gpu.gradients), np.asarray(cpu.gradients)
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()  # tf32 may be on for CUDA matmuls
    q = ma.query_gradients(model, ex[:4], cpu)
    s_cpu, s_gpu = ma.score_matrix(cpu, q, device="cpu"), ma.score_matrix(gpu, q, device="cuda")
    assert np.abs(s_gpu - s_cpu).max() <= 1e-3 * np.abs(s_cpu).max()
    fit = {"projection_dim": 8, "output_projection_dim": 32, "sampled_labels": False, "progress": False}
    ek_cpu = ma.fit_ekfac(model, ex, **fit)  # the data's labels: sampled ones differ between the devices' generators
    ek_gpu = ma.fit_ekfac(tiny_model("qwen3_moe").cuda(), ex, factor_device="cuda", **fit)
    again = ma.load_index(ma.build_index(model, ex, tmp_path / "again", **{**kw, "ekfac": ek_gpu}))
    first = ma.load_index(ma.build_index(model, ex, tmp_path / "first", **{**kw, "ekfac": ek_cpu}))
    assert [b.shape for b in again.blocks] == [b.shape for b in first.blocks]
