"""Decoder-only transformer of the Qwen2/Qwen3/Llama/Mistral families in Flax NNX, used as pure functions.

Dimension letters: B rows, T query tokens, S key slots (cache length), D hidden, H query heads,
K key/value heads, G = H // K query heads per key/value head, Dh head dim, F MLP width, V vocab, L layers.

The module tree mirrors Hugging Face names (``embed_tokens``, ``layers.self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ``norm``, ``lm_head``) with every decoder layer STACKED on a leading L axis
(``layers.self_attn.q_proj.kernel`` is [L, D, H*Dh]). The training forward runs them as a Python loop over
per-layer slices (or, with ``scan_layers``, one ``jax.lax.scan`` whose compile time does not grow with depth);
decoding with a KV cache runs them one by one from per-layer slices taken once per decode loop. Kernels are
[in, out], the Hugging Face ``weight`` transposed. ``init_model`` splits the module once into
``(graphdef, params)``; ``forward`` / ``unembed`` merge them inside, so callers jit over the params pytree only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config.model import ModelConfig  # noqa: F401  (re-exported)
from grpo_jax.config.sections import check
from grpo_jax.models.lora import LoRALinear
from grpo_jax.models.positional import (  # noqa: F401  (positions_from_mask: re-exported)
    apply_rope,
    attention_mask,
    positions_from_mask,
    rope_cos_sin,
    rope_inv_freq,
    rope_tables,
)


# model.remat: what each decoder layer's backward pass keeps (None: everything, no rematerialisation)
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

class KVCache(NamedTuple):
    """Key/value buffers, one per layer: k, v are L-tuples of [B, K, S, Dh] arrays in the compute dtype.

    Separate arrays, not one [L, ...] stack: a decode step then updates and reads each layer's buffer in place
    (slicing a layer out of a stack copies it, every step)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


