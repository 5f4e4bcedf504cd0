"""Tiny random-init MoE models of every supported transformers family, built offline.

Used by the tests, the benchmarks and `moe-attrib inspect tiny:<family>`. Sizes are small but
keep real proportions where they matter for coverage (experts dominate the parameter count).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

COMMON = dict(
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILY_OVERRIDES: dict[str, dict] = {
    "gpt_oss": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
    "mixtral": {},
    "qwen2_moe": dict(shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_next": dict(
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=2,
    ),
    "olmoe": {},
    "deepseek_v2": dict(
        first_k_dense_replace=0,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=4,
        n_group=1,
        topk_group=1,
    ),
    "deepseek_v3": dict(
        first_k_dense_replace=0,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=4,
        n_group=2,
        topk_group=1,
    ),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"], hc_mult=2),
    "llama4_text": dict(interleave_moe_layer_step=1, intermediate_size_mlp=64, no_rope_layers=[1, 1]),
    "longcat_flash": dict(
        zero_expert_num=2,
        expert_ffn_hidden_size=32,
        num_layers=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        qk_head_dim=16,
        head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
        ffn_hidden_size=64,
    ),
    "granitemoe": {},
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        mamba_d_state=4,
        mamba_expand=1,
        mamba_dt_rank=8,
        mamba_d_conv=2,
        use_mamba_kernels=False,
    ),
    "minimax": {},
    "ernie4_5_moe": dict(moe_layer_start_index=0, moe_layer_interval=1, moe_num_shared_experts=0),
    "glm4_moe": dict(first_k_dense_replace=0, n_group=1, topk_group=1, n_shared_experts=1),
    "dots1": dict(first_k_dense_replace=0, n_shared_experts=1, n_group=1, topk_group=1),
    "hunyuan_v1_moe": dict(moe_topk=2, num_shared_expert=1),
    "flex_olmo": {},
}

DENSE_FAMILIES = {"llama": {}}  # non-MoE reference, for "no fused experts" paths
FAMILIES = list(FAMILY_OVERRIDES)
FAMILY_OVERRIDES.update(DENSE_FAMILIES)


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """A tiny config of `family` with every decoder layer an MoE layer where the family allows."""
    if family not in FAMILY_OVERRIDES:
        raise KeyError(f"unknown tiny family {family!r}; known: {', '.join(FAMILIES)}")
    config = AutoConfig.for_model(family)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, value in {**COMMON, **FAMILY_OVERRIDES[family], **overrides}.items():
        if hasattr(text, key) or key in FAMILY_OVERRIDES[family] or key in overrides:
            setattr(text, key, value)
    # per-layer lists sized for another depth (the full-size default's, or the overrides' two layers): the
    # pattern repeated or cut to this depth, so every layer has an entry and `save_pretrained` validates
    for key in ("layer_types", "mlp_layer_types"):
        kinds, depth = getattr(text, key, None), getattr(text, "num_hidden_layers", None)
        if isinstance(kinds, list) and kinds and isinstance(depth, int) and len(kinds) != depth:
            setattr(text, key, [kinds[i % len(kinds)] for i in range(depth)])
    return config


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """Random-init tiny causal LM of `family`, in eval mode, with non-degenerate routing weights."""
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and float(p.abs().max()) == 0.0:
                p.normal_(0.0, 0.05)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):  # deepseek_v4 hash routing: distinct random experts per token id
                experts = model.config.get_text_config().num_local_experts
                buf.copy_(torch.stack([torch.randperm(experts)[: buf.shape[1]] for _ in range(buf.shape[0])]))
    return model.eval()


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    """A word-level tokenizer trained offline on `texts` (no downloads), as a transformers tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=special))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_tiny(directory: str, family: str, texts: list[str], seed: int = 0, **overrides) -> None:
    """Save a tiny random `family` model with a tokenizer trained on `texts` (`save_pretrained` layout)."""
    tokenizer = train_tokenizer(texts)
    vocab = max(len(tokenizer), 8)
    model = tiny_model(family, seed=seed, vocab_size=vocab, **overrides)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
