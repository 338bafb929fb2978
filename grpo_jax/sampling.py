"""Autoregressive sampling with a KV cache: prefill the prompt, then a ``lax.while_loop`` decode.

Dimension letters: B rows, P prompt tokens (left-padded), T = max_completion_length, S = P + T cache
slots, V vocab. Everything has static shapes; the loop exits early once every row has emitted EOS.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from grpo_jax.models import (compute_dtype_params, forward, init_cache, layer_params, model_config,
                             positions_from_mask, rotary_tables, unembed)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling hyper-parameters (TRL GRPOConfig names); filters follow HF logits warpers.

    ``host_threads`` (grpo_jax only) splits a one-device sampling call's rows into that many chunks, each run from
    its own host thread: XLA:CPU runs a small model's decode steps on one core, so chunks keep the others busy.
    The tokens do not depend on it. 0: one per CPU core on a one-device CPU mesh, else 1 (`host_chunks`)."""

    max_completion_length: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    host_threads: int = 0

    def __post_init__(self):
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"sampling.max_completion_length={self.max_completion_length!r} must be an "
                             "integer >= 1")
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be > 0: use greedy=True for argmax")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1] (1.0 disables it)")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"sampling.min_p={self.min_p} must be in [0, 1) (0.0 disables it)")
        if not isinstance(self.host_threads, int) or self.host_threads < 0:
            raise ValueError(f"sampling.host_threads={self.host_threads!r} must be an integer >= 0 (0: one per CPU "
                             "core on CPU, 1 elsewhere)")


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


# below this many bytes of [T, B, V] float32 noise, decode draws every step's Gumbel noise before its loop
PRECOMPUTED_NOISE_BYTES = 32 << 20


def _gumbel_rows(key, step, total: int, row_offset, rows: int, vocab: int):
    """Rows ``row_offset .. row_offset + rows`` of step ``step``'s Gumbel noise, the [total, vocab] draw
    ``jax.random.gumbel(fold_in(key, step), (total, vocab))``: ``jax.random.categorical(fold_in(key, step),
    logits)`` is ``argmax(logits + noise)``. With a threefry key and partitionable bits (jax's defaults) element i
    of the draw depends on ``threefry2x32(key, (0, i))`` alone: only these rows' bits are drawn, then
    `jax.random.gumbel`'s own float transform; otherwise the whole draw is sliced."""
    key = jax.random.fold_in(key, step)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key) if str(jax.random.key_impl(key)) == "threefry2x32" else None
    else:
        data = key if jax.config.jax_default_prng_impl == "threefry2x32" else None
    # the counters are (0, i) with i < 2**32: larger draws take the sliced whole draw too
    if data is None or not jax.config.jax_threefry_partitionable or total * vocab >= 2 ** 32:
        noise = jax.random.gumbel(key, (total, vocab), jnp.float32)
        return noise if rows == total else jax.lax.dynamic_slice_in_dim(noise, row_offset, rows, axis=0)
    counts = jnp.asarray(row_offset, jnp.uint32) * vocab + jnp.arange(rows * vocab, dtype=jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(counts), counts)
    # jax.random.uniform's mantissa trick over [tiny, 1), then gumbel's -log(-log(u))
    ones = jax.lax.bitcast_convert_type(((bits1 ^ bits2) >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32)
    tiny = jnp.finfo(jnp.float32).tiny
    uniform = jnp.maximum(tiny, (ones - 1.0) * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform)).reshape(rows, vocab)


