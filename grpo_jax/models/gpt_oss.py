"""The GPT-OSS family (``gpt_oss``, ``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): in every layer attention with
q/k/v/o biases and a learned sink logit per query head (`layers.Attention` with ``attention_sinks``), sliding-window
and full layers alternating, YaRN RoPE, and a mixture of experts whose router has a bias and whose experts apply a
clamped SwiGLU with biases. As transformers' ``modeling_gpt_oss.py``.

Weight names: the router is ``model.layers.<i>.mlp.router.{weight,bias}``; the experts are stored stacked, already
[in, out]: ``mlp.experts.gate_up_proj`` [E, D, 2F] (gate and up interleaved: column 2j is gate j, 2j + 1 up j),
``gate_up_proj_bias`` [E, 2F], ``down_proj`` [E, F, D], ``down_proj_bias`` [E, D], which our
``layers.mlp.experts.<name>`` [L, ...] hold as they are. Released checkpoints store the experts in MXFP4;
transformers dequantizes them (``Mxfp4Config(dequantize=True)``) before ``save_pretrained`` gives a folder this
loader reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import grouped, hf_config, moe
from grpo_jax.models.families import Family
from grpo_jax.models.layers import Attention, RMSNorm

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}


class Experts(moe.Experts):
    """GPT-OSS's E experts as its checkpoints store them: out = down((up + 1) * g * sigmoid(alpha g)) + bias, with
    g = min(gate, limit) and up clipped to [-limit, limit], gate and up one interleaved product plus its bias."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):  # its own stacks, not the base class's
        E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(config.initializer_range)
        dtype = config.param_jnp_dtype
        self.gate_up_proj = nnx.Param(init(rngs.params(), (E, D, 2 * F), dtype))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((E, 2 * F), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (E, F, D), dtype))
        self.down_proj_bias = nnx.Param(jnp.zeros((E, D), dtype))
        self.dtype = config.jnp_dtype
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.ragged_dot = grouped.grouped_dot

    def stacks(self) -> tuple:
        return self.gate_up_proj[...], self.gate_up_proj_bias[...], self.down_proj[...], self.down_proj_bias[...]

    def ffn(self, xs_MxD, group_M, group_sizes_E, stacks, ragged_dot):
        """`moe.swiglu`'s contract: float32 [M, D] for the sorted rows ``xs_MxD`` of experts ``group_M``."""
        gate_up_ExDx2F, gate_up_bias_Ex2F, down_ExFxD, down_bias_ExD = stacks
        M, F = xs_MxD.shape[0], down_ExFxD.shape[1]
        e_M = jnp.minimum(group_M, gate_up_ExDx2F.shape[0] - 1)  # rows past the groups: dropped by the caller
        h_MxFx2 = (ragged_dot(xs_MxD, gate_up_ExDx2F, group_sizes_E) + gate_up_bias_Ex2F[e_M]).reshape(M, F, 2)
        gate_MxF = jnp.minimum(h_MxFx2[..., 0], self.limit)
        up_MxF = jnp.clip(h_MxFx2[..., 1], -self.limit, self.limit)
        h_MxF = (up_MxF + 1) * (gate_MxF * jax.nn.sigmoid(gate_MxF * self.alpha))
        return (ragged_dot(h_MxF, down_ExFxD, group_sizes_E, preferred_element_type=jnp.float32)
                + down_bias_ExD[e_M].astype(jnp.float32))


class MLP(moe.SparseMoE):
    """The router (``router``: a biased [D, E] linear; the top K logits' softmax weights their experts, which is
    the renormalised top K of the full softmax) and `Experts`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):  # its own router, not the base class's
        self.router = nnx.Linear(config.hidden_size, config.num_experts, use_bias=True, dtype=config.jnp_dtype,
                                 param_dtype=config.param_jnp_dtype,
                                 kernel_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)
        self.experts = Experts(config, rngs)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = True

    def router_logits(self, x_NxD):
        return self.router(x_NxD)


class DecoderLayer(moe.RoutedDecoderLayer):
    """GPT-OSS's attention (no q/k norm, sinks), experts and norms, which scale in float32 (transformers keeps them
    so), in the routed pre-norm block."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.self_attn = Attention(config, rngs, bias=config.attention_bias, out_bias=config.attention_out_bias,
                                   qk_norm=False)
        self.mlp = MLP(config, rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config, f32_scale=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config, f32_scale=True)


def config_fields(hf, where: str) -> dict:
    """ModelConfig field values of a transformers GptOssConfig (its expert width is ``intermediate_size``)."""
    layer_types = tuple(hf.layer_types)
    hf_config.check_layer_types(layer_types, where)
    bias = bool(getattr(hf, "attention_bias", True))
    rope = hf_config.rope_fields(hf_config.rope_parameters(hf), hf, where)
    return dict(hf_config.common_fields(hf, where), **rope, layer_types=layer_types,
                sliding_window=hf.sliding_window if "sliding_attention" in layer_types else None,
                attention_bias=bias, attention_out_bias=bias, mlp_bias=False, qk_norm=False, attention_sinks=True,
                num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True,
                router_aux_loss_coef=float(hf.router_aux_loss_coef), swiglu_alpha=float(hf.swiglu_alpha),
                swiglu_limit=float(hf.swiglu_limit))


def hf_kwargs(config: ModelConfig) -> dict:
    """transformers GptOssConfig arguments of a ModelConfig."""
    problems = []
    if config.attention_bias != config.attention_out_bias:
        problems.append("gpt_oss has one attention_bias for q/k/v/o: set attention_out_bias == attention_bias")
    if not config.attention_sinks or config.qk_norm or config.mlp_bias or not config.norm_topk_prob:
        problems.append("gpt_oss has attention sinks, no q/k norm, no dense MLP bias and renormalised top-k "
                        "weights: set attention_sinks=true, qk_norm=false, mlp_bias=false, norm_topk_prob=true")
    if config.intermediate_size != config.moe_intermediate_size:
        problems.append("gpt_oss's intermediate_size is its experts' width: set intermediate_size == "
                        "moe_intermediate_size")
    problems += hf_config.foreign_options(config, "GPT-OSS")
    if problems:
        raise ValueError("model.model_type='gpt_oss' cannot express this config: " + "; ".join(problems))
    return dict(hf_config.common_kwargs(config), rope_parameters=hf_config.hf_rope(config),
                head_dim=config.resolved_head_dim, attention_bias=config.attention_bias,
                sliding_window=config.sliding_window, layer_types=list(config.resolved_layer_types),
                num_local_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                router_aux_loss_coef=config.router_aux_loss_coef, swiglu_alpha=config.swiglu_alpha,
                swiglu_limit=config.swiglu_limit)


FAMILY = Family(architectures=ARCHITECTURES, decoder_layer=DecoderLayer, config_fields=config_fields,
                hf_kwargs=hf_kwargs, routed=True, norm_f32_scale=True)
