"""The Cohere 2 family (``cohere2``, ``Cohere2ForCausalLM``: Command R7B, Command A): a parallel block,
x + attn(norm(x)) + mlp(norm(x)) over one bias-free LayerNorm, RoPE on interleaved pairs (2i, 2i + 1) and only in
the sliding-window layers (the full-attention ones, every ``sliding_window_pattern``-th, have no positional
encoding), SwiGLU, tied embeddings and logits multiplied by ``logit_scale``. As transformers'
``modeling_cohere2.py``.
"""

from __future__ import annotations

from flax import nnx

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import hf_config
from grpo_jax.models.families import Family
from grpo_jax.models.layers import MLP, Attention, LayerNorm

ARCHITECTURES = {"cohere2": "Cohere2ForCausalLM"}


class DecoderLayer(nnx.Module):
    """Parallel block: h = norm(x), then x + attn(h) + mlp(h)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = LayerNorm(config.hidden_size, config)
        self.self_attn = Attention(config, rngs, bias=config.attention_bias, out_bias=config.attention_out_bias,
                                   qk_norm=False, rope_interleaved=True)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, cos, sin, mask, cache_kv, cache_index, prefix_kv=None, prefix_group_size=1,
                 whole_mask=False):
        h = self.input_layernorm(x)
        attn, cache_kv, new_kv = self.self_attn(h, cos, sin, mask, cache_kv, cache_index, prefix_kv,
                                                prefix_group_size, whole_mask)
        return x + attn + self.mlp(h), cache_kv, new_kv


def config_fields(hf, where: str) -> dict:
    """ModelConfig field values of a transformers Cohere2Config."""
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported: only 'silu' (SwiGLU MLP)")
    layer_types = tuple(hf.layer_types)
    hf_config.check_layer_types(layer_types, where)
    bias = bool(getattr(hf, "attention_bias", False))
    rope = hf_config.rope_fields(hf_config.rope_parameters(hf), hf, where)
    return dict(hf_config.common_fields(hf, where, "layer_norm_eps"), **rope,
                sliding_window=hf.sliding_window if "sliding_attention" in layer_types else None,
                layer_types=layer_types, attention_bias=bias, attention_out_bias=bias, mlp_bias=False, qk_norm=False,
                logit_scale=float(hf.logit_scale))


def _problems(config: ModelConfig) -> list[str]:
    problems = []
    if config.attention_bias != config.attention_out_bias:
        problems.append("cohere2 has one attention_bias for q/k/v/o: set attention_out_bias == attention_bias")
    if config.mlp_bias or config.qk_norm or config.hidden_act != "silu":
        problems.append("cohere2 has no mlp bias, no q/k norm and a SwiGLU MLP: set mlp_bias=false, qk_norm=false, "
                        "hidden_act=silu")
    if config.resolved_head_dim != config.hidden_size // config.num_attention_heads:
        problems.append("cohere2's head_dim is hidden_size / num_attention_heads: set head_dim=null")
    return problems + hf_config.foreign_options(config, "Cohere")


def hf_kwargs(config: ModelConfig) -> dict:
    """transformers Cohere2Config arguments of a ModelConfig (its LayerNorm's epsilon is ``layer_norm_eps``)."""
    problems = _problems(config)
    if problems:
        raise ValueError("model.model_type='cohere2' cannot express this config: " + "; ".join(problems))
    kwargs = hf_config.common_kwargs(config)
    kwargs["layer_norm_eps"] = kwargs.pop("rms_norm_eps")
    return dict(kwargs, hidden_act="silu", rope_parameters=hf_config.hf_rope(config),
                attention_bias=config.attention_bias,
                sliding_window=config.sliding_window, layer_types=list(config.resolved_layer_types),
                logit_scale=1.0 if config.logit_scale is None else config.logit_scale)


FAMILY = Family(architectures=ARCHITECTURES, decoder_layer=DecoderLayer, config_fields=config_fields,
                hf_kwargs=hf_kwargs, layer_norm=True, rope_kinds=("sliding_attention",))
