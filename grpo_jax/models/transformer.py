"""The decoder driver in Flax NNX, used as pure functions: embed, the family's stacked decoder layers (each with
its attention kind's mask and RoPE), final norm, unembed. What differs between families is theirs
(`models.families`); the driver picks a model_type's family from the family modules it imports (`family`, as
MaxText's decoders module does), and `models.registry` above it maps config.json through the same families. The
shared layers are `models.layers`.

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

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config.model import ModelConfig  # noqa: F401  (re-exported)
from grpo_jax.config.sections import check
from grpo_jax.models import attention, cohere2, families, gemma, glm4_moe, gpt_oss, llama, paged, qwen3_moe
from grpo_jax.models.families import Family, kind_window, layer_kinds
from grpo_jax.models.layers import KVCache, LayerNorm, RMSNorm, linear
from grpo_jax.models.moe import Routing
from grpo_jax.models.positional import (  # noqa: F401  (positions_from_mask, rope_inv_freq: re-exported)
    attention_mask,
    positions_from_mask,
    rope_attention_scaling,
    rope_cos_sin,
    rope_inv_freq,
    rope_tables,
)

# every family the driver builds; a new family module is listed here (and its model types in config.model)
FAMILIES = (llama.FAMILY, gemma.FAMILY, qwen3_moe.FAMILY, cohere2.FAMILY, gpt_oss.FAMILY, glm4_moe.FAMILY)


def family(model_type: str) -> Family:
    """The `Family` of a model_type; an unknown one is an error listing the supported ones."""
    by_type = {mt: f for f in FAMILIES for mt in f.architectures}
    if model_type not in by_type:
        raise ValueError(f"model_type {model_type!r} is not supported: supported are {sorted(by_type)}")
    return by_type[model_type]


# model.remat: what each decoder layer's backward pass keeps (None: everything, no rematerialisation)
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Transformer(nnx.Module):
    """Token embedding, ``num_hidden_layers`` stacked decoder layers, final RMSNorm and an (optionally tied)
    head."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        check(config.vocab_size is not None, "model.vocab_size is None: set it, or train through "
               "grpo_jax.api.trainer, which takes it from the tokenizer")
        self.config = config
        fam = family(config.model_type)
        self.embed_scale = fam.embed_scale
        self.routed = fam.routed
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=config.jnp_dtype,
                                      param_dtype=config.param_jnp_dtype,
                                      embedding_init=nnx.initializers.normal(config.initializer_range),
                                      rngs=rngs)

        def stack(layer, count: int):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked_layers(rngs):
                return layer(config, rngs)
            return stacked_layers(rngs)

        k = config.first_k_dense_replace
        check(not k or fam.dense_layer is not None,
              f"model.first_k_dense_replace={k} with model_type={config.model_type!r}, which has no dense layers")
        if k:  # GLM-4-MoE's first layers: dense MLPs, a stack of their own before the routed ones
            self.dense_layers = stack(fam.dense_layer, k)
        self.layers = stack(fam.decoder_layer, config.num_hidden_layers - k)
        self.norm = (LayerNorm(config.hidden_size, config) if fam.layer_norm else
                     RMSNorm(config.hidden_size, config, fam.norm_offset, fam.norm_f32_scale))
        if not config.tie_word_embeddings:
            self.lm_head = linear(config.hidden_size, config.vocab_size, False, config, rngs)

    def __call__(self, input_ids_BxT, positions_BxT, attention_mask_BxS, cache=None, cache_index=0, *,
                 prefix=None, prefix_group_size: int = 1, return_kv: bool = False, layers=None, rope=None,
                 routing=None, return_routing: bool = False):
        """Final-normed hidden states [B, T, D] and the updated cache, or the inputs' keys/values with
        ``return_kv``, and with ``return_routing`` the layers' `Routing` (see module ``forward``)."""
        config = self.config
        T = input_ids_BxT.shape[1]
        S = attention_mask_BxS.shape[-1]
        cache_index = jnp.asarray(cache_index, jnp.int32)
        check(cache is None or (prefix is None and not return_kv),
               "a KV cache excludes prefix= and return_kv=: they are for cache-free (training) forwards")
        check(self.routed or (routing is None and not return_routing),
              f"routing= and return_routing= are for mixture-of-experts models, not model_type={config.model_type!r}")
        prefix_len = 0 if prefix is None else prefix.k[0].shape[2]
        whole_mask = attention_mask_BxS.ndim == 3
        kinds, kind_of_layer = layer_kinds(config)
        # a kernel backend's training forward takes who-sees-whom as structure (`attention.Visibility`), never a
        # [B, T, S] boolean; decoding with a contiguous cache keeps the dense masks (a paged one: lengths, below)
        kernel = attention.resolve(config.attention) in attention.KERNELS and cache is None and not whole_mask
        if whole_mask:  # who sees whom, given whole (packed layouts); a window counts positions, contiguous there
            check(cache is None and prefix is None and attention_mask_BxS.shape[1:] == (T, T),
                   "a [B, T, T] attention mask is for cache- and prefix-free forwards over the T inputs")
            delta_BxTxT = positions_BxT[:, :, None] - positions_BxT[:, None, :]
            masks = [attention_mask_BxS if kind_window(config, k) is None else
                     attention_mask_BxS & (delta_BxTxT < kind_window(config, k)) for k in kinds]
        else:
            if cache is None:
                check(S == prefix_len + T, f"without a cache attention_mask must cover the {prefix_len} prefix "
                       f"and T={T} input slots, got S={S}")
                query_slot_T = prefix_len + jnp.arange(T)
            else:  # cache_index [B]: each row writes at its own slot
                query_slot_T = (cache_index[:, None] if cache_index.ndim == 1 else cache_index) + jnp.arange(T)
            if kernel:
                masks = [attention.visibility(attention_mask_BxS, prefix_len, T, kind_window(config, k),
                                              prefix is not None) for k in kinds]
            else:
                masks = [attention_mask(attention_mask_BxS, query_slot_T, kind_window(config, k), positions_BxT)
                         for k in kinds]
            # a token per row over its pages: a kernel reads them
            if isinstance(cache, paged.PagedKVCache) and T == 1 and attention.paged_kernel(
                    attention.resolve(config.attention), config):
                masks = [None if kind_window(config, k) is None else m for k, m in zip(kinds, masks)]
        # one mask and one RoPE table per attention kind, built once; each layer takes its kind's
        rope = rotary_tables(config, S) if rope is None else rope
        cos_sins = [rope_cos_sin(positions_BxT, rope[k]) for k in kinds]
        # (graphdef, stacked params, first layer, routed) of each stack of layers, in order (`families.STACKS`)
        stacks = [(*nnx.split(getattr(self, name)), families.stack_layers(name, config).start,
                   self.routed and name == "layers") for name in families.STACKS if hasattr(self, name)]
        first_routed = config.first_k_dense_replace  # routing [L', ...] covers the routed layers only
        x = self.embed_tokens(input_ids_BxT)
        if self.embed_scale:  # the scale rounded to the compute dtype, as transformers' Gemma embedding does
            x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)

        def run_layer(graphdef, routed, params, *args, replay=None):
            """One decoder layer: (x, cache_kv, new_kv, its (router logits, experts) or None)."""
            layer = nnx.merge(graphdef, params)
            if not routed:
                return *layer(*args), None
            return layer(*args, routing=replay)

        def stack_of(l: int):  # the (graphdef, routed) of layer l
            graphdef, _, _, routed = next(s for s in reversed(stacks) if s[2] <= l)
            return graphdef, routed

        def replay_of(l: int):
            return None if routing is None or l < first_routed else routing[l - first_routed]

        if cache is not None:
            # decoding: one layer after another, each with its own cache buffers (updated in place). ``layers``
            # (`layer_params`, sliced once by the caller) keeps the slicing out of a decode loop's steps
            layers = layer_params_of(self) if layers is None else layers
            ks, vs, routed = [], [], []
            for l, (params, k, v, i) in enumerate(zip(layers, cache.k, cache.v, kind_of_layer)):
                layer_cache = paged.LayerPages(k, v, cache) if isinstance(cache, paged.PagedKVCache) else (k, v)
                x, (k, v), _, r = run_layer(*stack_of(l), params, x, *cos_sins[i], masks[i], layer_cache, cache_index,
                                            replay=replay_of(l))
                ks.append(k)
                vs.append(v)
                if r is not None:
                    routed.append(r)
            new_cache = (cache._replace(k=tuple(ks), v=tuple(vs)) if isinstance(cache, paged.PagedKVCache) else
                         KVCache(tuple(ks), tuple(vs)))
            out = self.norm(x), new_cache
            return (*out, _stack_routing(routed)) if return_routing else out

        # training and scoring: a loop or one scan over the stacked layers; a shared prefix's per-layer keys/values
        # are per-layer inputs (scan inputs, sliced per layer), never a carry (a carried [L, ...] buffer is saved
        # once per layer)
        # with several kinds a scanned layer picks its kind's mask and tables by its kind index (a scan input)
        # (a kernel's visibility is static, so there the scanned layer switches to its kind's branch instead)
        stacked_kinds = None if len(kinds) == 1 or kernel else (jnp.stack(masks),
                                                                 *(jnp.stack(t) for t in zip(*cos_sins)))

        def layer_step(graphdef, routed, x, xs, kind: int = 0):
            # kind_index: the layer's kind traced (a scan over several kinds); replay: its experts to replay
            params, prefix_kv, kind_index, replay = xs

            def run(mask, cos, sin):
                x_out, _, new_kv, r = run_layer(graphdef, routed, params, x, cos, sin, mask, None, cache_index,
                                                prefix_kv, prefix_group_size, whole_mask, replay=replay)
                return x_out, (new_kv if return_kv else None, r if return_routing else None)

            if kind_index is None:
                return run(masks[kind], *cos_sins[kind])
            if kernel:
                return jax.lax.switch(kind_index, [functools.partial(lambda i: run(masks[i], *cos_sins[i]), i)
                                                   for i in range(len(kinds))])
            return run(*(t[kind_index] for t in stacked_kinds))

        if REMAT_POLICIES[config.remat] is not None:
            layer_step = jax.checkpoint(layer_step, policy=REMAT_POLICIES[config.remat], prevent_cse=False,
                                        static_argnums=(0, 1, 4))
        new_kvs, routed = [], []
        if not config.scan_layers:
            # each layer's residuals stay separate buffers: a scan writes them into [L, ...] stacks slice by slice,
            # which cost the 0.5B H100 update 144 vs 120 ms and 34 vs 24 GiB peak (benchmarks/RESULTS.md)
            for i, params in enumerate(layer_params_of(self)):
                x, (new_kv, r) = layer_step(*stack_of(i), x, (params, None if prefix is None else (
                    prefix.k[i], prefix.v[i]), None, replay_of(i)), kind_of_layer[i])
                new_kvs.append(new_kv)
                if r is not None:  # a routed layer's, with return_routing
                    routed.append(r)
            kv = KVCache(*(tuple(kv[j] for kv in new_kvs) for j in (0, 1))) if return_kv else None
            return (self.norm(x), kv, _stack_routing(routed)) if return_routing else (self.norm(x), kv)
        for graphdef, stacked, first, is_routed in stacks:  # one scan a stack
            count = jax.tree.leaves(stacked)[0].shape[0]
            part = slice(first, first + count)
            prefix_kv = None if prefix is None else (jnp.stack(prefix.k[part]), jnp.stack(prefix.v[part]))
            # unrolling a few layers per iteration removes the loop's per-iteration cost, which dominates small
            # models (the default 2-layer run's update is 2x faster fully unrolled on CPU)
            kind_L = None if len(kinds) == 1 else jnp.asarray(kind_of_layer[part], jnp.int32)
            step = functools.partial(layer_step, graphdef, is_routed)
            x, (new_kv, r) = jax.lax.scan(lambda x, xs: step(x, xs, 0), x,
                                          (stacked, prefix_kv, kind_L, routing if is_routed else None),
                                          unroll=min(config.scan_unroll, count))
            new_kvs.append(new_kv)
            if is_routed:
                routed = r
        kv = KVCache(*(sum((tuple(kv[j]) for kv in new_kvs), ()) for j in (0, 1))) if return_kv else None
        return (self.norm(x), kv, Routing(*routed)) if return_routing else (self.norm(x), kv)

    def unembed(self, hidden_BxTxD):
        """Logits [B, T, V] in the compute dtype (scaled by ``logit_scale``, soft-capped with
        ``final_logit_softcapping``)."""
        if self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden_BxTxD)
        else:
            hidden_NxD = hidden_BxTxD.reshape(-1, hidden_BxTxD.shape[-1])
            logits = self.lm_head(hidden_NxD).reshape(*hidden_BxTxD.shape[:-1], -1)
        if self.config.logit_scale is not None:
            logits = logits * jnp.asarray(self.config.logit_scale, logits.dtype)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap


