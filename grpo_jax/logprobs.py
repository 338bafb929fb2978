"""Per-token log-probabilities (and entropies) of completions under a model (ALGORITHMS.md §1).

Dimension letters: B rows, P prompt tokens (left-padded), T completion tokens (right-padded), D hidden,
V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import forward, model_config, positions_from_mask, unembed


def token_logps_from_logits(logits_BxTxV, token_ids_BxT, *, temperature: float, with_entropy: bool = False):
    """log softmax(logits / temperature)[token] in float32, and entropy -sum_v p log p (or None)."""
    scaled_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
    logp_BxTxV = jax.nn.log_softmax(scaled_BxTxV, axis=-1)
    logps_BxT = jnp.take_along_axis(logp_BxTxV, token_ids_BxT[..., None], axis=-1)[..., 0]
    if not with_entropy:
        return logps_BxT, None
    entropy_BxT = -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)
    return logps_BxT, entropy_BxT


def packed_length(prompt_tokens_B, completion_tokens_B, group_size: int) -> int:
    """The buffer length of `completion_hidden`'s packed layout for rows of these real prompt and completion token
    counts (host arrays): each group's prompt tokens plus its completions' tokens, the longest group's count rounded
    up to 8 steps an octave (at most 1/8 padding; few lengths, so few compilations). 0 for no rows."""
    B = len(prompt_tokens_B)
    if B == 0:
        return 0
    counts_R = (np.asarray(prompt_tokens_B)[::group_size]
                + np.asarray(completion_tokens_B).reshape(-1, group_size).sum(1))
    need = max(int(counts_R.max()), 16)
    step = 1 << max(need.bit_length() - 4, 0)  # 8 lengths between each power of two and the next
    return -(-need // step) * step


def _packed_hidden(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                   G: int, L: int):
    """The packed layout's forward: each group is one buffer of L tokens, [its real prompt tokens | completion 1's
    masked tokens | ... | completion G's | padding]. Tokens carry their own positions (prompt: 0 .. p-1, completion
    tokens: p + t) and a branch id (0: prompt, g + 1: completion g); a token sees the earlier tokens of the prompt
    and of its own branch. Padding (left of prompts, right of completions) is never run.

    Returns (hidden [R, L, D], the buffers' token ids [R, L], source [R, G, T]: the slot whose hidden state
    predicts each completion token: the prompt's last slot for t = 0, the completion's own token t - 1 after)."""
    B, P = prompt_ids_BxP.shape
    T = completion_ids_BxT.shape[1]
    R = B // G
    p_R = jnp.sum(prompt_mask_BxP[::G], axis=1).astype(jnp.int32)
    n_RxG = jnp.sum(completion_mask_BxT, axis=1).astype(jnp.int32).reshape(R, G)
    start_RxG = p_R[:, None] + jnp.cumsum(n_RxG, axis=1) - n_RxG  # where each completion starts in its buffer
    i_L = jnp.arange(L)
    # the last branch starting at or before a slot (an empty completion starts where the next one does)
    branch_RxL = jnp.where(i_L[None] < p_R[:, None], 0,
                           jnp.sum(start_RxG[:, None, :] <= i_L[None, :, None], axis=2))
    valid_RxL = i_L[None] < (p_R + jnp.sum(n_RxG, axis=1))[:, None]
    start_RxL = jnp.take_along_axis(start_RxG, jnp.maximum(branch_RxL - 1, 0), axis=1)
    t_RxL = jnp.clip(i_L[None] - start_RxL, 0, T - 1)
    # gathers inside each group's rows ([R, G, ...]): a mesh that splits rows keeps whole groups on one device
    ids_RxGxT = jnp.asarray(completion_ids_BxT, jnp.int32).reshape(R, G, T)
    completion_tok_RxL = ids_RxGxT[jnp.arange(R)[:, None], jnp.maximum(branch_RxL - 1, 0), t_RxL]
    prompt_tok_RxL = jnp.take_along_axis(prompt_ids_BxP[::G].astype(jnp.int32),
                                         jnp.clip(P - p_R[:, None] + i_L[None], 0, P - 1), axis=1)
    ids_RxL = jnp.where(~valid_RxL, 0, jnp.where(branch_RxL == 0, prompt_tok_RxL, completion_tok_RxL))
    positions_RxL = jnp.where(~valid_RxL, 0, jnp.where(branch_RxL == 0, i_L[None], p_R[:, None] + t_RxL))
    visible_RxLxL = ((i_L[None, None, :] <= i_L[None, :, None]) & valid_RxL[:, None, :]
                     & ((branch_RxL[:, None, :] == 0) | (branch_RxL[:, None, :] == branch_RxL[:, :, None])))
    window = model_config(graphdef, params).sliding_window
    if window is not None:
        visible_RxLxL &= positions_RxL[:, :, None] - positions_RxL[:, None, :] < window
    hidden_RxLxD, _ = forward(graphdef, params, ids_RxL, positions_RxL, visible_RxLxL)
    t_T = jnp.arange(T)
    source_RxGxT = jnp.where(t_T[None, None] == 0, p_R[:, None, None] - 1, start_RxG[:, :, None] + t_T - 1)
    return hidden_RxLxD, ids_RxL, jnp.clip(source_RxGxT, 0, L - 1)


def _gather_slots(values_RxL, source_RxGxT):
    """[R, L] per-slot values -> [B, T] at each completion token's source slot."""
    R, G, T = source_RxGxT.shape
    return jnp.take_along_axis(values_RxL, source_RxGxT.reshape(R, G * T), axis=1).reshape(R * G, T)


