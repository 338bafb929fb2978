"""Decoder-only transformer of the Qwen2/Llama family in Flax NNX, used as pure functions.

Dimension letters: B rows, T query tokens, S key slots (cache length), D hidden, H query heads,
K key/value heads, G = H // K query heads per key/value head, Dh head dim, V vocab, L layers.

The module tree mirrors Hugging Face ``Qwen2ForCausalLM`` names (``embed_tokens``,
``layers[i].self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ``norm``, ``lm_head``) so a
safetensors checkpoint maps onto it by renaming ``model.`` away and transposing ``weight`` -> ``kernel``.
``init_model`` splits the module once into ``(graphdef, params)``; ``forward`` / ``unembed`` merge them
inside, so callers jit over the params pytree only.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters; names follow Hugging Face ``config.json`` (Qwen2/Llama)."""

    vocab_size: int | None = None  # None: the tokenizer's size (the trainer fills it in)
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    initializer_range: float = 0.02

    def __post_init__(self):
        names = ("vocab_size",) if self.vocab_size is not None else ()
        for name in (*names, "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads}: choose a divisor for the kv heads")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not a multiple of model.num_attention_heads="
                f"{self.num_attention_heads}: set model.head_dim explicitly or change the head count")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise ValueError(f"model.head_dim={self.head_dim!r} must be a positive integer or None")
        if self.resolved_head_dim % 2:
            raise ValueError(f"model.head_dim={self.resolved_head_dim} must be even for rotary embeddings")
        if self.dtype not in _DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r} is not supported: use one of {sorted(_DTYPES)}")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta={self.rope_theta} must be > 0")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"model.rms_norm_eps={self.rms_norm_eps} must be > 0")
        if self.initializer_range <= 0:
            raise ValueError(f"model.initializer_range={self.initializer_range} must be > 0")

    @property
    def resolved_head_dim(self) -> int:
        """Head dimension: ``head_dim`` or ``hidden_size // num_attention_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def jnp_dtype(self):
        """The parameter and compute dtype as a jnp dtype."""
        return _DTYPES[self.dtype]


class KVCache(NamedTuple):
    """Per-layer key/value buffers: k, v of shape [L, B, S, K, Dh] in the model dtype."""

    k: jax.Array
    v: jax.Array


class RMSNorm(nnx.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in float32 (as HF Qwen2RMSNorm)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def rope_cos_sin(positions_BxT, head_dim: int, theta: float):
    """Rotary tables cos, sin [B, T, Dh] in float32 (HF layout: frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    emb_BxTxDh = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)
    return jnp.cos(emb_BxTxDh), jnp.sin(emb_BxTxDh)


def apply_rope(x_BxTxHxDh, cos_BxTxDh, sin_BxTxDh):
    """x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]; computed in float32."""
    x = x_BxTxHxDh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x * cos_BxTxDh[:, :, None, :] + rotated * sin_BxTxDh[:, :, None, :]
    return out.astype(x_BxTxHxDh.dtype)