def _stack_routing(per_layer: list) -> Routing:
    """The layers' (router logits, experts) stacked into one `Routing` of [L, ...] arrays."""
    return Routing(*(jnp.stack(parts) for parts in zip(*per_layer)))


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


def layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention); a paged cache keeps a window layer's keys in a
    `paged.Ring`."""
    kinds, kind_of_layer = layer_kinds(config)
    return tuple(kind_window(config, kinds[i]) for i in kind_of_layer)


def rotary_tables(config: ModelConfig, num_positions: int) -> dict:
    """Per attention kind, RoPE cos, sin [num_positions, Dh/2] of positions 0 .. num_positions - 1
    (`positional.rope_tables`): a forward gathers its positions' rows. Pass them as ``forward(..., rope=)`` to a
    decode loop, whose steps then gather instead of evaluating sin/cos again. A kind the family leaves without
    RoPE (NoPE) gets zero frequencies: cos 1 and sin 0, which turn nothing."""
    rope_kinds = family(config.model_type).rope_kinds
    tables = {}
    for kind in layer_kinds(config)[0]:
        inv_freq = rope_inv_freq(config, kind)
        tables[kind] = rope_tables(inv_freq if rope_kinds is None or kind in rope_kinds else 0 * inv_freq,
                                   num_positions, rope_attention_scaling(config, kind))
    return tables


def layer_params_of(model: Transformer) -> list:
    """Per-layer parameter states [l] of a model's stacked decoder layers, every stack in order (each leaf sliced
    on its leading axis)."""
    out = []
    for name in families.STACKS:
        if hasattr(model, name):
            stacked = nnx.split(getattr(model, name))[1]
            count = len(families.stack_layers(name, model.config))
            out += [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(count)]
    return out


def layer_params(graphdef, params) -> list:
    """The decoder layers' parameters, one state per layer: pass as ``forward(..., layers=)`` to a decode loop
    so each step reads them in place instead of slicing (copying) them out of the stack again."""
    return layer_params_of(nnx.merge(graphdef, params))


def compute_dtype_params(graphdef, params) -> nnx.State:
    """``params`` with each float leaf stored wider than the compute dtype (``model.dtype``) cast to it, but the
    family's `Family.float32_params`.

    Every other layer casts its weights to the compute dtype before use, so the numbers are the same; a decode
    loop given these reads bfloat16 weights in place instead of converting float32 ones in every step."""
    config = model_config(graphdef, params)
    dtype = jnp.dtype(config.jnp_dtype)
    kept = family(config.model_type).float32_params

    def cast(path, x):
        wider = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > dtype.itemsize
        name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        if wider and kept and name.endswith(kept):
            return x
        return x.astype(dtype) if wider else x
    return jax.tree_util.tree_map_with_path(cast, params)


def model_config(graphdef: nnx.GraphDef, params: nnx.State) -> ModelConfig:
    """The ModelConfig stored (as static data) in the module tree."""
    return nnx.merge(graphdef, params).config


def forward(graphdef, params, input_ids_BxT, positions_BxT, attention_mask_BxS, cache: KVCache | None = None,
            cache_index: jax.Array | int = 0, *, prefix: KVCache | None = None, prefix_group_size: int = 1,
            return_kv: bool = False, layers: list | None = None, rope=None, routing: jax.Array | None = None,
            return_routing: bool = False):
    """Pure forward pass: (hidden [B, T, D], updated cache or None), and with ``return_routing`` a third output.

    A boolean [B, T, T] ``attention_mask`` (no cache, no prefix) says outright which inputs each input sees (packed
    layouts, `logprobs.completion_logps`). Without a cache S == T and a token attends to earlier tokens whose
    ``attention_mask`` is 1. With a cache the T new keys/values go to slots [cache_index, cache_index + T) for every
    row (a [B] ``cache_index``: each row's own slots) and a token at slot s attends to slots <= s masked by
    ``attention_mask_BxS`` over all S slots. On a sliding-window layer (its kind's window W) a token sees only the
    keys fewer than W positions back (`positional.attention_mask`; a whole mask: ``positions_BxT`` of both).
    ``positions_BxT`` drive RoPE (left padding: ``cumsum(mask) - 1`` clipped at 0); they must be below S (every
    left-padded or cached layout's are), the length of the RoPE tables built for the call (``rope``: `rotary_tables`
    covering them, made once by a decode loop's caller).

    ``cache`` may instead be a `paged.PagedKVCache`: the new keys/values go to its row positions in its pages, and
    each layer reads them back in the slot order above (the mask as for a contiguous cache), or for one token per
    row under a kernel backend, full-attention layers read the pages through `attention.paged_decode` (in each row
    shard's ``shard_map``, `paged.attend`); a sliding-window layer attends over its `paged.Ring`.

    With a cache the layers run one after another (``layers``: their `layer_params`, sliced once by a decode
    loop's caller); without one a Python loop runs them, or with ``model.scan_layers`` a single ``lax.scan``
    (whose compile time does not grow with depth).

    Shared prefixes (no cache): ``return_kv`` returns the inputs' keys/values as a `KVCache` ([B, K, T, Dh] per
    layer) in place of the cache; ``prefix`` (such a `KVCache` of [R, K, P, Dh] with B = R * ``prefix_group_size``)
    puts rows g*G .. g*G + G - 1 after prefix row g: the T inputs sit at slots P .. P + T - 1 and
    ``attention_mask_BxS`` covers all P + T slots. A group's prompt then runs once, not G times, with the
    same result (and gradient: the repeat sums the group's gradients into the one prefix).

    Mixture-of-experts models (a family with ``routed``): ``return_routing`` adds the layers' `Routing` (router
    logits [L, B, T, E], the experts each input went to [L, B, T, K]); ``routing`` [L, B, T, K] replays those
    experts instead of the routers' top K (routing replay; the weights stay the current routers' probabilities).
    """
    model = nnx.merge(graphdef, params)
    return model(input_ids_BxT, positions_BxT, attention_mask_BxS, cache, cache_index, prefix=prefix,
                 prefix_group_size=prefix_group_size, return_kv=return_kv, layers=layers, rope=rope,
                 routing=routing, return_routing=return_routing)


def unembed(graphdef, params, hidden_BxTxD):
    """Logits [B, T, V] = lm_head(hidden) (or hidden @ embed_tokens^T when tied), in the compute dtype."""
    return nnx.merge(graphdef, params).unembed(hidden_BxTxD)
