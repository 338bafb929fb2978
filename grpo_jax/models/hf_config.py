"""Hugging Face ``config.json`` <-> ModelConfig for the llama, mistral, qwen2 and qwen3 families.

Reads through ``transformers.AutoConfig`` (transformers 5 keeps RoPE settings in ``rope_parameters``, older
versions in ``rope_theta`` / ``rope_scaling``: both are read). Anything the decoder cannot express exactly
(another model_type, activation, RoPE type, partial sliding window, ...) is an error naming the option and
what is supported.
"""

from __future__ import annotations

import dataclasses
import os

from grpo_jax.config.model import ROPE_TYPES, ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# fields taken from the user's config, never from config.json
_KEPT = ("path", "dtype", "param_dtype", "remat")


def _rope_fields(hf, where: str) -> dict:
    rope = getattr(hf, "rope_parameters", None)
    if not rope:  # transformers < 5
        rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters {sorted(rope)} are not supported: one RoPE "
                         f"setting for every layer, rope_type in {ROPE_TYPES}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported: supported are {ROPE_TYPES}")
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor={partial} is not supported: only 1.0 (full rotary)")
    out = {"rope_theta": float(rope["rope_theta"]), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    return out


def _sliding_window(hf, where: str) -> int | None:
    window = getattr(hf, "sliding_window", None)
    if hf.model_type in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
        window = None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None and window is not None and hf.model_type in ("qwen2", "qwen3"):  # transformers < 5
        layer_types = ["sliding_attention" if i >= hf.max_window_layers else "full_attention"
                       for i in range(hf.num_hidden_layers)]
    kinds = set(layer_types or [])
    if kinds - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{where}: layer_types {sorted(kinds)} are not supported: only full_attention and "
                         "sliding_attention")
    if kinds == {"full_attention"}:
        return None
    if len(kinds) == 2:
        sliding = [i for i, k in enumerate(layer_types) if k == "sliding_attention"]
        raise ValueError(f"{where}: sliding_window={window} on layers {sliding} only is not supported: the "
                         "window must apply to every layer or to none (use_sliding_window=false)")
    return window


def config_fields(hf, where: str = "config.json") -> dict:
    """ModelConfig field values that describe a transformers config (llama, mistral, qwen2, qwen3)."""
    mt = getattr(hf, "model_type", None)
    if mt not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {mt!r} is not supported: supported are {sorted(ARCHITECTURES)}")
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported: only 'silu' (SwiGLU MLP)")
    fields = dict(
        model_type=mt, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or None, rms_norm_eps=float(hf.rms_norm_eps),
        tie_word_embeddings=bool(hf.tie_word_embeddings), max_position_embeddings=hf.max_position_embeddings,
        initializer_range=float(getattr(hf, "initializer_range", 0.02)),
        sliding_window=_sliding_window(hf, where), **_rope_fields(hf, where))
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


def resolve_config(config: ModelConfig) -> ModelConfig:
    """Fill the architecture from ``config.path``'s config.json; no path: the config unchanged.

    ``path``, ``dtype``, ``param_dtype`` and ``remat`` stay as given. A field set to a non-default value that
    differs from config.json is an error naming both values.
    """
    if config.path is None:
        return config
    import transformers

    path = os.fspath(config.path)
    where = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"model.path={path!r} is not a folder: point it at a local Hugging Face model folder")
    if not os.path.isfile(where):
        raise ValueError(f"model.path={path!r} has no config.json: it must be a Hugging Face model folder "
                         "(config.json + model.safetensors)")
    try:
        hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{where}: transformers cannot read it ({type(e).__name__}: {e}); supported model_type: "
                         f"{sorted(ARCHITECTURES)}") from e
    fields = config_fields(hf, where)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for name, value in fields.items():
        given = getattr(config, name)
        if given != defaults[name] and given != value:
            raise ValueError(f"model.{name}={given!r} conflicts with {where} ({name}={value!r}): remove the "
                             f"override (the architecture comes from model.path) or point model.path elsewhere")
    return dataclasses.replace(config, **fields)


def to_hf_config(config: ModelConfig, **extra):
    """The transformers config (LlamaConfig, MistralConfig, Qwen2Config or Qwen3Config) of a ModelConfig.

    A qwen2 config without q/k/v bias is written as Qwen2 with zero biases (the caller writes them).
    """
    import transformers

    mt = config.model_type
    if mt not in ARCHITECTURES:
        raise ValueError(f"model.model_type={mt!r} cannot be exported: supported are {sorted(ARCHITECTURES)}")
    rope = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type in ("linear", "llama3"):
        rope["factor"] = config.rope_factor
    if config.rope_type == "llama3":
        rope.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings)
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
    if problems:
        raise ValueError(f"model.model_type={mt!r} cannot express this config: " + "; ".join(problems))
    kwargs = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, hidden_act="silu", rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range, rope_parameters=rope)
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
                      max_window_layers=0)
    if mt == "mistral":
        kwargs["sliding_window"] = config.sliding_window
    hf = transformers.AutoConfig.for_model(mt, **kwargs, **extra)
    hf.architectures = [ARCHITECTURES[mt]]
    return hf