def argmax_last_axis(x_BxV):
    """``jnp.argmax(x, axis=-1)`` (first maximum; a NaN counts as the maximum) as two plain reductions: XLA:CPU
    runs argmax's (value, index) reduction element by element, ~3x slower on a decode step's [B, V]."""
    V = x_BxV.shape[-1]
    max_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    hit_BxV = (x_BxV == max_Bx1) | jnp.isnan(x_BxV)
    return jnp.min(jnp.where(hit_BxV, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def _choose(logits_BxV, noise_BxV, config: SamplingConfig, greedy: bool):
    """Pick one token per row; returns (tokens [B], full-vocab logp at temperature [B])."""
    scaled_BxV = logits_BxV.astype(jnp.float32) / config.temperature
    logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
    if greedy:
        tokens_B = argmax_last_axis(scaled_BxV)
    else:  # jax.random.categorical's own formula (Gumbel-max), with the noise drawn by the caller
        tokens_B = argmax_last_axis(noise_BxV + filter_logits(scaled_BxV, config))
    tokens_B = tokens_B.astype(jnp.int32)
    return tokens_B, jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]


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
             prompt_group_size: int = 1, cache_sharding=None, row_offset=0,
             total_rows: int | None = None) -> SampleOutput:
    """Sample up to T = config.max_completion_length tokens per left-padded prompt.

    Prefill writes the prompt into a KV cache of S = P + T slots; decode step t feeds token t - 1 at slot
    P + t - 1 (RoPE position = real prompt length + t - 1) and samples token t with key
    ``fold_in(key, t)``. ``greedy`` takes the arg-max (no filters) but still reports logps at temperature.
    ``prompt_group_size`` G > 1 promises that rows g*G .. g*G + G - 1 hold the same prompt
    (`data.repeat_groups` order): the prompt is then prefilled once per group and its cache copied G times.
    ``cache_sharding`` (`sharding.cache_sharding`) pins the KV cache's layout over a mesh; None leaves it to XLA.
    ``row_offset`` / ``total_rows``: these B rows are rows ``row_offset ..`` of a call over ``total_rows`` rows,
    whose noise they draw (`_gumbel_rows`: the tokens of a chunk are those of the whole call).
    """
    B, P = prompt_ids_BxP.shape
    T = config.max_completion_length
    G = prompt_group_size
    if not isinstance(G, int) or G < 1 or B % G:
        raise ValueError(f"prompt_group_size={G!r} must be a positive integer dividing the {B} rows")
    total = B if total_rows is None else total_rows
    eos_E = jnp.asarray(eos_token_ids, jnp.int32).reshape(-1)
    prompt_mask_BxP = prompt_mask_BxP.astype(jnp.int32)
    prompt_len_B = jnp.sum(prompt_mask_BxP, axis=-1)

    mask_BxS = jnp.concatenate([prompt_mask_BxP, jnp.zeros((B, T), jnp.int32)], axis=1)
    # one prefill per distinct prompt (R = B / G rows), then every group member starts from its cache
    model_cfg = model_config(graphdef, params)
    cache_R = init_cache(model_cfg, B // G, P + T)
    # weights cast to the compute dtype and sliced per layer once here, not in every decode step
    params = compute_dtype_params(graphdef, params)
    layers = layer_params(graphdef, params)
    rope = rotary_tables(model_cfg, P + T)  # RoPE of every slot: decode steps gather theirs
    hidden_RxPxD, cache_R = forward(graphdef, params, prompt_ids_BxP[::G],
                                    positions_from_mask(prompt_mask_BxP[::G]), mask_BxS[::G], cache_R, 0,
                                    layers=layers, rope=rope)
    # left padding puts every row's last real token at slot P - 1
    logits_RxV = unembed(graphdef, params, hidden_RxPxD[:, -1:])[:, 0]
    cache = jax.tree.map(lambda x_RxKxSxDh: jnp.repeat(x_RxKxSxDh, G, axis=0), cache_R) if G > 1 else cache_R
    constrain = (lambda c: c) if cache_sharding is None else (  # noqa: E731
        lambda c: jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, cache_sharding), c))
    cache = constrain(cache)
    logits_BxV = jnp.repeat(logits_RxV, G, axis=0) if G > 1 else logits_RxV

    V = logits_BxV.shape[-1]

    def noise_at(step):  # this call's rows of the step's [total, V] draw
        return _gumbel_rows(key, step, total, row_offset, B, V)

    # a CPU threefry call is a small loop of its own: drawing every step's noise at once (when it is small)
    # takes it out of the decode loop; the same bits either way (vmap of the per-step draw)
    noise_TxBxV = None
    if not greedy and T * B * V * 4 <= PRECOMPUTED_NOISE_BYTES:
        noise_TxBxV = jax.vmap(noise_at)(jnp.arange(T))

    def record(state: _DecodeState, logits_BxV):
        if greedy:
            noise_BxV = None
        elif noise_TxBxV is None:
            noise_BxV = noise_at(state.step)
        else:
            noise_BxV = jax.lax.dynamic_index_in_dim(noise_TxBxV, state.step, keepdims=False)
        tokens_B, logp_B = _choose(logits_BxV, noise_BxV, config, greedy)
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


generate_jit = jax.jit(generate, static_argnames=("config", "eos_token_ids", "pad_token_id", "greedy",
                                                 "prompt_group_size", "cache_sharding", "total_rows"))


def _host_threads(config: SamplingConfig, mesh) -> int:
    if config.host_threads:
        return config.host_threads
    one_cpu = mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"
    return len(os.sched_getaffinity(0)) if one_cpu and hasattr(os, "sched_getaffinity") else 1


