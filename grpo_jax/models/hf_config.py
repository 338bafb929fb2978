"""Hugging Face ``config.json`` <-> ModelConfig: the pieces every family's mapping (`families.Family.config_fields`
/ ``hf_kwargs``) shares: RoPE settings, layer types, sizes and norms. `models.registry` dispatches by model_type
(`resolve_config`, `config_fields`, `to_hf_config`).

Reads through ``transformers.AutoConfig`` (transformers 5 keeps RoPE settings in ``rope_parameters``, older
versions in ``rope_theta`` / ``rope_scaling``: both are read). Anything the decoder cannot express exactly
(another model_type, activation, RoPE type, ...) is an error naming the option and what is supported.
"""

from __future__ import annotations

from grpo_jax.config.model import LAYER_TYPES, ROPE_TYPES, ModelConfig


def rope_parameters(hf) -> dict:
    """The RoPE settings of a transformers config as one dict (transformers 5's ``rope_parameters``, or < 5's
    ``rope_scaling`` plus ``rope_theta``); per-layer-type settings stay nested under the layer type."""
    rope = getattr(hf, "rope_parameters", None)
    if not rope:  # transformers < 5
        rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return dict(rope)


def rope_fields(rope: dict, hf, where: str, partial: bool = False) -> dict:
    """ModelConfig RoPE fields of one flat RoPE setting (``rope_type``, ``rope_theta``, ``factor``, ...);
    ``partial``: the family reads ``partial_rotary_factor`` itself (GLM-4-MoE), else it must be 1."""
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters {sorted(rope)} are not supported for "
                         f"model_type {hf.model_type!r}: one RoPE setting for every layer, rope_type in {ROPE_TYPES}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported: supported are {ROPE_TYPES}")
    factor = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if not partial and factor not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor={factor} is not supported for model_type "
                         f"{hf.model_type!r}: only 1.0 (full rotary)")
    out = {"rope_theta": float(rope["rope_theta"]), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    if rope_type == "yarn":
        out.update(_yarn_fields(rope, hf, where))
    return out


def _yarn_fields(rope: dict, hf, where: str) -> dict:
    """ModelConfig fields of a yarn ``rope_parameters``, with transformers' defaults; DeepSeek's mscale options
    (which also rescale the non-rotary dims) are refused."""
    for name in ("mscale", "mscale_all_dim"):
        if rope.get(name):
            raise ValueError(f"{where}: rope_parameters {name}={rope[name]} is not supported: only YaRN's default "
                             "attention factor or an explicit attention_factor")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    attention_factor = rope.get("attention_factor")
    return dict(rope_factor=float(hf.max_position_embeddings / original if factor is None else factor),
                rope_original_max_position_embeddings=original,
                rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                rope_truncate=bool(rope.get("truncate", True)),
                rope_attention_factor=None if attention_factor is None else float(attention_factor))


def hf_rope(config: ModelConfig) -> dict:
    """transformers' flat ``rope_parameters`` of the config's (full-attention) RoPE."""
    rope = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type in ("linear", "llama3"):
        rope["factor"] = config.rope_factor
    if config.rope_type == "llama3":
        rope.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings)
    if config.rope_type == "yarn":
        rope.update(factor=config.rope_factor, beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                    original_max_position_embeddings=config.rope_original_max_position_embeddings,
                    truncate=config.rope_truncate)
        if config.rope_attention_factor is not None:
            rope["attention_factor"] = config.rope_attention_factor
    return rope


def check_layer_types(layer_types, where: str) -> None:
    """An error naming the kinds other than full_attention and sliding_attention."""
    kinds = set(layer_types or [])
    if kinds - set(LAYER_TYPES):
        raise ValueError(f"{where}: layer_types {sorted(kinds)} are not supported: only {' and '.join(LAYER_TYPES)}")


# ModelConfig options of some families only: option -> (those families' name, the model_type to use instead)
FAMILY_OPTIONS = {"rope_local_base_freq": ("Gemma", "a gemma model_type"),
                  "query_pre_attn_scalar": ("Gemma", "a gemma model_type"),
                  "attn_logit_softcapping": ("Gemma", "a gemma model_type"),
                  "final_logit_softcapping": ("Gemma", "a gemma model_type"),
                  "logit_scale": ("Cohere", "model_type=cohere2"),
                  "attention_sinks": ("GPT-OSS", "model_type=gpt_oss")}


def foreign_options(config: ModelConfig, family: str | None = None) -> list[str]:
    """One problem per option of another family than ``family`` (a `FAMILY_OPTIONS` name) set in ``config`` (not
    null or false): what this family's export cannot express."""
    off = lambda name: "false" if isinstance(getattr(config, name), bool) else "null"  # noqa: E731
    return [f"{name} is a {owner} option: set {name}={off(name)} or {instead}"
            for name, (owner, instead) in FAMILY_OPTIONS.items()
            if owner != family and getattr(config, name) not in (None, False)]


def common_fields(hf, where: str, eps_name: str = "rms_norm_eps") -> dict:
    """The ModelConfig fields every family reads alike (sizes, norms, embeddings); the norms' epsilon is
    ``eps_name`` of config.json (Cohere's LayerNorm: layer_norm_eps)."""
    return dict(
        model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or None, rms_norm_eps=float(getattr(hf, eps_name)),
        tie_word_embeddings=bool(hf.tie_word_embeddings), max_position_embeddings=hf.max_position_embeddings,
        initializer_range=float(getattr(hf, "initializer_range", 0.02)))


def common_kwargs(config: ModelConfig) -> dict:
    """transformers config arguments every family writes alike."""
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range)
