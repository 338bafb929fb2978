"""A model family is a module (`models.llama`, `models.gemma`) that fills one `Family`: its decoder layer, what
the generic driver (`models.transformer`) does differently for it, its config.json mapping and its weight names.

Adding a family: write ``models/<family>.py`` with a decoder layer built from `models.layers` (its call takes
``(x, cos, sin, mask, cache_kv, cache_index, prefix_kv, prefix_group_size, whole_mask)`` and returns
``(x, cache_kv, new_kv)``, as `models.layers.DecoderLayer`), ``config_fields`` and ``hf_kwargs``; list its
model types in `grpo_jax.config.model.MODEL_TYPES` and its ``FAMILY`` in `models.transformer.FAMILIES`. Sampling,
log-probs and the losses see only `models.transformer`'s functions and need nothing.

Per-layer attention kinds are transformers' ``layer_types`` (full_attention, sliding_attention): each kind has its
window (`kind_window`) and its RoPE (`positional.rope_inv_freq`); a forward builds one mask and one RoPE table per
kind and each layer uses its kind's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from grpo_jax.config.model import BUFFERS, ModelConfig


def hf_names(path: str, config: ModelConfig) -> tuple[list[str], int, bool]:
    """(Hugging Face tensor names, how many leading axes of ours they are stacked over, transposed) for one of our
    parameter paths: module names are transformers' under ``model.``; ``layers.<m>`` [L, ...] is
    ``model.layers.<i>.<m>`` for the layers i of the stack (`stack_layers`). A stack over several axes lists its
    names row-major."""
    *module, leaf = path.split(".")
    hf_leaf = "weight" if leaf in ("kernel", "embedding") else leaf
    transposed = leaf == "kernel"
    if module[0] == "lm_head":
        return [f"lm_head.{hf_leaf}"], 0, transposed
    if module[0] in STACKS:
        inner = ".".join(module[1:])
        return [f"model.layers.{i}.{inner}.{hf_leaf}" for i in stack_layers(module[0], config)], 1, transposed
    return [f"model.{'.'.join(module)}.{hf_leaf}"], 0, transposed


# the stacks of decoder layers a model holds: ``dense_layers`` (the first ``first_k_dense_replace``, GLM-4-MoE's
# dense-MLP layers before its routed ones) and ``layers`` (the rest: every layer of every other family)
STACKS = ("dense_layers", "layers")


def stack_layers(stack: str, config: ModelConfig) -> range:
    """The decoder layer indices (transformers' ``model.layers.<i>``) a stack holds, in order."""
    k = config.first_k_dense_replace
    return range(k) if stack == "dense_layers" else range(k, config.num_hidden_layers)


def without_buffers(updates):
    """Optimizer updates with the `BUFFERS`' zeroed (AdamW's weight decay would move them)."""
    def zero(path, u):
        return jax.numpy.zeros_like(u) if any(getattr(k, "key", None) in BUFFERS for k in path) else u
    return jax.tree_util.tree_map_with_path(zero, updates)


@dataclasses.dataclass(frozen=True)
class Family:
    """What one family of decoders needs beyond the shared driver."""

    architectures: dict[str, str]  # model_type -> transformers' *ForCausalLM class name
    decoder_layer: type  # nnx.Module built as ``decoder_layer(config, rngs)``
    config_fields: Callable[[Any, str], dict]  # (transformers config, where) -> ModelConfig field values
    hf_kwargs: Callable[[ModelConfig], dict]  # ModelConfig -> transformers.AutoConfig.for_model arguments
    norm_offset: bool = False  # RMSNorms scale by (1 + weight) (Gemma)
    norm_f32_scale: bool = False  # the final RMSNorm scales in float32 before the cast (GPT-OSS)
    layer_norm: bool = False  # the final norm is a bias-free LayerNorm, not an RMSNorm (Cohere)
    # the attention kinds whose layers apply RoPE; None: every kind (Cohere 2: sliding layers only, full ones NoPE)
    rope_kinds: tuple[str, ...] | None = None
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) in the compute dtype (Gemma)
    # ModelConfig -> [(name, shape)]: tensors transformers' class always has that this config does not (written
    # as zeros on export)
    export_zeros: Callable[[ModelConfig], list] | None = None
    # (our parameter path, config) -> (Hugging Face names, leading axes stacked, transposed)
    hf_names: Callable[[str, ModelConfig], tuple[list[str], int, bool]] = hf_names
    # mixture of experts: the decoder layer takes ``routing=`` (experts to replay [B, T, K], or None) and returns a
    # fourth output, (router logits [B, T, E], chosen experts [B, T, K])
    routed: bool = False
    # dotted path suffixes of parameters their layers compute with in float32 whatever the compute dtype, which
    # `transformer.compute_dtype_params` leaves wide (GLM-4-MoE's router, as transformers keeps it)
    float32_params: tuple[str, ...] = ()
    # the first ``config.first_k_dense_replace`` layers' module (GLM-4-MoE's dense ones, `layers.DecoderLayer`);
    # None: every layer is a ``decoder_layer``
    dense_layer: type | None = None


def layer_kinds(config: ModelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(the distinct attention kinds in order of first use, each layer's index into them)."""
    types = config.resolved_layer_types
    kinds = tuple(dict.fromkeys(types))
    return kinds, tuple(kinds.index(t) for t in types)


def kind_window(config: ModelConfig, kind: str) -> int | None:
    """The sliding window of a layer kind: ``sliding_window`` for sliding_attention, None for full_attention."""
    return config.sliding_window if kind == "sliding_attention" else None
