"""FSDP2-sharded collection (`--fsdp`): 2 gloo ranks give the index rows and EK-FAC factors of a
one-process run, on a transposed-with-biases family (gpt_oss), one with shared experts
(deepseek_v3) and one with a hash-routed layer (deepseek_v4); and the pieces it rests on."""

import contextlib
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_attrib.app import cli
from moe_attrib.curvature.ekfac import load_ekfac
from moe_attrib.fingerprint import model_fingerprint
from moe_attrib.indexing.index import load_index
from moe_attrib.model.zoo import save_tiny
from moe_attrib.scoring.results import read_results
from moe_attrib.workflows import attribution
from tests.conftest import run_torchrun
from tests.fsdp_driver import EKFAC_ARGS
from tests.test_build import CORPUS, ENV, texts

FAMILIES = ["gpt_oss", "deepseek_v3", "deepseek_v4"]
COMMON = ["--track_moe_experts", "--projection_dim", "8", "--token_batch_size", "80", "--precision", "fp32"]


def save_family(path: Path, family: str) -> None:
    save_tiny(str(path), family, texts())


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """One torchrun launch: `build --fsdp` and `ekfac --fsdp` of every family on 2 gloo ranks."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not Path(torchrun).exists():
        pytest.skip("torchrun not installed")
    work = tmp_path_factory.mktemp("fsdp")
    for family in FAMILIES:
        save_family(work / family / "model", family)
    driver = Path(__file__).parent / "fsdp_driver.py"
    res = run_torchrun(
        [torchrun, "--nproc_per_node=2", str(driver), str(work), str(CORPUS), *FAMILIES],
        capture_output=True,
        text=True,
        timeout=600,
        env={**ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return work, res


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_two_ranks_equal_one_process(sharded_runs, family):
    work, res = sharded_runs
    model = str(work / family / "model")
    for argv in (
        ["build", model, str(CORPUS), "--index", str(work / family / "index"), "--quiet", *COMMON],
        ["ekfac", model, str(CORPUS), "--out", str(work / family / "ekfac"), "--quiet", *COMMON, *EKFAC_ARGS],
    ):
        assert cli.main(argv) == 0
    one, two = load_index(work / family / "index"), load_index(work / family / "fsdp_index")
    assert one.manifest["settings"]["model_fingerprint"] == two.manifest["settings"]["model_fingerprint"]
    assert one.gradients.shape == two.gradients.shape and np.abs(one.gradients).max() > 0
    np.testing.assert_allclose(two.gradients, one.gradients, rtol=1e-5, atol=1e-6 * np.abs(one.gradients).max())
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-5)
    np.testing.assert_array_equal(two.expert_counts, one.expert_counts)
    a, b = load_ekfac(work / family / "ekfac"), load_ekfac(work / family / "fsdp_ekfac")
    assert sorted(a.factors) == sorted(b.factors)
    for name, f in a.factors.items():
        g = b.factors[name]
        for field in ("A", "G", "tokens", "lam"):
            want, got = getattr(f, field), getattr(g, field)
            # sums over tokens in another order (per rank, then all-reduced): fp32 rounding, as for the rows above
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=f"{name}.{field}")
    assert "memory plan per rank (FSDP2 over 2 ranks)" in res.stdout
    scores = work / family / "scores.jsonl"
    index = str(work / family / "fsdp_index")
    assert cli.main(["score", "--index", index, model, str(CORPUS), "--out", str(scores)]) == 0
    plain, sharded = read_results(scores), read_results(work / family / "fsdp_scores.jsonl")
    assert len(plain) == len(sharded) == one.gradients.shape[0]
    for p, s in zip(plain, sharded, strict=True):
        assert [h["example"] for h in p["results"]] == [h["example"] for h in s["results"]]
        np.testing.assert_allclose([h["score"] for h in s["results"]], [h["score"] for h in p["results"]], rtol=1e-5)


def test_lazy_shard_loading_matches_transformers(tmp_path):
    """A per-expert checkpoint (qwen3_moe saves experts one by one) fused shard by shard, one rank."""
    from moe_attrib.model.distributed import Dist
    from moe_attrib.model.sharding import load_sharded
    from moe_attrib.workflows.loading import load_model

    save_tiny(str(tmp_path), "qwen3_moe", texts())
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free()}", rank=0, world_size=1)
    try:
        sharded = load_sharded(str(tmp_path), torch.float32, Dist(0, 1, torch.device("cpu"), fsdp=True))
        plain = load_model(str(tmp_path), "fp32")
        state = sharded.state_dict()
        for key, want in plain.state_dict().items():
            got = state[key].full_tensor() if hasattr(state[key], "full_tensor") else state[key]
            assert torch.equal(got, want), key
        assert model_fingerprint(sharded) == model_fingerprint(plain)
        ids = torch.tensor([[1, 5, 6, 7, 8]])
        torch.testing.assert_close(sharded(ids).logits, plain(ids).logits)
    finally:
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def one_rank_sharded(tmp_path):
    """A 3-layer tiny qwen3_moe loaded shard by shard and wrapped by FSDP2 on one gloo rank, a batch, and
    the plain model's per-example gradients of it (projection 8)."""
    from moe_attrib.collect.collector import per_example_gradients
    from moe_attrib.model.distributed import Dist
    from moe_attrib.model.sharding import load_sharded
    from moe_attrib.workflows.loading import load_model

    save_tiny(str(tmp_path), "qwen3_moe", texts(), num_hidden_layers=3)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [4, 3, 9, 8, 2, 6]])
    want = per_example_gradients(load_model(str(tmp_path), "fp32"), ids, projection_dim=8)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free()}", rank=0, world_size=1)
    try:
        yield load_sharded(str(tmp_path), torch.float32, Dist(0, 1, torch.device("cpu"), fsdp=True)), ids, want
    finally:
        torch.distributed.destroy_process_group()