def completion_hidden(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                      *, prompt_group_size: int = 1):
    """Hidden states [B, T, D] that predict the T completion tokens (prompt ++ completion positions P-1 .. P+T-2).

    ``prompt_group_size`` G > 1 promises rows g*G .. g*G + G - 1 share their prompt (ids and mask, the
    `data.repeat_groups` order): each prompt then runs once and its keys/values are shared by the group's
    completions (`models.forward`'s ``prefix``), instead of G times. Same result, fewer FLOPs. (The packed layout,
    `completion_logps`'s ``packed_length``, is `_packed_hidden`.)
    """
    B, P = prompt_ids_BxP.shape
    T = completion_ids_BxT.shape[1]
    G = _group_size(prompt_group_size, B)
    mask_BxL = jnp.concatenate([prompt_mask_BxP, completion_mask_BxT], axis=1).astype(jnp.int32)
    if G == 1:
        ids_BxL = jnp.concatenate([prompt_ids_BxP, completion_ids_BxT], axis=1).astype(jnp.int32)
        hidden_BxLxD, _ = forward(graphdef, params, ids_BxL, positions_from_mask(mask_BxL), mask_BxL)
        return hidden_BxLxD[:, P - 1:P + T - 1]
    prompt_mask_RxP = prompt_mask_BxP[::G].astype(jnp.int32)
    hidden_RxPxD, prompt_kv = forward(graphdef, params, prompt_ids_BxP[::G].astype(jnp.int32),
                                      positions_from_mask(prompt_mask_RxP), prompt_mask_RxP, return_kv=True)
    hidden_BxTxD, _ = forward(graphdef, params, completion_ids_BxT.astype(jnp.int32),
                              positions_from_mask(mask_BxL)[:, P:], mask_BxL, prefix=prompt_kv, prefix_group_size=G)
    last_prompt_Bx1xD = jnp.repeat(hidden_RxPxD[:, P - 1:], G, axis=0)
    return jnp.concatenate([last_prompt_Bx1xD, hidden_BxTxD[:, :T - 1]], axis=1)


def _group_size(G, B: int) -> int:
    if not isinstance(G, int) or G < 1 or B % G:
        raise ValueError(f"prompt_group_size={G!r} must be a positive integer dividing the {B} rows")
    return G


def _logps_of_hidden(graphdef, params, hidden_BxTxD, ids_BxT, *, temperature: float, with_entropy: bool,
                     chunk_size: int):
    """Log-probs (and entropies, or None) of ``ids`` under the logits of ``hidden``, [B, T] float32; ``chunk_size``
    rows unembedded at a time (`completion_logps`)."""
    def rows(hidden_CxTxD, ids_CxT):
        logits_CxTxV = unembed(graphdef, params, hidden_CxTxD)
        return token_logps_from_logits(logits_CxTxV, ids_CxT, temperature=temperature, with_entropy=with_entropy)

    if chunk_size <= 0:
        return rows(hidden_BxTxD, ids_BxT)

    # checkpointed: the backward pass recomputes each chunk's logits instead of keeping all of them
    @jax.checkpoint
    def one_row(args):
        hidden_TxD, ids_T = args
        logps_1xT, entropy_1xT = rows(hidden_TxD[None], ids_T[None])
        return logps_1xT[0], (entropy_1xT[0] if with_entropy else jnp.zeros((), jnp.float32))

    # batch_size vmaps chunk_size rows per map step (and handles a ragged last chunk)
    logps_BxT, entropy = jax.lax.map(one_row, (hidden_BxTxD, ids_BxT), batch_size=chunk_size)
    return logps_BxT, (entropy if with_entropy else None)


