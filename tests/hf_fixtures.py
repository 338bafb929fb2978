"""Tiny random Hugging Face model folders (llama, mistral, qwen2, qwen3, gemma2, gemma3, qwen3_moe, cohere2, gpt_oss,
glm4_moe), built and saved by transformers.

Every folder is a real ``save_pretrained`` output (config.json, model.safetensors, generation_config.json), so
the loader is tested on what users bring. Biases and norm weights are randomised too (transformers initialises
them to 0 and 1, which would hide a missing or misplaced tensor).
"""

from __future__ import annotations

import os

VOCAB = 128
PAD_ID, EOS_ID = 0, 1

# per family: (the feature under test, config kwargs); "untied" variants add the options each family allows
FAMILIES = {
    "llama": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "mistral": dict(model_type="mistral", sliding_window=4),
    # local layers (window 4 < the 12-token rows) between global ones, two RoPE bases (linear scaling on the global
    # one), query_pre_attn_scalar != head_dim, so each of them moves the logits
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24,
                   sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # alternating windows; soft caps small enough to bend the scores and logits of a random model
    "gemma2": dict(model_type="gemma2", num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=20,
                   sliding_window=4, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    # two sliding layers (window 4, interleaved RoPE) before a full one without RoPE, a parallel block over
    # LayerNorm, logits scaled by 0.5
    "cohere2": dict(model_type="cohere2", num_hidden_layers=3, sliding_window=4, logit_scale=0.5,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # sliding (window 4) and full layers alternating with sinks, YaRN (factor 8 over an original context of 16), a
    # clamp of 0.5 that binds, biased router and experts
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32, sliding_window=4, swiglu_limit=0.5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
    # a dense first layer before two routed ones: 8 experts in 4 groups (the best 2 kept), a correction bias that
    # moves the choice, weights scaled by 2.5, one shared expert, RoPE on half of each head, q/k norm
    "glm4_moe": dict(model_type="glm4_moe", num_hidden_layers=3, head_dim=16, n_routed_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                     attention_bias=True),
}
UNTIED_EXTRA = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(),
    "qwen3": dict(attention_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}),
    "mistral": dict(head_dim=8),
    "gemma3": dict(attention_bias=True),
    "gemma2": dict(attention_bias=True),
    "qwen3_moe": dict(attention_bias=True, norm_topk_prob=False),
    "cohere2": dict(attention_bias=True),
    # truncated correction range and an explicit attention factor
    # no dense layer, no shared expert, plain top-k weights, no q/k norm, a quarter of each head turned
    "glm4_moe": dict(first_k_dense_replace=0, n_shared_experts=0, norm_topk_prob=False, use_qk_norm=False,
                     attention_bias=False, n_group=1, topk_group=1,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25}),
    "gpt_oss": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "attention_factor": 1.3,
                                     "original_max_position_embeddings": 32}),
}


def hf_config(family: str, tied: bool, **overrides):
    """The transformers config of one tiny test model (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128)."""
    import transformers

    kwargs = dict(FAMILIES[family])
    model_type = kwargs.pop("model_type")
    if not tied:
        kwargs.update(UNTIED_EXTRA[family])
    kwargs = {**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                     tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=2, eos_token_id=EOS_ID,
                     pad_token_id=PAD_ID), **kwargs}
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def build_model(family: str, tied: bool, seed: int = 0, **overrides):
    """A float32 transformers CausalLM with random weights, biases and norm scales (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, tied, **overrides),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():  # GLM-4-MoE's router correction bias: large enough to move the choice
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    return model.eval()


def save_model(model, folder, **kwargs) -> str:
    """``model.save_pretrained(folder)``; returns the folder as a string."""
    folder = os.fspath(folder)
    model.save_pretrained(folder, **kwargs)
    return folder
