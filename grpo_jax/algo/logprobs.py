"""Per-token log-probabilities (and entropies) of completions under a model (docs/algorithms.md §1).

Dimension letters: B rows, P prompt tokens (left-padded), T completion tokens (right-padded), D hidden, V vocab,
R buffers of L slots.

Rows run through the model in one of three layouts (`trajectory.Layout`), all computed the same way here: the
buffers' forward, the vocabulary on the slots that predict a completion token, and each token's log-prob gathered
from the slot that predicts it. ``padded``: each row is prompt ++ completion. ``shared``: each group's prompt runs
once and its rows' completions attend to its keys/values (`models.forward`'s prefix). ``packed``: each group is one
buffer of its real tokens (no padding runs), every completion a branch that sees the prompt and itself.

Mixture-of-experts models: ``routing`` replays the experts the sampler chose for each token (routing replay), and
``router_aux`` adds the routers' load-balancing loss over the rows' real tokens, in every layout (`_slot_sources`
says which row token each slot runs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_jax.algo import trajectory
from grpo_jax.models.moe import load_balancing_loss
from grpo_jax.models.transformer import forward, model_config, unembed


# With a logps chunk, a chunk's float32 logits at most (a 16k-token row over Gemma's 262k vocabulary is 16 GiB,
# and its softmax, entropy and backward hold several such buffers)
LOGITS_PIECE_BYTES = 2 ** 30


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
                     chunk_size: int, row_sharding=None):
    """Log-probs (and entropies, or None) of ``ids`` under the logits of ``hidden``, [N, C] float32; ``chunk_size``
    rows of C slots unembedded at a time (`completion_logps`), in each shard of ``row_sharding`` (None: one)."""
    def rows(hidden_KxCxD, ids_KxC):
        logits_KxCxV = unembed(graphdef, params, hidden_KxCxD)
        return token_logps_from_logits(logits_KxCxV, ids_KxC, temperature=temperature, with_entropy=with_entropy)

    if chunk_size <= 0:
        return rows(hidden_NxCxD, ids_NxC)
    N, C, D = hidden_NxCxD.shape
    piece = _slots_per_piece(C, chunk_size * model_config(graphdef, params).vocab_size)

    # checkpointed: the backward pass recomputes each chunk's logits instead of keeping all of them
    @jax.checkpoint
    def one_piece(args):
        hidden_CxD, ids_C = args
        logps_1xC, entropy_1xC = rows(hidden_CxD[None], ids_C[None])
        return logps_1xC[0], (entropy_1xC[0] if with_entropy else jnp.zeros((), jnp.float32))

    def one_row(args):
        if piece == C:
            return one_piece(args)
        # a long row over a large vocabulary in pieces of its slots: each slot's log-prob is its own row of logits
        hidden_CxD, ids_C = args
        pad = -C % piece
        hidden_QxSxD = jnp.pad(hidden_CxD, ((0, pad), (0, 0))).reshape(-1, piece, D)
        ids_QxS = jnp.pad(ids_C, (0, pad)).reshape(-1, piece)
        logps_QxS, entropy_QxS = jax.lax.map(one_piece, (hidden_QxSxD, ids_QxS))
        return logps_QxS.reshape(-1)[:C], (entropy_QxS.reshape(-1)[:C] if with_entropy else entropy_QxS[0])

    def rows_in_chunks(hidden_MxCxD, ids_MxC):  # batch_size vmaps chunk_size rows per map step (and a ragged last)
        return jax.lax.map(one_row, (hidden_MxCxD, ids_MxC), batch_size=chunk_size)

    if row_sharding is None:
        logps_NxC, entropy = rows_in_chunks(hidden_NxCxD, ids_NxC)
        return logps_NxC, (entropy if with_entropy else None)
    # each row shard maps over its own rows: a map over the rows' axis itself would step through rows of every
    # shard, which XLA does by gathering all rows' hidden states onto every chip
    S = _row_shards(row_sharding)
    pad = -N % S
    hidden_SxMxCxD = jax.lax.with_sharding_constraint(
        jnp.pad(hidden_NxCxD, ((0, pad), (0, 0), (0, 0))).reshape(S, -1, C, D), row_sharding)
    ids_SxMxC = jax.lax.with_sharding_constraint(jnp.pad(ids_NxC, ((0, pad), (0, 0))).reshape(S, -1, C), row_sharding)
    logps_SxMxC, entropy = jax.vmap(rows_in_chunks)(hidden_SxMxCxD, ids_SxMxC)
    return logps_SxMxC.reshape(-1, C)[:N], (entropy.reshape(-1, C)[:N] if with_entropy else None)


def _row_shards(row_sharding) -> int:
    """How many ways ``row_sharding`` splits the rows (its first dimension)."""
    axes = row_sharding.spec[0] if len(row_sharding.spec) else None
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    return math.prod(row_sharding.mesh.shape[axis] for axis in axes)


def _slots_per_piece(C: int, values_per_slot: int) -> int:
    """Slots of a row unembedded at once under ``chunk_size``: all C, unless a chunk's float32 logits would pass
    `LOGITS_PIECE_BYTES`; then the largest power of two that keeps them under it."""
    per_slot = 4 * values_per_slot
    if C * per_slot <= LOGITS_PIECE_BYTES:
        return C
    return 2 ** max(0, (LOGITS_PIECE_BYTES // per_slot).bit_length() - 1)


def _slot_sources(prompt_mask_BxP, completion_mask_BxT, layout_of):
    """Which row token each slot of a layout runs: (prefix [R, Pp] or None, buffers [R, L]) flat indices + 1 into
    the rows' [B, P + T] tokens (0: a padding slot), from the layout of the tokens' indices in place of their ids."""
    B, P = prompt_mask_BxP.shape
    index_BxS = jnp.arange(1, B * (P + completion_mask_BxT.shape[1]) + 1, dtype=jnp.int32).reshape(B, -1)
    layout = layout_of(index_BxS[:, :P], index_BxS[:, P:])
    return (None if layout.prefix is None else layout.prefix[0]), layout.ids


def _gather_tokens(x_BxSx, source):
    """Per slot, the value of the row token it runs (`_slot_sources`; a padding slot gets token 0's)."""
    flat = x_BxSx.reshape(-1, *x_BxSx.shape[2:])
    return flat[jnp.maximum(source - 1, 0)]


def _token_weights(sources, real_BxS, group_size: int, num_prompt: int):
    """Per slot of the sources (`_slot_sources`, concatenated), how many of the rows' real tokens it stands for,
    each token counted once: a group's prompt token stands for its G rows, and a token run in several slots (a
    packed group's last prompt token, once per branch) counts in the first."""
    S = real_BxS.shape[1]
    src = jnp.concatenate([x.reshape(-1) for x in sources])
    flat = jnp.maximum(src - 1, 0)
    row, place = flat // S, flat % S
    in_prompt = place < num_prompt
    canonical = jnp.where(in_prompt, row // group_size * group_size * S + place, flat)
    slot = jnp.arange(src.shape[0])
    first = jnp.full((real_BxS.size,), src.shape[0]).at[canonical].min(jnp.where(src > 0, slot, src.shape[0]))
    count = jnp.where(in_prompt, group_size, 1).astype(jnp.float32)
    return jnp.where((src > 0) & (first[canonical] == slot), count * real_BxS.reshape(-1)[flat], 0.0)


def completion_logps(graphdef, params, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxT, completion_mask_BxT,
                     *, temperature: float, with_entropy: bool = False, chunk_size: int = 0,
                     prompt_group_size: int = 1, packed_length: int = 0, packed_buffers: int = 0,
                     routing=None, router_aux: bool = False, row_sharding=None):
    """Log-probs [B, T] (float32) of the completion tokens, and entropies [B, T] or None (and with ``router_aux``
    the load-balancing loss, a third output).

    logps[b, t] = log softmax(logits / temperature)[completion_ids[b, t]] over the full vocabulary, at the slot that
    predicts token t of row b, the model seeing prompt ++ completion (masks ``prompt_mask ++ completion_mask``,
    positions from them). The layout (`trajectory.layout`): ``packed_length`` L > 0 (`trajectory.packed_length` of
    these rows, or more) packs the groups of ``prompt_group_size`` rows (or the rows, G = 1) one after another into
    ``packed_buffers`` buffers of L slots (0: one a group); else G > 1 runs each group's prompt once (rows g*G ..
    g*G + G - 1 share it, the `data.repeat_groups` order); else every row runs on its own. Same result in each, up
    to float rounding. ``chunk_size > 0`` unembeds ``chunk_size`` rows of T slots at a time with ``lax.map`` so the
    float32 logits never exist at once, in the forward or (chunks rematerialised) the backward pass. Masked
    positions hold finite junk; callers mask.

    Mixture-of-experts models: ``routing`` [B, P + T, L, K] (`Trajectory.routed_experts`) replays each token's
    experts in every layer; ``router_aux``: transformers' ``load_balancing_loss_func`` over every real token of the
    rows (prompt ++ completion, the prompt counted once per row, as TRL's forward of each row counts it), of the
    routers' own top K. The shared-prompt layout never runs a row's last completion token, which predicts nothing,
    so there the loss misses those tokens.

    ``row_sharding`` (a `NamedSharding` of the rows, or None): the buffers' hidden states are kept split over rows
    that way, and with a chunk each shard unembeds its own rows ``chunk_size`` at a time, so each chip runs and
    keeps its own rows (XLA's own choice held every row's hidden states on every chip).
    """
    B, T = completion_ids_BxT.shape
    layout_of = lambda prompt, completion: trajectory.layout(  # noqa: E731
        prompt, prompt_mask_BxP, completion, completion_mask_BxT, group_size=prompt_group_size,
        packed_length=packed_length, packed_buffers=packed_buffers)
    layout = layout_of(prompt_ids_BxP, completion_ids_BxT)
    routed = routing is not None or router_aux
    prefix_source, source = (_slot_sources(prompt_mask_BxP, completion_mask_BxT, layout_of) if routed
                             else (None, None))

    def replay(source):  # the slots' replayed experts [L, R, S, K]
        return None if routing is None else _gather_tokens(routing, source).transpose(2, 0, 1, 3)

    prefix, router = None, []  # router: each forward's Routing (with router_aux)
    if layout.prefix is not None:
        ids_RxP, positions_RxP, mask_RxP = layout.prefix
        _, prefix, *router = forward(graphdef, params, ids_RxP, positions_RxP, mask_RxP, return_kv=True,
                                     routing=replay(prefix_source), return_routing=router_aux)
    hidden_RxLxD, _, *buffer_router = forward(graphdef, params, layout.ids, layout.positions, layout.mask,
                                              prefix=prefix,
                                              prefix_group_size=prompt_group_size if prefix is not None else 1,
                                              routing=replay(source), return_routing=router_aux)
    router += buffer_router
    if row_sharding is not None:  # else XLA splits the hidden size like the fsdp params and every chip holds all rows
        hidden_RxLxD = jax.lax.with_sharding_constraint(hidden_RxLxD, row_sharding)
    start, size = layout.scored
    hidden_RxCxD = hidden_RxLxD[:, start:start + size]
    next_RxC = layout.next_ids[:, start:start + size]
    R, C, D = hidden_RxCxD.shape
    if chunk_size > 0 and C != T:  # chunks of T slots, as many as a padded row has: the same logits memory per chunk
        pad = -(R * C) % T
        hidden_RxCxD = jnp.pad(hidden_RxCxD.reshape(R * C, D), ((0, pad), (0, 0))).reshape(-1, T, D)
        next_RxC = jnp.pad(next_RxC.reshape(-1), (0, pad)).reshape(-1, T)
    logps, entropy = _logps_of_hidden(graphdef, params, hidden_RxCxD, next_RxC, temperature=temperature,
                                      with_entropy=with_entropy, chunk_size=chunk_size, row_sharding=row_sharding)

    def gather(slots):  # each completion token's log-prob, from the slot that predicts it
        return jnp.take(slots.reshape(-1), layout.source.reshape(-1), axis=0).reshape(B, T)

    out = gather(logps), (None if entropy is None else gather(entropy))
    if not router_aux:
        return out
    real_BxS = jnp.concatenate([prompt_mask_BxP, completion_mask_BxT], axis=1).astype(jnp.float32)
    sources = ([] if prefix_source is None else [prefix_source]) + [source]
    weights = _token_weights(sources, real_BxS, prompt_group_size, prompt_ids_BxP.shape[1])
    logits = jnp.concatenate([r.logits.reshape(r.logits.shape[0], -1, r.logits.shape[-1]) for r in router], axis=1)
    aux = load_balancing_loss(logits, model_config(graphdef, params).num_experts_per_tok, weights)
    return (*out, aux)
