"""A decoding call's state (`Decoding`) and static options (`DecodeOptions`), and the pieces a decode step is made
of: free slots taking waiting rows (`admit`), each slot's next token drawn (`sample_next`) with its row's noise
(`slot_noise`), the experts recorded (`record_experts`). `grpo_jax.algo.decoder` composes them into `start`,
`advance` and `append`; its docstring has the dimension letters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.algo.sampling import draw, row_noise
from grpo_jax.config.sections import SamplingConfig
from grpo_jax.models import paged

SEGMENTS = 16  # `advance(segment=True)` returns after about 1 / SEGMENTS of the call's groups end (at least one)
READMIT_ROWS = 8  # rows admitted again after `append` in one decode step, at most (the pass is [8, T] tokens)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """A decoding call's static options (hashable: a jit static argument)."""

    sampling: SamplingConfig
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    greedy: bool = False  # arg-max tokens (their log-probs still at the temperature)
    group_size: int = 1  # G: rows g*G .. g*G + G - 1 share a prompt (`data.repeat_groups`), prefilled once
    num_slots: int = 0  # N rows decode at once; 0: every row (a static batch)
    pause_at_eos: bool = False  # EOS pauses a row for `append` / `retire` instead of ending it (multi-turn)
    noise_ahead: bool = False  # draw every row's noise of every step in `start` (`cpu.py`: one draw, not T)
    argmax: Callable | None = None  # arg-max of the last axis (`cpu.argmax_last_axis`); None: jnp.argmax
    cache_sharding: Any = None  # the slots' KV cache layout over a mesh (`sharding.cache_sharding`); None: XLA's
    record_routing: bool = False  # keep each token's experts (mixture of experts, routing replay)
    page_size: int = 0  # a paged KV cache of pages of this many tokens (`models.paged`); 0: contiguous per slot
    kv_cache_tokens: int = 0  # the paged cache's pool in tokens (`paged.num_pages`); 0: every slot's whole row


class Decoding(NamedTuple):
    """A call between two decoding steps: the call's prompts, its N slots and its B rows as far as they got."""

    key: jax.Array  # the call's sampling key
    row_offset: jax.Array  # [] int32: these rows are rows row_offset .. of the call (host-thread chunks)
    prompt_ids: jax.Array  # [B, P]
    prompt_mask: jax.Array  # [B, P]
    prompt_kv: Any  # KVCache of each distinct prompt, [R, K, P, Dh] per layer (refills copy it in)
    prompt_logits: jax.Array  # [R, V]: each prompt's next-token logits (a row's first token)
    noise: jax.Array | None  # [B, T, V] every step's noise, with ``noise_ahead``
    slot_row: jax.Array  # [N] the row each slot holds (B: none)
    live: jax.Array  # [N] the slot's row is decoding (its pending token goes in next)
    pending: jax.Array  # [N] the row's last token, not fed through the model yet
    cache: Any  # KVCache [N, K, S, Dh] per layer, or a `paged.PagedKVCache` (``page_size``)
    cache_mask: jax.Array  # [N, S] int32: the cache slots holding the row's tokens
    tokens: jax.Array  # [B, T] completion tokens, sampled or appended (pad after)
    sampled: jax.Array  # [B, T] int32: 1 on sampled tokens
    logps: jax.Array  # [B, T] float32: the sampler's log-probs (0 where not sampled)
    turns: jax.Array  # [B, T] int32: each token's turn, -1 after the row's last token
    length: jax.Array  # [B] tokens in the completion so far
    turn: jax.Array  # [B] the row's current turn
    ended: jax.Array  # [B] bool: the row is over (EOS without pause_at_eos, T tokens, or retired)
    paused: jax.Array  # [B] bool: the row sampled EOS with pause_at_eos and waits for `append` or `retire`
    ready: jax.Array  # [B] bool: tokens were appended to the row, which waits to be admitted again
    at_eos: jax.Array  # [B] bool: the row's last token is a sampled EOS (not truncated)
    next_row: jax.Array  # [] the first row still waiting for a slot
    steps: jax.Array  # [] decode steps run (forward passes of the N slots)
    routing: jax.Array | None = None  # [B, P + T, L, K] each token's experts per layer, with ``record_routing``
    page_free: jax.Array | None = None  # [shards, pages] bool: each row shard's free pages, with ``page_size``
    preempted: jax.Array | None = None  # [] rows preempted for pages so far (a pool smaller than every slot's row)
    seen: jax.Array | None = None  # [B, V] bool: the row's prompt and completion tokens, with a repetition penalty


