"""Autoregressive sampling with a KV cache: prefill the prompt, then a ``lax.while_loop`` decode.

Dimension letters: B rows, P prompt tokens (left-padded), T = max_completion_length, S = P + T cache
slots, V vocab. Everything has static shapes; the loop exits early once every row has emitted EOS.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

from grpo_jax.config.sections import SamplingConfig  # noqa: F401  (re-exported)
from grpo_jax.models import (compute_dtype_params, forward, init_cache, layer_params, model_config,
                             positions_from_mask, rotary_tables, unembed)


class SampleOutput(NamedTuple):
    """Sampled completions.

    completion_ids [B, T] int32 (pad after EOS), completion_mask [B, T] int32 (1 up to and including the
    first EOS), is_truncated [B] bool (no EOS within T), sampler_per_token_logps [B, T] float32 (full-vocabulary
    log-softmax of logits / temperature at the sampled token, 0 where the mask is 0), num_decode_steps []
    int32 (tokens sampled per row before the loop stopped; < T when every row ended early).
    """

    completion_ids: jax.Array
    completion_mask: jax.Array
    is_truncated: jax.Array
    sampler_per_token_logps: jax.Array
    num_decode_steps: jax.Array


def _top_k(scores_BxV, k: int):
    kth_Bx1 = jax.lax.top_k(scores_BxV, min(k, scores_BxV.shape[-1]))[0][..., -1:]
    return jnp.where(scores_BxV < kth_Bx1, -jnp.inf, scores_BxV)


def _top_p(scores_BxV, top_p: float):
    # HF TopPLogitsWarper: drop the ascending-sorted tokens whose cumulative mass is <= 1 - top_p
    order_BxV = jnp.argsort(scores_BxV, axis=-1)
    sorted_BxV = jnp.take_along_axis(scores_BxV, order_BxV, axis=-1)
    cumulative_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1)
    remove_sorted_BxV = (cumulative_BxV <= 1 - top_p).at[..., -1].set(False)
    remove_BxV = jnp.put_along_axis(jnp.zeros_like(remove_sorted_BxV), order_BxV, remove_sorted_BxV,
                                    axis=-1, inplace=False)
    return jnp.where(remove_BxV, -jnp.inf, scores_BxV)


def _min_p(scores_BxV, min_p: float):
    # HF MinPLogitsWarper: the arg-max token always survives since min_p < 1
    probs_BxV = jax.nn.softmax(scores_BxV, axis=-1)
    threshold_Bx1 = min_p * jnp.max(probs_BxV, axis=-1, keepdims=True)
    return jnp.where(probs_BxV < threshold_Bx1, -jnp.inf, scores_BxV)


def filter_logits(scaled_logits_BxV, config: SamplingConfig):
    """Apply top-k, then top-p, then min-p to temperature-scaled logits; removed tokens become -inf."""
    scores = scaled_logits_BxV
    if config.top_k > 0:
        scores = _top_k(scores, config.top_k)
    if config.top_p < 1.0:
        scores = _top_p(scores, config.top_p)
    if config.min_p > 0.0:
        scores = _min_p(scores, config.min_p)
    return scores


def prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, group_size: int, cache_length: int):
    """Each distinct prompt (R = B / ``group_size`` rows, `data.repeat_groups` order) run once into a KV cache of
    ``cache_length`` slots: (params in the compute dtype, their per-layer slices, RoPE tables of every slot,
    cache [R, ...], the logits of each prompt's next token [R, V]). The casts and slices are made once here, not
    in every decode step."""
    B, P = prompt_ids_BxP.shape
    G = group_size
    if not isinstance(G, int) or G < 1 or B % G:
        raise ValueError(f"prompt_group_size={G!r} must be a positive integer dividing the {B} rows")
    model_cfg = model_config(graphdef, params)
    params = compute_dtype_params(graphdef, params)
    layers = layer_params(graphdef, params)
    rope = rotary_tables(model_cfg, cache_length)  # RoPE of every slot: decode steps gather theirs
    mask_RxS = jnp.zeros((B // G, cache_length), jnp.int32).at[:, :P].set(prompt_mask_BxP[::G].astype(jnp.int32))
    hidden_RxPxD, cache_R = forward(graphdef, params, prompt_ids_BxP[::G], positions_from_mask(prompt_mask_BxP[::G]),
                                    mask_RxS, init_cache(model_cfg, B // G, cache_length), 0, layers=layers,
                                    rope=rope)
    # left padding puts every row's last real token at slot P - 1
    return params, layers, rope, cache_R, unembed(graphdef, params, hidden_RxPxD[:, -1:])[:, 0]


def _threefry_words(key):
    """The key's two uint32 words when it is a threefry key, else None (other PRNGs draw other bits)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key) if str(jax.random.key_impl(key)) == "threefry2x32" else None
    return key if jax.config.jax_default_prng_impl == "threefry2x32" else None


def gumbel_rows(key, step, total: int, row_offset, rows: int, vocab: int):
    """Rows ``row_offset .. row_offset + rows`` of ``jax.random.gumbel(fold_in(key, step), (total, vocab))``:
    the noise `generate`'s ``jax.random.categorical`` adds to those rows' scores at ``step``.

    With a threefry key and partitionable bits (jax's defaults) element i of that draw hashes the counter
    (0, i) alone, so only these rows' bits are drawn (`jax.extend.random.threefry_2x32`), then
    `jax.random.gumbel`'s own float transform; otherwise the whole draw is sliced. A row's noise is then a
    function of (key, step, row) alone, whatever rows share its call (`grpo_jax.continuous` relies on it).
    """
    key = jax.random.fold_in(key, step)
    words = _threefry_words(key)
    # the counters are (0, i) with i < 2**32: larger draws take the sliced whole draw too
    if (words is None or not jax.config.jax_threefry_partitionable or total * vocab >= 2 ** 32
            or jax.config.jax_high_dynamic_range_gumbel):
        noise = jax.random.gumbel(key, (total, vocab), jnp.float32)
        return noise if rows == total else jax.lax.dynamic_slice_in_dim(noise, row_offset, rows, axis=0)
    n = rows * vocab
    counts = jnp.asarray(row_offset, jnp.uint32) * vocab + jnp.arange(n, dtype=jnp.uint32)
    # threefry_2x32 hashes the pairs (first half[i], second half[i]) of its counts into the two output halves
    bits = threefry_2x32((words[0], words[1]), jnp.concatenate([jnp.zeros_like(counts), counts]))
    # jax.random.uniform's mantissa trick over [tiny, 1), then gumbel's -log(-log(u))
    ones = jax.lax.bitcast_convert_type(((bits[:n] ^ bits[n:]) >> np.uint32(9)) | np.uint32(0x3F800000),
                                        jnp.float32)
    tiny = jnp.finfo(jnp.float32).tiny
    uniform = jnp.maximum(tiny, (ones - 1.0) * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform)).reshape(rows, vocab)


