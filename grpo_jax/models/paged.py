"""The paged KV cache: each layer's keys/values in a pool of pages, a page table per decode slot, pages taken from a
free list as a row grows and given back when its slot is freed; and its sizing.

A slot's row is laid out in its pages as its prompt's real tokens first (left padding dropped), then its completion:
row position j sits in page ``pages_NxQ[n, j // page_size]`` at offset ``j % page_size``, so a row's valid tokens
are positions [0, length) as the decode kernels take them. The dense path reads a slot back in today's contiguous
order (left-padded prompt in slots 0 .. P - 1, completion t at slot P + t) through a per-step position map.

A sliding-window layer keeps no pages: each slot holds a `Ring` of its window's last keys/values, so its memory and
its decode reads follow the window (Gemma 3's local layers: 1,024 positions of a 16k row).

On a mesh whose row axes split the slots (`split`), each row shard has a pool and free list of its own: its slots
take pages from it only, the pool's page axis is split with the slots, and every pass writes and reads its shard's
pages in a ``shard_map`` (XLA cannot know that a page table points into the same shard, and would move pools).

Dimension letters: N decode slots, Q pages per slot, K key/value heads, Dh head dim, S = P + T slots of the
contiguous order, A tokens written per slot; "pages" in shapes is a shard's page count. ``NONE`` in a page table is
that count: out of range, so writes there are dropped and reads filled with zeros.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax.models import attention
from grpo_jax.models.attention import HEAD_AXIS, ROW_AXES


class PagedKVCache(NamedTuple):
    """Key/value pages, one pool per full-attention layer ([K, pages, page_size, Dh], the kernels' layout; a `Ring`
    per sliding-window layer), and where a pass
    writes and reads: row positions of its new tokens [N, A] and of the contiguous order's slots [N, S] (-1: none),
    each row's valid tokens after the write [N]. Over row shards (`split`) the pool's pages are the shards' own in
    shard order and a page table holds page ids local to its slot's shard."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    pages_NxQ: jax.Array
    length_N: jax.Array
    write_NxA: jax.Array
    view_NxS: jax.Array


class Ring(NamedTuple):
    """A sliding-window layer's keys (or values) in place of a pool: [N, K, W, Dh], each slot's last W row positions,
    position j at ``j % W`` (W = the window, or the row's whole length when shorter). A query at position q sees
    q - W + 1 .. q, all of them there: a window layer's memory and reads follow its window, not the row."""

    buf: jax.Array


