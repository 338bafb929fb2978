"""The GLM-4-MoE family (``glm4_moe``, ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air, GLM-4.6): the first
``first_k_dense_replace`` layers with a dense SwiGLU MLP (`layers.DecoderLayer`, in the driver's ``dense_layers``
stack), the others with DeepSeek-V3's routing: sigmoid scores plus a correction bias choose each token's experts
among the ``topk_group`` best of ``n_group`` groups (a group scored by its two best), the chosen experts weighted
by their plain sigmoid scores (renormalised with ``norm_topk_prob``) times ``routed_scaling_factor``, beside
``n_shared_experts`` always-on experts. Attention has q/k/v biases (``attention_bias``), optional q/k norms
(``use_qk_norm``) and RoPE on the first ``partial_rotary_factor`` of each head (0.5). As transformers'
``modeling_glm4_moe.py``.

Weight names: the router is ``model.layers.<i>.mlp.gate.weight`` [E, D] and its ``e_score_correction_bias`` [E] (a
buffer that DeepSeek's auxiliary-loss-free balancing moves outside the gradient: here it is never trained); the
experts are stored one by one, as Qwen3-MoE's (`qwen3_moe.hf_names`); the shared experts are
``mlp.shared_experts.{gate,up,down}_proj``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import families, hf_config, layers, moe
from grpo_jax.models.families import Family
from grpo_jax.models.layers import MLP, Attention, RMSNorm

ARCHITECTURES = {"glm4_moe": "Glm4MoeForCausalLM"}


class Router(nnx.Module):
    """``kernel`` [D, E] (transformers' ``weight`` transposed) and ``e_score_correction_bias`` [E], in float32."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D, E = config.hidden_size, config.num_experts
        # float32 whatever model.param_dtype says, as transformers keeps the router (`_keep_in_fp32_modules`)
        self.kernel = nnx.Param(nnx.initializers.normal(config.initializer_range)(rngs.params(), (D, E), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))

    def __call__(self, x_NxD):
        """Router logits [N, E] in float32, as transformers computes them."""
        return x_NxD.astype(jnp.float32) @ self.kernel[...].astype(jnp.float32)


def route(logits_NxE, bias_E, config: ModelConfig, replay_NxK=None):
    """(experts [N, K] int32, weights [N, K] float32): transformers' ``Glm4MoeTopkRouter`` after the logits;
    ``replay_NxK``: these experts instead (routing replay), weighted as the router weighs them."""
    N, E = logits_NxE.shape
    scores_NxE = jax.nn.sigmoid(logits_NxE)
    if replay_NxK is None:
        choice_NxE = scores_NxE + jax.lax.stop_gradient(bias_E)  # the bias steers the choice, never the weights
        groups = config.n_group
        group_NxG = jnp.sum(jax.lax.top_k(choice_NxE.reshape(N, groups, E // groups), 2)[0], axis=-1)
        best_groups_NxK = jax.lax.top_k(group_NxG, config.topk_group)[1]
        kept_NxG = jnp.zeros((N, groups), bool).at[jnp.arange(N)[:, None], best_groups_NxK].set(True)
        kept_NxE = jnp.repeat(kept_NxG, E // groups, axis=1)
        experts_NxK = jax.lax.top_k(jnp.where(kept_NxE, choice_NxE, -jnp.inf), config.num_experts_per_tok)[1]
    else:
        experts_NxK = replay_NxK.astype(jnp.int32)
    weights_NxK = jnp.take_along_axis(scores_NxE, experts_NxK, axis=-1)
    if config.norm_topk_prob:
        weights_NxK = weights_NxK / (jnp.sum(weights_NxK, axis=-1, keepdims=True) + 1e-20)
    return experts_NxK, weights_NxK * config.routed_scaling_factor


class SharedMoE(nnx.Module):
    """Routed experts (``gate``, ``experts``) plus the shared experts' dense MLP (``shared_experts``)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.gate = Router(config, rngs)
        self.experts = moe.Experts(config, rngs)
        # always there, as in transformers: n_shared_experts 0 gives it no width (and zero-size tensors)
        self.shared_experts = MLP(config, rngs, width=config.moe_intermediate_size * config.n_shared_experts)
        self.config = config

    def __call__(self, x_BxTxD, replay_BxTxK=None):
        """(out [B, T, D], router logits [B, T, E] in the compute dtype, chosen experts [B, T, K] int32)."""
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D)
        logits_NxE = self.gate(x_NxD)
        replay_NxK = None if replay_BxTxK is None else replay_BxTxK.reshape(B * T, -1)
        experts_NxK, weights_NxK = route(logits_NxE, self.gate.e_score_correction_bias[...], self.config, replay_NxK)
        out_NxD = self.experts(x_NxD, experts_NxK, weights_NxK) + self.shared_experts(x_NxD)
        return (out_NxD.reshape(B, T, D), logits_NxE.astype(x_BxTxD.dtype).reshape(B, T, -1),
                experts_NxK.reshape(B, T, -1))


class DecoderLayer(moe.RoutedDecoderLayer):
    """GLM's attention (q/k/v biases, optional q/k norm, no o_proj bias) and `SharedMoE` in the routed block."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.self_attn = Attention(config, rngs, bias=config.attention_bias, out_bias=False, qk_norm=config.qk_norm)
        self.mlp = SharedMoE(config, rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config)


def hf_names(path: str, config: ModelConfig) -> tuple[list[str], int, bool]:
    """`families.hf_names`, and the stacked experts ``layers.mlp.experts.<proj>`` [L', E, in, out]: the hub's
    ``model.layers.<i>.mlp.experts.<j>.<proj>.weight`` [out, in] of the routed layers, layer-major."""
    *module, leaf = path.split(".")
    if module[-1:] != ["experts"]:
        return families.hf_names(path, config)
    inner = ".".join(module[1:])
    return [f"model.layers.{i}.{inner}.{j}.{leaf}.weight" for i in families.stack_layers("layers", config)
            for j in range(config.num_experts)], 2, True


def config_fields(hf, where: str) -> dict:
    """ModelConfig field values of a transformers Glm4MoeConfig."""
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported: only 'silu' (SwiGLU experts)")
    rope = hf_config.rope_parameters(hf)
    partial = float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 0.5)))
    return dict(hf_config.common_fields(hf, where), **hf_config.rope_fields(rope, hf, where, partial=True),
                attention_bias=bool(hf.attention_bias), attention_out_bias=False, mlp_bias=False,
                qk_norm=bool(hf.use_qk_norm), num_experts=hf.n_routed_experts,
                num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=hf.moe_intermediate_size,
                norm_topk_prob=bool(hf.norm_topk_prob), router_aux_loss_coef=0.0,
                first_k_dense_replace=int(hf.first_k_dense_replace), n_shared_experts=int(hf.n_shared_experts),
                n_group=int(hf.n_group), topk_group=int(hf.topk_group),
                routed_scaling_factor=float(hf.routed_scaling_factor), partial_rotary_factor=partial)


def hf_kwargs(config: ModelConfig) -> dict:
    """transformers Glm4MoeConfig arguments of a ModelConfig."""
    problems = []
    if config.attention_out_bias or config.mlp_bias or config.hidden_act != "silu":
        problems.append("glm4_moe has no o_proj or MLP bias and SwiGLU MLPs: set attention_out_bias=false, "
                        "mlp_bias=false, hidden_act=silu")
    if config.sliding_window is not None or (config.layer_types is not None and len(set(config.layer_types)) > 1):
        problems.append("glm4_moe attends fully in every layer: set sliding_window=null, layer_types=null")
    problems += hf_config.foreign_options(config)
    if problems:
        raise ValueError("model.model_type='glm4_moe' cannot express this config: " + "; ".join(problems))
    return dict(hf_config.common_kwargs(config), hidden_act="silu",
                rope_parameters=dict(hf_config.hf_rope(config), partial_rotary_factor=config.partial_rotary_factor),
                head_dim=config.resolved_head_dim, attention_bias=config.attention_bias, use_qk_norm=config.qk_norm,
                n_routed_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                first_k_dense_replace=config.first_k_dense_replace, n_shared_experts=config.n_shared_experts,
                n_group=config.n_group, topk_group=config.topk_group,
                routed_scaling_factor=config.routed_scaling_factor)


FAMILY = Family(architectures=ARCHITECTURES, decoder_layer=DecoderLayer, dense_layer=layers.DecoderLayer,
                config_fields=config_fields, hf_kwargs=hf_kwargs, hf_names=hf_names, routed=True,
                float32_params=("mlp.gate.kernel", "mlp.gate.e_score_correction_bias"))
