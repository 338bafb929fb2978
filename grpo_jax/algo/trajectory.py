"""`Trajectory`: a round's rows as one pytree, from the decoder (`grpo_jax.algo.decoder`) to the loss.

Dimension letters: B rows, P prompt tokens (left-padded), T completion tokens (right-padded).

A row is its prompt and one completion holding every turn: the tokens the policy sampled and, between turns, tokens
appended from outside (a tool's result, an environment's observation). Attention sees all of them
(``completion_mask``); the loss trains only ``loss_mask`` (the tokens the policy sampled, as TRL's ``tool_mask``
leaves them; round-level options such as `rounds.mask_truncated` clear whole rows). The round adds the advantages
and the old / reference log-probs; `train_step.train_step` takes it as its batch. Positions follow from the masks
(`positions`): a completion token at index t sits at position (real prompt tokens) + t.

A `Layout` is how rows run through the model for their log-probs (`logprobs.completion_logps`): ``padded`` (each row
alone), ``shared`` (each group's prompt once) or ``packed`` (groups' real tokens one after another in a few
buffers); `layout` builds it from the rows' arrays, `packed_need` says how long a packed buffer must be and
`choose_packing` picks the layout with the fewest forward FLOPs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Trajectory(NamedTuple):
    """Rows from the decoder to the loss (TRL's names where TRL has the concept)."""

    prompt_ids: jax.Array  # [B, P] int32, left-padded
    prompt_mask: jax.Array  # [B, P] int32, 1 on real tokens
    completion_ids: jax.Array  # [B, T] int32, pad after the row's last token
    completion_mask: jax.Array  # [B, T] int32: the completion's tokens, sampled or appended (what attention sees)
    loss_mask: jax.Array  # [B, T] int32: the tokens the loss trains (sampled by the policy; 0 on appended ones)
    sampler_per_token_logps: jax.Array  # [B, T] float32: the sampler's log-probs of its tokens (0 elsewhere)
    turns: jax.Array  # [B, T] int32: each token's turn (a sampled turn and the tokens appended after it), -1 after
    is_truncated: jax.Array  # [B] bool: the row ended without EOS (ran out of T tokens)
    advantages: jax.Array | None = None  # [B], or [B, T] (process supervision)
    old_per_token_logps: jax.Array | None = None  # [B, T]; None: on-policy (one update per round)
    ref_per_token_logps: jax.Array | None = None  # [B, T]; None when beta == 0
    # mixture of experts with routing replay (model.routing_replay): the experts the sampler's routers chose for
    # each prompt ++ completion token in each layer [B, P + T, L, K] (a completion's last token, never fed back
    # in, holds expert ids that nothing reads); None: the log-prob forwards route afresh
    routed_experts: jax.Array | None = None


def positions(prompt_mask_BxP, completion_mask_BxT):
    """RoPE positions of a left-padded prompt ++ completion row: ([B, P] prompt, [B, T] completion). Prompt token j
    of p real ones is at j - (P - p) (0 on padding); completion token t at p + t."""
    P = prompt_mask_BxP.shape[1]
    p_B = jnp.sum(prompt_mask_BxP, axis=1, dtype=jnp.int32)
    prompt_BxP = jnp.maximum(jnp.arange(P)[None] - (P - p_B)[:, None], 0)
    return prompt_BxP, p_B[:, None] + jnp.arange(completion_mask_BxT.shape[1])[None]


class Layout(NamedTuple):
    """Rows as model inputs: R buffers of L slots after an optional shared prefix, and which slot predicts which
    completion token. Slot l of a buffer predicts ``next_ids[l]``; only slots ``scored = (start, size)`` are
    scored; completion token t of row b is predicted by scored slot ``source[b, t]`` (flat over the buffers)."""

    ids: jax.Array  # [R, L] int32
    positions: jax.Array  # [R, L] int32
    mask: jax.Array  # [R, S] int32 (prefix ++ buffer slots, causal) or [R, L, L] bool: who sees whom
    next_ids: jax.Array  # [R, L] the token each slot predicts (anything where none follows)
    source: jax.Array  # [B, T] int32 flat index into the scored slots [R, size]
    scored: tuple[int, int]  # (first scored slot, scored slots) of every buffer
    prefix: tuple | None = None  # (ids, positions, mask) [B / G, Pp] shared by each group's buffers, or None


def _group_needs(prompt_tokens_B, completion_tokens_B, group_size: int) -> np.ndarray:
    """[R] slots each group takes in a packed buffer: its prompt less the last token, then per row that token again
    and the row's completion."""
    prompt_R = np.asarray(prompt_tokens_B)[::group_size]
    completions_R = np.asarray(completion_tokens_B).reshape(-1, group_size).sum(1)
    return prompt_R - 1 + group_size + completions_R


def packed_need(prompt_tokens_B, completion_tokens_B, group_size: int, buffers: int = 0) -> int:
    """Slots the longest packed buffer of these rows needs (host arrays of real token counts), ``buffers`` buffers
    each holding consecutive groups (0: one group a buffer). 0 for no rows."""
    if len(prompt_tokens_B) == 0:
        return 0
    needs_R = _group_needs(prompt_tokens_B, completion_tokens_B, group_size)
    return int(needs_R.reshape(buffers or len(needs_R), -1).sum(1).max())


def packed_length(prompt_tokens_B, completion_tokens_B, group_size: int, buffers: int = 0) -> int:
    """The buffer length of the packed layout for rows of these real prompt and completion token counts (host
    arrays; ``buffers`` as `packed_need`), rounded up to 4 lengths an octave (at most 1/4 padding; few lengths, so
    few compilations). 0 for no rows."""
    need = packed_need(prompt_tokens_B, completion_tokens_B, group_size, buffers)
    if need == 0:
        return 0
    need = max(need, 16)
    step = 1 << max(need.bit_length() - 3, 0)  # 4 lengths between each power of two and the next
    return -(-need // step) * step


def layout(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT, *, group_size: int = 1,
           packed_length: int = 0, packed_buffers: int = 0) -> Layout:
    """The rows' `Layout`: ``packed_length`` > 0 packed (groups of G = ``group_size`` rows, one after another in
    ``packed_buffers`` buffers of that length; 0: one buffer a group); else G > 1 shared (each group's prompt a
    prefix); else padded."""
    B, P = prompt_ids_BxP.shape
    T = completion_ids_BxT.shape[1]
    G = group_size
    if not isinstance(G, int) or G < 1 or B % G:
        raise ValueError(f"prompt_group_size={G!r} must be a positive integer dividing the {B} rows")
    prompt_ids_BxP, completion_ids_BxT = prompt_ids_BxP.astype(jnp.int32), completion_ids_BxT.astype(jnp.int32)
    mask_BxS = jnp.concatenate([prompt_mask_BxP, completion_mask_BxT], axis=1).astype(jnp.int32)
    identity_BxT = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T)
    if packed_length:
        return _packed(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT, G, packed_buffers,
                       packed_length)
    positions_BxS = jnp.maximum(jnp.cumsum(mask_BxS, axis=1) - 1, 0)  # left padding: cumsum(mask) - 1
    if G == 1:  # slot P - 1 + t predicts token t
        ids_BxS = jnp.concatenate([prompt_ids_BxP, completion_ids_BxT], axis=1)
        next_BxS = jnp.concatenate([ids_BxS[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
        return Layout(ids_BxS, positions_BxS, mask_BxS, next_BxS, identity_BxT, (P - 1, T))
    # shared: each group's prompt is the prefix, its last token hidden from the rows, whose buffers start with that
    # token again: buffer slot t predicts token t (the last completion token predicts nothing, so it is not run)
    prefix = (prompt_ids_BxP[::G], positions_BxS[::G, :P], prompt_mask_BxP[::G].astype(jnp.int32))
    ids_BxT = jnp.concatenate([prompt_ids_BxP[:, P - 1:], completion_ids_BxT[:, :T - 1]], axis=1)
    seen_BxS = mask_BxS.at[:, P - 1].set(0)
    return Layout(ids_BxT, positions_BxS[:, P - 1:P + T - 1], seen_BxS, completion_ids_BxT, identity_BxT, (0, T),
                  prefix)


def _packed(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT, G: int, K: int,
            L: int) -> Layout:
    """K buffers of L slots (0: one a group), each holding its share of the groups one after another. Rows split
    into K runs of consecutive rows: a mesh that splits rows (K a multiple of its shards) keeps each buffer's rows
    on one device."""
    B, T = completion_ids_BxT.shape
    K = K or B // G
    if not isinstance(K, int) or K < 1 or (B // G) % K:
        raise ValueError(f"packed_buffers={K!r} must be a positive integer dividing the {B // G} groups")
    split = lambda x: x.reshape(K, B // K, *x.shape[1:])  # noqa: E731
    pack = functools.partial(_pack_buffer, G=G, L=L)
    ids_KxL, positions_KxL, visible_KxLxL, next_KxL, source_KxNxT = jax.vmap(pack)(
        split(prompt_ids_BxP), split(prompt_mask_BxP), split(completion_ids_BxT), split(completion_mask_BxT))
    source_BxT = (source_KxNxT + (jnp.arange(K, dtype=jnp.int32) * L)[:, None, None]).reshape(B, T)
    return Layout(ids_KxL, positions_KxL, visible_KxLxL, next_KxL, source_BxT, (0, L))


def _pack_buffer(prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT, completion_mask_NxT, *, G: int, L: int):
    """One buffer of L slots: per group of G rows [its prompt but the last token | per row: that token, then the
    row's completion], group after group, then padding. A row's branch sees its group's prompt and itself, never
    another row's branch or another group; padding is never run. Positions: prompt token j at j, a branch's copy
    of the last prompt token at p - 1, its completion token t at p + t. Returns ids, positions, visible [L, L],
    next ids [L] and source [N, T] (the slot predicting each completion token)."""
    N, P = prompt_ids_NxP.shape
    T = completion_ids_NxT.shape[1]
    R = N // G
    p_R = jnp.sum(prompt_mask_NxP[::G], axis=1).astype(jnp.int32)
    size_RxG = jnp.sum(completion_mask_NxT, axis=1).astype(jnp.int32).reshape(R, G) + 1  # copied token + completion
    need_R = p_R - 1 + jnp.sum(size_RxG, axis=1)
    group_start_R = jnp.cumsum(need_R) - need_R
    start_RxG = (group_start_R + p_R - 1)[:, None] + jnp.cumsum(size_RxG, axis=1) - size_RxG  # each branch's slot
    i_L = jnp.arange(L)
    r_L = jnp.clip(jnp.sum(group_start_R[None] <= i_L[:, None], axis=1) - 1, 0, R - 1)  # each slot's group
    j_L = i_L - group_start_R[r_L]  # the slot's index in its group
    p_L, start_LxG = p_R[r_L], start_RxG[r_L]
    valid_L = i_L < jnp.sum(need_R)
    # the last branch starting at or before a slot (0: the group's prompt)
    branch_L = jnp.where(j_L < p_L - 1, 0, jnp.sum(start_LxG <= i_L[:, None], axis=1))
    g_L = jnp.maximum(branch_L - 1, 0)
    t_L = i_L - jnp.take_along_axis(start_LxG, g_L[:, None], axis=1)[:, 0]  # index in the branch (0: prompt's last)
    branch_ids_RxGx1T = jnp.concatenate([prompt_ids_NxP[:, P - 1:], completion_ids_NxT], axis=1).reshape(R, G, T + 1)
    branch_tok_L = branch_ids_RxGx1T[r_L, g_L, jnp.clip(t_L, 0, T)]
    next_tok_L = branch_ids_RxGx1T[r_L, g_L, jnp.clip(t_L + 1, 0, T)]
    prompt_tok_L = prompt_ids_NxP[::G][r_L, jnp.clip(P - p_L + j_L, 0, P - 1)]
    in_prompt = branch_L == 0
    ids_L = jnp.where(~valid_L, 0, jnp.where(in_prompt, prompt_tok_L, branch_tok_L))
    positions_L = jnp.where(~valid_L, 0, jnp.where(in_prompt, j_L, p_L - 1 + t_L))
    # padding sees nothing (its blocks are skipped, `cpu.blocked_attention`); a token sees its group's prompt and
    # its own branch
    visible_LxL = ((i_L[None] <= i_L[:, None]) & valid_L[None] & valid_L[:, None] & (r_L[None] == r_L[:, None])
                   & ((branch_L[None] == 0) | (branch_L[None] == branch_L[:, None])))
    source_NxT = jnp.minimum(start_RxG.reshape(N, 1) + jnp.arange(T), L - 1).astype(jnp.int32)
    return ids_L, positions_L, visible_LxL, jnp.where(valid_L, next_tok_L, 0), source_NxT


def forward_flops(config) -> tuple[float, float]:
    """(matmul FLOPs per token, attention FLOPs per (query, key) pair) of one forward pass of a `ModelConfig`: 2 per
    multiply-add of every weight (the unembedding included), 4 per pair per query head and layer (scores and mix)."""
    D, Dh, H, K = config.hidden_size, config.resolved_head_dim, config.num_attention_heads, config.num_key_value_heads
    layer = D * H * Dh * 2 + D * K * Dh * 2 + 3 * D * config.intermediate_size
    return 2.0 * (config.num_hidden_layers * layer + D * config.vocab_size), 4.0 * config.num_hidden_layers * H * Dh


def layout_flops(prompt_tokens_B, completion_tokens_B, group_size: int, P: int, T: int, flops: tuple[float, float],
                 *, packed_length: int = 0, packed_buffers: int = 0, micro_batches: int = 1,
                 dense_pair_cost: float = 1.0, blocked_pairs=None) -> float:
    """The forward FLOPs of these rows' log-prob pass in a layout (host counts, rows in micro-batch order:
    ``micro_batches`` runs of consecutive rows; ``flops``: `forward_flops`): the static layout (padded when G = 1,
    else shared) or ``packed_buffers`` buffers a micro-batch (0: one a group) of ``packed_length`` slots. Every slot
    of a buffer runs the matmuls; attention computes every (query, key) score XLA is given, masked or not, each at
    ``dense_pair_cost`` times a matmul FLOP's time (`cpu.DENSE_PAIR_COST` on the CPU), except that
    ``blocked_pairs(prompt tokens [R], branch tokens [R, G], length, buffers)`` (`cpu.blocked_pairs`, None: dense)
    gives a packed call's, priced."""
    per_token, per_pair = flops
    B, G = len(prompt_tokens_B), group_size
    R = B // G
    if not packed_length:
        if G == 1:
            return B * (P + T) * per_token + B * (P + T) ** 2 * per_pair * dense_pair_cost
        return (R * P + B * T) * per_token + (R * P * P + B * T * (P + T)) * per_pair * dense_pair_cost
    L, M = packed_length, micro_batches
    K = packed_buffers or R // M
    pairs = M * K * L * L * dense_pair_cost
    if blocked_pairs is not None:
        prompt_MxRm = (np.asarray(prompt_tokens_B)[::G] - 1).reshape(M, -1)
        branches_MxRmxG = np.asarray(completion_tokens_B).reshape(M, -1, G) + 1  # the copied last prompt token too
        blocked = [blocked_pairs(prompt, branches, L, K) for prompt, branches in zip(prompt_MxRm, branches_MxRmxG)]
        pairs = pairs if None in blocked else sum(blocked)
    return M * K * L * per_token + pairs * per_pair


def choose_packing(prompt_tokens_B, completion_tokens_B, group_size: int, P: int, T: int, flops: tuple[float, float],
                   *, packing: bool | None, micro_batches: int = 1, shards: int = 1,
                   dense_pair_cost: float = 1.0, blocked_pairs=None, shapes=None) -> tuple[int, int]:
    """`train.packing` resolved for these rows (in micro-batch order, as `layout_flops`): (buffer length, buffers a
    micro-batch), or (0, 0) for the static layout (shared prompts when G > 1, else padded). The buffer counts tried
    are the multiples of ``shards`` (devices splitting a micro-batch's rows) that divide its groups; the one with
    the fewest `layout_flops` wins, and ``packing`` None also weighs the static layout: packing runs no padding,
    and fewer, longer buffers pad less, but a dense buffer's attention grows with the square of its length. A
    buffer's [L, L] mask stays within the larger of 256 MiB and one buffer a group's.

    ``shapes`` (`packing_shapes`): the choice is one of these (the run's programs compiled ahead), the cheapest by
    `layout_flops` of those the rows fit in; None: any length and count as above."""
    if packing is False or len(prompt_tokens_B) == 0:
        return 0, 0
    if shapes is not None:
        return _choose_listed(prompt_tokens_B, completion_tokens_B, group_size, P, T, flops, shapes,
                              micro_batches=micro_batches, dense_pair_cost=dense_pair_cost,
                              blocked_pairs=blocked_pairs)
    M = micro_batches
    R_m = len(prompt_tokens_B) // group_size // M
    counts = [K for K in range(shards, R_m + 1, shards) if R_m % K == 0] or [R_m]
    one_a_group = packed_length(prompt_tokens_B, completion_tokens_B, group_size)
    budget = max(R_m * one_a_group ** 2, 1 << 28)
    best, best_flops = (one_a_group, R_m), float("inf")
    for K in counts:
        L = packed_length(prompt_tokens_B, completion_tokens_B, group_size, M * K)
        cost = layout_flops(prompt_tokens_B, completion_tokens_B, group_size, P, T, flops, packed_length=L,
                            packed_buffers=K, micro_batches=M, dense_pair_cost=dense_pair_cost,
                            blocked_pairs=blocked_pairs)
        if K * L * L <= budget and cost < best_flops:
            best, best_flops = (L, K), cost
    if packing:
        return best
    static = layout_flops(prompt_tokens_B, completion_tokens_B, group_size, P, T, flops,
                          dense_pair_cost=dense_pair_cost)
    return best if best_flops < static else (0, 0)


def _level(need: int) -> int:
    """The shortest length of `packing_shapes`' ladder holding ``need`` slots: 2 lengths an octave (16, 24, 32, 48, 64,
    96, ...), at most 1/2 padding, half as many programs as `packed_length`'s 4."""
    need = max(int(need), 16)
    step = 1 << max(need.bit_length() - 2, 0)  # 2 lengths between each power of two and the next
    return -(-need // step) * step


def packing_shapes(prompt_range: tuple[int, int], group_size: int, rows: int, P: int, T: int,
                   flops: tuple[float, float], *, packing: bool | None, micro_batches: int = 1, shards: int = 1,
                   dense_pair_cost: float = 1.0, blocked_pairs=None, max_lengths: int = 2
                   ) -> tuple[tuple[int, int], ...]:
    """Every (buffer length, buffers a micro-batch) `choose_packing` may pick for ``rows`` rows in ``micro_batches``
    micro-batches of groups of G = ``group_size``, prompts of ``prompt_range`` = (fewest, most) real tokens and
    completions of 1 .. T: known before the first round, so each is compiled once ahead of it. (0, 0) is the static
    layout (``packing`` not true).

    Packed: one buffer count K, `choose_packing`'s (over ``shards``, the same costs) for a round whose prompts are
    the middle length and whose completions spread evenly over 1 .. T (seeded); lengths on a ladder of 2 an octave
    from the need of K buffers of the shortest groups (prompt less 1, then per row the copied token and a
    completion) to that of the longest. With ``packing`` None a length is kept only if it costs fewer `layout_flops`
    than the static layout for the shortest rows that need it (the static layout costs the same whatever the rows,
    so longer rows would never take it). At most ``max_lengths`` (`train.packed_lengths`), the longest (groups
    needing less take the shortest, padded): each is a program of the step and of each log-prob pass to compile."""
    static = ((0, 0),) if packing is not True else ()
    if packing is False or rows == 0:
        return static
    G, M = group_size, micro_batches
    cost = dict(micro_batches=M, dense_pair_cost=dense_pair_cost, blocked_pairs=blocked_pairs)
    low, high = prompt_range
    spread = np.random.default_rng(0).integers(1, T + 1, rows)
    _, K = choose_packing(np.full(rows, (low + high) // 2), spread, G, P, T, flops, packing=True, shards=shards,
                          **cost)
    per_buffer = rows // G // M // K  # groups a buffer holds
    lengths, level = [], _level(per_buffer * (low - 1 + 2 * G))
    while True:
        lengths.append(level)
        if level >= per_buffer * (high - 1 + G * (T + 1)):
            break
        level = _level(level + 1)
    static_flops = layout_flops(np.full(rows, high), np.full(rows, T), G, P, T, flops, dense_pair_cost=dense_pair_cost)
    keep, shorter = [], 0
    for L in lengths:
        # the shortest rows that need L: prompts of ``low`` tokens and completions just past the shorter length
        completion = min(max(-(-((shorter + 1) // per_buffer - (low - 1) - G) // G), 1), T)
        packed = layout_flops(np.full(rows, low), np.full(rows, completion), G, P, T, flops, packed_length=L,
                              packed_buffers=K, **cost)
        if packing or packed < static_flops:
            keep.append((L, K))
        shorter = L
    return static + tuple(keep[-max_lengths:])


def _choose_listed(prompt_tokens_B, completion_tokens_B, group_size: int, P: int, T: int, flops, shapes, *,
                   micro_batches: int, dense_pair_cost: float, blocked_pairs) -> tuple[int, int]:
    """`choose_packing` within ``shapes``: the cheapest by `layout_flops` of those these rows fit in."""
    M = micro_batches
    best, best_flops = None, float("inf")
    for L, K in shapes:
        if L and packed_need(prompt_tokens_B, completion_tokens_B, group_size, M * K) > L:
            continue
        cost = layout_flops(prompt_tokens_B, completion_tokens_B, group_size, P, T, flops, packed_length=L,
                            packed_buffers=K, micro_batches=M, dense_pair_cost=dense_pair_cost,
                            blocked_pairs=blocked_pairs if L else None)
        if cost < best_flops:
            best, best_flops = (L, K), cost
    if best is None:
        raise ValueError(f"rows needing {packed_need(prompt_tokens_B, completion_tokens_B, group_size)} packed slots "
                         f"fit none of the listed shapes {shapes}: list them with `packing_shapes` over these rows' "
                         "prompt lengths and max_completion_length")
    return best
