"""Per-token log-probabilities (and entropies) of completions under a model (ALGORITHMS.md §1).

Dimension letters: B rows, P prompt tokens (left-padded), T completion tokens (right-padded), D hidden,
V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models import forward, positions_from_mask, unembed


def token_logps_from_logits(logits_BxTxV, token_ids_BxT, *, temperature: float, with_entropy: bool = False):
    """log softmax(logits / temperature)[token] in float32, and entropy -sum_v p log p (or None)."""
    scaled_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
    logp_BxTxV = jax.nn.log_softmax(scaled_BxTxV, axis=-1)
    logps_BxT = jnp.take_along_axis(logp_BxTxV, token_ids_BxT[..., None], axis=-1)[..., 0]
    if not with_entropy:
        return logps_BxT, None
    entropy_BxT = -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)
    return logps_BxT, entropy_BxT


def completion_hidden(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                      *, prompt_group_size: int = 1):
    """Hidden states [B, T, D] that predict the T completion tokens (prompt ++ completion positions P-1 .. P+T-2).

    ``prompt_group_size`` G > 1 promises rows g*G .. g*G + G - 1 share their prompt (ids and mask, the
    `data.repeat_groups` order): each prompt then runs once and its keys/values are shared by the group's
    completions (`models.forward`'s ``prefix``), instead of G times. Same result, fewer FLOPs.
    """
    B, P = prompt_ids_BxP.shape
    T = completion_ids_BxT.shape[1]
    G = prompt_group_size
    if not isinstance(G, int) or G < 1 or B % G:
        raise ValueError(f"prompt_group_size={G!r} must be a positive integer dividing the {B} rows")
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


def completion_logps(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                     *, temperature: float, with_entropy: bool = False, chunk_size: int = 0,
                     prompt_group_size: int = 1):
    """Log-probs [B, T] (float32) of the completion tokens, and entropies [B, T] or None.

    logps[b, t] = log softmax(logits[b, P - 1 + t] / temperature)[completion_ids[b, t]] over the full
    vocabulary, on input prompt ++ completion with mask prompt_mask ++ completion_mask and positions
    cumsum(mask) - 1. ``chunk_size > 0`` unembeds ``chunk_size`` rows at a time with ``lax.map`` so the
    float32 [B, T, V] logits never exist at once, in the forward or (chunks rematerialised) the backward pass.
    ``prompt_group_size``: see `completion_hidden`. Masked positions hold finite junk; callers mask.
    """
    hidden_BxTxD = completion_hidden(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT,
                                     completion_mask_BxT, prompt_group_size=prompt_group_size)
    completion_ids_BxT = completion_ids_BxT.astype(jnp.int32)

    def rows(hidden_CxTxD, ids_CxT):
        logits_CxTxV = unembed(graphdef, params, hidden_CxTxD)
        return token_logps_from_logits(logits_CxTxV, ids_CxT, temperature=temperature, with_entropy=with_entropy)

    if chunk_size <= 0:
        return rows(hidden_BxTxD, completion_ids_BxT)

    # checkpointed: the backward pass recomputes each chunk's logits instead of keeping all of them
    @jax.checkpoint
    def one_row(args):
        hidden_TxD, ids_T = args
        logps_1xT, entropy_1xT = rows(hidden_TxD[None], ids_T[None])
        return logps_1xT[0], (entropy_1xT[0] if with_entropy else jnp.zeros((), jnp.float32))

    # batch_size vmaps chunk_size rows per map step (and handles a ragged last chunk)
    logps_BxT, entropy = jax.lax.map(one_row, (hidden_BxTxD, completion_ids_BxT), batch_size=chunk_size)
    return logps_BxT, (entropy if with_entropy else None)
