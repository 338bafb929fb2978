"""LoRA (Hu et al., arXiv 2106.09685) on the decoder's linear layers: y = x W + b + (alpha / r) (x A) B.

`LoRALinear` is ``nnx.Linear`` (same ``kernel`` and ``bias``, so the base keeps its paths, Hugging Face names and
sharding rules) plus ``lora_a`` [in, r] and ``lora_b`` [r, out] as ``nnx.LoRAParam``; stacked over the layers
they are [L, in, r] and [L, r, out]. The variable type is the split: `split_trainable` separates the adapters
(trained) from the base (frozen) in any params pytree, and `base_params` is the base with the adapters off,
which is the reference policy. Initialisation and scaling follow PEFT's ``LoraConfig``: A Kaiming-uniform
(bound 1/sqrt(in), PyTorch's ``nn.Linear`` default) or Gaussian (std 1/r), B zero, scale alpha / r.

Dropout (PEFT's ``lora_dropout`` p) acts on the adapter's input only, x W + b + scale * ((dropout(x) A) B), and only
in a forward that `with_dropout` gave a key: the update's (TRL's train-mode loss forward). Sampling, the old and
reference log-probs and evaluation run without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config.model import LoRAConfig, ModelConfig

# PyTorch's nn.Linear init, which PEFT uses for A: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
_KAIMING_A = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def _initializers(lora: LoRAConfig):
    """(A init, B init) of PEFT's ``init_lora_weights``: true, "gaussian", or false (B like A: not zero)."""
    if lora.init_lora_weights == "gaussian":
        return nnx.initializers.normal(1.0 / lora.rank), nnx.initializers.zeros_init()
    if lora.init_lora_weights is False:
        return _KAIMING_A, _KAIMING_A
    return _KAIMING_A, nnx.initializers.zeros_init()


class LoRADropoutKey(nnx.Variable):
    """A LoRA layer's dropout key ([2], or [L, 2] for stacked layers): set by `with_dropout` for one forward."""


def dropout_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Keep-mask of inverted dropout: True with probability 1 - ``rate``, one draw per element of ``shape``."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


class LoRALinear(nnx.Linear):
    """``nnx.Linear`` plus a rank-r update in the compute dtype: x W + b + scale * ((x A) B).

    A and B are drawn from the ``lora`` stream of ``rngs``, so a model's base weights are those of the same seed
    without adapters. They are stored in float32 whatever ``param_dtype`` (PEFT's ``autocast_adapter_dtype``).
    """

    def __init__(self, in_features: int, out_features: int, *, lora: LoRAConfig, rngs: nnx.Rngs, **kwargs):
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        a_init, b_init = _initializers(lora)
        self.lora_a = nnx.LoRAParam(a_init(rngs.lora(), (in_features, lora.rank), jnp.float32))
        # fan-in of B is r (PyTorch's layout [out, r]); flax's initializer takes it from the first dim here too
        self.lora_b = nnx.LoRAParam(b_init(rngs.lora(), (lora.rank, out_features), jnp.float32))
        self.lora_scale = lora.scale
        self.dropout = lora.dropout  # its `LoRADropoutKey` (dropout_key) exists only in a `with_dropout` forward
        self.adapters_on = True  # static: `adapters_off` makes a graphdef of the base model (the reference)

    def __call__(self, x, out_sharding=None):
        y = super().__call__(x, out_sharding=out_sharding)
        if not self.adapters_on:
            return y
        dtype = y.dtype
        a, b = self.lora_a[...].astype(dtype), self.lora_b[...].astype(dtype)
        x = x.astype(dtype)
        if hasattr(self, "dropout_key"):  # PEFT's nn.Dropout in train mode: zero with prob p, scale by 1 / (1 - p)
            keep = dropout_mask(self.dropout_key[...], x.shape, self.dropout)
            x = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, dtype), jnp.zeros((), dtype))
        return y + ((x @ a) @ b) * jnp.asarray(self.lora_scale, dtype)