def record_experts(d: Decoding, routed, rows_M, places_MxA, valid_MxA) -> Decoding:
    """``d.routing`` with a forward's experts ([L, M, A, K], of the `Routing` ``routed``) written at rows ``rows_M``,
    row places ``places_MxA`` (indices into prompt ++ completion) where ``valid_MxA``. ``rows_M`` None: a static
    batch's step, every row m at one place (A = 1), a column write (no scatter across the row shards)."""
    if d.routing is None:
        return d
    B = d.routing.shape[0]
    experts_MxAxLxK = routed.experts.transpose(1, 2, 0, 3).astype(d.routing.dtype)
    if rows_M is None:
        at = places_MxA[0, 0]
        old_BxAxLxK = jax.lax.dynamic_slice_in_dim(d.routing, at, 1, axis=1)
        new_BxAxLxK = jnp.where(valid_MxA[:, :, None, None], experts_MxAxLxK, old_BxAxLxK)
        return d._replace(routing=jax.lax.dynamic_update_slice_in_dim(d.routing, new_BxAxLxK, at, axis=1))
    rows_MxA = jnp.where(valid_MxA, rows_M[:, None], B)  # B: dropped
    return d._replace(routing=d.routing.at[rows_MxA, places_MxA].set(experts_MxAxLxK, mode="drop"))


def constrain_cache(cache, options: DecodeOptions):
    if options.cache_sharding is None or isinstance(cache, paged.PagedKVCache):  # pools: XLA's layout
        return cache
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, options.cache_sharding), cache)


def slot_noise(decoding: Decoding, rows_N, t_N, vocab: int):
    """Each slot's noise for its row's next token."""
    if decoding.noise is not None:
        return decoding.noise[rows_N, jnp.minimum(t_N, decoding.noise.shape[1] - 1)]
    return jax.vmap(lambda r, t: row_noise(decoding.key, decoding.row_offset + r, t, vocab))(rows_N, t_N)


def free_slots(d: Decoding):
    """[N] bool: slots holding no row or a row that is over (a paused row keeps its slot)."""
    B = d.tokens.shape[0]
    return (d.slot_row == B) | d.ended[jnp.minimum(d.slot_row, B - 1)]