class RMSNorm(nnx.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), statistics in float32 (as HF Qwen2RMSNorm)."""

    def __init__(self, dim: int, config: ModelConfig):
        self.weight = nnx.Param(jnp.ones((dim,), config.param_jnp_dtype))
        self.eps = config.rms_norm_eps
        self.dtype = config.jnp_dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


def _linear(din, dout, bias, config, rngs, name=None):
    """The layer ``name`` (PEFT's name): a `LoRALinear` when ``config.lora`` targets it, else ``nnx.Linear``."""
    kwargs = {"use_bias": bias, "dtype": config.jnp_dtype, "param_dtype": config.param_jnp_dtype,
              "kernel_init": nnx.initializers.normal(config.initializer_range), "rngs": rngs}
    if config.lora.enabled and name in config.lora.targets:
        return LoRALinear(din, dout, lora=config.lora, **kwargs)
    return nnx.Linear(din, dout, **kwargs)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v/o biases, q/k norms and a KV cache."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D, H, K, Dh = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                       config.resolved_head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, Dh
        self.q_proj = _linear(D, H * Dh, config.attention_bias, config, rngs, "q_proj")
        self.k_proj = _linear(D, K * Dh, config.attention_bias, config, rngs, "k_proj")
        self.v_proj = _linear(D, K * Dh, config.attention_bias, config, rngs, "v_proj")
        self.o_proj = _linear(H * Dh, D, config.attention_out_bias, config, rngs, "o_proj")
        if config.qk_norm:
            self.q_norm = RMSNorm(Dh, config)
            self.k_norm = RMSNorm(Dh, config)
        self.qk_norm = config.qk_norm
        # ``attend(q [B,T,K,G,Dh], k, v [B,K,T,Dh], mask [B,T,T]) -> [B,K,G,T,Dh] or None`` for whole masks (packed
        # layouts), set by `grpo_jax.cpu.packed_attention`; None: the dense softmax below
        self.attend_whole_mask = None

    def __call__(self, x_BxTxD, cos, sin, mask_BxTxS, cache_kv, cache_index, prefix_kv=None,
                 prefix_group_size: int = 1, whole_mask: bool = False):
        """Attend from T new tokens; with ``cache_kv`` (this layer's k, v [B,K,S,Dh]) write them at cache_index.

        ``prefix_kv`` (k, v [R,K,P,Dh], R = B / ``prefix_group_size``): this layer's keys/values of a prefix
        shared by each group of rows, attended before the T new tokens (S = P + T). ``whole_mask``: the mask was
        given whole ([B, T, T], no cache, no prefix). Returns (out, cache_kv, the new tokens' (k, v) [B,K,T,Dh])."""
        B, T, _ = x_BxTxD.shape
        H, K, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        x_NxD = x_BxTxD.reshape(B * T, -1)
        q_BxTxHxDh = self.q_proj(x_NxD).reshape(B, T, H, Dh)
        k_BxTxKxDh = self.k_proj(x_NxD).reshape(B, T, K, Dh)
        v_BxTxKxDh = self.v_proj(x_NxD).reshape(B, T, K, Dh)
        if self.qk_norm:
            q_BxTxHxDh, k_BxTxKxDh = self.q_norm(q_BxTxHxDh), self.k_norm(k_BxTxKxDh)
        q_BxTxHxDh = apply_rope(q_BxTxHxDh, cos, sin)
        k_BxTxKxDh = apply_rope(k_BxTxKxDh, cos, sin)
        # keys/values kv-head-major [B, K, S, Dh]: the cache keeps this layout, so a decode step's attention
        # dots read it in place (a [B, S, K, Dh] cache was transposed, i.e. copied whole, every step and layer)
        k_BxKxTxDh, v_BxKxTxDh = k_BxTxKxDh.transpose(0, 2, 1, 3), v_BxTxKxDh.transpose(0, 2, 1, 3)
        if cache_kv is None:
            k_BxKxSxDh, v_BxKxSxDh = k_BxKxTxDh, v_BxKxTxDh
            if prefix_kv is not None:  # repeat's gradient sums each group's rows back into its one prefix
                k_BxKxSxDh, v_BxKxSxDh = (
                    jnp.concatenate([jnp.repeat(p.astype(new.dtype), prefix_group_size, axis=0), new], axis=2)
                    for p, new in zip(prefix_kv, (k_BxKxTxDh, v_BxKxTxDh)))
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
        out_BxKxGxTxDh = None
        if whole_mask and self.attend_whole_mask is not None:
            out_BxKxGxTxDh = self.attend_whole_mask(q_BxTxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, mask_BxTxS)
        if out_BxKxGxTxDh is None:
            scores = jnp.einsum("btkgd,bksd->bkgts", q_BxTxKxGxDh, k_BxKxSxDh,
                                preferred_element_type=jnp.float32) * (Dh ** -0.5)
            # a finite floor (not -inf) keeps fully masked padding queries NaN-free: they become uniform
            scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxDh.dtype)
            out_BxKxGxTxDh = jnp.einsum("bkgts,bksd->bkgtd", probs, v_BxKxSxDh)
        out_BxTxKxGxDh = out_BxKxGxTxDh.transpose(0, 3, 1, 2, 4)
        out_BxTxD = self.o_proj(out_BxTxKxGxDh.reshape(B * T, H * Dh)).reshape(B, T, -1)
        return out_BxTxD, cache_kv, (k_BxKxTxDh, v_BxKxTxDh)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(D, F, config.mlp_bias, config, rngs, "gate_proj")
        self.up_proj = _linear(D, F, config.mlp_bias, config, rngs, "up_proj")
        self.down_proj = _linear(F, D, config.mlp_bias, config, rngs, "down_proj")

    def __call__(self, x_BxTxD):
        # 2-D matmuls: XLA:CPU runs the weight gradient of a [B, T, D] dense (two contracting dims) ~2x slower
        x_NxD = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])
        out_NxD = self.down_proj(jax.nn.silu(self.gate_proj(x_NxD)) * self.up_proj(x_NxD))
        return out_NxD.reshape(x_BxTxD.shape)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.self_attn = Attention(config, rngs)
        self.mlp = MLP(config, rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config)

    def __call__(self, x, cos, sin, mask, cache_kv, cache_index, prefix_kv=None, prefix_group_size=1,
                 whole_mask=False):
        attn, cache_kv, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_kv, cache_index,
                                                prefix_kv, prefix_group_size, whole_mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache_kv, new_kv