def adapters_off(graphdef: nnx.GraphDef, params: Any) -> nnx.GraphDef:
    """``graphdef`` whose LoRA layers skip their adapters: with the same params, the frozen base model (the
    reference policy), without a copy of its weights and without the adapters' FLOPs. ``params`` may be abstract
    (shapes or shardings)."""
    model = nnx.merge(graphdef, params)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, LoRALinear):
            module.adapters_on = False
    return nnx.split(model)[0]


def _dropout_layers(model) -> list[LoRALinear]:
    """The model's LoRA layers with their adapters on and a dropout rate > 0, in graph order."""
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, LoRALinear) and m.adapters_on and m.dropout > 0]


def has_dropout(graphdef: nnx.GraphDef, params: Any) -> bool:
    """Whether the model has LoRA layers with dropout (``params`` may be abstract)."""
    return bool(_dropout_layers(nnx.merge(graphdef, params)))


def with_dropout(graphdef: nnx.GraphDef, params: nnx.State, key: jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of the same model with LoRA dropout on, drawn from ``key``: each dropout layer gets its
    own key (stacked layers one per layer, so each layer of a scan draws its own mask); unchanged without dropout.

    Use inside the jitted update, once per forward, with a key from the train state (resume replays it)."""
    model = nnx.merge(graphdef, params)
    layers = _dropout_layers(model)
    if not layers:
        return graphdef, params
    for i, module in enumerate(layers):
        layer_key = jax.random.fold_in(key, i)
        stacked = module.lora_a[...].ndim == 3  # [L, in, r]: the decoder's layers, vmapped at construction
        module.dropout_key = LoRADropoutKey(jax.random.split(layer_key, module.lora_a[...].shape[0]) if stacked
                                            else layer_key)
    return nnx.split(model)


def base_config(config: ModelConfig) -> ModelConfig:
    """The config without adapters: the frozen base's architecture."""
    return dataclasses.replace(config, lora=LoRAConfig())


def has_adapters(params: Any) -> bool:
    """Whether a params state holds LoRA adapters."""
    return len(jax.tree.leaves(nnx.filter_state(params, nnx.LoRAParam))) > 0


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(trainable, frozen): (adapters, base) when ``params`` holds adapters, else (params, None).

    The train step differentiates and the optimizer updates the trainable part only; `join` puts them back.
    """
    if not has_adapters(params):
        return params, None
    return nnx.split_state(params, nnx.LoRAParam, ...)


def join(trainable: nnx.State, frozen: nnx.State | None) -> nnx.State:
    """The params state `split_trainable` split."""
    return trainable if frozen is None else nnx.merge_state(frozen, trainable)


def base_params(params: nnx.State) -> nnx.State:
    """The base of a params state with adapters: the model with the adapters off (the reference policy)."""
    return nnx.split_state(params, nnx.LoRAParam, ...)[1]


def merged_params(config: ModelConfig, params: nnx.State) -> nnx.State:
    """``params`` with every adapted kernel replaced by W + scale * A B (summed in float32, stored in W's dtype).

    PEFT's ``merge_and_unload``: run with `adapters_off` (or, after `base_params`, the base graphdef) they give
    the logits of the model with adapters, up to rounding.
    """
    pairs = nnx.to_pure_dict(nnx.filter_state(params, nnx.LoRAParam))  # {stack: {block: {module: {lora_a, _b}}}}

    def merge(path, w):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        ab = pairs
        for key in keys[:-1] if keys[-1] == "kernel" else ():  # the kernel's module, where its adapters sit
            ab = ab.get(key, {}) if isinstance(ab, dict) else {}
        if not isinstance(ab, dict) or "lora_a" not in ab:
            return w
        delta = jnp.einsum("...ir,...ro->...io", ab["lora_a"], ab["lora_b"], preferred_element_type=jnp.float32)
        return (w.astype(jnp.float32) + config.lora.scale * delta).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(merge, params)


def merged(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """The same model as ``(graphdef, params)`` with the adapters merged into the kernels (`merged_params`) and
    skipped (`adapters_off`): one product per layer, as the base model runs. What sampling runs, once per call."""
    config = nnx.merge(graphdef, params).config
    return adapters_off(graphdef, params), merged_params(config, params)