def _packed_logps(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT, G: int,
                  L: int, *, temperature: float, with_entropy: bool, chunk_size: int):
    """`completion_logps` over the packed layout: the vocabulary is applied to the R * L buffer slots, not to the
    B * T padded rows (at a real vocabulary the unembedding is a large share of a token's FLOPs, and most padded
    slots are padding). A slot's logits score the next token of its buffer; the prompt's last slot, which predicts
    the first token of each of the G completions, is scored once more for those."""
    B, T = completion_ids_BxT.shape
    R = B // G
    hidden_RxLxD, ids_RxL, source_RxGxT = _packed_hidden(graphdef, params, prompt_ids_BxP, prompt_mask_BxP,
                                                         completion_ids_BxT, completion_mask_BxT, G, L)
    next_RxL = jnp.concatenate([ids_RxL[:, 1:], jnp.zeros((R, 1), jnp.int32)], axis=1)
    D = hidden_RxLxD.shape[-1]
    hidden_NxCxD, next_NxC = hidden_RxLxD, next_RxL
    if chunk_size > 0:  # chunks of T slots, as many as a padded row has: the same logits memory per chunk
        pad = -(R * L) % T
        hidden_NxCxD = jnp.pad(hidden_RxLxD.reshape(R * L, D), ((0, pad), (0, 0))).reshape(-1, T, D)
        next_NxC = jnp.pad(next_RxL.reshape(-1), (0, pad)).reshape(-1, T)
    slot_logps_RxL, slot_entropy_RxL = (
        None if x is None else x.reshape(-1)[:R * L].reshape(R, L)
        for x in _logps_of_hidden(graphdef, params, hidden_NxCxD, next_NxC, temperature=temperature,
                                  with_entropy=with_entropy, chunk_size=chunk_size))
    last_Rx1xD = jnp.take_along_axis(hidden_RxLxD, source_RxGxT[:, :1, :1], axis=1)  # the prompt's last slot
    logp_RxV = jax.nn.log_softmax(unembed(graphdef, params, last_Rx1xD)[:, 0].astype(jnp.float32) / temperature)
    first_RxG = jnp.take_along_axis(logp_RxV, completion_ids_BxT[:, 0].reshape(R, G).astype(jnp.int32), axis=1)
    later_BxT = _gather_slots(slot_logps_RxL, source_RxGxT)
    logps_BxT = jnp.where(jnp.arange(T)[None] == 0, first_RxG.reshape(B, 1), later_BxT)
    return logps_BxT, (None if slot_entropy_RxL is None else _gather_slots(slot_entropy_RxL, source_RxGxT))


def completion_logps(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                     *, temperature: float, with_entropy: bool = False, chunk_size: int = 0,
                     prompt_group_size: int = 1, packed_length: int = 0):
    """Log-probs [B, T] (float32) of the completion tokens, and entropies [B, T] or None.

    logps[b, t] = log softmax(logits[b, P - 1 + t] / temperature)[completion_ids[b, t]] over the full
    vocabulary, on input prompt ++ completion with mask prompt_mask ++ completion_mask and positions
    cumsum(mask) - 1. ``chunk_size > 0`` unembeds ``chunk_size`` rows at a time with ``lax.map`` so the
    float32 [B, T, V] logits never exist at once, in the forward or (chunks rematerialised) the backward pass.
    ``prompt_group_size``: see `completion_hidden`. ``packed_length`` L > 0 (`packed_length` of these rows, or
    more) runs each group as one buffer of L tokens holding its real prompt and masked completion tokens only
    (`_packed_hidden`), and the vocabulary on the buffers' slots only (`_packed_logps`; chunks of T slots): same
    result where the mask is 1. Masked positions hold finite junk; callers mask.
    """
    G = _group_size(prompt_group_size, completion_ids_BxT.shape[0])
    if packed_length:
        return _packed_logps(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT,
                             completion_mask_BxT, G, packed_length, temperature=temperature,
                             with_entropy=with_entropy, chunk_size=chunk_size)
    hidden_BxTxD = completion_hidden(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT,
                                     completion_mask_BxT, prompt_group_size=G)
    return _logps_of_hidden(graphdef, params, hidden_BxTxD, completion_ids_BxT.astype(jnp.int32),
                            temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size)