class Transformer(nnx.Module):
    """Token embedding, ``num_hidden_layers`` stacked decoder layers, final RMSNorm and an (optionally tied)
    head."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        check(config.vocab_size is not None, "model.vocab_size is None: set it, or train through "
               "grpo_jax.trainer, which takes it from the tokenizer")
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=config.jnp_dtype,
                                      param_dtype=config.param_jnp_dtype,
                                      embedding_init=nnx.initializers.normal(config.initializer_range),
                                      rngs=rngs)

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked_layers(rngs):
            return DecoderLayer(config, rngs)

        self.layers = stacked_layers(rngs)
        self.norm = RMSNorm(config.hidden_size, config)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, config, rngs)

    def __call__(self, input_ids_BxT, positions_BxT, attention_mask_BxS, cache=None, cache_index=0, *,
                 prefix=None, prefix_group_size: int = 1, return_kv: bool = False, layers=None, rope=None):
        """Final-normed hidden states [B, T, D] and the updated cache, or the inputs' keys/values with
        ``return_kv`` (see module ``forward``)."""
        config = self.config
        T = input_ids_BxT.shape[1]
        S = attention_mask_BxS.shape[-1]
        cache_index = jnp.asarray(cache_index, jnp.int32)
        check(cache is None or (prefix is None and not return_kv),
               "a KV cache excludes prefix= and return_kv=: they are for cache-free (training) forwards")
        prefix_len = 0 if prefix is None else prefix.k[0].shape[2]
        whole_mask = attention_mask_BxS.ndim == 3
        if whole_mask:  # who sees whom, given whole (packed layouts)
            check(cache is None and prefix is None and attention_mask_BxS.shape[1:] == (T, T),
                   "a [B, T, T] attention mask is for cache- and prefix-free forwards over the T inputs")
            mask_BxTxS = attention_mask_BxS
        elif cache is None:
            check(S == prefix_len + T, f"without a cache attention_mask must cover the {prefix_len} prefix and "
                   f"T={T} input slots, got S={S}")
            query_slot_T = prefix_len + jnp.arange(T)
        else:  # cache_index [B]: each row writes at its own slot
            query_slot_T = (cache_index[:, None] if cache_index.ndim == 1 else cache_index) + jnp.arange(T)
        if attention_mask_BxS.ndim == 2:
            mask_BxTxS = attention_mask(attention_mask_BxS, query_slot_T, config.sliding_window)
        cos, sin = rope_cos_sin(positions_BxT, rotary_tables(config, S) if rope is None else rope)
        layer_graphdef, stacked = nnx.split(self.layers)
        x = self.embed_tokens(input_ids_BxT)

        if cache is not None:
            # decoding: one layer after another, each with its own cache buffers (updated in place). ``layers``
            # (`layer_params`, sliced once by the caller) keeps the slicing out of a decode loop's steps
            layers = layer_params_from(stacked, config.num_hidden_layers) if layers is None else layers
            ks, vs = [], []
            for params, k, v in zip(layers, cache.k, cache.v):
                x, (k, v), _ = nnx.merge(layer_graphdef, params)(x, cos, sin, mask_BxTxS, (k, v), cache_index)
                ks.append(k)
                vs.append(v)
            return self.norm(x), KVCache(tuple(ks), tuple(vs))

        # training and scoring: a loop or one scan over the stacked layers; a shared prefix's per-layer keys/values
        # are per-layer inputs (scan inputs, sliced per layer), never a carry (a carried [L, ...] buffer is saved
        # once per layer)
        def layer_step(x, xs):
            params, prefix_kv = xs
            x, _, new_kv = nnx.merge(layer_graphdef, params)(x, cos, sin, mask_BxTxS, None, cache_index,
                                                             prefix_kv, prefix_group_size, whole_mask)
            return x, (new_kv if return_kv else None)

        if REMAT_POLICIES[config.remat] is not None:
            layer_step = jax.checkpoint(layer_step, policy=REMAT_POLICIES[config.remat], prevent_cse=False)
        if not config.scan_layers:
            # each layer's residuals stay separate buffers: a scan writes them into [L, ...] stacks slice by slice,
            # which cost the 0.5B H100 update 144 vs 120 ms and 34 vs 24 GiB peak (benchmarks/RESULTS.md)
            new_kvs = []
            for i, params in enumerate(layer_params_from(stacked, config.num_hidden_layers)):
                x, new_kv = layer_step(x, (params, None if prefix is None else (prefix.k[i], prefix.v[i])))
                new_kvs.append(new_kv)
            if return_kv:
                return self.norm(x), KVCache(*(tuple(kv[j] for kv in new_kvs) for j in (0, 1)))
            return self.norm(x), None
        prefix_kv = None if prefix is None else (jnp.stack(prefix.k), jnp.stack(prefix.v))
        # unrolling a few layers per iteration removes the loop's per-iteration cost, which dominates small
        # models (the default 2-layer run's update is 2x faster fully unrolled on CPU)
        x, new_kv = jax.lax.scan(layer_step, x, (stacked, prefix_kv),
                                 unroll=min(config.scan_unroll, config.num_hidden_layers))
        if return_kv:
            return self.norm(x), KVCache(*(tuple(kv) for kv in new_kv))
        return self.norm(x), None

    def unembed(self, hidden_BxTxD):
        """Logits [B, T, V] in the compute dtype."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden_BxTxD)
        hidden_NxD = hidden_BxTxD.reshape(-1, hidden_BxTxD.shape[-1])
        return self.lm_head(hidden_NxD).reshape(*hidden_BxTxD.shape[:-1], -1)


