"""The Llama family: ``llama`` (Llama 3.x), ``mistral``, ``qwen2`` (Qwen2/2.5) and ``qwen3`` (Qwen3 dense).

One pre-norm block, x + attn(norm(x)) then x + mlp(norm(x)), with SwiGLU; the types differ in biases (qwen2:
q/k/v; llama: one flag for q/k/v/o, one for the MLP), q/k RMSNorm (qwen3), RoPE scaling and a sliding window
(mistral: every layer; qwen2/qwen3 with ``use_sliding_window``: the layers from ``max_window_layers`` on, as
their ``layer_types`` say).
"""

from __future__ import annotations

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import hf_config
from grpo_jax.models.families import Family
from grpo_jax.models.layers import DecoderLayer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def _window_fields(hf, where: str) -> dict:
    """sliding_window, and layer_types when only some layers slide (qwen2/qwen3's ``max_window_layers``)."""
    window = getattr(hf, "sliding_window", None)
    if hf.model_type in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
        window = None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None and window is not None and hf.model_type in ("qwen2", "qwen3"):  # transformers < 5
        layer_types = ["sliding_attention" if i >= hf.max_window_layers else "full_attention"
                       for i in range(hf.num_hidden_layers)]
    hf_config.check_layer_types(layer_types, where)
    kinds = set(layer_types or [])
    if window is None or kinds == {"full_attention"}:
        return dict(sliding_window=None, layer_types=None)
    if len(kinds) == 2:
        return dict(sliding_window=window, layer_types=tuple(layer_types))
    return dict(sliding_window=window, layer_types=None)


def config_fields(hf, where: str) -> dict:
    """ModelConfig field values of a llama, mistral, qwen2 or qwen3 transformers config."""
    mt = hf.model_type
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported: only 'silu' (SwiGLU MLP)")
    fields = dict(hf_config.common_fields(hf, where), **_window_fields(hf, where),
                  **hf_config.rope_fields(hf_config.rope_parameters(hf), hf, where))
    bias = bool(getattr(hf, "attention_bias", False))
    if mt == "llama":  # one flag for q/k/v/o
        fields.update(attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False)),
                      qk_norm=False)
    elif mt == "qwen2":  # q/k/v always carry a bias, o_proj never
        fields.update(attention_bias=True, attention_out_bias=False, mlp_bias=False, qk_norm=False)
    elif mt == "qwen3":
        fields.update(attention_bias=bias, attention_out_bias=bias, mlp_bias=False, qk_norm=True)
    else:  # mistral
        fields.update(attention_bias=False, attention_out_bias=False, mlp_bias=False, qk_norm=False)
    return fields


def _problems(config: ModelConfig) -> list[str]:
    mt = config.model_type
    problems = []
    if mt == "llama" and config.attention_bias != config.attention_out_bias:
        problems.append("llama has one attention_bias for q/k/v/o: set attention_out_bias == attention_bias")
    if mt == "qwen3" and config.attention_bias != config.attention_out_bias:
        problems.append("qwen3 has one attention_bias for q/k/v/o: set attention_out_bias == attention_bias")
    if mt == "qwen2" and config.attention_out_bias:
        problems.append("qwen2 has no o_proj bias: set attention_out_bias=false")
    if mt != "llama" and config.mlp_bias:
        problems.append(f"{mt} has no mlp bias: set mlp_bias=false or model_type=llama")
    if config.qk_norm != (mt == "qwen3"):
        problems.append("q/k norm exists in qwen3 only: set qk_norm=" + ("true" if mt == "qwen3" else "false"))
    if mt == "llama" and config.sliding_window is not None:
        problems.append("llama has no sliding window: use model_type=mistral or sliding_window=null")
    if mt in ("llama", "mistral") and config.layer_types is not None and len(set(config.layer_types)) > 1:
        problems.append(f"{mt} has one attention kind for every layer: set layer_types=null or model_type=qwen2")
    problems += hf_config.foreign_options(config)
    if config.hidden_act != "silu":
        problems.append("the llama family's MLP is SwiGLU: set hidden_act=silu")
    return problems


def hf_kwargs(config: ModelConfig) -> dict:
    """transformers config arguments (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) of a ModelConfig.

    A qwen2 config without q/k/v bias is written as Qwen2 with zero biases (`qwen2_zero_biases`)."""
    mt = config.model_type
    problems = _problems(config)
    if problems:
        raise ValueError(f"model.model_type={mt!r} cannot express this config: " + "; ".join(problems))
    kwargs = dict(hf_config.common_kwargs(config), hidden_act="silu", rope_parameters=hf_config.hf_rope(config))
    if mt != "qwen2":
        kwargs["head_dim"] = config.resolved_head_dim
    elif config.head_dim is not None and config.head_dim != config.hidden_size // config.num_attention_heads:
        raise ValueError(f"model.head_dim={config.head_dim} cannot be exported as qwen2 (head_dim is always "
                         "hidden_size / num_attention_heads there): use model_type=qwen3 or llama")
    if mt in ("llama", "qwen3"):
        kwargs["attention_bias"] = config.attention_bias
    if mt == "llama":
        kwargs["mlp_bias"] = config.mlp_bias
    if mt in ("qwen2", "qwen3"):
        kwargs.update(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window,
                      max_window_layers=0, layer_types=list(config.resolved_layer_types))
    if mt == "mistral":
        kwargs["sliding_window"] = config.sliding_window
    return kwargs


def qwen2_zero_biases(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2 always has q/k/v biases: a qwen2 config without them exports zeros, which makes the export exact."""
    if config.model_type != "qwen2" or config.attention_bias:
        return []
    width = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads,
             "v_proj": config.num_key_value_heads}
    return [(f"model.layers.{i}.self_attn.{proj}.bias", (heads * config.resolved_head_dim,))
            for i in range(config.num_hidden_layers) for proj, heads in width.items()]


FAMILY = Family(architectures=ARCHITECTURES, decoder_layer=DecoderLayer, config_fields=config_fields,
                hf_kwargs=hf_kwargs, export_zeros=qwen2_zero_biases)
