"""CUDA-graphed collection (`moe_attrib.collect.graphs`): the checks that need no GPU. The graphed step
itself is compared with the eager one in `tests/test_gpu.py`."""

import pytest
import torch
import transformers.masking_utils as masking

import moe_attrib as ma
from moe_attrib.collect.graphs import GraphedCollector, graphed_shapes, unpacked_positions
from moe_attrib.model.zoo import tiny_model


def test_unpacked_positions_answers_not_packed_and_restores_transformers():
    """The packed-sequence check transformers runs when no mask is given: its eager answer for positions
    the model derives itself is None, the patched one is None without reading them, and exit restores it."""
    real = masking.find_packed_sequence_indices
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    assert real(positions) is None
    packed = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    assert real(packed) is not None  # a real packing is found eagerly
    with unpacked_positions():
        assert masking.find_packed_sequence_indices is not real
        assert masking.find_packed_sequence_indices(positions) is None
    assert masking.find_packed_sequence_indices is real


def test_model_forward_is_unchanged_under_unpacked_positions():
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(input_ids=ids, use_cache=False).logits
        with unpacked_positions():
            patched = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(eager, patched)


def test_graphed_collector_refuses_what_it_cannot_replay():
    model = tiny_model("qwen3_moe")
    report = ma.discover(model)
    collector = ma.GradientCollector(model, report, projection_dim=4)
    with pytest.raises(RuntimeError, match="entered collector"):
        GraphedCollector(collector)
    with ma.GradientCollector(model, report, projection_dim=4, row_sink=lambda records, batch: None) as c:
        with pytest.raises(ValueError, match="row_sink"):
            GraphedCollector(c)
    with ma.GradientCollector(model, report, projection_dim=4) as c:
        with pytest.raises(ValueError, match="CUDA device"):
            GraphedCollector(c).collect(torch.randint(3, 50, (2, 8)))


def test_build_index_refuses_cuda_graphs_it_cannot_run(tmp_path):
    """Before any work: no CUDA device, or recompute (Python per layer); nothing is written."""
    from moe_attrib.data import Example
    from moe_attrib.workflows.build import check_graphable

    model = tiny_model("qwen3_moe")
    examples = [Example(i, list(range(3, 11))) for i in range(4)]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ma.build_index(model, examples, tmp_path / "index", projection_dim=4, cuda_graphs=True, progress=False)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="recompute_layers"):
        check_graphable(torch.device("cuda"), recompute=True, sharded=False)
    with pytest.raises(ValueError, match="fsdp"):
        check_graphable(torch.device("cuda"), recompute=False, sharded=True)


def test_graphed_shapes_are_unpadded_shapes_that_repeat_enough():
    """Against a count by hand: padded batches never count, a shape counts once per batch."""
    batches = [[8, 8]] * 3 + [[8, 7]] * 5 + [[5, 5, 5]] * 2 + [[8]] * 2 + [[]]
    assert graphed_shapes(batches, 2) == {(2, 8), (3, 5), (1, 8)}
    assert graphed_shapes(batches, 3) == {(2, 8)}
    assert graphed_shapes(batches, 4) == set()


def test_default_build_on_cpu_runs_eagerly_and_asks_for_nothing(tmp_path):
    """`cuda_graphs=None` (the default) where graphs cannot run is the eager build: same rows as
    `cuda_graphs=False`, no warning."""
    import warnings

    import numpy as np

    from moe_attrib.data import Example

    model = tiny_model("qwen3_moe")
    examples = [Example(i, list(range(3 + i % 3, 11 + i % 3))) for i in range(40)]
    kw = {"projection_dim": 4, "token_batch_size": 8, "progress": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = ma.load_index(ma.build_index(model, examples, tmp_path / "auto", **kw))
    off = ma.load_index(ma.build_index(model, examples, tmp_path / "off", cuda_graphs=False, **kw))
    assert np.array_equal(np.asarray(auto.gradients), np.asarray(off.gradients))


def _result(grad: torch.Tensor, losses: torch.Tensor, counts: torch.Tensor) -> ma.PerExampleGradients:
    out = ma.PerExampleGradients({"model.layers.0.mlp.experts.down_proj.weight": grad})
    out.losses, out.expert_counts, out.expert_layers = losses, counts, ["model.layers.0.mlp.experts"]
    return out


def test_a_replay_is_kept_only_if_it_is_the_eager_step():
    """The check a first replay passes before its graph is kept: the eager step's routing and losses, and
    gradients within the eager backward's own spread; any other replay is named and dropped."""
    from moe_attrib.collect.graphs import GRADIENT_TOLERANCE, _disagreement

    gen = torch.Generator().manual_seed(0)
    grad, losses = torch.randn(3, 4, 8, 8, generator=gen), torch.rand(3, generator=gen) + 1
    counts = torch.randint(0, 5, (3, 1, 4), generator=gen).float()
    eager = _result(grad, losses, counts)
    assert _disagreement(_result(grad.clone(), losses.clone(), counts.clone()), eager) is None
    noisy = grad + 0.1 * GRADIENT_TOLERANCE * grad.abs().max() * torch.randn(grad.shape, generator=gen).clamp(-1, 1)
    assert _disagreement(_result(noisy, losses.clone(), counts.clone()), eager) is None
    moved = counts.clone()
    moved[0, 0, 0] += 1  # one token routed to expert 0 instead of expert 1
    moved[0, 0, 1] -= 1
    assert "other experts" in _disagreement(_result(grad, losses, moved), eager)
    assert "losses differ" in _disagreement(_result(grad, losses * (1 + 1e-4), counts), eager)
    off = grad.clone()
    off[1, 2] += 2 * GRADIENT_TOLERANCE * grad.abs().max()
    assert "experts.down_proj.weight differs" in _disagreement(_result(off, losses, counts), eager)


def test_build_command_line_cuda_graphs_modes():
    """`--cuda_graphs` absent is auto, bare is on, and anything but auto/on/off is refused."""
    from moe_attrib.app.cli import build_parser

    parser = build_parser()

    def mode(*extra: str) -> str:
        return parser.parse_args(["build", "MODEL", "DATA", "--index", "DIR", *extra]).cuda_graphs

    assert mode() == "auto" and mode("--cuda_graphs") == "on" and mode("--cuda_graphs", "off") == "off"
    assert mode("--cuda_graphs", "--resume") == "on"
    with pytest.raises(SystemExit):
        mode("--cuda_graphs", "maybe")
