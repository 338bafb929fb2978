"""The pieces every decoder family builds its layers from: RMSNorm (Cohere: LayerNorm), linear layers (LoRA where
configured), grouped-query attention with RoPE and a KV cache, the gated MLP and the cache itself.

Dimension letters: B rows, T query tokens, S key slots (cache length), D hidden, H query heads, K key/value heads,
G = H // K query heads per key/value head, Dh head dim, F MLP width. Kernels are [in, out], the Hugging Face
``weight`` transposed; module names are Hugging Face's, so weight names map one to one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import attention, paged
from grpo_jax.models.attention import attention_scores  # noqa: F401  (re-exported)
from grpo_jax.models.lora import LoRALinear
from grpo_jax.models.positional import apply_rope

# hidden_act -> the function (transformers' ACT2FN names)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class KVCache(NamedTuple):
    """Key/value buffers, one per layer: k, v are L-tuples of [B, K, S, Dh] arrays in the compute dtype.

    Separate arrays, not one [L, ...] stack: a decode step then updates and reads each layer's buffer in place
    (slicing a layer out of a stack copies it, every step)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


class RMSNorm(nnx.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in float32 (as HF Qwen2RMSNorm).

    ``offset`` (Gemma): y = (1 + weight) * x / sqrt(...), the product too in float32 before the cast (as HF
    Gemma3RMSNorm), the weight initialised to 0. ``f32_scale`` (GPT-OSS, as HF Olmo2RMSNorm): weight * x in
    float32, then the cast."""

    def __init__(self, dim: int, config: ModelConfig, offset: bool = False, f32_scale: bool = False):
        self.weight = nnx.Param((jnp.zeros if offset else jnp.ones)((dim,), config.param_jnp_dtype))
        self.eps = config.rms_norm_eps
        self.dtype = config.jnp_dtype
        self.offset = offset
        self.f32_scale = f32_scale

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset or self.f32_scale:
            return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


class LayerNorm(nnx.Module):
    """y = weight * (x - mean(x)) / sqrt(var(x) + eps) without a bias, statistics and product in float32, then cast
    (as HF Cohere2LayerNorm); eps is ``rms_norm_eps`` (config.json's ``layer_norm_eps``)."""

    def __init__(self, dim: int, config: ModelConfig):
        self.weight = nnx.Param(jnp.ones((dim,), config.param_jnp_dtype))
        self.eps = config.rms_norm_eps
        self.dtype = config.jnp_dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        x32 = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * x32).astype(self.dtype)


def linear(din, dout, bias, config, rngs, name=None):
    """The layer ``name`` (PEFT's name): a `LoRALinear` when ``config.lora`` targets it, else ``nnx.Linear``."""
    kwargs = {"use_bias": bias, "dtype": config.jnp_dtype, "param_dtype": config.param_jnp_dtype,
              "kernel_init": nnx.initializers.normal(config.initializer_range), "rngs": rngs}
    if config.lora.enabled and name in config.lora.targets:
        return LoRALinear(din, dout, lora=config.lora, **kwargs)
    return nnx.Linear(din, dout, **kwargs)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v/o biases, q/k norms, query scaling, score
    soft-capping, attention sinks (``config.attention_sinks``: a learned logit per query head in every softmax,
    GPT-OSS's ``sinks``) and a KV cache."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, *, bias: bool, out_bias: bool, qk_norm: bool,
                 norm_offset: bool = False, query_scalar: float | None = None, softcap: float | None = None,
                 rope_interleaved: bool = False):
        D, H, K, Dh = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                       config.resolved_head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, Dh
        self.q_proj = linear(D, H * Dh, bias, config, rngs, "q_proj")
        self.k_proj = linear(D, K * Dh, bias, config, rngs, "k_proj")
        self.v_proj = linear(D, K * Dh, bias, config, rngs, "v_proj")
        self.o_proj = linear(H * Dh, D, out_bias, config, rngs, "o_proj")
        if qk_norm:
            self.q_norm = RMSNorm(Dh, config, norm_offset)
            self.k_norm = RMSNorm(Dh, config, norm_offset)
        self.qk_norm = qk_norm
        if config.attention_sinks:
            self.sinks = nnx.Param(nnx.initializers.normal(config.initializer_range)(rngs.params(), (H,),
                                                                                     config.param_jnp_dtype))
        self.has_sinks = config.attention_sinks
        self.scale = (Dh if query_scalar is None else query_scalar) ** -0.5
        self.softcap = softcap
        self.rope_interleaved = rope_interleaved  # RoPE on pairs (2i, 2i + 1) (Cohere), not halves
        self.backend = config.attention  # `attention.resolve`d at trace time, by the backend it is traced for
        # ``attend(q [B,T,K,G,Dh], k, v [B,K,T,Dh], mask [B,T,T], scale, softcap) -> [B,K,G,T,Dh] or None`` for
        # whole masks (packed layouts) on the CPU, set by `grpo_jax.device.cpu.packed_attention`; None: dense
        self.attend_whole_mask = None

    def __call__(self, x_BxTxD, cos, sin, mask_BxTxS, cache_kv, cache_index, prefix_kv=None,
                 prefix_group_size: int = 1, whole_mask: bool = False):
        """Attend from T new tokens; with ``cache_kv`` (this layer's k, v [B,K,S,Dh]) write them at cache_index,
        or with a `paged.LayerPages` at its row positions (``mask_BxTxS`` None there: a decode kernel reads the pages).

        ``prefix_kv`` (k, v [R,K,P,Dh], R = B / ``prefix_group_size``): this layer's keys/values of a prefix
        shared by each group of rows, attended before the T new tokens (S = P + T). ``whole_mask``: the mask was
        given whole ([B, T, T], no cache, no prefix). ``mask_BxTxS`` may instead be an `attention.Visibility`
        (a kernel backend's training forward, `models.transformer`). Returns (out, cache_kv, the new tokens'
        (k, v) [B,K,T,Dh])."""
        B, T, _ = x_BxTxD.shape
        H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        x_NxD = x_BxTxD.reshape(B * T, -1)
        q_BxTxHxDh = self.q_proj(x_NxD).reshape(B, T, H, Dh)
        k_BxTxKxDh = self.k_proj(x_NxD).reshape(B, T, K, Dh)
        v_BxTxKxDh = self.v_proj(x_NxD).reshape(B, T, K, Dh)
        if self.qk_norm:
            q_BxTxHxDh, k_BxTxKxDh = self.q_norm(q_BxTxHxDh), self.k_norm(k_BxTxKxDh)
        q_BxTxHxDh = apply_rope(q_BxTxHxDh, cos, sin, self.rope_interleaved)
        k_BxTxKxDh = apply_rope(k_BxTxKxDh, cos, sin, self.rope_interleaved)
        # keys/values kv-head-major [B, K, S, Dh]: the cache keeps this layout, so a decode step's attention
        # dots read it in place (a [B, S, K, Dh] cache was transposed, i.e. copied whole, every step and layer)
        k_BxKxTxDh, v_BxKxTxDh = k_BxTxKxDh.transpose(0, 2, 1, 3), v_BxTxKxDh.transpose(0, 2, 1, 3)
        if cache_kv is None:
            k_BxKxSxDh, v_BxKxSxDh = k_BxKxTxDh, v_BxKxTxDh
            if prefix_kv is not None:  # repeat's gradient sums each group's rows back into its one prefix
                k_BxKxSxDh, v_BxKxSxDh = (
                    jnp.concatenate([jnp.repeat(p.astype(new.dtype), prefix_group_size, axis=0), new], axis=2)
                    for p, new in zip(prefix_kv, (k_BxKxTxDh, v_BxKxTxDh)))
        elif isinstance(cache_kv, paged.LayerPages) and isinstance(cache_kv.k, paged.Ring):  # a window's ring
            pages = cache_kv.cache
            cache_kv = tuple(paged.ring_write(ring, pages.write_NxA, new)
                             for ring, new in zip(cache_kv[:2], (k_BxKxTxDh, v_BxKxTxDh)))
            k_BxKxSxDh, v_BxKxSxDh = (ring.buf for ring in cache_kv)
            mask_BxTxS = paged.ring_mask(pages.write_NxA, cache_kv[0])  # its entries' positions, not slots
        elif isinstance(cache_kv, paged.LayerPages):  # a paged cache: write into pages, read them back
            pages = cache_kv.cache
            cache_kv = tuple(paged.write(pool, pages.pages_NxQ, pages.write_NxA, new)
                             for pool, new in zip(cache_kv[:2], (k_BxKxTxDh, v_BxKxTxDh)))
            if mask_BxTxS is None:  # a decode kernel (`models.transformer`): each row's tokens [0, length)
                out_BxKxGxTxDh = paged.attend(
                    q_BxTxHxDh.reshape(B, T, K, H // K, Dh), *cache_kv, pages.pages_NxQ, pages.length_N,
                    scale=self.scale, softcap=self.softcap, backend=attention.resolve(self.backend))
                return self._out(out_BxKxGxTxDh), cache_kv, (k_BxKxTxDh, v_BxKxTxDh)
            k_BxKxSxDh, v_BxKxSxDh = (paged.gather(pool, pages.pages_NxQ, pages.view_NxS) for pool in cache_kv)
        elif cache_index.ndim == 1:  # a slot of its own per row (continuous batching): a scatter
            write = jax.vmap(lambda c_KxSxDh, new_KxTxDh, i: jax.lax.dynamic_update_slice(c_KxSxDh, new_KxTxDh,
                                                                                         (0, i, 0)))
            cache_kv = tuple(write(c, new.astype(c.dtype), cache_index)
                             for c, new in zip(cache_kv, (k_BxKxTxDh, v_BxKxTxDh)))
            k_BxKxSxDh, v_BxKxSxDh = cache_kv
        else:
            start = (0, 0, cache_index, 0)
            cache_kv = tuple(jax.lax.dynamic_update_slice(c, new.astype(c.dtype), start)
                             for c, new in zip(cache_kv, (k_BxKxTxDh, v_BxKxTxDh)))
            k_BxKxSxDh, v_BxKxSxDh = cache_kv
        q_BxTxKxGxDh = q_BxTxHxDh.reshape(B, T, K, H // K, Dh)
        # query head h = k * G + g attends with key/value head k (transformers' repeat_kv), and so reads sink h
        sinks_KxG = self.sinks[...].reshape(K, H // K) if self.has_sinks else None
        out_BxKxGxTxDh = attention.attend(q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask_BxTxS, scale=self.scale,
                                          softcap=self.softcap, backend=attention.resolve(self.backend),
                                          whole_mask=whole_mask, whole_mask_hook=self.attend_whole_mask,
                                          sinks_KxG=sinks_KxG)
        return self._out(out_BxKxGxTxDh), cache_kv, (k_BxKxTxDh, v_BxKxTxDh)

    def _out(self, out_BxKxGxTxDh):
        """The heads' outputs [B, K, G, T, Dh] through o_proj -> [B, T, D]."""
        B, K, G, T, Dh = out_BxKxGxTxDh.shape
        out_BxTxKxGxDh = out_BxKxGxTxDh.transpose(0, 3, 1, 2, 4)
        return self.o_proj(out_BxTxKxGxDh.reshape(B * T, K * G * Dh)).reshape(B, T, -1)


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_pytorch_tanh."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, *, bias: bool = False, width: int | None = None):
        D, F = config.hidden_size, config.intermediate_size if width is None else width
        self.gate_proj = linear(D, F, bias, config, rngs, "gate_proj")
        self.up_proj = linear(D, F, bias, config, rngs, "up_proj")
        self.down_proj = linear(F, D, bias, config, rngs, "down_proj")
        self.act = config.hidden_act

    def __call__(self, x_BxTxD):
        # 2-D matmuls: XLA:CPU runs the weight gradient of a [B, T, D] dense (two contracting dims) ~2x slower
        x_NxD = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])
        out_NxD = self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x_NxD)) * self.up_proj(x_NxD))
        return out_NxD.reshape(x_BxTxD.shape)


class DecoderLayer(nnx.Module):
    """The pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), with the config's biases and q/k norm (the
    Llama family's layer, and GLM-4-MoE's dense ones)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.self_attn = Attention(config, rngs, bias=config.attention_bias, out_bias=config.attention_out_bias,
                                   qk_norm=config.qk_norm)
        self.mlp = MLP(config, rngs, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config)

    def __call__(self, x, cos, sin, mask, cache_kv, cache_index, prefix_kv=None, prefix_group_size=1,
                 whole_mask=False):
        attn, cache_kv, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, cache_index,
                                                prefix_kv, prefix_group_size, whole_mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache_kv, new_kv
