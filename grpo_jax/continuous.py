"""Continuous batching: N slots decode while the call's other rows wait, and a row that ends hands its slot on.

Dimension letters: B rows of the call, N slots (N < B), R = B / G distinct prompts, P prompt tokens (left-padded),
T = max_completion_length, S = P + T cache slots per decode slot, V vocab.

A static batch decodes every row until the longest ends, so with lengths spread like real runs (mean a quarter of
the longest) most of its decoded slots are padding. Here every prompt is prefilled once up front (its keys and
values kept, P slots each); a decode step then runs the N slots, and a slot whose row ended (EOS or T tokens) is
refilled with the next waiting row: its prompt's keys/values are copied in and its first token is drawn from the
prompt's logits, inside the same device loop. Shapes are static throughout; the loop ends when no row is left.

Row b's token t is drawn with row b's Gumbel noise at step t (`sampling.gumbel_rows`), the noise `sampling.generate`
adds to that row: the tokens are a function of (params, prompt, key, b) alone, the same whatever N, and the same as
`sampling.generate`'s up to the float rounding of a batch of another size.

`start` and `advance` run the same loop in segments, each ending once more of the call's groups have finished,
so that the host can score finished groups while the devices decode the others (`grpo_jax.stream`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.models import compute_dtype_params, forward, layer_params, model_config, rotary_tables, unembed
from grpo_jax.sampling import SampleOutput, SamplingConfig, filter_logits, gumbel_rows, prefill

SEGMENTS = 16  # `advance` returns after about 1 / SEGMENTS of the call's groups finished (at least one group)


class _SlotState(NamedTuple):
    row_N: jax.Array          # the row each slot decodes (B: none)
    t_N: jax.Array            # tokens its row has sampled
    pending_N: jax.Array      # its row's last token, not yet fed through the model
    live_N: jax.Array         # its row has not ended
    next_row: jax.Array       # the first row still waiting
    iterations: jax.Array     # decode steps run
    cache: object
    mask_NxS: jax.Array
    ids_BxT: jax.Array
    completion_mask_BxT: jax.Array
    logps_BxT: jax.Array
    ended_by_eos_B: jax.Array
    ended_B: jax.Array        # the row ended (EOS or T tokens)


class Decoding(NamedTuple):
    """A continuously batched call between two segments of its loop (`start`, `advance`)."""

    state: _SlotState
    prompts_R: object  # each prompt's keys/values (refills copy them in)
    logits_RxV: jax.Array  # each prompt's next-token logits (a refilled slot's first token)


def generate(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, *, config: SamplingConfig, num_slots: int,
             eos_token_ids: tuple[int, ...], pad_token_id: int, greedy: bool = False, prompt_group_size: int = 1,
             row_offset=0, total_rows: int | None = None, cache_sharding=None, argmax=None) -> SampleOutput:
    """`sampling.generate`'s output for the same rows, decoded ``num_slots`` rows at a time.

    ``row_offset`` / ``total_rows``: these B rows are rows ``row_offset ..`` of a call over ``total_rows`` rows
    (None: B), whose noise they draw (`cpu.ChunkedSampler`'s chunks). ``argmax`` replaces ``jnp.argmax`` (e.g.
    `cpu.argmax_last_axis`); ``cache_sharding`` pins the slots' KV cache over a mesh. ``num_decode_steps`` counts
    the loop's decode steps (forward passes of the N slots).
    """
    options = dict(config=config, num_slots=num_slots, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                   greedy=greedy, prompt_group_size=prompt_group_size, row_offset=row_offset, total_rows=total_rows,
                   cache_sharding=cache_sharding, argmax=argmax)
    decoding = start(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, **options)
    return output(advance(graphdef, params, decoding, prompt_mask_BxP, key, until_done=True, **options))


def start(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, **options) -> Decoding:
    """Prefill every prompt and fill the slots with the first rows (their first tokens drawn): no decode step yet.
    ``options``: `generate`'s keywords."""
    B, P = prompt_ids_BxP.shape
    params, layers, _, prompts_R, logits_RxV = prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP,
                                                       options["prompt_group_size"], P)
    first, _, _ = _loop(graphdef, params, layers, prompts_R, logits_RxV, prompt_mask_BxP, key, **options)
    return Decoding(first(), prompts_R, logits_RxV)


