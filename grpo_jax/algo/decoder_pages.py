"""The decoder's page scheduling over a paged KV cache (`models.paged`): a page for each decoding row's next token,
rows that wait for pages and the youngest rows preempted when a pool smaller than every slot's row runs short.
Functions of a `decoder.Decoding` (its slots, rows and ``page_free`` free list), used by `grpo_jax.algo.decoder`."""

from __future__ import annotations

import jax.numpy as jnp

from grpo_jax.models import paged


def small_pool(options, N: int, P: int) -> bool:
    """Whether the paged pool holds fewer pages than every slot's whole row (rows then wait and are preempted)."""
    T = options.sampling.max_completion_length
    if not options.page_size:
        return False
    pages = paged.num_pages(options.kv_cache_tokens, N, P, T, options.page_size)
    return pages < N * paged.pages_per_row(P, T, options.page_size)


def page_need(d, page_size: int):
    """[N] bool: the live slots whose pending token starts a page they do not hold yet."""
    B, _ = d.prompt_mask.shape
    rows_N = jnp.minimum(d.slot_row, B - 1)
    position_N = jnp.sum(d.prompt_mask[rows_N], axis=1, dtype=jnp.int32) + d.length[rows_N] - 1
    page_N, _ = paged.locate(d.cache.pages_NxQ, position_N[:, None], page_size, d.page_free.shape[0])
    return d.live & (page_N[:, 0] == d.page_free.shape[0])


def preempt(d, page_size: int):
    """With too few free pages for this step's new pages, the youngest live rows (highest row first) give their
    slots and pages up until the rest fit; they wait to be admitted again (`decoder._readmit`: recomputed in one
    pass). The oldest live row is never preempted while the pool holds a whole row: every step decodes a token."""
    B = d.tokens.shape[0]
    pages = d.page_free.shape[0]
    need_N = page_need(d, page_size)
    held_N = jnp.sum(d.cache.pages_NxQ < pages, axis=1)
    order_N = jnp.argsort(jnp.where(d.live, -d.slot_row, 1))  # youngest live rows first, then the rest
    freed_N = jnp.cumsum(jnp.where(d.live, held_N, 0)[order_N])
    spared_N = jnp.cumsum(need_N[order_N])
    free, total = jnp.sum(d.page_free), jnp.sum(need_N)
    fits_N = free + freed_N >= total - spared_N
    count = jnp.where(free >= total, 0, jnp.argmax(fits_N) + 1)
    first_N = jnp.arange(d.live.shape[0]) < count
    victim_N = jnp.zeros_like(d.live).at[order_N].set(first_N) & d.live
    pages_NxQ, page_free = paged.release(d.cache.pages_NxQ, d.page_free, victim_N)
    rows_at = jnp.where(victim_N, d.slot_row, B)  # B: dropped
    return d._replace(cache=d.cache._replace(pages_NxQ=pages_NxQ), page_free=page_free, live=d.live & ~victim_N,
                      slot_row=jnp.where(victim_N, B, d.slot_row), ready=d.ready.at[rows_at].set(True, mode="drop"),
                      preempted=d.preempted + jnp.sum(victim_N))


def page_step(d, prompt_len_N, completion_N, P: int, T: int, page_size: int):
    """``d`` with a page for each live slot's pending token (completion index ``completion_N``) and the cache's
    maps for a decode step: write it there, read the slots back in the contiguous order of P + T slots."""
    position_N = jnp.where(d.live, prompt_len_N + completion_N, -1)
    pages_NxQ, page_free = paged.grow(d.cache.pages_NxQ, d.page_free, position_N + 1, page_size)
    cache = d.cache._replace(pages_NxQ=pages_NxQ, length_N=prompt_len_N + completion_N + 1,
                             write_NxA=position_N[:, None], view_NxS=paged.contiguous_positions(prompt_len_N, P, T))
    return d._replace(cache=cache, page_free=page_free)
