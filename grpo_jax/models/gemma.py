"""The Gemma family: ``gemma2`` (Gemma 2) and ``gemma3_text`` (Gemma 3 text, ``Gemma3ForCausalLM``).

A sandwich block, x + norm(attn(norm(x))) then x + norm(mlp(norm(x))), every RMSNorm Gemma's (1 + w, in
float32), GeGLU (gelu_pytorch_tanh), scores scaled by ``query_pre_attn_scalar``^-1/2, embeddings multiplied by
sqrt(hidden) and local (sliding-window) layers interleaved with global ones (``layer_types``; Gemma 2 alternates,
Gemma 3 has five local to one global). Gemma 2 soft-caps attention scores and the final logits; Gemma 3 has
q/k RMSNorm and two RoPE bases (global layers ``rope_theta`` with its scaling, local ones
``rope_local_base_freq``). As transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py``.
"""

from __future__ import annotations

from flax import nnx

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import hf_config
from grpo_jax.models.families import Family
from grpo_jax.models.layers import MLP, Attention, RMSNorm

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


class DecoderLayer(nnx.Module):
    """Sandwich block: x + post_attn_norm(attn(input_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D = config.hidden_size
        self.self_attn = Attention(config, rngs, bias=config.attention_bias, out_bias=config.attention_out_bias,
                                   qk_norm=config.qk_norm, norm_offset=True,
                                   query_scalar=config.query_pre_attn_scalar, softcap=config.attn_logit_softcapping)
        self.mlp = MLP(config, rngs)
        self.input_layernorm = RMSNorm(D, config, offset=True)
        self.post_attention_layernorm = RMSNorm(D, config, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(D, config, offset=True)
        self.post_feedforward_layernorm = RMSNorm(D, config, offset=True)

    def __call__(self, x, cos, sin, mask, cache_kv, cache_index, prefix_kv=None, prefix_group_size=1,
                 whole_mask=False):
        attn, cache_kv, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, cache_index,
                                                prefix_kv, prefix_group_size, whole_mask)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache_kv, new_kv


def _rope_fields(hf, where: str) -> dict:
    rope = hf_config.rope_parameters(hf)
    if hf.model_type == "gemma2" or not any(isinstance(v, dict) for v in rope.values()):
        return hf_config.rope_fields(rope, hf, where)
    unknown = sorted(set(rope) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"{where}: rope_parameters for layer types {unknown} are not supported: only "
                         "full_attention and sliding_attention")
    local = rope.get("sliding_attention", {})
    local_type = local.get("rope_type", "default")
    if local_type != "default":
        raise ValueError(f"{where}: rope_parameters.sliding_attention.rope_type={local_type!r} is not supported: "
                         "the local layers' RoPE must be default (its base only, as in Gemma 3)")
    return dict(hf_config.rope_fields(rope["full_attention"], hf, where),
                rope_local_base_freq=float(local.get("rope_theta", 10000.0)))


def config_fields(hf, where: str) -> dict:
    """ModelConfig field values of a gemma2 or gemma3_text transformers config."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{where}: hidden_activation {act!r} is not supported: only 'gelu_pytorch_tanh' (GeGLU)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{where}: use_bidirectional_attention=true is not supported: a causal decoder only")
    layer_types = tuple(hf.layer_types)
    hf_config.check_layer_types(layer_types, where)
    bias = bool(getattr(hf, "attention_bias", False))
    softcap = {name: None if getattr(hf, name, None) is None else float(getattr(hf, name))
               for name in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(hf_config.common_fields(hf, where), **_rope_fields(hf, where), **softcap,
                sliding_window=hf.sliding_window if "sliding_attention" in layer_types else None,
                layer_types=layer_types, hidden_act=act, query_pre_attn_scalar=int(hf.query_pre_attn_scalar),
                attention_bias=bias, attention_out_bias=bias, mlp_bias=False, qk_norm=hf.model_type == "gemma3_text")


def _problems(config: ModelConfig) -> list[str]:
    mt = config.model_type
    problems = []
    if config.attention_bias != config.attention_out_bias:
        problems.append(f"{mt} has one attention_bias for q/k/v/o: set attention_out_bias == attention_bias")
    if config.mlp_bias:
        problems.append(f"{mt} has no mlp bias: set mlp_bias=false")
    if config.qk_norm != (mt == "gemma3_text"):
        problems.append(f"{mt} {'always has' if mt == 'gemma3_text' else 'has no'} q/k norm: set qk_norm="
                        + ("true" if mt == "gemma3_text" else "false"))
    if mt == "gemma2" and config.rope_local_base_freq is not None:
        problems.append("gemma2 has one RoPE base: set rope_local_base_freq=null")
    if config.hidden_act != "gelu_pytorch_tanh":
        problems.append(f"{mt}'s MLP is GeGLU: set hidden_act=gelu_pytorch_tanh")
    return problems + hf_config.foreign_options(config, "Gemma")


def hf_kwargs(config: ModelConfig) -> dict:
    """transformers config arguments (Gemma2Config, Gemma3TextConfig) of a ModelConfig."""
    problems = _problems(config)
    if problems:
        raise ValueError(f"model.model_type={config.model_type!r} cannot express this config: " + "; ".join(problems))
    rope = hf_config.hf_rope(config)
    if config.model_type == "gemma3_text":
        local = config.rope_theta if config.rope_local_base_freq is None else config.rope_local_base_freq
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    scalar = config.resolved_head_dim if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar
    return dict(hf_config.common_kwargs(config), head_dim=config.resolved_head_dim,
                hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                sliding_window=config.sliding_window, layer_types=list(config.resolved_layer_types),
                attn_logit_softcapping=config.attn_logit_softcapping,
                final_logit_softcapping=config.final_logit_softcapping, attention_bias=config.attention_bias,
                rope_parameters=rope)


FAMILY = Family(architectures=ARCHITECTURES, decoder_layer=DecoderLayer, config_fields=config_fields,
                hf_kwargs=hf_kwargs, norm_offset=True, embed_scale=True)