def host_chunks(config: SamplingConfig, mesh, num_rows: int, group_size: int) -> int:
    """Row chunks for one sampling call: ``config.host_threads`` (0: the CPU cores this process may use on a
    one-device CPU mesh, else 1), lowered until the chunks split into whole groups of ``group_size`` rows."""
    groups = num_rows // group_size
    return max(k for k in range(1, min(_host_threads(config, mesh), groups) + 1) if groups % k == 0)


class _Sampler:
    """`jit_generate`'s callable: one jitted call, or `host_chunks` row chunks run from host threads."""

    def __init__(self, jitted, config: SamplingConfig, mesh, prompt_group_size: int, replicated):
        self._jitted, self._config, self._mesh, self._group = jitted, config, mesh, prompt_group_size
        self._pool = None  # made on the first chunked call (its threads start as chunks need them)
        # chunks' row offsets as device scalars, made once (one device): a host scalar is a transfer in every call
        self._offset = functools.cache(lambda row: jax.device_put(np.int32(row), replicated))
        self._split = jax.jit(lambda ids, mask, k: list(zip(jnp.split(ids, k), jnp.split(mask, k))), static_argnums=2)
        self._concat = jax.jit(lambda outs: SampleOutput(
            *(jnp.concatenate(parts) for parts in zip(*(o[:4] for o in outs))),
            num_decode_steps=jnp.max(jnp.stack([o.num_decode_steps for o in outs]))))

    def _cache_size(self) -> int:
        return self._jitted._cache_size()

    def __call__(self, params, prompt_ids_BxP, prompt_mask_BxP, key, greedy):
        B = prompt_ids_BxP.shape[0]
        k = host_chunks(self._config, self._mesh, B, 1 if greedy else self._group)
        if k == 1:
            return self._jitted(params, prompt_ids_BxP, prompt_mask_BxP, key, np.int32(0), greedy, B)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_host_threads(self._config, self._mesh),
                                            thread_name_prefix="grpo_jax-sample")

        def run(i, ids, mask):  # waiting in the worker: chunks dispatched without it sometimes ran one by one
            return jax.block_until_ready(self._jitted(params, ids, mask, key, self._offset(i * (B // k)), greedy, B))
        chunks = self._split(prompt_ids_BxP, prompt_mask_BxP, k)
        futures = [self._pool.submit(run, i, ids, mask) for i, (ids, mask) in enumerate(chunks)]
        return self._concat([f.result() for f in futures])


def jit_generate(graphdef, mesh, *, config: SamplingConfig, eos_token_ids: tuple[int, ...], pad_token_id: int,
                 params_sharding=None, prompt_group_size: int = 1):
    """`generate` jitted over `mesh`: `fn(params, prompt_ids, prompt_mask, key, greedy) -> SampleOutput`.

    Prompt rows and outputs split over (data, fsdp), key and step count replicated; `params_sharding`
    (`sharding.param_shardings`) None takes the params' own layout. `greedy` is static: greedy calls
    (evaluation) have one row per prompt, sampling calls `prompt_group_size` rows per prompt. On a one-device
    mesh `config.host_threads` may split a call into row chunks run concurrently (`host_chunks`).
    """
    from grpo_jax import sharding  # local: sharding does not depend on sampling, keep it that way

    if config.host_threads > 1 and mesh.devices.size > 1:
        raise ValueError(f"sampling.host_threads={config.host_threads} splits one device's rows over host "
                         f"threads, but the mesh has {mesh.devices.size} devices (which already sample in "
                         "parallel): set it to 0 or 1")
    rows, replicated = sharding.row_sharded(mesh), sharding.replicated(mesh)

    def sample(params, prompt_ids_BxP, prompt_mask_BxP, key, row_offset, greedy, total_rows):
        cache = sharding.cache_sharding(mesh, model_config(graphdef, params).num_key_value_heads)
        return generate(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, config=config,
                        eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, greedy=greedy,
                        prompt_group_size=1 if greedy else prompt_group_size, cache_sharding=cache,
                        row_offset=row_offset, total_rows=total_rows)

    jitted = jax.jit(sample, static_argnums=(5, 6),
                     in_shardings=(params_sharding, rows, rows, replicated, replicated),
                     out_shardings=SampleOutput(rows, rows, rows, rows, num_decode_steps=replicated))
    return _Sampler(jitted, config, mesh, prompt_group_size, replicated)