def assert_same_gradients(got, want) -> None:
    assert want.keys() == got.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6 * float(value.abs().max()))


def test_collection_step_keeps_last_layer_gathered_and_forms_no_weight_gradients(tmp_path):
    """One rank: the per-example gradients of the plain model; between forward and backward only the last
    layer stays gathered (the others were resharded and are gathered again for their backward); after the
    step every layer is resharded and no parameter holds a gradient (collection needs activation gradients
    only: nothing for FSDP2 to reduce-scatter)."""
    from moe_attrib.collect.collector import per_example_gradients
    from moe_attrib.model.sharding import decoder_layers, is_dtensor

    with one_rank_sharded(tmp_path) as (sharded, ids, want):
        layers = decoder_layers(sharded)
        seen = []  # after the last layer's forward: which layers hold sharded (DTensor) parameters
        sharded.model.norm.register_forward_hook(
            lambda m, a, out: seen.append([all(is_dtensor(p) for p in lay.parameters()) for lay in layers])
        )
        got = per_example_gradients(sharded, ids, projection_dim=8)
        assert seen == [[True, True, False]]
        assert all(is_dtensor(p) for p in sharded.parameters())
        assert all(p.grad is None for p in sharded.parameters())
        assert_same_gradients(got, want)


def free() -> int:
    from tests.conftest import free_port

    return free_port()


