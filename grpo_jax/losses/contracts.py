"""Shape, rank and dtype contracts at the maths functions' boundaries (chex, checked while tracing: nothing runs on
the devices), so a wrong array from a loss variant or a data pipeline fails naming the arrays and the shapes they
must have, not deep inside XLA. Each takes the arrays by name; None is an argument left out.
"""

from __future__ import annotations

import chex


def _given(arrays: dict) -> dict:
    return {name: x for name, x in arrays.items() if x is not None}


def same_shape(**arrays) -> None:
    """The arrays of an elementwise function all of one shape (any rank)."""
    named = _given(arrays)
    if len(named) > 1:
        chex.assert_equal_shape(list(named.values()), custom_message=f"{', '.join(named)} must share one shape")


def per_token(**arrays) -> None:
    """Each array [B, T] (rank 2), all of one shape."""
    named = _given(arrays)
    for name, x in named.items():
        chex.assert_rank(x, 2, custom_message=f"{name} must be [B, T]")
    if len(named) > 1:
        chex.assert_equal_shape(list(named.values()), custom_message=f"{', '.join(named)} must share one [B, T] shape")


def floating(**arrays) -> None:
    """Each array of a floating dtype (log-probs, advantages, entropies: an integer array is a mix-up)."""
    for name, x in _given(arrays).items():
        chex.assert_type(x, float, custom_message=f"{name} holds {x.dtype}, not floats")


def advantages(advantages_, per_token_logps) -> None:
    """Advantages [B] (one a sequence) or [B, T] (one a token) for [B, T] log-probs."""
    chex.assert_rank(advantages_, {1, 2}, custom_message="advantages must be [B] or [B, T]")
    B, T = per_token_logps.shape
    shape = (B,) if advantages_.ndim == 1 else (B, T)
    chex.assert_shape(advantages_, shape, custom_message=f"advantages must be [B]={B} rows or [B, T]={B, T} for "
                                                         f"per_token_logps {per_token_logps.shape}")


def grouped_rewards(rewards_NxF, reward_weights_F) -> None:
    """Rewards [N, F] (N rows, F functions) with one weight [F] a function."""
    chex.assert_rank(rewards_NxF, 2, custom_message="rewards must be [N, F]: one column per reward function")
    chex.assert_rank(reward_weights_F, 1, custom_message="reward_weights must be [F]")
    N, F = rewards_NxF.shape
    chex.assert_shape(reward_weights_F, (F,), custom_message=f"reward_weights must hold one weight per reward "
                                                             f"function (rewards are {rewards_NxF.shape})")


def trajectory(batch) -> None:
    """A train step's rows (`algo.trajectory.Trajectory`): prompt ids and mask [B, P]; completion ids, masks, turns
    and per-token log-probs [B, T]; is_truncated [B]; advantages [B] or [B, T]."""
    chex.assert_rank(batch.prompt_ids, 2, custom_message="prompt_ids must be [B, P]")
    chex.assert_equal_shape([batch.prompt_ids, batch.prompt_mask], custom_message="prompt_ids, prompt_mask must "
                                                                                  "share one [B, P] shape")
    per_token(completion_ids=batch.completion_ids, completion_mask=batch.completion_mask, loss_mask=batch.loss_mask,
              turns=batch.turns, sampler_per_token_logps=batch.sampler_per_token_logps,
              old_per_token_logps=batch.old_per_token_logps, ref_per_token_logps=batch.ref_per_token_logps)
    B = batch.completion_ids.shape[0]
    chex.assert_shape(batch.prompt_ids, (B, None), custom_message=f"prompt_ids must have the completions' B={B} rows")
    chex.assert_shape(batch.is_truncated, (B,), custom_message=f"is_truncated must be [B]={B}")
    if batch.advantages is not None:
        advantages(batch.advantages, batch.completion_ids)
