"""The decoder's page scheduling over a paged KV cache (`models.paged`): a page for each decoding row's next token,
rows that wait for pages and the youngest rows preempted when a pool smaller than every slot's row runs short.
Functions of a `decoder.Decoding` (its slots, rows and ``page_free`` free list), used by `grpo_jax.algo.decoder`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models import paged


def small_pool(options, N: int, P: int, shards: int) -> bool:
    """Whether a row shard's pool holds fewer pages than every one of its slots' whole rows (rows then wait and are
    preempted)."""
    T = options.sampling.max_completion_length
    if not options.page_size:
        return False
    pages = paged.num_pages(options.kv_cache_tokens, N, P, T, options.page_size, shards)
    return pages < N // shards * paged.pages_per_row(P, T, options.page_size)


def page_need(d, page_size: int):
    """[N] bool: the live slots whose pending token starts a page they do not hold yet."""
    B, _ = d.prompt_mask.shape
    rows_N = jnp.minimum(d.slot_row, B - 1)
    position_N = jnp.sum(d.prompt_mask[rows_N], axis=1, dtype=jnp.int32) + d.length[rows_N] - 1
    page_N, _ = paged.locate(d.cache.pages_NxQ, position_N[:, None], page_size, d.page_free.shape[1])
    return d.live & (page_N[:, 0] == d.page_free.shape[1])


def _victims(live_n, slot_row_n, need_n, held_n, free_p):
    """[n] bool: a shard's youngest live rows that give their pages up so that its other rows' new pages fit."""
    order_n = jnp.argsort(jnp.where(live_n, -slot_row_n, 1))  # youngest live rows first, then the rest
    freed_n = jnp.cumsum(jnp.where(live_n, held_n, 0)[order_n])
    spared_n = jnp.cumsum(need_n[order_n])
    free, total = jnp.sum(free_p), jnp.sum(need_n)
    fits_n = free + freed_n >= total - spared_n
    count = jnp.where(free >= total, 0, jnp.argmax(fits_n) + 1)
    return jnp.zeros_like(live_n).at[order_n].set(jnp.arange(live_n.shape[0]) < count) & live_n


def preempt(d, page_size: int):
    """With too few free pages in a row shard for this step's new pages, its youngest live rows (highest row first)
    give their slots and pages up until the rest fit; they wait to be admitted again (`decoder._readmit`: recomputed
    in one pass). A shard's oldest live row is never preempted while its pool holds a whole row: every step decodes
    a token."""
    B = d.tokens.shape[0]
    S, pages = d.page_free.shape
    need_N = page_need(d, page_size)
    held_N = jnp.sum(d.cache.pages_NxQ < pages, axis=1)
    shard = lambda x: x.reshape(S, -1)  # noqa: E731
    victim_N = jax.vmap(_victims)(shard(d.live), shard(d.slot_row), shard(need_N), shard(held_N),
                                  d.page_free).reshape(-1)
    pages_NxQ, page_free = paged.release(d.cache.pages_NxQ, d.page_free, victim_N)
    rows_at = jnp.where(victim_N, d.slot_row, B)  # B: dropped
    return d._replace(cache=d.cache._replace(pages_NxQ=pages_NxQ), page_free=page_free, live=d.live & ~victim_N,
                      slot_row=jnp.where(victim_N, B, d.slot_row), ready=d.ready.at[rows_at].set(True, mode="drop"),
                      preempted=d.preempted + jnp.sum(victim_N))


def spare_pages(d, page_size: int):
    """[shards] free pages a row shard has beyond this step's new pages of its live rows."""
    S = d.page_free.shape[0]
    return jnp.sum(d.page_free, axis=1) - jnp.sum(page_need(d, page_size).reshape(S, -1), axis=1)


def fit_in_shards(slots_M, pages_M, spare_S, num_slots: int):
    """[M] bool: the rows going to ``slots_M`` (in order; N: none) whose ``pages_M`` fit in their shards' ``spare_S``
    beside the rows before them that go to the same shard."""
    shard_M = jnp.minimum(slots_M, num_slots - 1) // (num_slots // spare_S.shape[0])
    M = slots_M.shape[0]
    before_MxM = (shard_M[:, None] == shard_M[None]) & (jnp.arange(M)[None] <= jnp.arange(M)[:, None])
    return jnp.sum(jnp.where(before_MxM, pages_M[None], 0), axis=1) <= spare_S[shard_M]


def page_step(d, prompt_len_N, completion_N, P: int, T: int, page_size: int):
    """``d`` with a page for each live slot's pending token (completion index ``completion_N``) and the cache's
    maps for a decode step: write it there, read the slots back in the contiguous order of P + T slots."""
    position_N = jnp.where(d.live, prompt_len_N + completion_N, -1)
    pages_NxQ, page_free = paged.grow(d.cache.pages_NxQ, d.page_free, position_N + 1, page_size)
    cache = d.cache._replace(pages_NxQ=pages_NxQ, length_N=prompt_len_N + completion_N + 1,
                             write_NxA=position_N[:, None], view_NxS=paged.contiguous_positions(prompt_len_N, P, T))
    return d._replace(cache=cache, page_free=page_free)
