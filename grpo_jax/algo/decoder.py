"""The decoder: a resumable decoding state (`Decoding`) and the pure functions over it.

Dimension letters: B rows of the call, N decode slots (N <= B), R = B / G distinct prompts (G rows each), P prompt
tokens (left-padded), T = max_completion_length, S = P + T cache slots per decode slot, V vocab, M rows handed to
`append` / `retire`, A tokens appended per row at most.

Rows wait, in order, for one of N slots. `start` prefills every distinct prompt once (its keys/values kept, P slots)
and gives the first N rows a slot, drawing their first tokens from their prompts' logits. `advance` runs decode
steps inside one ``lax.while_loop``: each feeds every decoding slot's last token and draws its next one; a slot whose
row has ended takes the next waiting row (its prompt's keys/values copied in, its first token drawn) in the same
step. N = B is a static batch (no row waits); fewer slots than rows is continuous batching. A row ends at EOS or
after T tokens. With ``pause_at_eos`` (multi-turn) EOS pauses the row for the host, which `append`s tokens from
outside (a tool's result: not sampled, ``loss_mask`` 0) or `retire`s it. With a slot for every row the row keeps
its slot and the appended tokens run into it. With fewer slots a paused row gives its slot up, as a scheduler
preempts a request that waits on the outside, and after `append` it is admitted again at the next step with a free
slot (before any new row), its prompt's keys/values copied in and its completion so far run through the model in
one pass. Either way a row's numbers do not depend on when the host appends. `trajectory` gives the rows, as far as
they got, as a `trajectory.Trajectory`.

With ``record_routing`` (mixture-of-experts models, routing replay) every pass also writes the experts its routers
chose for each token it runs into ``routing`` [B, P + T, L, K], at the token's place in the row (prompt ++
completion): the trajectory carries them to the log-prob forwards.

With ``page_size`` (`sampling.kv_cache` paged) the slots' keys/values live in a pool of pages (`models.paged`):
a row holds its prompt's real tokens and its completion in pages taken as it grows and given back when its slot is
freed; every pass reads them back in the contiguous order (or a decode kernel reads them), so the tokens are the
contiguous cache's. A pool smaller than every slot's row makes rows wait for pages and preempts the youngest
(`decoder_pages`), run again through the append path's one-pass recompute.

Row b draws token t with the noise `sampling.row_noise(key, row_offset + b, t)`: a row's tokens are a function of
(params, its prompt and earlier tokens, key, its row in the call), the same for any slot count, chunking (a chunk's
``row_offset``) or mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.algo import decoder_pages
# DecodeOptions, Decoding, continuous_slots, finished_groups, SEGMENTS: callers name them `decoder.X`
from grpo_jax.algo.decoding import (READMIT_ROWS, SEGMENTS, DecodeOptions, Decoding, admit,  # noqa: F401
                                    constrain_cache, continuous_slots, finished_groups, free_slots, record_experts,
                                    sample_next, slot_noise)
from grpo_jax.algo.sampling import row_noise
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.models import paged
from grpo_jax.models.layers import KVCache
from grpo_jax.models.moe import routing_dtype
from grpo_jax.models.transformer import (compute_dtype_params, forward, init_cache, layer_params, layer_windows,
                                         model_config, positions_from_mask, rotary_tables, unembed)


def prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, group_size: int, return_routing: bool = False):
    """Each distinct prompt (rows g*G, `data.repeat_groups` order) run once: (its keys/values [R, K, P, Dh], the
    logits of its next token [R, V]) and with ``return_routing`` its tokens' `Routing` ([L, R, P, ...]). ``params``
    in the compute dtype (`models.compute_dtype_params`)."""
    B, P = prompt_ids_BxP.shape
    G = group_size
    if not isinstance(G, int) or G < 1 or B % G:
        raise ValueError(f"group_size={G!r} must be a positive integer dividing the {B} rows")
    model_cfg = model_config(graphdef, params)
    mask_RxP = prompt_mask_BxP[::G].astype(jnp.int32)
    hidden_RxPxD, kv_R, *routed = forward(graphdef, params, prompt_ids_BxP[::G], positions_from_mask(mask_RxP),
                                          mask_RxP, init_cache(model_cfg, B // G, P), 0,
                                          layers=layer_params(graphdef, params), rope=rotary_tables(model_cfg, P),
                                          return_routing=return_routing)
    # left padding puts every prompt's last real token at slot P - 1
    return kv_R, unembed(graphdef, params, hidden_RxPxD[:, -1:])[:, 0], *routed


def prompt_tokens(prompt_ids_BxP, prompt_mask_BxP, V: int, options: DecodeOptions):
    """[B, V] bool: the tokens of each row's prompt, which a repetition penalty discourages (as transformers and
    vLLM do); None without one."""
    if options.sampling.repetition_penalty == 1.0:
        return None
    B = prompt_ids_BxP.shape[0]
    rows_BxP = jnp.broadcast_to(jnp.arange(B)[:, None], prompt_ids_BxP.shape)
    return jnp.zeros((B, V), bool).at[rows_BxP, prompt_ids_BxP].max(prompt_mask_BxP.astype(bool))


def start(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, options: DecodeOptions, row_offset=0) -> Decoding:
    """Prefill the call's prompts and give the first N rows a slot, their first tokens drawn: no decode step yet."""
    B, P = prompt_ids_BxP.shape
    T = options.sampling.max_completion_length
    N = options.num_slots or B
    if not isinstance(N, int) or not 0 < N <= B:
        raise ValueError(f"{N!r} decode slots for {B} rows: the slots must be between 1 and the rows")
    params = compute_dtype_params(graphdef, params)
    prompt_kv, logits_RxV, *routed = prefill(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, options.group_size,
                                             options.record_routing)
    V = logits_RxV.shape[-1]
    row_offset = jnp.asarray(row_offset, jnp.int32)
    noise = None
    if options.noise_ahead and not options.greedy:
        noise = jax.vmap(lambda r: jax.vmap(lambda t: row_noise(key, row_offset + r, t, V))(jnp.arange(T)))(
            jnp.arange(B))
    page_free = preempted = None
    if options.page_size:  # a pool and free list per row shard of the slots (`paged.split`)
        _, Kh, _, Dh = prompt_kv.k[0].shape
        shards = paged.split(N, Kh).shards
        pages = paged.num_pages(options.kv_cache_tokens, N, P, T, options.page_size, shards)
        cache = paged.init(layer_windows(model_config(graphdef, params)), Kh, Dh, prompt_kv.k[0].dtype, pages,
                           options.page_size, N, paged.pages_per_row(P, T, options.page_size), P + T, shards)
        page_free = jnp.ones((shards, pages), bool)
        if decoder_pages.small_pool(options, N, P, shards):
            if options.pause_at_eos and N == B:
                raise ValueError(f"sampling.kv_cache_tokens={options.kv_cache_tokens} is below every slot's whole row "
                                 "while paused rows keep their slots (a slot per row, multi-turn): raise it to 0")
            preempted = jnp.zeros((), jnp.int32)
    else:
        cache = constrain_cache(jax.tree.map(lambda x_RxKxPxDh: jnp.zeros(
            (N, x_RxKxPxDh.shape[1], P + T, x_RxKxPxDh.shape[3]), x_RxKxPxDh.dtype), prompt_kv), options)
    d = Decoding(
        key=key, row_offset=row_offset, prompt_ids=prompt_ids_BxP, prompt_mask=prompt_mask_BxP, prompt_kv=prompt_kv,
        prompt_logits=logits_RxV, noise=noise, slot_row=jnp.full((N,), B, jnp.int32), live=jnp.zeros((N,), bool),
        pending=jnp.zeros((N,), jnp.int32), cache=cache, cache_mask=jnp.zeros((N, P + T), jnp.int32),
        tokens=jnp.full((B, T), options.pad_token_id, jnp.int32), sampled=jnp.zeros((B, T), jnp.int32),
        logps=jnp.zeros((B, T), jnp.float32), turns=jnp.full((B, T), -1, jnp.int32),
        length=jnp.zeros((B,), jnp.int32), turn=jnp.zeros((B,), jnp.int32), ended=jnp.zeros((B,), bool),
        paused=jnp.zeros((B,), bool), ready=jnp.zeros((B,), bool), at_eos=jnp.zeros((B,), bool),
        next_row=jnp.zeros((), jnp.int32),
        steps=jnp.zeros((), jnp.int32), page_free=page_free, preempted=preempted,
        seen=prompt_tokens(prompt_ids_BxP, prompt_mask_BxP, V, options))
    if options.record_routing:  # each row's prompt tokens took its group's prompt's experts
        experts_LxRxPxK = routed[0].experts
        L, _, _, K = experts_LxRxPxK.shape
        dtype = routing_dtype(model_config(graphdef, params).num_experts)
        prompts_BxPxLxK = jnp.repeat(experts_LxRxPxK, options.group_size, axis=1).transpose(1, 2, 0, 3)
        d = d._replace(routing=jnp.zeros((B, P + T, L, K), dtype).at[:, :P].set(prompts_BxPxLxK.astype(dtype)))
    return sample_next(*admit(d, jnp.zeros((N, V), logits_RxV.dtype), options.group_size, options), options)


