"""The tiny models of `moe_attrib.model.zoo`: every family saves and loads back as the same model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_attrib.model.zoo import FAMILIES, save_tiny, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_saves_and_loads_back_the_same_model(family, tmp_path):
    """`save_tiny` writes what `from_pretrained` reads back: the same weights and logits (a config whose
    per-layer lists kept the full-size default's length failed `save_pretrained`'s validation)."""
    texts = [f"the {w} sat on the mat number {i}" for i, w in enumerate(["cat", "dog", "bird", "fish"] * 5)]
    save_tiny(str(tmp_path), family, texts)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    vocab = loaded.config.get_text_config().vocab_size
    built = tiny_model(family, vocab_size=vocab)
    assert built.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in built.state_dict().items())
    ids = torch.randint(3, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = built(input_ids=ids).logits
        # `from_pretrained` maps safetensors storage whose tensors need not start on a 64-byte boundary,
        # and the CPU grouped-matmul kernel rounds differently on such operands (3e-8 seen on granitemoe):
        # float32 rounding of equal weights, far inside 1e-5 of logits of order 0.1-1
        assert torch.allclose(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
        for p in loaded.parameters():  # the same bytes in fresh (64-byte aligned) memory: the same kernels
            p.data = p.data.clone()
        assert torch.equal(loaded(input_ids=ids).logits, want)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next"])
def test_per_layer_lists_follow_any_depth(family):
    """A depth other than the overrides' two layers: every layer gets its entry, the pattern repeated (three
    layers of gpt_oss raised IndexError in the model's constructor)."""
    model = tiny_model(family, num_hidden_layers=3)
    kinds = model.config.get_text_config().layer_types
    assert len(kinds) == 3 and kinds[2] == kinds[0] != kinds[1]
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits.shape == (1, 4, model.config.vocab_size)
