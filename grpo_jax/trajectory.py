"""`Trajectory`: a round's rows as one pytree, from the decoder (`grpo_jax.decoder`) to the loss.

Dimension letters: B rows, P prompt tokens (left-padded), T completion tokens (right-padded).

A row is its prompt and one completion holding every turn: the tokens the policy sampled and, between turns, tokens
appended from outside (a tool's result, an environment's observation). Attention sees all of them
(``completion_mask``); the loss trains only ``loss_mask`` (the tokens the policy sampled, as TRL's ``tool_mask``
leaves them; round-level options such as `rounds.mask_truncated` clear whole rows). The round adds the advantages
and the old / reference log-probs; `train_step.train_step` takes it as its batch. Positions follow from the masks
(`positions`): a completion token at index t sits at position (real prompt tokens) + t.

A `Layout` is how rows run through the model for their log-probs (`logprobs.completion_logps`): ``padded`` (each row
alone), ``shared`` (each group's prompt once) or ``packed`` (each group one buffer of its real tokens); `layout`
builds it from the rows' arrays, `packed_need` says how long a packed buffer must be.
"""

from __future__ import annotations

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


def packed_need(prompt_tokens_B, completion_tokens_B, group_size: int) -> int:
    """Slots the longest packed buffer of these rows needs (host arrays of real token counts): a group's prompt less
    its last token, then per row that token again and the row's completion. 0 for no rows."""
    if len(prompt_tokens_B) == 0:
        return 0
    prompt_R = np.asarray(prompt_tokens_B)[::group_size]
    completions_R = np.asarray(completion_tokens_B).reshape(-1, group_size).sum(1)
    return int((prompt_R - 1 + group_size + completions_R).max())


def packed_length(prompt_tokens_B, completion_tokens_B, group_size: int) -> int:
    """The buffer length of the packed layout for rows of these real prompt and
    completion token counts (host arrays), rounded up to 4 lengths an octave (at most 1/4 padding; few lengths, so
    few compilations). 0 for no rows."""
    need = packed_need(prompt_tokens_B, completion_tokens_B, group_size)
    if need == 0:
        return 0
    need = max(need, 16)
    step = 1 << max(need.bit_length() - 3, 0)  # 4 lengths between each power of two and the next
    return -(-need // step) * step


def layout(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT, *, group_size: int = 1,
           packed_length: int = 0, sliding_window: int | None = None) -> Layout:
    """The rows' `Layout`: ``packed_length`` > 0 packed (G = ``group_size`` rows a buffer); else G > 1 shared
    (each group's prompt a prefix); else padded."""
    B, P = prompt_ids_BxP.shape
    T = completion_ids_BxT.shape[1]
    G = group_size
    if not isinstance(G, int) or G < 1 or B % G:
        raise ValueError(f"prompt_group_size={G!r} must be a positive integer dividing the {B} rows")
    prompt_ids_BxP, completion_ids_BxT = prompt_ids_BxP.astype(jnp.int32), completion_ids_BxT.astype(jnp.int32)
    mask_BxS = jnp.concatenate([prompt_mask_BxP, completion_mask_BxT], axis=1).astype(jnp.int32)
    identity_BxT = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T)
    if packed_length:
        return _packed(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT, G, packed_length,
                       sliding_window)
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


