"""The Qwen3-MoE family (``qwen3_moe``, ``Qwen3MoeForCausalLM``): Qwen3's attention (q/k RMSNorm) and, in every
layer, the sparse mixture-of-experts block of `models.moe` in place of the dense MLP.

Weight names: the router is ``model.layers.<i>.mlp.gate.weight`` [E, D]; the hub (and transformers'
``save_pretrained``, which writes the original format) stores each expert apart,
``model.layers.<i>.mlp.experts.<j>.{gate,up,down}_proj.weight``, which our stacked ``layers.mlp.experts.<proj>``
[L, E, in, out] hold transposed (`hf_names`).
"""

from __future__ import annotations

from flax import nnx

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import hf_config
from grpo_jax.models import families
from grpo_jax.models.families import Family
from grpo_jax.models.layers import Attention, RMSNorm
from grpo_jax.models.moe import RoutedDecoderLayer, SparseMoE

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM"}


class DecoderLayer(RoutedDecoderLayer):
    """Qwen3's attention (q/k norm) and `SparseMoE` in the routed pre-norm block."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.self_attn = Attention(config, rngs, bias=config.attention_bias, out_bias=config.attention_bias,
                                   qk_norm=True)
        self.mlp = SparseMoE(config, rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config)


def hf_names(path: str, config: ModelConfig) -> tuple[list[str], int, bool]:
    """`families.hf_names`, and the stacked experts ``layers.mlp.experts.<proj>`` [L, E, in, out]: the hub's
    ``model.layers.<i>.mlp.experts.<j>.<proj>.weight`` [out, in], layer-major."""
    *module, leaf = path.split(".")
    if module[-1:] != ["experts"]:
        return families.hf_names(path, config)
    inner = ".".join(module[1:])
    return [f"model.layers.{i}.{inner}.{j}.{leaf}.weight" for i in range(config.num_hidden_layers)
            for j in range(config.num_experts)], 2, True


def config_fields(hf, where: str) -> dict:
    """ModelConfig field values of a transformers Qwen3MoeConfig; layers with a dense MLP are refused."""
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported: only 'silu' (SwiGLU experts)")
    if getattr(hf, "decoder_sparse_step", 1) != 1 or list(getattr(hf, "mlp_only_layers", None) or []):
        raise ValueError(f"{where}: decoder_sparse_step={hf.decoder_sparse_step}, mlp_only_layers="
                         f"{hf.mlp_only_layers}: dense-MLP layers are not supported, every layer must be sparse "
                         "(decoder_sparse_step=1, mlp_only_layers=[])")
    hf_config.check_layer_types(getattr(hf, "layer_types", None), where)
    bias = bool(getattr(hf, "attention_bias", False))
    return dict(hf_config.common_fields(hf, where), **hf_config.rope_fields(hf_config.rope_parameters(hf), hf, where),
                sliding_window=getattr(hf, "sliding_window", None), attention_bias=bias, attention_out_bias=bias,
                mlp_bias=False, qk_norm=True, num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                router_aux_loss_coef=float(hf.router_aux_loss_coef))


def hf_kwargs(config: ModelConfig) -> dict:
    """transformers Qwen3MoeConfig arguments of a ModelConfig."""
    problems = []
    if config.attention_bias != config.attention_out_bias:
        problems.append("qwen3_moe has one attention_bias for q/k/v/o: set attention_out_bias == attention_bias")
    if not config.qk_norm or config.mlp_bias or config.hidden_act != "silu":
        problems.append("qwen3_moe has q/k norm, no mlp bias and SwiGLU experts: set qk_norm=true, mlp_bias=false, "
                        "hidden_act=silu")
    if config.layer_types is not None and len(set(config.layer_types)) > 1:
        problems.append("qwen3_moe has one attention kind for every layer: set layer_types=null")
    problems += hf_config.foreign_options(config)
    if problems:
        raise ValueError("model.model_type='qwen3_moe' cannot express this config: " + "; ".join(problems))
    return dict(hf_config.common_kwargs(config), hidden_act="silu", rope_parameters=hf_config.hf_rope(config),
                head_dim=config.resolved_head_dim, attention_bias=config.attention_bias,
                use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window,
                num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                router_aux_loss_coef=config.router_aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[])


FAMILY = Family(architectures=ARCHITECTURES, decoder_layer=DecoderLayer, config_fields=config_fields,
                hf_kwargs=hf_kwargs, hf_names=hf_names, routed=True)