class Split(NamedTuple):
    """How the slots' pages split over the abstract mesh (`jax.sharding.use_abstract_mesh`): ``shards`` row shards
    over the mesh axes ``rows`` (each holds its slots and a pool of its own pages, so a pass never reads another
    shard's pages) and key/value heads over ``head``; ``mesh`` None: one shard, nothing split."""

    mesh: Any
    rows: tuple[str, ...]
    head: str | None
    shards: int

    @property
    def pool(self) -> PartitionSpec:  # [K, pages, page_size, Dh]
        return PartitionSpec(self.head, self.rows or None, None, None)

    def slots(self, *trailing) -> PartitionSpec:  # [N, ...]
        return PartitionSpec(self.rows or None, *trailing)

    def map(self, fn, in_specs, out_specs, manual: bool = False):
        """``fn`` run on each shard's slots and pages (a ``shard_map``), or ``fn`` itself when nothing splits and
        not ``manual`` (a Mosaic kernel, which XLA does not partition, runs in a ``shard_map`` on any mesh)."""
        if self.mesh is None or not (self.rows or self.head or manual):
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def split(num_slots: int, kv_heads: int = 0) -> Split:
    """The abstract mesh's `Split` of ``num_slots`` slots (and ``kv_heads`` key/value heads): rows over the mesh's
    row axes of size > 1 when they divide the slots, heads over ``tensor`` when it divides them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return Split(None, (), None, 1)
    rows = tuple(a for a in ROW_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    shards = math.prod(mesh.shape[a] for a in rows)
    if num_slots % shards:
        rows, shards = (), 1
    head = HEAD_AXIS if (HEAD_AXIS in mesh.axis_names and mesh.shape[HEAD_AXIS] > 1 and kv_heads
                         and kv_heads % mesh.shape[HEAD_AXIS] == 0) else None
    return Split(mesh, rows, head, shards)


def pages_per_row(prompt_length: int, completion_length: int, page_size: int) -> int:
    """Q: pages a slot may hold (a whole row, prompt and completion)."""
    return -(-(prompt_length + completion_length) // page_size)


def num_pages(kv_cache_tokens: int, num_slots: int, prompt_length: int, completion_length: int, page_size: int,
              shards: int = 1):
    """A row shard's pages for ``sampling.kv_cache_tokens`` over ``shards`` shards of ``num_slots`` / ``shards``
    slots each (0: every slot's whole row, nothing waits; never more). A shard's pool must hold one whole row (its
    oldest row then always decodes; `decoder_pages` preempts the others)."""
    row = pages_per_row(prompt_length, completion_length, page_size)
    slots = num_slots // shards
    if kv_cache_tokens == 0:
        return slots * row
    pages = -(-kv_cache_tokens // (page_size * shards))
    if pages < row:
        where = f" over {shards} row shards ({pages} each)" if shards > 1 else ""
        raise ValueError(f"sampling.kv_cache_tokens={kv_cache_tokens} holds {-(-kv_cache_tokens // page_size)} pages "
                         f"of {page_size}{where}, fewer than one row of {prompt_length} + {completion_length} tokens "
                         f"a shard: raise it to >= {row * page_size * shards}")
    return min(pages, slots * row)


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


def init(windows: tuple, kv_heads: int, head_dim: int, dtype, pages: int, page_size: int, num_slots: int,
         max_pages: int, contiguous_length: int, shards: int = 1) -> PagedKVCache:
    """Zero pools of ``pages`` pages a shard, one per layer whose ``windows`` entry is None, a zero `Ring` per
    sliding-window layer, an empty page table and empty maps (nothing written, nothing read)."""
    def layer(window):
        if window is None:
            return jnp.zeros((kv_heads, shards * pages, page_size, head_dim), dtype)
        return Ring(jnp.zeros((num_slots, kv_heads, min(window, contiguous_length), head_dim), dtype))

    pool = lambda: tuple(layer(w) for w in windows)  # noqa: E731
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


def _write(pool, pages_NxQ, position_NxA, new_NxKxAxDh):
    # one scatter of rows into the pool seen as [K * pages * page_size, Dh], a bitcast of the kernels' row-major
    # layout: scattered over its head axis, XLA:TPU laid a pool of 2+ heads out another way and copied it whole to
    # and from the kernels' layout every decode step
    K, pages, size, Dh = pool.shape
    page_NxA, offset_NxA = locate(pages_NxQ, position_NxA, size, pages)
    row_KxNxA = jnp.where(page_NxA < pages, (jnp.arange(K)[:, None, None] * pages + page_NxA) * size + offset_NxA,
                          K * pages * size)  # out of range: dropped
    new = new_NxKxAxDh.transpose(1, 0, 2, 3).reshape(-1, Dh).astype(pool.dtype)
    rows = pool.reshape(K * pages * size, Dh).at[row_KxNxA.reshape(-1)].set(new, mode="drop")
    return rows.reshape(pool.shape)


def _gather(pool, pages_NxQ, position_NxS):
    page_NxS, offset_NxS = locate(pages_NxQ, position_NxS, pool.shape[2], pool.shape[1])
    return pool.at[:, page_NxS, offset_NxS].get(mode="fill", fill_value=0).transpose(1, 0, 2, 3)


def write(pool, pages_NxQ, position_NxA, new_NxKxAxDh):
    """``pool`` with every slot's new keys (or values) [N, K, A, Dh] at its row positions (-1: not written), each
    shard writing its own slots into its own pages."""
    s = split(pages_NxQ.shape[0], pool.shape[0])
    heads = s.slots(s.head, None, None)
    return s.map(_write, (s.pool, s.slots(None), s.slots(None), heads), s.pool)(pool, pages_NxQ, position_NxA,
                                                                                new_NxKxAxDh)


def gather(pool, pages_NxQ, position_NxS):
    """[N, K, S, Dh]: every slot's keys (or values) at row positions ``position_NxS`` (zeros at -1), each shard
    reading its own pages."""
    s = split(pages_NxQ.shape[0], pool.shape[0])
    return s.map(_gather, (s.pool, s.slots(None), s.slots(None)), s.slots(s.head, None, None))(pool, pages_NxQ,
                                                                                               position_NxS)


def _ring_write(buf_NxKxWxDh, position_NxA, new_NxKxAxDh):
    W = buf_NxKxWxDh.shape[2]
    slot_NxA = jnp.where(position_NxA >= 0, position_NxA % W, W)  # W: dropped
    put = lambda b, s, n: b.at[:, s].set(n.astype(b.dtype), mode="drop")  # noqa: E731
    return jax.vmap(put)(buf_NxKxWxDh, slot_NxA, new_NxKxAxDh)


def _ring_gather(buf_NxKxWxDh, position_NxS):
    W = buf_NxKxWxDh.shape[2]
    take = lambda b, p: jnp.where((p >= 0)[None, :, None], b[:, jnp.maximum(p, 0) % W], 0)  # noqa: E731
    return jax.vmap(take)(buf_NxKxWxDh, position_NxS)


def ring_write(ring: Ring, position_NxA, new_NxKxAxDh) -> Ring:
    """``ring`` with every slot's new keys (or values) at its row positions (-1: not written; at most W of a slot's
    positions, else the later would land on the earlier), each shard writing its own slots."""
    s = split(ring.buf.shape[0], ring.buf.shape[1])
    heads = s.slots(s.head, None, None)
    return Ring(s.map(_ring_write, (heads, s.slots(None), heads), heads)(ring.buf, position_NxA, new_NxKxAxDh))


def ring_mask(position_NxT, ring: Ring):
    """[N, T, W] bool: which of a slot's ring entries its queries at row positions ``position_NxT`` (written there
    already) see: the entry r holds position q - ((q - r) mod W), seen when it is a position of the row (>= 0)."""
    W = ring.buf.shape[2]
    held_NxTxW = position_NxT[..., None] - (position_NxT[..., None] - jnp.arange(W)) % W
    return (held_NxTxW >= 0) & (position_NxT[..., None] >= 0)


def _window_positions(position_NxS, upto_N, W: int):
    """The positions of a whole row's write that a ring of W keeps: those from upto - W on (else -1)."""
    return jnp.where(position_NxS >= upto_N[:, None] - W, position_NxS, -1)