def _packed(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT, G: int, L: int,
            sliding_window: int | None) -> Layout:
    """Each group of G rows as one buffer of L slots: [its prompt but the last token | per row: that token, then the
    row's completion | padding]. A row's branch sees the shared prompt and itself, never another row's branch;
    padding is never run. Positions: prompt token j at j, a branch's copy of the last prompt token at p - 1, its
    completion token t at p + t."""
    B, P = prompt_ids_BxP.shape
    T = completion_ids_BxT.shape[1]
    R = B // G
    p_R = jnp.sum(prompt_mask_BxP[::G], axis=1).astype(jnp.int32)
    n_RxG = jnp.sum(completion_mask_BxT, axis=1).astype(jnp.int32).reshape(R, G)
    size_RxG = n_RxG + 1  # a branch: the copied last prompt token and the completion
    start_RxG = (p_R - 1)[:, None] + jnp.cumsum(size_RxG, axis=1) - size_RxG  # where each branch starts
    i_L = jnp.arange(L)
    # the last branch starting at or before a slot (0: the shared prompt)
    branch_RxL = jnp.where(i_L[None] < (p_R - 1)[:, None], 0,
                           jnp.sum(start_RxG[:, None, :] <= i_L[None, :, None], axis=2))
    valid_RxL = i_L[None] < (p_R - 1 + jnp.sum(size_RxG, axis=1))[:, None]
    g_RxL = jnp.maximum(branch_RxL - 1, 0)
    t_RxL = i_L[None] - jnp.take_along_axis(start_RxG, g_RxL, axis=1)  # index in the branch (0: the prompt's last)
    # gathers inside each group's rows ([R, G, ...]): a mesh that splits rows keeps whole groups on one device
    branch_ids_RxGx1T = jnp.concatenate([prompt_ids_BxP[:, P - 1:], completion_ids_BxT], axis=1).reshape(R, G, T + 1)
    branch_tok_RxL = branch_ids_RxGx1T[jnp.arange(R)[:, None], g_RxL, jnp.clip(t_RxL, 0, T)]
    next_tok_RxL = branch_ids_RxGx1T[jnp.arange(R)[:, None], g_RxL, jnp.clip(t_RxL + 1, 0, T)]
    prompt_tok_RxL = jnp.take_along_axis(prompt_ids_BxP[::G], jnp.clip(P - p_R[:, None] + i_L[None], 0, P - 1), axis=1)
    in_prompt = branch_RxL == 0
    ids_RxL = jnp.where(~valid_RxL, 0, jnp.where(in_prompt, prompt_tok_RxL, branch_tok_RxL))
    positions_RxL = jnp.where(~valid_RxL, 0, jnp.where(in_prompt, i_L[None], p_R[:, None] - 1 + t_RxL))
    # padding sees nothing (its blocks are skipped, `cpu.blocked_attention`); a token sees the prompt and its branch
    visible_RxLxL = ((i_L[None, None, :] <= i_L[None, :, None]) & valid_RxL[:, None, :] & valid_RxL[:, :, None]
                     & ((branch_RxL[:, None, :] == 0) | (branch_RxL[:, None, :] == branch_RxL[:, :, None])))
    if sliding_window is not None:
        visible_RxLxL &= positions_RxL[:, :, None] - positions_RxL[:, None, :] < sliding_window
    source_BxT = (jnp.arange(R)[:, None, None] * L + start_RxG[:, :, None] + jnp.arange(T)).reshape(B, T)
    return Layout(ids_RxL, positions_RxL, visible_RxLxL, jnp.where(valid_RxL, next_tok_RxL, 0),
                  jnp.minimum(source_BxT, R * L - 1).astype(jnp.int32), (0, L))


def forward_flops(config) -> tuple[float, float]:
    """(matmul FLOPs per token, attention FLOPs per (query, key) pair) of one forward pass of a `ModelConfig`: 2 per
    multiply-add of every weight (the unembedding included), 4 per pair per query head and layer (scores and mix)."""
    D, Dh, H, K = config.hidden_size, config.resolved_head_dim, config.num_attention_heads, config.num_key_value_heads
    layer = D * H * Dh * 2 + D * K * Dh * 2 + 3 * D * config.intermediate_size
    return 2.0 * (config.num_hidden_layers * layer + D * config.vocab_size), 4.0 * config.num_hidden_layers * H * Dh


def layout_flops(prompt_tokens_B, completion_tokens_B, group_size: int, P: int, T: int, flops: tuple[float, float],
                 *, packed_length: int = 0, blocked_pairs=None) -> float:
    """The forward FLOPs of these rows' log-prob pass in a layout (host counts; ``flops``: `forward_flops`): the
    static layout (padded when G = 1, else shared) or packed buffers of ``packed_length`` slots. Every slot of a
    buffer runs the matmuls; attention computes every (query, key) score XLA is given, masked or not, except that
    ``blocked_pairs(prompt tokens [R], branch tokens [R, G], length)`` (`cpu.blocked_pairs`, None: dense) gives a
    packed buffer's."""
    per_token, per_pair = flops
    B, G = len(prompt_tokens_B), group_size
    R = B // G
    if not packed_length:
        if G == 1:
            return B * (P + T) * per_token + B * (P + T) ** 2 * per_pair
        return (R * P + B * T) * per_token + (R * P * P + B * T * (P + T)) * per_pair
    L = packed_length
    pairs = None
    if blocked_pairs is not None:
        branches_RxG = np.asarray(completion_tokens_B).reshape(R, G) + 1  # the copied last prompt token too
        pairs = blocked_pairs(np.asarray(prompt_tokens_B)[::G] - 1, branches_RxG, L)
    return R * L * per_token + R * (L * L if pairs is None else pairs) * per_pair


def choose_packed_length(prompt_tokens_B, completion_tokens_B, group_size: int, P: int, T: int,
                         flops: tuple[float, float], *, packing: bool | None, blocked_pairs=None) -> int:
    """`train.packing` resolved for these rows: the packed buffer length (`packed_length`), or 0 for the static
    layout (shared prompts when G > 1, else padded). ``packing`` None chooses whichever `layout_flops` says costs
    less: packing runs no padding, but a dense buffer's attention grows with the square of its length."""
    if packing is False or len(prompt_tokens_B) == 0:
        return 0
    L = packed_length(prompt_tokens_B, completion_tokens_B, group_size)
    if packing:
        return L
    static = layout_flops(prompt_tokens_B, completion_tokens_B, group_size, P, T, flops)
    packed = layout_flops(prompt_tokens_B, completion_tokens_B, group_size, P, T, flops, packed_length=L,
                          blocked_pairs=blocked_pairs)
    return L if packed < static else 0
