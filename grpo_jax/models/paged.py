"""The paged KV cache: each layer's keys/values in a pool of pages, a page table per decode slot, pages taken from a
free list as a row grows and given back when its slot is freed; and its sizing.

A slot's row is laid out in its pages as its prompt's real tokens first (left padding dropped), then its completion:
row position j sits in page ``pages_NxQ[n, j // page_size]`` at offset ``j % page_size``, so a row's valid tokens
are positions [0, length) as the decode kernels take them. The dense path reads a slot back in today's contiguous
order (left-padded prompt in slots 0 .. P - 1, completion t at slot P + t) through a per-step position map.

Dimension letters: N decode slots, Q pages per slot, K key/value heads, Dh head dim, S = P + T slots of the
contiguous order, A tokens written per slot; "pages" in shapes is the pool's page count. ``NONE`` in a page table is
the pool's page count: out of range, so writes there are dropped and reads filled with zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PagedKVCache(NamedTuple):
    """Key/value pages, one pool per layer ([K, pages, page_size, Dh], the kernels' layout), and where a pass
    writes and reads: row positions of its new tokens [N, A] and of the contiguous order's slots [N, S] (-1: none),
    each row's valid tokens after the write [N]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    pages_NxQ: jax.Array
    length_N: jax.Array
    write_NxA: jax.Array
    view_NxS: jax.Array


def pages_per_row(prompt_length: int, completion_length: int, page_size: int) -> int:
    """Q: pages a slot may hold (a whole row, prompt and completion)."""
    return -(-(prompt_length + completion_length) // page_size)


def num_pages(kv_cache_tokens: int, num_slots: int, prompt_length: int, completion_length: int, page_size: int):
    """The pool's pages for ``sampling.kv_cache_tokens`` (0: every slot's whole row, nothing waits; never more).
    A smaller pool must hold one whole row (the oldest row then always decodes; `decoder` preempts the others)."""
    row = pages_per_row(prompt_length, completion_length, page_size)
    if kv_cache_tokens == 0:
        return num_slots * row
    pages = -(-kv_cache_tokens // page_size)
    if pages < row:
        raise ValueError(f"sampling.kv_cache_tokens={kv_cache_tokens} holds {pages} pages of {page_size}, fewer than "
                         f"one row of {prompt_length} + {completion_length} tokens: raise it to >= {row * page_size}")
    return min(pages, num_slots * row)


def cache_bytes(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, slots: int, prompt_length: int,
                completion_length: int, page_size: int = 0, distinct_prompts: int = 1, kv_cache_tokens: int = 0):
    """Bytes of keys and values a decoding call holds: ``page_size`` 0, the contiguous cache (every slot
    prompt + completion, beside the distinct prompts' keys/values); else the paged pool (`num_pages`) beside them."""
    per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    prompts = distinct_prompts * prompt_length * per_token
    if page_size == 0:
        return prompts + slots * (prompt_length + completion_length) * per_token
    pages = num_pages(kv_cache_tokens, slots, prompt_length, completion_length, page_size)
    return prompts + pages * page_size * per_token


def init(num_layers: int, kv_heads: int, head_dim: int, dtype, pages: int, page_size: int, num_slots: int,
         max_pages: int, contiguous_length: int) -> PagedKVCache:
    """Zero pools, an empty page table and empty maps (nothing written, nothing read)."""
    pool = lambda: tuple(jnp.zeros((kv_heads, pages, page_size, head_dim), dtype)  # noqa: E731
                         for _ in range(num_layers))
    return PagedKVCache(pool(), pool(), jnp.full((num_slots, max_pages), pages, jnp.int32),
                        jnp.zeros((num_slots,), jnp.int32), jnp.full((num_slots, 1), -1, jnp.int32),
                        jnp.full((num_slots, contiguous_length), -1, jnp.int32))


def locate(pages_NxQ, position_NxA, page_size: int, pages: int):
    """(page, offset) [N, A] of row positions; page ``pages`` (out of range) where the position is -1 or beyond
    the table, or its page is not taken."""
    Q = pages_NxQ.shape[1]
    valid = (position_NxA >= 0) & (position_NxA < Q * page_size)
    index = jnp.clip(position_NxA // page_size, 0, Q - 1)
    page_NxA = jnp.where(valid, jnp.take_along_axis(pages_NxQ, index, axis=1), pages)
    return page_NxA, jnp.where(valid, position_NxA % page_size, 0)


def write(pool, pages_NxQ, position_NxA, new_NxKxAxDh):
    """``pool`` with the new keys (or values) at their row positions (-1: not written)."""
    page_NxA, offset_NxA = locate(pages_NxQ, position_NxA, pool.shape[2], pool.shape[1])
    return pool.at[:, page_NxA, offset_NxA].set(new_NxKxAxDh.transpose(1, 0, 2, 3).astype(pool.dtype), mode="drop")


def gather(pool, pages_NxQ, position_NxS):
    """[N, K, S, Dh]: the keys (or values) at row positions ``position_NxS`` (zeros at -1)."""
    page_NxS, offset_NxS = locate(pages_NxQ, position_NxS, pool.shape[2], pool.shape[1])
    return pool.at[:, page_NxS, offset_NxS].get(mode="fill", fill_value=0).transpose(1, 0, 2, 3)


def contiguous_positions(prompt_len_N, prompt_width: int, completion_slots: int, completion_length_N=None):
    """[N, S] row position of each slot of the contiguous order (S = prompt_width + completion_slots): the
    left-padded prompt's slot s holds position s - padding, completion slot t position prompt_len + t; -1 for
    padding and, with ``completion_length_N``, completion slots past it."""
    s_S = jnp.arange(prompt_width + completion_slots)
    pad_N = prompt_width - prompt_len_N
    position_NxS = jnp.where(s_S[None] < prompt_width, s_S[None] - pad_N[:, None],
                             prompt_len_N[:, None] + s_S[None] - prompt_width)
    valid_NxS = position_NxS >= 0
    if completion_length_N is not None:
        valid_NxS &= s_S[None] < prompt_width + completion_length_N[:, None]
    return jnp.where(valid_NxS, position_NxS, -1)


def release(pages_NxQ, free_pages, slots_N):
    """(page table, free list) with the pages of slots ``slots_N`` (bool [N]) given back."""
    pages = free_pages.shape[0]
    taken_NxQ = jnp.where(slots_N[:, None], pages_NxQ, pages)
    return jnp.where(slots_N[:, None], pages, pages_NxQ), free_pages.at[taken_NxQ].set(True, mode="drop")


def grow(pages_NxQ, free_pages, upto_N, page_size: int):
    """(page table, free list) with slot n's pages covering row positions [0, upto_N[n]): each missing page taken
    from the free list, in slot order (none left: the page stays missing, its writes dropped; `num_pages` sizes
    the pool so that this cannot happen)."""
    N, Q = pages_NxQ.shape
    pages = free_pages.shape[0]
    need_NxQ = (jnp.arange(Q)[None] < -(-upto_N[:, None] // page_size)) & (pages_NxQ == pages)
    rank_NxQ = jnp.cumsum(need_NxQ.reshape(-1)).reshape(N, Q) - 1
    free_ids = jnp.nonzero(free_pages, size=min(N * Q, pages), fill_value=pages)[0]
    take_NxQ = jnp.where(need_NxQ, free_ids[jnp.minimum(rank_NxQ, free_ids.shape[0] - 1)], pages)
    take_NxQ = jnp.where(rank_NxQ < free_ids.shape[0], take_NxQ, pages)
    return jnp.where(need_NxQ, take_NxQ, pages_NxQ), free_pages.at[take_NxQ].set(False, mode="drop")


def store(cache: PagedKVCache, free_pages, slots_M, contiguous: tuple, position_MxS, upto_M):
    """(cache, free list) with slots ``slots_M`` (N: none) given fresh pages covering [0, upto_M) and the
    contiguous keys/values ``contiguous`` ((k, v) L-tuples of [M, K, S, Dh]) written at ``position_MxS``."""
    N = cache.pages_NxQ.shape[0]
    held_N = jnp.zeros((N,), bool).at[slots_M].set(True, mode="drop")
    pages_NxQ, free_pages = release(cache.pages_NxQ, free_pages, held_N)
    upto_N = jnp.zeros((N,), jnp.int32).at[slots_M].set(upto_M, mode="drop")
    pages_NxQ, free_pages = grow(pages_NxQ, free_pages, upto_N, cache.k[0].shape[2])
    rows_MxQ = pages_NxQ[jnp.minimum(slots_M, N - 1)]
    position_MxS = jnp.where((slots_M < N)[:, None], position_MxS, -1)
    k, v = (tuple(write(pool, rows_MxQ, position_MxS, new) for pool, new in zip(pools, news))
            for pools, news in zip((cache.k, cache.v), contiguous))
    return cache._replace(k=k, v=v, pages_NxQ=pages_NxQ), free_pages


def view(cache: PagedKVCache, slots_M, position_MxS):
    """(k, v) L-tuples [M, K, S, Dh]: slots ``slots_M`` read back in the contiguous order."""
    rows_MxQ = cache.pages_NxQ[slots_M]
    return tuple(tuple(gather(pool, rows_MxQ, position_MxS) for pool in pools) for pools in (cache.k, cache.v))


class LayerPages(NamedTuple):
    """One layer's pools and the pass's maps (`PagedKVCache`), as `models.layers.Attention` takes its cache."""

    k: jax.Array
    v: jax.Array
    cache: PagedKVCache