def attend(q_NxTxKxGxDh, k_pool, v_pool, pages_NxQ, length_N, **kernel):
    """`attention.paged_decode` (``kernel``: its keyword arguments) for every slot, each shard's kernel over its
    own slots, pages and key/value heads."""
    s = split(pages_NxQ.shape[0], k_pool.shape[0])
    decode = s.map(functools.partial(attention.paged_decode, **kernel),
                   (s.slots(None, s.head, None, None), s.pool, s.pool, s.slots(None), s.slots()),
                   s.slots(s.head, None, None, None), manual=True)
    return decode(q_NxTxKxGxDh, k_pool, v_pool, pages_NxQ, length_N)


def _global_rows(pages_NxQ, slots_M, shards: int, pages: int):
    """[M, Q] the page tables of slots ``slots_M`` (N: none) as ids into the whole pool (shard-local ids offset by
    their shard's first page), the whole pool's page count where a page is not taken."""
    N = pages_NxQ.shape[0]
    safe_M = jnp.minimum(slots_M, N - 1)
    rows_MxQ = pages_NxQ[safe_M]
    first_M = (safe_M // (N // shards)) * pages
    return jnp.where((rows_MxQ < pages) & (slots_M < N)[:, None], rows_MxQ + first_M[:, None], shards * pages)


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


def by_shard(fn, pages_NxQ, free_SxP, *slot_args):
    """``fn(pages [n, Q], free [p], *slot args [n, ...]) -> (pages, free)`` run for each row shard's slots and free
    list (vmapped): (page table [N, Q], free lists [shards, p])."""
    S = free_SxP.shape[0]
    shard = lambda x: x.reshape(S, x.shape[0] // S, *x.shape[1:])  # noqa: E731
    pages_SxnxQ, free_SxP = jax.vmap(fn)(shard(pages_NxQ), free_SxP, *map(shard, slot_args))
    return pages_SxnxQ.reshape(pages_NxQ.shape), free_SxP


def _release(pages_nxQ, free_p, slots_n):
    pages = free_p.shape[0]
    taken_nxQ = jnp.where(slots_n[:, None], pages_nxQ, pages)
    return jnp.where(slots_n[:, None], pages, pages_nxQ), free_p.at[taken_nxQ].set(True, mode="drop")


def _grow(page_size: int):
    def grow(pages_nxQ, free_p, upto_n):
        n, Q = pages_nxQ.shape
        pages = free_p.shape[0]
        need_nxQ = (jnp.arange(Q)[None] < -(-upto_n[:, None] // page_size)) & (pages_nxQ == pages)
        rank_nxQ = jnp.cumsum(need_nxQ.reshape(-1)).reshape(n, Q) - 1
        free_ids = jnp.nonzero(free_p, size=min(n * Q, pages), fill_value=pages)[0]
        take_nxQ = jnp.where(need_nxQ, free_ids[jnp.minimum(rank_nxQ, free_ids.shape[0] - 1)], pages)
        take_nxQ = jnp.where(rank_nxQ < free_ids.shape[0], take_nxQ, pages)
        return jnp.where(need_nxQ, take_nxQ, pages_nxQ), free_p.at[take_nxQ].set(False, mode="drop")
    return grow


def release(pages_NxQ, free_SxP, slots_N):
    """(page table, free lists [shards, pages]) with the pages of slots ``slots_N`` (bool [N]) given back."""
    return by_shard(_release, pages_NxQ, free_SxP, slots_N)


def grow(pages_NxQ, free_SxP, upto_N, page_size: int):
    """(page table, free lists) with slot n's pages covering row positions [0, upto_N[n]): each missing page taken
    from its shard's free list, in slot order (none left: the page stays missing, its writes dropped; `num_pages`
    sizes the pool so that this cannot happen)."""
    return by_shard(_grow(page_size), pages_NxQ, free_SxP, upto_N)


def _fresh(cache: PagedKVCache, free_SxP, held_N, upto_N, page_size: int):
    """(page table, free lists) with slots ``held_N`` given fresh pages covering [0, upto_N)."""
    pages_NxQ, free_SxP = release(cache.pages_NxQ, free_SxP, held_N)
    return grow(pages_NxQ, free_SxP, jnp.where(held_N, upto_N, 0), page_size)


def store(cache: PagedKVCache, free_SxP, held_N, contiguous: tuple, position_NxS, upto_N, page_size: int):
    """(cache, free lists) with the slots ``held_N`` (bool [N]) given fresh pages covering [0, upto_N) and their
    contiguous keys/values ``contiguous`` ((k, v) L-tuples of [N, K, S, Dh], slot by slot) written at
    ``position_NxS`` (a `Ring` keeps the last W of them): each shard writes its own slots."""
    pages_NxQ, free_SxP = _fresh(cache, free_SxP, held_N, upto_N, page_size)
    position_NxS = jnp.where(held_N[:, None], position_NxS, -1)

    def put(pool, new):
        if isinstance(pool, Ring):
            return ring_write(pool, _window_positions(position_NxS, upto_N, pool.buf.shape[2]), new)
        return write(pool, pages_NxQ, position_NxS, new)

    k, v = (tuple(map(put, pools, news)) for pools, news in zip((cache.k, cache.v), contiguous))
    return cache._replace(k=k, v=v, pages_NxQ=pages_NxQ), free_SxP


def store_slots(cache: PagedKVCache, free_SxP, slots_M, contiguous: tuple, position_MxS, upto_M, page_size: int):
    """`store` for a few slots ``slots_M`` (N: none) with ``contiguous`` keys/values [M, K, S, Dh]: written through
    whole-pool page ids (rows re-admitted after appended tokens; XLA moves the M rows to their shards)."""
    N = cache.pages_NxQ.shape[0]
    held_N = jnp.zeros((N,), bool).at[slots_M].set(True, mode="drop")
    upto_N = jnp.zeros((N,), jnp.int32).at[slots_M].set(upto_M, mode="drop")
    pages_NxQ, free_SxP = _fresh(cache, free_SxP, held_N, upto_N, page_size)
    rows_MxQ = _global_rows(pages_NxQ, slots_M, *free_SxP.shape)
    position_MxS = jnp.where((slots_M < N)[:, None], position_MxS, -1)

    def put(pool, new):
        if isinstance(pool, Ring):  # the M slots' rings, written and put back (slot N: dropped)
            rows = _ring_write(pool.buf[jnp.minimum(slots_M, N - 1)],
                               _window_positions(position_MxS, upto_M, pool.buf.shape[2]), new)
            return Ring(pool.buf.at[slots_M].set(rows, mode="drop"))
        return _write(pool, rows_MxQ, position_MxS, new)

    k, v = (tuple(map(put, pools, news)) for pools, news in zip((cache.k, cache.v), contiguous))
    return cache._replace(k=k, v=v, pages_NxQ=pages_NxQ), free_SxP


def view(cache: PagedKVCache, free_SxP, slots_M, position_MxS):
    """(k, v) L-tuples [M, K, S, Dh]: slots ``slots_M`` read back in the contiguous order (a `Ring`'s positions
    before its window hold later keys there: a window mask never shows them)."""
    rows_MxQ = _global_rows(cache.pages_NxQ, slots_M, *free_SxP.shape)

    def get(pool):
        if isinstance(pool, Ring):
            return _ring_gather(pool.buf[jnp.minimum(slots_M, cache.pages_NxQ.shape[0] - 1)], position_MxS)
        return _gather(pool, rows_MxQ, position_MxS)

    return tuple(tuple(map(get, pools)) for pools in (cache.k, cache.v))


class LayerPages(NamedTuple):
    """One layer's pools (or `Ring` s) and the pass's maps (`PagedKVCache`), as `models.layers.Attention` takes its
    cache."""

    k: jax.Array
    v: jax.Array
    cache: PagedKVCache