def test_fsdp_needs_torchrun(tmp_path):
    env = {k: v for k, v in ENV.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    import subprocess

    res = subprocess.run(
        [sys.executable, "-m", "moe_attrib", "build", "tiny:qwen3_moe", str(CORPUS), "--index", str(tmp_path / "i"),
         "--fsdp", "--quiet"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2 and "--fsdp shards the model over the ranks of a torchrun launch" in res.stderr
    assert not (tmp_path / "i").exists()


def test_memory_plan_follows_the_projection_kind_and_recompute():
    """The plan's routed rows by hand (tiny qwen3_moe: hidden 64, expert width 32, top-2, 2 layers):
    at p=48 the default kind keeps the 32-wide sides exact, v1 projects every side to 48; with
    `recompute` the activations are one layer's plus each layer's input."""
    from moe_attrib.collect.projection import PROJECTION_V1
    from moe_attrib.model.zoo import tiny_model
    from moe_attrib.workflows.plan import memory_plan

    model = tiny_model("qwen3_moe")
    tokens, p, k, layers = 1000, 48, 2, 2
    v2 = memory_plan(model, 1, tokens, p)
    v1 = memory_plan(model, 1, tokens, p, projection=PROJECTION_V1)
    # gate_up: in 64 -> p, out 64 -> p; down: in 32 (kept), out 64 -> p
    assert v2["routed grid rows"] == layers * tokens * k * 4 * ((p + p) + (32 + p))
    assert v1["routed grid rows"] == layers * tokens * k * 4 * 4 * p
    full = memory_plan(model, 1, tokens, p)["activations (estimate)"]
    kept = memory_plan(model, 1, tokens, p, recompute=True)["activations (estimate)"]
    size = next(model.parameters()).element_size()
    assert kept == full // layers + tokens * layers * 64 * size


def test_choose_sharding_by_hand():
    from moe_attrib.workflows.checks import UsageError
    from moe_attrib.workflows.plan import choose_sharding

    assert choose_sharding(80, 100, 1, False, False, "build") == (False, None)  # fits: 80 <= 0.9 x 100
    with pytest.raises(UsageError, match=r"torchrun --nproc_per_node 3 -m moe_attrib build"):
        choose_sharding(250, 100, 1, False, False, "build")  # ceil(250 / 90) = 3 GPUs, no torchrun
    shard, note = choose_sharding(250, 100, 4, False, True, "ekfac")  # torchrun, 4 ranks: shard automatically
    assert shard and "sharding it over the 4 ranks" in note
    with pytest.raises(UsageError, match=r"still does not fit; launch `torchrun --nproc_per_node 3"):
        choose_sharding(250, 100, 2, False, True, "build")
    assert choose_sharding(250, 100, 4, True, True, "build") == (True, None)  # --fsdp asked and enough
    assert choose_sharding(10, 100, 1, True, True, "build") == (True, None)  # --fsdp asked, fits anyway


def test_build_refuses_a_model_larger_than_the_device_before_any_work(tmp_path, monkeypatch, capsys):
    """The checkpoint's size from its safetensors headers against the device's free memory (faked:
    no GPU here), before the model is loaded or anything written."""
    from transformers import AutoModelForCausalLM

    from moe_attrib.workflows import loading

    model_dir = tmp_path / "m"
    save_tiny(str(model_dir), "qwen3_moe", texts())
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    assert loading.checkpoint_numel(str(model_dir)) == params
    shutil.copy(model_dir / "model.safetensors", model_dir / "consolidated.safetensors")  # another copy: not loaded
    assert loading.checkpoint_numel(str(model_dir)) == params
    sharded = tmp_path / "sharded"  # several files and their index
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert loading.checkpoint_numel(str(sharded)) == params
    monkeypatch.setattr(loading, "device_free_bytes", lambda device: params * 4 // 2)  # half the fp32 weights
    loaded = []
    monkeypatch.setattr(attribution, "load_inputs", lambda *a: loaded.append(1))
    code = cli.main(["build", str(model_dir), str(CORPUS), "--index", str(tmp_path / "idx"), "--precision", "fp32"])
    err = capsys.readouterr().err
    assert code == 2 and "torchrun --nproc_per_node 3 -m moe_attrib build" in err, err
    assert not loaded and not (tmp_path / "idx").exists() and not (tmp_path / "idx.part").exists()


def test_recompute_layers_under_fsdp_gives_the_plain_gradients(tmp_path):
    """`--recompute_layers` with `--fsdp` (one gloo rank): the recomputed, sharded layers give the plain
    model's per-example gradients and leave no parameter gradient."""
    from moe_attrib.collect.collector import per_example_gradients

    with one_rank_sharded(tmp_path) as (sharded, ids, want):
        got = per_example_gradients(sharded, ids, projection_dim=8, recompute=True)
        assert all(p.grad is None for p in sharded.parameters())
        assert_same_gradients(got, want)