def admit(d: Decoding, logits_NxV, group_size: int, options: DecodeOptions):
    """Free slots take the next waiting rows, in slot order: their prompts' keys/values and mask go in, and their
    logits become the prompts' next-token logits."""
    B, P = d.prompt_mask.shape
    free_N = takes_N = free_slots(d)
    if d.preempted is not None:  # a small pool: a slot takes a row when its shard has pages for a whole prompt
        S, N = d.page_free.shape[0], free_N.shape[0]
        need_SxN = jnp.cumsum(free_N.reshape(S, -1), axis=1) * -(-(P + 1) // options.page_size)
        takes_N = free_N & (need_SxN <= jnp.sum(d.page_free, axis=1, keepdims=True)).reshape(N)
    new_row_N = d.next_row + jnp.cumsum(takes_N) - 1
    admit_N = takes_N & (new_row_N < B) & ~jnp.any(d.ready)  # rows appended to go first: their groups end sooner
    row_N = jnp.where(admit_N, new_row_N, jnp.where(free_N, B, d.slot_row))
    safe_N = jnp.minimum(row_N, B - 1)
    group_N = safe_N // group_size

    def admit_mask(mask_NxS):
        prompt_mask_NxS = jnp.zeros_like(mask_NxS).at[:, :P].set(d.prompt_mask[safe_N].astype(mask_NxS.dtype))
        return jnp.where(admit_N[:, None], prompt_mask_NxS, mask_NxS)

    def copy_prompts(cache_and_mask):
        cache, mask_NxS = cache_and_mask
        cache = jax.tree.map(lambda c_NxKxSxDh, p_RxKxPxDh: c_NxKxSxDh.at[:, :, :P].set(jnp.where(
            admit_N[:, None, None, None], p_RxKxPxDh[group_N], c_NxKxSxDh[:, :, :P])), cache, d.prompt_kv)
        return constrain_cache(cache, options), admit_mask(mask_NxS)

    def page_prompts(cache_mask_free):  # the prompt's real tokens into fresh pages, first in the row
        cache, mask_NxS, free = cache_mask_free
        prompt_len_N = jnp.sum(d.prompt_mask[safe_N], axis=1, dtype=jnp.int32)
        cache, free = paged.store(cache, free, admit_N, tuple(tuple(p[group_N] for p in kv) for kv in d.prompt_kv),
                                  paged.contiguous_positions(prompt_len_N, P, 0), prompt_len_N, options.page_size)
        return cache, admit_mask(mask_NxS), free

    if options.page_size:
        cache, cache_mask, page_free = jax.lax.cond(jnp.any(admit_N), page_prompts, lambda c: c,
                                                    (d.cache, d.cache_mask, d.page_free))
        d = d._replace(page_free=page_free)
    else:
        cache, cache_mask = jax.lax.cond(jnp.any(admit_N), copy_prompts, lambda cm: cm, (d.cache, d.cache_mask))
    logits_NxV = jnp.where(admit_N[:, None], d.prompt_logits[group_N].astype(logits_NxV.dtype), logits_NxV)
    d = d._replace(slot_row=row_N, live=d.live | admit_N, next_row=d.next_row + jnp.sum(admit_N), cache=cache,
                   cache_mask=cache_mask)
    return d, logits_NxV


def sample_next(d: Decoding, logits_NxV, options: DecodeOptions, in_step: bool = False) -> Decoding:
    """Each decoding slot's next token, drawn with its row's noise at its row's step, written at its row.
    ``in_step``: a static batch, whose slot n holds row n and whose live rows all draw token ``d.steps + 1``: the
    writes are one column, not scatters."""
    B, T = d.tokens.shape
    live_N = d.live
    # a static batch's rows as they are, not gathered through slot_row (on a pod: across the row shards)
    rows_N = jnp.arange(B) if in_step else jnp.minimum(d.slot_row, B - 1)
    at_rows = (lambda x: x) if in_step else (lambda x: x[rows_N])  # noqa: E731
    t_N = jnp.broadcast_to(d.steps + 1, live_N.shape) if in_step else d.length[rows_N]
    noise = None if options.greedy else slot_noise(d, rows_N, t_N, logits_NxV.shape[-1])
    seen_NxV = None if d.seen is None else at_rows(d.seen)
    tokens_N, logp_N = draw(logits_NxV, noise, options.sampling, greedy=options.greedy, argmax=options.argmax,
                            seen_NxV=seen_NxV)
    if in_step:
        t = jnp.minimum(d.steps + 1, T - 1)  # rows that ended keep their column

        def write(x_BxT, v_N):
            return jax.lax.dynamic_update_slice_in_dim(
                x_BxT, jnp.where(live_N, v_N, jax.lax.dynamic_index_in_dim(x_BxT, t, 1, False))[:, None], t, 1)

        def flag(x_B, v_N):
            return jnp.where(live_N, v_N, x_B)
    else:
        at = jnp.where(live_N, rows_N, B)  # B: out of bounds, the write is dropped
        write = lambda x_BxT, v_N: x_BxT.at[at, t_N].set(v_N, mode="drop")  # noqa: E731
        flag = lambda x_B, v_N: x_B.at[at].set(v_N, mode="drop")  # noqa: E731
    eos_N = jnp.isin(tokens_N, jnp.asarray(options.eos_token_ids, jnp.int32))
    full_N = t_N + 1 >= T
    # a turn that ends on the last token pauses too: the host reads its tool calls (TRL runs them, then rolls back)
    pause_N = eos_N if options.pause_at_eos else jnp.zeros_like(eos_N)
    end_N = (full_N | eos_N) & ~pause_N
    park = d.slot_row.shape[0] < B  # rows wait for slots: a paused row gives its slot up
    seen = None if d.seen is None else d.seen.at[jnp.where(live_N, rows_N, B), tokens_N].set(True, mode="drop")
    return d._replace(
        live=live_N & ~end_N & ~pause_N, pending=jnp.where(live_N, tokens_N, d.pending), seen=seen,
        slot_row=jnp.where(live_N & pause_N, B, d.slot_row) if park else d.slot_row,
        tokens=write(d.tokens, tokens_N), sampled=write(d.sampled, jnp.ones_like(tokens_N)),
        logps=write(d.logps, logp_N), turns=write(d.turns, at_rows(d.turn)), length=flag(d.length, t_N + 1),
        ended=flag(d.ended, end_N), paused=flag(d.paused, pause_N), at_eos=flag(d.at_eos, eos_N))


def finished_groups(ended_B, group_size: int):
    """How many groups of ``group_size`` rows have every row over."""
    return jnp.sum(jnp.all(ended_B.reshape(-1, group_size), axis=1))


def continuous_slots(max_batch_rows: int, rows: int, total_rows: int, row_shards: int) -> int:
    """Decode slots for ``rows`` of a decoding call over ``total_rows`` (a host-thread chunk takes its share of
    ``sampling.max_batch_rows``), a multiple of the mesh's ``row_shards``; ``rows`` (a static batch) when that is
    not fewer."""
    if not max_batch_rows:
        return rows
    share = -(-max_batch_rows * rows // total_rows)
    return min(rows, -(-share // row_shards) * row_shards)