def init_model(config: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Build the transformer and split it once into ``(graphdef, params)``.

    LoRA adapters (``config.lora``) draw from a stream of their own: the base weights are the same seed's
    without adapters."""
    model = Transformer(config, rngs=nnx.Rngs(seed, lora=jax.random.fold_in(jax.random.key(seed), 1)))
    return nnx.split(model)


def init_cache(config: ModelConfig, batch_size: int, max_length: int) -> KVCache:
    """Zero KV cache: L buffers of [B, K, max_length, Dh] each for k and v, in the compute dtype."""
    shape = (batch_size, config.num_key_value_heads, max_length, config.resolved_head_dim)
    buffers = lambda: tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.num_hidden_layers))  # noqa: E731
    return KVCache(buffers(), buffers())


def rotary_tables(config: ModelConfig, num_positions: int):
    """RoPE cos, sin [num_positions, Dh/2] of positions 0 .. num_positions - 1 (`positional.rope_tables`): a
    forward gathers its positions' rows. Pass them as ``forward(..., rope=)`` to a decode loop, whose steps
    then gather instead of evaluating sin/cos again."""
    return rope_tables(rope_inv_freq(config), num_positions)


def layer_params_from(stacked, num_layers: int) -> list:
    """Per-layer parameter states [l] of the stacked decoder layers (each leaf sliced on its leading L axis)."""
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)]


def layer_params(graphdef, params) -> list:
    """The decoder layers' parameters, one state per layer: pass as ``forward(..., layers=)`` to a decode loop
    so each step reads them in place instead of slicing (copying) them out of the stack again."""
    model = nnx.merge(graphdef, params)
    return layer_params_from(nnx.split(model.layers)[1], model.config.num_hidden_layers)


def compute_dtype_params(graphdef, params) -> nnx.State:
    """``params`` with each float leaf stored wider than the compute dtype (``model.dtype``) cast to it.

    Every layer casts its weights to the compute dtype before use, so the numbers are the same; a decode
    loop given these reads bfloat16 weights in place instead of converting float32 ones in every step."""
    dtype = jnp.dtype(model_config(graphdef, params).jnp_dtype)

    def cast(x):
        wider = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > dtype.itemsize
        return x.astype(dtype) if wider else x
    return jax.tree.map(cast, params)


def model_config(graphdef: nnx.GraphDef, params: nnx.State) -> ModelConfig:
    """The ModelConfig stored (as static data) in the module tree."""
    return nnx.merge(graphdef, params).config


def forward(graphdef, params, input_ids_BxT, positions_BxT, attention_mask_BxS, cache: KVCache | None = None,
            cache_index: jax.Array | int = 0, *, prefix: KVCache | None = None, prefix_group_size: int = 1,
            return_kv: bool = False, layers: list | None = None, rope=None):
    """Pure forward pass: (hidden [B, T, D], updated cache or None).

    A boolean [B, T, T] ``attention_mask`` (no cache, no prefix) says outright which inputs each input sees (packed
    layouts, `logprobs.completion_logps`). Without a cache S == T and a token attends to earlier tokens whose
    ``attention_mask`` is 1 (and, with ``sliding_window`` W, to the last W slots only). With a cache the T new
    keys/values go to slots [cache_index, cache_index + T) for every row (a [B] ``cache_index``: each row's own
    slots) and a token at slot s attends to slots <= s masked by ``attention_mask_BxS`` over all S slots.
    ``positions_BxT`` drive RoPE (left padding: ``cumsum(mask) - 1`` clipped at 0); they must be below S (every
    left-padded or cached layout's are), the length of the RoPE tables built for the call (``rope``: `rotary_tables`
    covering them, made once by a decode loop's caller).

    With a cache the layers run one after another (``layers``: their `layer_params`, sliced once by a decode
    loop's caller); without one a Python loop runs them, or with ``model.scan_layers`` a single ``lax.scan``
    (whose compile time does not grow with depth).

    Shared prefixes (no cache): ``return_kv`` returns the inputs' keys/values as a `KVCache` ([B, K, T, Dh] per
    layer) in place of the cache; ``prefix`` (such a `KVCache` of [R, K, P, Dh] with B = R * ``prefix_group_size``)
    puts rows g*G .. g*G + G - 1 after prefix row g: the T inputs sit at slots P .. P + T - 1 and
    ``attention_mask_BxS`` covers all P + T slots. A group's prompt then runs once, not G times, with the
    same result (and gradient: the repeat sums the group's gradients into the one prefix).
    """
    model = nnx.merge(graphdef, params)
    return model(input_ids_BxT, positions_BxT, attention_mask_BxS, cache, cache_index, prefix=prefix,
                 prefix_group_size=prefix_group_size, return_kv=return_kv, layers=layers, rope=rope)


def unembed(graphdef, params, hidden_BxTxD):
    """Logits [B, T, V] = lm_head(hidden) (or hidden @ embed_tokens^T when tied), in the compute dtype."""
    return nnx.merge(graphdef, params).unembed(hidden_BxTxD)