class _DecodeState(NamedTuple):
    step: jax.Array           # tokens sampled so far (also the slot of the pending token, minus P)
    pending_B: jax.Array      # the last sampled token, not yet fed through the model
    done_B: jax.Array         # rows whose pending token or an earlier one was EOS
    cache: object
    mask_BxS: jax.Array
    ids_BxT: jax.Array
    completion_mask_BxT: jax.Array
    logps_BxT: jax.Array


def generate(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, *, config: SamplingConfig,
             eos_token_ids: tuple[int, ...], pad_token_id: int, greedy: bool = False,
             prompt_group_size: int = 1, cache_sharding=None, choose_tokens=None) -> SampleOutput:
    """Sample up to T = config.max_completion_length tokens per left-padded prompt.

    Prefill writes the prompt into a KV cache of S = P + T slots; decode step t feeds token t - 1 at slot
    P + t - 1 (RoPE position = real prompt length + t - 1) and samples token t as
    ``jax.random.categorical(fold_in(key, t), filter_logits(logits / temperature))``. ``greedy`` takes the
    arg-max (no filters) but still reports logps at temperature.
    ``prompt_group_size`` G > 1 promises that rows g*G .. g*G + G - 1 hold the same prompt
    (`data.repeat_groups` order): the prompt is then prefilled once per group and its cache copied G times.
    ``cache_sharding`` (`sharding.cache_sharding`) pins the KV cache's layout over a mesh; None leaves it to XLA.
    ``choose_tokens(key, (T, B, V), greedy)`` (e.g. `cpu.token_chooser`), called once before the decode loop,
    returns ``choose(t, scores_BxV) -> tokens_B`` picking the same tokens another way; None: the draw above.
    """
    B, P = prompt_ids_BxP.shape
    T = config.max_completion_length
    G = prompt_group_size
    eos_E = jnp.asarray(eos_token_ids, jnp.int32).reshape(-1)
    prompt_mask_BxP = prompt_mask_BxP.astype(jnp.int32)
    prompt_len_B = jnp.sum(prompt_mask_BxP, axis=-1)
    mask_BxS = jnp.concatenate([prompt_mask_BxP, jnp.zeros((B, T), jnp.int32)], axis=1)
    params, layers, rope, cache_R, logits_RxV = prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, G, P + T)
    cache = jax.tree.map(lambda x_RxKxSxDh: jnp.repeat(x_RxKxSxDh, G, axis=0), cache_R) if G > 1 else cache_R
    constrain = (lambda c: c) if cache_sharding is None else (  # noqa: E731
        lambda c: jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, cache_sharding), c))
    cache = constrain(cache)
    logits_BxV = jnp.repeat(logits_RxV, G, axis=0) if G > 1 else logits_RxV

    def categorical(step, scores_BxV):
        if greedy:
            return jnp.argmax(scores_BxV, axis=-1)
        return jax.random.categorical(jax.random.fold_in(key, step), scores_BxV)

    choose = categorical if choose_tokens is None else choose_tokens(key, (T, B, logits_BxV.shape[-1]), greedy)

    def record(state: _DecodeState, logits_BxV):
        scaled_BxV = logits_BxV.astype(jnp.float32) / config.temperature
        tokens_B = choose(state.step, scaled_BxV if greedy else filter_logits(scaled_BxV, config))
        tokens_B = tokens_B.astype(jnp.int32)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(scaled_BxV, axis=-1), tokens_B[:, None], axis=-1)[:, 0]
        live_B = ~state.done_B
        tokens_B = jnp.where(live_B, tokens_B, pad_token_id)
        t = state.step
        return state._replace(
            step=t + 1,
            pending_B=tokens_B,
            done_B=state.done_B | (live_B & jnp.isin(tokens_B, eos_E)),
            ids_BxT=state.ids_BxT.at[:, t].set(tokens_B),
            completion_mask_BxT=state.completion_mask_BxT.at[:, t].set(live_B.astype(jnp.int32)),
            logps_BxT=state.logps_BxT.at[:, t].set(jnp.where(live_B, logp_B, 0.0)),
        )

    def cond(state: _DecodeState):
        return (state.step < T) & ~jnp.all(state.done_B)

    def body(state: _DecodeState):
        slot = P + state.step - 1
        mask_BxS = jax.lax.dynamic_update_slice(state.mask_BxS, jnp.ones((B, 1), jnp.int32), (0, slot))
        positions_Bx1 = (prompt_len_B + state.step - 1)[:, None]
        hidden_Bx1xD, cache = forward(graphdef, params, state.pending_B[:, None], positions_Bx1, mask_BxS,
                                      state.cache, slot, layers=layers, rope=rope)
        cache = constrain(cache)
        logits_BxV = unembed(graphdef, params, hidden_Bx1xD)[:, 0]
        return record(state._replace(cache=cache, mask_BxS=mask_BxS), logits_BxV)

    state = _DecodeState(
        step=jnp.zeros((), jnp.int32),
        pending_B=jnp.zeros((B,), jnp.int32),
        done_B=jnp.zeros((B,), bool),
        cache=cache,
        mask_BxS=mask_BxS,
        ids_BxT=jnp.full((B, T), pad_token_id, jnp.int32),
        completion_mask_BxT=jnp.zeros((B, T), jnp.int32),
        logps_BxT=jnp.zeros((B, T), jnp.float32),
    )
    state = jax.lax.while_loop(cond, body, record(state, logits_BxV))
    return SampleOutput(
        completion_ids=state.ids_BxT,
        completion_mask=state.completion_mask_BxT,
        is_truncated=~state.done_B,
        sampler_per_token_logps=state.logps_BxT,
        num_decode_steps=state.step,
    )
