"""Per-token log-probabilities (and entropies) of completions under a model (ALGORITHMS.md §1).

Dimension letters: B rows, P prompt tokens (left-padded), T completion tokens (right-padded), D hidden, V vocab,
R buffers of L slots.

Rows run through the model in one of three layouts (`trajectory.Layout`), all computed the same way here: the
buffers' forward, the vocabulary on the slots that predict a completion token, and each token's log-prob gathered
from the slot that predicts it. ``padded``: each row is prompt ++ completion. ``shared``: each group's prompt runs
once and its rows' completions attend to its keys/values (`models.forward`'s prefix). ``packed``: each group is one
buffer of its real tokens (no padding runs), every completion a branch that sees the prompt and itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax import trajectory
from grpo_jax.models import forward, unembed


def token_logps_from_logits(logits_BxTxV, token_ids_BxT, *, temperature: float, with_entropy: bool = False):
    """log softmax(logits / temperature)[token] in float32, and entropy -sum_v p log p (or None)."""
    scaled_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
    logp_BxTxV = jax.nn.log_softmax(scaled_BxTxV, axis=-1)
    logps_BxT = jnp.take_along_axis(logp_BxTxV, token_ids_BxT[..., None], axis=-1)[..., 0]
    if not with_entropy:
        return logps_BxT, None
    entropy_BxT = -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)
    return logps_BxT, entropy_BxT


def _logps_of_hidden(graphdef, params, hidden_NxCxD, ids_NxC, *, temperature: float, with_entropy: bool,
                     chunk_size: int):
    """Log-probs (and entropies, or None) of ``ids`` under the logits of ``hidden``, [N, C] float32; ``chunk_size``
    rows of C slots unembedded at a time (`completion_logps`)."""
    def rows(hidden_KxCxD, ids_KxC):
        logits_KxCxV = unembed(graphdef, params, hidden_KxCxD)
        return token_logps_from_logits(logits_KxCxV, ids_KxC, temperature=temperature, with_entropy=with_entropy)

    if chunk_size <= 0:
        return rows(hidden_NxCxD, ids_NxC)

    # checkpointed: the backward pass recomputes each chunk's logits instead of keeping all of them
    @jax.checkpoint
    def one_row(args):
        hidden_CxD, ids_C = args
        logps_1xC, entropy_1xC = rows(hidden_CxD[None], ids_C[None])
        return logps_1xC[0], (entropy_1xC[0] if with_entropy else jnp.zeros((), jnp.float32))

    # batch_size vmaps chunk_size rows per map step (and handles a ragged last chunk)
    logps_NxC, entropy = jax.lax.map(one_row, (hidden_NxCxD, ids_NxC), batch_size=chunk_size)
    return logps_NxC, (entropy if with_entropy else None)


def completion_logps(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                     *, temperature: float, with_entropy: bool = False, chunk_size: int = 0,
                     prompt_group_size: int = 1, packed_length: int = 0, packed_buffers: int = 0):
    """Log-probs [B, T] (float32) of the completion tokens, and entropies [B, T] or None.

    logps[b, t] = log softmax(logits / temperature)[completion_ids[b, t]] over the full vocabulary, at the slot that
    predicts token t of row b, the model seeing prompt ++ completion (masks ``prompt_mask ++ completion_mask``,
    positions from them). The layout (`trajectory.layout`): ``packed_length`` L > 0 (`trajectory.packed_length` of
    these rows, or more) packs the groups of ``prompt_group_size`` rows (or the rows, G = 1) one after another into
    ``packed_buffers`` buffers of L slots (0: one a group); else G > 1 runs each group's prompt once (rows g*G ..
    g*G + G - 1 share it, the `data.repeat_groups` order); else every row runs on its own. Same result in each, up
    to float rounding. ``chunk_size > 0`` unembeds ``chunk_size`` rows of T slots at a time with ``lax.map`` so the
    float32 logits never exist at once, in the forward or (chunks rematerialised) the backward pass. Masked
    positions hold finite junk; callers mask.
    """
    B, T = completion_ids_BxT.shape
    layout = trajectory.layout(prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                               group_size=prompt_group_size, packed_length=packed_length,
                               packed_buffers=packed_buffers)
    prefix = None
    if layout.prefix is not None:
        ids_RxP, positions_RxP, mask_RxP = layout.prefix
        _, prefix = forward(graphdef, params, ids_RxP, positions_RxP, mask_RxP, return_kv=True)
    hidden_RxLxD, _ = forward(graphdef, params, layout.ids, layout.positions, layout.mask, prefix=prefix,
                              prefix_group_size=prompt_group_size if prefix is not None else 1)
    start, size = layout.scored
    hidden_RxCxD = hidden_RxLxD[:, start:start + size]
    next_RxC = layout.next_ids[:, start:start + size]
    R, C, D = hidden_RxCxD.shape
    if chunk_size > 0 and C != T:  # chunks of T slots, as many as a padded row has: the same logits memory per chunk
        pad = -(R * C) % T
        hidden_RxCxD = jnp.pad(hidden_RxCxD.reshape(R * C, D), ((0, pad), (0, 0))).reshape(-1, T, D)
        next_RxC = jnp.pad(next_RxC.reshape(-1), (0, pad)).reshape(-1, T)
    logps, entropy = _logps_of_hidden(graphdef, params, hidden_RxCxD, next_RxC, temperature=temperature,
                                      with_entropy=with_entropy, chunk_size=chunk_size)

    def gather(slots):  # each completion token's log-prob, from the slot that predicts it
        return jnp.take(slots.reshape(-1), layout.source.reshape(-1), axis=0).reshape(B, T)

    return gather(logps), (None if entropy is None else gather(entropy))