def _readmit(graphdef, params, d: Decoding, options: DecodeOptions, layers, rope) -> Decoding:
    """Up to `READMIT_ROWS` rows with appended tokens take free slots: their prompts' keys/values copied in and
    their completions but the last token run through the model in one pass; the last is the slot's pending token."""
    B, P = d.prompt_mask.shape
    N, T = d.slot_row.shape[0], d.tokens.shape[1]
    K = min(N, READMIT_ROWS)
    rows_K = jnp.nonzero(d.ready, size=K, fill_value=B)[0]
    slots_K = jnp.nonzero(free_slots(d), size=K, fill_value=N)[0]
    valid_K = (rows_K < B) & (slots_K < N)
    row_K = jnp.minimum(rows_K, B - 1)
    length_K = d.length[row_K]
    if d.preempted is not None:  # a small pool: rows whose tokens so far and pending one fit, beside the live rows'
        prompt_len_K = jnp.sum(d.prompt_mask[row_K], axis=1, dtype=jnp.int32)
        pages_K = jnp.where(valid_K, -(-(prompt_len_K + length_K) // options.page_size), 0)
        valid_K &= decoder_pages.fit_in_shards(slots_K, pages_K, decoder_pages.spare_pages(d, options.page_size), N)
    t_T = jnp.arange(T)
    mask_KxS = jnp.concatenate([d.prompt_mask[row_K].astype(d.cache_mask.dtype),
                                (t_T[None] < length_K[:, None] - 1).astype(d.cache_mask.dtype)], axis=1)
    positions_KxT = jnp.sum(d.prompt_mask[row_K], axis=1, dtype=jnp.int32)[:, None] + t_T[None]
    cache_K = jax.tree.map(lambda p_RxKxPxDh: jnp.zeros((K, p_RxKxPxDh.shape[1], P + T, p_RxKxPxDh.shape[3]),
                                                       p_RxKxPxDh.dtype)
                           .at[:, :, :P].set(p_RxKxPxDh[row_K // options.group_size]), d.prompt_kv)
    _, cache_K, *routed = forward(graphdef, params, d.tokens[row_K], positions_KxT, mask_KxS, cache_K, P,
                                  layers=layers, rope=rope,
                                  return_routing=options.record_routing)
    if options.record_routing:  # the completion so far ran again: its experts as this pass chose them
        d = record_experts(d, routed[0], row_K, P + t_T[None], valid_K[:, None] & (t_T[None] < length_K[:, None] - 1))
    into = jnp.where(valid_K, slots_K, N)  # N: dropped
    if options.page_size:
        prompt_len_K = jnp.sum(d.prompt_mask[row_K], axis=1, dtype=jnp.int32)
        cache, page_free = paged.store_slots(d.cache, d.page_free, into, tuple(cache_K),
                                             paged.contiguous_positions(prompt_len_K, P, T, length_K - 1),
                                             prompt_len_K + length_K - 1, options.page_size)
        d = d._replace(page_free=page_free)
    else:
        cache = jax.tree.map(lambda c, new: c.at[into].set(new, mode="drop"), d.cache, cache_K)
    return d._replace(
        cache=constrain_cache(cache, options), cache_mask=d.cache_mask.at[into].set(mask_KxS, mode="drop"),
        slot_row=d.slot_row.at[into].set(row_K, mode="drop"), live=d.live.at[into].set(True, mode="drop"),
        pending=d.pending.at[into].set(d.tokens[row_K, jnp.maximum(length_K - 1, 0)], mode="drop"),
        ready=d.ready.at[jnp.where(valid_K, row_K, B)].set(False, mode="drop"))


def advance(graphdef, params, decoding: Decoding, options: DecodeOptions, *, segment: bool = False) -> Decoding:
    """Decode steps until every row is over or paused, or (``segment``) until about 1 / `SEGMENTS` more of the
    call's groups are over (at least one) or a row pauses. Tokens do not depend on where a call stops."""
    B, P = decoding.prompt_mask.shape
    G = options.group_size
    params = compute_dtype_params(graphdef, params)
    layers = layer_params(graphdef, params)
    T = options.sampling.max_completion_length
    rope = rotary_tables(model_config(graphdef, params), P + T)  # decode positions reach P + T - 1
    prompt_len_B = jnp.sum(decoding.prompt_mask, axis=1, dtype=jnp.int32)
    slots_N = jnp.arange(decoding.slot_row.shape[0])

    # a static batch (slots for every row, none pausing) feeds every row's token t at cache slot P + t - 1 in the
    # same step t: one slice write for all rows, not a scatter (rows that ended write where nothing reads)
    small = decoding.preempted is not None  # rows may be preempted: slot n no longer holds row n
    in_step = decoding.slot_row.shape[0] == B and not options.pause_at_eos and not small

    def body(d: Decoding) -> Decoding:
        if options.page_size:  # the pages of slots whose rows are over (ended, retired, parked) go back
            pages_NxQ, page_free = paged.release(d.cache.pages_NxQ, d.page_free, free_slots(d))
            d = d._replace(cache=d.cache._replace(pages_NxQ=pages_NxQ), page_free=page_free)
        if (options.pause_at_eos and decoding.slot_row.shape[0] < B) or small:  # parked rows to admit again
            d = jax.lax.cond(jnp.any(d.ready) & jnp.any(free_slots(d)),
                             lambda d: _readmit(graphdef, params, d, options, layers, rope), lambda d: d, d)
        if small:  # too few free pages for this step's new ones: the youngest rows wait
            d = decoder_pages.preempt(d, options.page_size)
        # a static batch's slot n holds row n: its rows' values as they are, not gathered through slot_row (a
        # gather XLA cannot know is local, so on a pod it all-gathered them across the row shards every step)
        rows_N = None if in_step else jnp.minimum(d.slot_row, B - 1)
        if in_step:
            at_N = P + d.steps
            cache_mask = jax.lax.dynamic_update_slice(d.cache_mask, jnp.ones_like(d.cache_mask[:, :1]), (0, at_N))
            prompt_len_N = prompt_len_B
            positions_Nx1 = (prompt_len_N + d.steps)[:, None]
        else:
            t_N = d.length[rows_N]
            at_N = P + t_N - 1  # the pending token's cache slot (slots that hold no decoding row write harmlessly)
            cache_mask = d.cache_mask.at[slots_N, at_N].set(1)
            prompt_len_N = prompt_len_B[rows_N]
            positions_Nx1 = (prompt_len_N + t_N - 1)[:, None]
        if options.page_size:  # the pending token goes to row position prompt length + t - 1, a page taken if new
            d = decoder_pages.page_step(d, prompt_len_N, jnp.broadcast_to(at_N - P, prompt_len_N.shape), P, T,
                                        options.page_size)
        hidden_Nx1xD, cache, *routed = forward(
            graphdef, params, d.pending[:, None], positions_Nx1, cache_mask, d.cache, at_N, layers=layers, rope=rope,
            return_routing=options.record_routing)
        logits_NxV = unembed(graphdef, params, hidden_Nx1xD)[:, 0]
        if options.record_routing:  # the pending tokens went in at their rows' places
            d = record_experts(d, routed[0], rows_N, jnp.broadcast_to(at_N, d.live.shape)[:, None], d.live[:, None])
        d = d._replace(cache=constrain_cache(cache, options), cache_mask=cache_mask)
        if in_step:  # a static batch has no row waiting for a slot: nothing to admit
            d = sample_next(d, logits_NxV, options, in_step)
        else:
            d = sample_next(*admit(d, logits_NxV, G, options), options)
        return d._replace(steps=d.steps + 1)

    def cond(d: Decoding):
        return jnp.any(d.live) | (((d.next_row < B) | jnp.any(d.ready)) & jnp.any(free_slots(d)))

    if segment:
        target = finished_groups(decoding.ended, G) + max(1, B // G // SEGMENTS)
        paused = jnp.sum(decoding.paused)
        return jax.lax.while_loop(
            lambda d: cond(d) & (finished_groups(d.ended, G) < target) & (jnp.sum(d.paused) <= paused), body,
            decoding)
    return jax.lax.while_loop(cond, body, decoding)


def append(graphdef, params, decoding: Decoding, rows_M, tokens_MxA, counts_M, options: DecodeOptions) -> Decoding:
    """Paused rows ``rows_M`` (-1: no row) get ``counts_M`` tokens from outside (``tokens_MxA[m, :count]``; a row
    takes at most what fits in T) after their last sampled token: not sampled (``loss_mask`` 0), in the turn they
    follow; the next turn is the row's next. With a slot for every row the row kept its slot and the tokens are run
    into it now ([M, A] tokens: a row's numbers depend on its own A only, so give rows of one A bucket together in
    calls of fixed M); with fewer slots the row is admitted again at the next decode step with a free slot
    (`advance`). A row they fill to T tokens is over (truncated): a caller that must not cut a tool's result retires
    the row instead."""
    B, P = decoding.prompt_mask.shape
    T = options.sampling.max_completion_length
    M, A = tokens_MxA.shape
    N = decoding.slot_row.shape[0]
    valid_M = rows_M >= 0
    row_M = jnp.where(valid_M, rows_M, 0)
    valid_M &= decoding.paused[row_M]
    t_M = decoding.length[row_M]
    count_M = jnp.where(valid_M, jnp.clip(counts_M, 0, T - t_M), 0)
    i_A = jnp.arange(A)
    real_MxA = i_A[None] < count_M[:, None]
    resumed_M = valid_M & (count_M > 0)
    full_M = t_M + count_M >= T
    d = decoding
    if N == B:  # the row holds its slot: run the turn's EOS and all but the last token in, the last is pending
        S = P + T
        params = compute_dtype_params(graphdef, params)
        slot_M = jnp.argmax(d.slot_row[None, :] == row_M[:, None], axis=1)
        feed_MxA = jnp.concatenate([d.pending[slot_M][:, None], tokens_MxA[:, :A - 1]], axis=1)
        feed_MxA = jnp.where(real_MxA, feed_MxA, options.pad_token_id)
        at_M = P + t_M - 1
        # A spare cache slots: a row near T writes its padded inputs there, not back over its tokens
        prompt_len_M = jnp.sum(d.prompt_mask[row_M], axis=1, dtype=jnp.int32)
        # a paged slot is read back in the contiguous order, run as today, and its row written back
        held = (KVCache(*paged.view(d.cache, d.page_free, slot_M, paged.contiguous_positions(prompt_len_M, P, T)))
                if options.page_size else jax.tree.map(lambda c_NxKxSxDh: c_NxKxSxDh[slot_M], d.cache))
        cache_M = jax.tree.map(lambda c_MxKxSxDh: jnp.pad(c_MxKxSxDh, ((0, 0), (0, 0), (0, A), (0, 0))), held)
        mask_MxS = jnp.pad(d.cache_mask[slot_M], ((0, 0), (0, A)))
        mask_MxS = mask_MxS.at[jnp.arange(M)[:, None], at_M[:, None] + i_A[None]].max(real_MxA.astype(mask_MxS.dtype))
        positions_MxA = jnp.minimum(prompt_len_M[:, None] + t_M[:, None] - 1 + i_A[None], S - 1)  # finite RoPE
        rope = rotary_tables(model_config(graphdef, params), S)
        _, cache_M, *routed = forward(graphdef, params, feed_MxA, positions_MxA, mask_MxS, cache_M, at_M,
                                      layers=layer_params(graphdef, params), rope=rope,
                                      return_routing=options.record_routing)
        if options.record_routing:  # the pending token and the appended ones but the last went in
            d = record_experts(d, routed[0], row_M, at_M[:, None] + i_A[None], real_MxA & resumed_M[:, None])
        into = jnp.where(resumed_M, slot_M, N)  # N: dropped
        last_M = jnp.take_along_axis(tokens_MxA, jnp.maximum(count_M - 1, 0)[:, None], axis=1)[:, 0]
        if options.page_size:
            cache, page_free = paged.store_slots(
                d.cache, d.page_free, into, tuple(tuple(c[:, :, :S] for c in kv) for kv in cache_M),
                paged.contiguous_positions(prompt_len_M, P, T, t_M + count_M - 1), prompt_len_M + t_M + count_M - 1,
                options.page_size)
            d = d._replace(page_free=page_free)
        else:
            cache = jax.tree.map(lambda c, new: c.at[into].set(new[:, :, :S], mode="drop"), d.cache, cache_M)
        d = d._replace(cache=constrain_cache(cache, options),
                       cache_mask=d.cache_mask.at[into].set(mask_MxS[:, :S], mode="drop"),
                       live=d.live.at[into].set(~full_M, mode="drop"), pending=d.pending.at[into].set(last_M,
                                                                                                    mode="drop"))
    row_at = jnp.where(real_MxA, row_M[:, None], B)  # B: dropped
    t_at = t_M[:, None] + i_A[None]
    put = lambda x_BxT, v: x_BxT.at[row_at, t_at].set(v, mode="drop")  # noqa: E731
    rows_at = jnp.where(resumed_M, row_M, B)
    flag = lambda x_B, v_M: x_B.at[rows_at].set(v_M, mode="drop")  # noqa: E731
    seen = None if d.seen is None else d.seen.at[row_at, tokens_MxA].set(True, mode="drop")  # a tool's tokens too
    return d._replace(
        seen=seen, tokens=put(d.tokens, tokens_MxA), sampled=put(d.sampled, jnp.zeros_like(tokens_MxA)),
        logps=put(d.logps, jnp.zeros(tokens_MxA.shape, jnp.float32)),
        turns=put(d.turns, jnp.broadcast_to(d.turn[row_M][:, None], tokens_MxA.shape)),
        length=flag(d.length, t_M + count_M), turn=flag(d.turn, d.turn[row_M] + 1),
        paused=flag(d.paused, jnp.zeros_like(resumed_M)), ended=flag(d.ended, full_M),
        ready=flag(d.ready, ~full_M & (N < B)), at_eos=flag(d.at_eos, jnp.zeros_like(resumed_M)))


def retire(decoding: Decoding, rows_M) -> Decoding:
    """Rows ``rows_M`` (-1: no row) are over now, paused or not: their slots take waiting rows at the next step."""
    B = decoding.tokens.shape[0]
    at = jnp.where(rows_M >= 0, rows_M, B)
    held_N = jnp.isin(decoding.slot_row, jnp.where(rows_M >= 0, rows_M, -1))
    return decoding._replace(ended=decoding.ended.at[at].set(True, mode="drop"),
                             paused=decoding.paused.at[at].set(False, mode="drop"),
                             ready=decoding.ready.at[at].set(False, mode="drop"), live=decoding.live & ~held_N)


def trajectory(decoding: Decoding) -> Trajectory:
    """The call's rows as a `Trajectory` (rows not over yet: what they have so far)."""
    d = decoding
    completion_mask = (jnp.arange(d.tokens.shape[1])[None] < d.length[:, None]).astype(jnp.int32)
    return Trajectory(prompt_ids=d.prompt_ids, prompt_mask=d.prompt_mask, completion_ids=d.tokens,
                      completion_mask=completion_mask, loss_mask=d.sampled, sampler_per_token_logps=d.logps,
                      turns=d.turns, is_truncated=~d.at_eos, routed_experts=d.routing)


def generate(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, options: DecodeOptions) -> Trajectory:
    """Every row decoded to its end: `start`, `advance`, `trajectory`."""
    decoding = start(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, key, options)
    return trajectory(advance(graphdef, params, decoding, options))
