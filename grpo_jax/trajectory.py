"""`Trajectory`: a round's rows as one pytree, from the decoder (`grpo_jax.decoder`) to the loss.

Dimension letters: B rows, P prompt tokens (left-padded), T completion tokens (right-padded).

A row is its prompt and one completion holding every turn: the tokens the policy sampled and, between turns, tokens
appended from outside (a tool's result, an environment's observation). Attention sees all of them
(``completion_mask``); the loss trains only ``loss_mask`` (the tokens the policy sampled, as TRL's ``tool_mask``
leaves them; round-level options such as `rounds.mask_truncated` clear whole rows). The round adds the advantages
and the old / reference log-probs; `train_step.train_step` takes it as its batch. Positions follow from the masks
(`positions`): a completion token at index t sits at position (real prompt tokens) + t.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


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