def advance(graphdef, params, decoding: Decoding, prompt_mask_BxP, key, *, until_done: bool = False,
            **options) -> Decoding:
    """Decode steps until about 1 / `SEGMENTS` of the call's groups (at least one) more have finished, or every
    row (``until_done``: every row). Tokens do not depend on where segments end. ``options``: `generate`'s."""
    params = compute_dtype_params(graphdef, params)
    _, cond, body = _loop(graphdef, params, layer_params(graphdef, params), decoding.prompts_R, decoding.logits_RxV,
                          prompt_mask_BxP, key, **options)
    if until_done:
        return decoding._replace(state=jax.lax.while_loop(cond, body, decoding.state))
    G = options["prompt_group_size"]
    groups = decoding.state.ended_B.shape[0] // G
    target = finished_groups(decoding.state.ended_B, G) + max(1, groups // SEGMENTS)
    state = jax.lax.while_loop(lambda st: cond(st) & (finished_groups(st.ended_B, G) < target), body, decoding.state)
    return decoding._replace(state=state)


def finished_groups(ended_B, group_size: int):
    """How many groups of ``group_size`` rows have every row ended."""
    return jnp.sum(jnp.all(ended_B.reshape(-1, group_size), axis=1))


def output(decoding: Decoding) -> SampleOutput:
    """The call's rows as `sampling.generate` returns them (rows not ended yet: what they have so far)."""
    state = decoding.state
    return SampleOutput(completion_ids=state.ids_BxT, completion_mask=state.completion_mask_BxT,
                        is_truncated=~state.ended_by_eos_B, sampler_per_token_logps=state.logps_BxT,
                        num_decode_steps=state.iterations)


def _loop(graphdef, params, layers, prompts_R, logits_RxV, prompt_mask_BxP, key, *, config: SamplingConfig,
          num_slots: int, eos_token_ids: tuple[int, ...], pad_token_id: int, greedy: bool = False,
          prompt_group_size: int = 1, row_offset=0, total_rows: int | None = None, cache_sharding=None, argmax=None):
    """(first() -> state with the first rows in their slots, cond, body) of the decode loop; ``params`` in the
    compute dtype and ``layers`` their per-layer slices (`sampling.prefill`)."""
    B, P = prompt_mask_BxP.shape
    N, T, G = num_slots, config.max_completion_length, prompt_group_size
    if not isinstance(N, int) or not 0 < N <= B:
        raise ValueError(f"sampling.max_batch_rows gives {N!r} slots for {B} rows: it must be between 1 and the rows")
    total = B if total_rows is None else total_rows
    argmax = (lambda x: jnp.argmax(x, axis=-1)) if argmax is None else argmax  # noqa: E731
    eos_E = jnp.asarray(eos_token_ids, jnp.int32).reshape(-1)
    prompt_mask_BxP = prompt_mask_BxP.astype(jnp.int32)
    prompt_len_B = jnp.sum(prompt_mask_BxP, axis=-1)
    rope = rotary_tables(model_config(graphdef, params), P + T)  # the decode steps' positions reach P + T - 1
    constrain = (lambda c: c) if cache_sharding is None else (  # noqa: E731
        lambda c: jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, cache_sharding), c))
    slots_N = jnp.arange(N)
    V = logits_RxV.shape[-1]

    def refill(state: _SlotState, logits_NxV):
        """Ended slots take the next waiting rows, in slot order: their prompts' keys/values and mask go in."""
        free_N = ~state.live_N
        new_row_N = state.next_row + jnp.cumsum(free_N) - 1
        refill_N = free_N & (new_row_N < B)
        row_N = jnp.where(refill_N, new_row_N, jnp.where(state.live_N, state.row_N, B))
        group_N = jnp.minimum(row_N, B - 1) // G

        def copy_prompts(cache_and_mask):
            cache, mask_NxS = cache_and_mask
            cache = jax.tree.map(lambda c_NxKxSxDh, p_RxKxPxDh: c_NxKxSxDh.at[:, :, :P].set(jnp.where(
                refill_N[:, None, None, None], p_RxKxPxDh[group_N], c_NxKxSxDh[:, :, :P])), cache, prompts_R)
            prompt_mask_NxS = jnp.zeros_like(mask_NxS).at[:, :P].set(prompt_mask_BxP[jnp.minimum(row_N, B - 1)])
            return constrain(cache), jnp.where(refill_N[:, None], prompt_mask_NxS, mask_NxS)

        cache, mask_NxS = jax.lax.cond(jnp.any(refill_N), copy_prompts, lambda cm: cm, (state.cache, state.mask_NxS))
        logits_NxV = jnp.where(refill_N[:, None], logits_RxV[group_N], logits_NxV)
        return state._replace(row_N=row_N, t_N=jnp.where(refill_N, 0, state.t_N), live_N=state.live_N | refill_N,
                              next_row=state.next_row + jnp.sum(refill_N), cache=cache, mask_NxS=mask_NxS), logits_NxV

    def record(state: _SlotState, logits_NxV):
        """Each live slot's next token, drawn with its row's noise at its row's step; outputs written by row."""
        scaled_NxV = logits_NxV.astype(jnp.float32) / config.temperature
        if greedy:
            tokens_N = argmax(scaled_NxV)
        else:
            noise_NxV = jax.vmap(lambda t, row: gumbel_rows(key, t, total, row_offset + row, 1, V)[0])(
                state.t_N, jnp.minimum(state.row_N, B - 1))
            tokens_N = argmax(noise_NxV + filter_logits(scaled_NxV, config))
        tokens_N = tokens_N.astype(jnp.int32)
        logp_N = jnp.take_along_axis(jax.nn.log_softmax(scaled_NxV, axis=-1), tokens_N[:, None], axis=-1)[:, 0]
        live_N = state.live_N
        eos_N = jnp.isin(tokens_N, eos_E)
        row_N = jnp.where(live_N, state.row_N, B)  # B: out of bounds, the write is dropped
        t_N = state.t_N
        write = lambda x_BxT, v_N: x_BxT.at[row_N, t_N].set(v_N, mode="drop")  # noqa: E731
        return state._replace(
            t_N=t_N + live_N, pending_N=jnp.where(live_N, tokens_N, pad_token_id),
            live_N=live_N & ~eos_N & (t_N + 1 < T),
            ids_BxT=write(state.ids_BxT, tokens_N),
            completion_mask_BxT=write(state.completion_mask_BxT, jnp.ones_like(tokens_N)),
            logps_BxT=write(state.logps_BxT, logp_N),
            ended_by_eos_B=state.ended_by_eos_B.at[row_N].set(eos_N, mode="drop"),
            ended_B=state.ended_B.at[row_N].set(eos_N | (t_N + 1 >= T), mode="drop"))

    def cond(state: _SlotState):
        return jnp.any(state.live_N) | (state.next_row < B)

    def body(state: _SlotState):
        slot_N = P + state.t_N - 1  # where each slot's pending token goes (ended slots: harmless, refilled or idle)
        mask_NxS = state.mask_NxS.at[slots_N, slot_N].set(1)
        positions_Nx1 = (prompt_len_B[jnp.minimum(state.row_N, B - 1)] + state.t_N - 1)[:, None]
        hidden_Nx1xD, cache = forward(graphdef, params, state.pending_N[:, None], positions_Nx1, mask_NxS,
                                      state.cache, slot_N, layers=layers, rope=rope)
        logits_NxV = unembed(graphdef, params, hidden_Nx1xD)[:, 0]
        state = state._replace(cache=constrain(cache), mask_NxS=mask_NxS, iterations=state.iterations + 1)
        return record(*refill(state, logits_NxV))

    def first():
        # the prompts' caches hold their P slots only: a slot's completion part is written by its own decode steps
        cache = constrain(jax.tree.map(lambda x_RxKxPxDh: jnp.zeros(
            (N, *x_RxKxPxDh.shape[1:2], P + T, x_RxKxPxDh.shape[3]), x_RxKxPxDh.dtype), prompts_R))
        state = _SlotState(
            row_N=jnp.full((N,), B, jnp.int32), t_N=jnp.zeros((N,), jnp.int32), pending_N=jnp.zeros((N,), jnp.int32),
            live_N=jnp.zeros((N,), bool), next_row=jnp.zeros((), jnp.int32), iterations=jnp.zeros((), jnp.int32),
            cache=cache, mask_NxS=jnp.zeros((N, P + T), jnp.int32),
            ids_BxT=jnp.full((B, T), pad_token_id, jnp.int32), completion_mask_BxT=jnp.zeros((B, T), jnp.int32),
            logps_BxT=jnp.zeros((B, T), jnp.float32), ended_by_eos_B=jnp.zeros((B,), bool),
            ended_B=jnp.zeros((B,), bool))
        return record(*refill(state, jnp.zeros((N, V), logits_RxV.dtype)))

    return first, cond, body