def _linear(din, dout, bias, config, rngs):
    init = nnx.initializers.normal(config.initializer_range)
    return nnx.Linear(din, dout, use_bias=bias, dtype=config.jnp_dtype, param_dtype=config.jnp_dtype,
                      kernel_init=init, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v bias and a KV cache."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D, H, K, Dh = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                       config.resolved_head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, Dh
        self.q_proj = _linear(D, H * Dh, config.attention_bias, config, rngs)
        self.k_proj = _linear(D, K * Dh, config.attention_bias, config, rngs)
        self.v_proj = _linear(D, K * Dh, config.attention_bias, config, rngs)
        self.o_proj = _linear(H * Dh, D, False, config, rngs)

    def __call__(self, x_BxTxD, cos, sin, mask_BxTxS, cache_kv, layer: int, cache_index):
        """Attend from T new tokens; with ``cache_kv`` (k, v [L,B,S,K,Dh]) write them at ``cache_index``."""
        B, T, _ = x_BxTxD.shape
        H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        q_BxTxHxDh = apply_rope(self.q_proj(x_BxTxD).reshape(B, T, H, Dh), cos, sin)
        k_BxTxKxDh = apply_rope(self.k_proj(x_BxTxD).reshape(B, T, K, Dh), cos, sin)
        v_BxTxKxDh = self.v_proj(x_BxTxD).reshape(B, T, K, Dh)
        if cache_kv is None:
            k_BxSxKxDh, v_BxSxKxDh = k_BxTxKxDh, v_BxTxKxDh
        else:
            # one in-place update of the whole [L, ...] buffer keeps the while-loop carry alias-free
            start = (layer, 0, cache_index, 0, 0)
            cache_k = jax.lax.dynamic_update_slice(cache_kv[0], k_BxTxKxDh[None].astype(cache_kv[0].dtype), start)
            cache_v = jax.lax.dynamic_update_slice(cache_kv[1], v_BxTxKxDh[None].astype(cache_kv[1].dtype), start)
            cache_kv = (cache_k, cache_v)
            k_BxSxKxDh, v_BxSxKxDh = cache_k[layer], cache_v[layer]
        q_BxTxKxGxDh = q_BxTxHxDh.reshape(B, T, K, H // K, Dh)
        scores = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxDh, k_BxSxKxDh,
                            preferred_element_type=jnp.float32) * (Dh ** -0.5)
        # a finite floor (not -inf) keeps fully masked padding queries NaN-free: they become uniform
        scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
        out_BxTxKxGxDh = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxDh)
        return self.o_proj(out_BxTxKxGxDh.reshape(B, T, H * Dh)), cache_kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(D, F, False, config, rngs)
        self.up_proj = _linear(D, F, False, config, rngs)
        self.down_proj = _linear(F, D, False, config, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = config.jnp_dtype
        self.self_attn = Attention(config, rngs)
        self.mlp = MLP(config, rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(self, x, cos, sin, mask, cache_kv, layer, cache_index):
        attn, cache_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, layer, cache_index)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache_kv


class Transformer(nnx.Module):
    """Token embedding, ``num_hidden_layers`` decoder layers, final RMSNorm and an (optionally tied) head."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        if config.vocab_size is None:
            raise ValueError("model.vocab_size is None: set it, or train through grpo_jax.trainer, which takes "
                             "it from the tokenizer")
        self.config = config
        dtype = config.jnp_dtype
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(config.initializer_range),
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, config, rngs)

    def __call__(self, input_ids_BxT, positions_BxT, attention_mask_BxS, cache=None, cache_index=0):
        """Final-normed hidden states [B, T, D] and the updated cache (see module ``forward``)."""
        T = input_ids_BxT.shape[1]
        S = attention_mask_BxS.shape[1]
        cache_index = jnp.asarray(cache_index, jnp.int32)
        if cache is None:
            if S != T:
                raise ValueError(f"without a cache attention_mask must cover the T={T} inputs, got S={S}")
            query_slot_T = jnp.arange(T)
            cache_kv = None
        else:
            query_slot_T = cache_index + jnp.arange(T)
            cache_kv = (cache.k, cache.v)
        causal_TxS = jnp.arange(S)[None, :] <= query_slot_T[:, None]
        mask_BxTxS = causal_TxS[None] & (attention_mask_BxS[:, None, :] > 0)
        cos, sin = rope_cos_sin(positions_BxT, self.config.resolved_head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids_BxT)
        for i, layer in enumerate(self.layers):
            x, cache_kv = layer(x, cos, sin, mask_BxTxS, cache_kv, i, cache_index)
        new_cache = None if cache is None else KVCache(*cache_kv)
        return self.norm(x), new_cache

    def unembed(self, hidden_BxTxD):
        """Logits [B, T, V] in the model dtype."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden_BxTxD)
        return self.lm_head(hidden_BxTxD)


def init_model(config: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Build the transformer and split it once into ``(graphdef, params)``."""
    model = Transformer(config, rngs=nnx.Rngs(seed))
    return nnx.split(model)


def init_cache(config: ModelConfig, batch_size: int, max_length: int) -> KVCache:
    """Zero KV cache of shape [L, B, max_length, K, Dh] in the model dtype."""
    shape = (config.num_hidden_layers, batch_size, max_length, config.num_key_value_heads,
             config.resolved_head_dim)
    return KVCache(jnp.zeros(shape, config.jnp_dtype), jnp.zeros(shape, config.jnp_dtype))


def model_config(graphdef: nnx.GraphDef, params: nnx.State) -> ModelConfig:
    """The ModelConfig stored (as static data) in the module tree."""
    return nnx.merge(graphdef, params).config


def forward(graphdef, params, input_ids_BxT, positions_BxT, attention_mask_BxS, cache: KVCache | None = None,
            cache_index: jax.Array | int = 0):
    """Pure forward pass: (hidden [B, T, D], updated cache or None).

    Without a cache S == T and a token attends to earlier tokens whose ``attention_mask`` is 1. With a cache
    the T new keys/values go to slots [cache_index, cache_index + T) for every row and a token at slot s
    attends to slots <= s masked by ``attention_mask_BxS`` over all S slots. ``positions_BxT`` drive RoPE
    (left padding: ``cumsum(mask) - 1`` clipped at 0).
    """
    model = nnx.merge(graphdef, params)
    return model(input_ids_BxT, positions_BxT, attention_mask_BxS, cache, cache_index)


def unembed(graphdef, params, hidden_BxTxD):
    """Logits [B, T, V] = lm_head(hidden) (or hidden @ embed_tokens^T when tied), in the model dtype."""
    return nnx.merge(graphdef, params).unembed(hidden_BxTxD)


def positions_from_mask(mask_BxT):
    """RoPE positions for a left-padded mask: cumsum(mask) - 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)
