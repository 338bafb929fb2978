"""Per-token losses -> one scalar, with the normaliser of each loss_type (docs/algorithms.md §7), and metrics (§9).

Every normaliser is global to the optimizer step: `num_sequences` rows and `num_items_in_batch` active tokens
of the whole step (all devices, all micro-batches), so the sum of `aggregate` over micro-batches is the
full-batch value for every loss_type. Left at None they are this batch's B and Σ mask (one micro-batch).

Where TRL's gradient-accumulated numbers differ (with one micro-batch per step they agree):
- bnpo: TRL divides each micro-batch by its own token count (then by the accumulation steps), which is not
  the full-batch value when micro-batches carry different token counts; we divide by the step's count.
- dapo, cispo, vespo: TRL divides by the round's tokens per optimizer step on average
  (num_items_in_batch · GA / steps_per_generation / processes); we divide by the step's own count. They
  agree when steps_per_generation == gradient_accumulation_steps.
- grpo, sapo, luspo, dr_grpo: TRL's per-micro-batch row means over equal-sized micro-batches are exact.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from grpo_jax.config.loss import LOSS_TYPES
from grpo_jax.losses import contracts
from grpo_jax.losses.masks import masked_mean, masked_sum


def aggregate(per_token_loss_BxT: jax.Array, completion_mask_BxT: jax.Array, *, loss_type: str,
              max_completion_length: int | None = None, num_items_in_batch=None, num_sequences=None
              ) -> jax.Array:
    """Reduce per-token losses to a scalar with the normaliser of `loss_type`.

    grpo, sapo:         Σ_i (Σ_t ℓ·m / max(Σ_t m, 1)) / num_sequences   (an all-masked row adds 0, counts 1)
    luspo:              Σ_i Σ_t ℓ·m / num_sequences
    bnpo, dapo, cispo, vespo:  Σ ℓ·m / max(num_items_in_batch, 1)
    dr_grpo:            Σ ℓ·m / (num_sequences · max_completion_length)
    Shapes: per_token_loss [B, T] or [B, 1] (broadcast), completion_mask [B, T] (0/1, any dtype) -> scalar f32.
    """
    contracts.per_token(completion_mask=completion_mask_BxT)
    chex.assert_rank(per_token_loss_BxT, 2, custom_message="per_token_loss must be [B, T] or [B, 1]")
    chex.assert_is_broadcastable(per_token_loss_BxT.shape, completion_mask_BxT.shape,
                                 custom_message=f"per_token_loss {per_token_loss_BxT.shape} must be [B, T] or [B, 1] "
                                                f"for completion_mask {completion_mask_BxT.shape}")
    mask_BxT = jnp.asarray(completion_mask_BxT, jnp.float32)
    loss_BxT = jnp.broadcast_to(per_token_loss_BxT, mask_BxT.shape)
    if num_sequences is None:
        num_sequences = mask_BxT.shape[0]
    if num_items_in_batch is None:
        num_items_in_batch = jnp.sum(mask_BxT)
    if loss_type in ("grpo", "sapo"):
        row_sum_B = masked_sum(loss_BxT, mask_BxT, axis=1)
        return jnp.sum(row_sum_B / jnp.maximum(jnp.sum(mask_BxT, axis=1), 1.0)) / num_sequences
    total = masked_sum(loss_BxT, mask_BxT)
    if loss_type == "luspo":
        return total / num_sequences
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return total / jnp.maximum(jnp.asarray(num_items_in_batch, jnp.float32), 1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss.max_completion_length=None is required by loss_type='dr_grpo': set it to "
                             "sampling.max_completion_length (the trainer does this for you)")
        return total / (num_sequences * max_completion_length)
    raise ValueError(f"loss.loss_type={loss_type!r} is not supported: choose one of {LOSS_TYPES}")


def entropy_bonus(entropies_BxT: jax.Array, completion_mask_BxT: jax.Array, *, coef: float,
                  entropy_mask_BxT: jax.Array | None = None, num_items_in_batch=None) -> jax.Array:
    """Entropy regularisation to *subtract* from the loss: coef · mean entropy over the tokens it acts on.

    Without an entropy mask: coef · Σ H·m / max(num_items_in_batch, 1) (exactly summable over micro-batches).
    With one (top_entropy_quantile < 1): coef · masked_mean_{m·e}(H) · Σ m / num_items_in_batch, the
    token-weighted combination of micro-batch means. With num_items_in_batch = None both equal TRL's
    per-micro-batch mean. Gradient flows through `entropies_BxT` only if the caller lets it.
    """
    mask_BxT = jnp.asarray(completion_mask_BxT, jnp.float32)
    local_items = jnp.sum(mask_BxT)
    step_items = local_items if num_items_in_batch is None else jnp.asarray(num_items_in_batch, jnp.float32)
    step_items = jnp.maximum(step_items, 1.0)
    if entropy_mask_BxT is None:
        return coef * masked_sum(entropies_BxT, mask_BxT) / step_items
    effective_BxT = mask_BxT * entropy_mask_BxT
    return coef * masked_mean(entropies_BxT, effective_BxT) * local_items / step_items


def clip_ratio_metrics(ratio_BxT: jax.Array, advantages_BxT: jax.Array, completion_mask_BxT: jax.Array, *,
                       epsilon_low: float, epsilon_high: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fractions of active tokens clipped low / high / either, scalars (TRL `clip_ratio/*_mean`).

    low: r < 1 - ε_low and A < 0;  high: r > 1 + ε_high and A > 0 (the tokens whose gradient the clip stops).
    A per-sequence ratio [B, 1] is broadcast over the row's tokens (token-weighted; TRL weights sequences).
    """
    ratio_BxT = jax.lax.stop_gradient(ratio_BxT)
    low = (ratio_BxT < 1.0 - epsilon_low) & (advantages_BxT < 0)
    high = (ratio_BxT > 1.0 + epsilon_high) & (advantages_BxT > 0)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return (masked_mean(f32(low), completion_mask_BxT), masked_mean(f32(high), completion_mask_BxT),
            masked_mean(f32(low | high), completion_mask_BxT))


def clip_ratio_extremes(ratio_BxT: jax.Array, advantages_BxT: jax.Array, completion_mask_BxT: jax.Array, *,
                        epsilon_low: float, epsilon_high: float) -> tuple[jax.Array, jax.Array]:
    """The smallest row's fraction of active tokens clipped low and the largest row's clipped high, scalars (TRL
    `clip_ratio/low_min`, `clip_ratio/high_max`): rows without active tokens are left out (NaN when all are)."""
    ratio_BxT = jax.lax.stop_gradient(ratio_BxT)
    low = (ratio_BxT < 1.0 - epsilon_low) & (advantages_BxT < 0)
    high = (ratio_BxT > 1.0 + epsilon_high) & (advantages_BxT > 0)
    shape = jnp.broadcast_shapes(low.shape, completion_mask_BxT.shape)  # a sequence-level ratio is [B, 1]
    mask = jnp.broadcast_to(completion_mask_BxT, shape).astype(jnp.float32)
    tokens_B = jnp.sum(mask, axis=-1)

    def row_means(x):  # NaN for a row with no active token, as TRL's 0 / 0
        x = jnp.broadcast_to(x, shape)
        return jnp.where(tokens_B > 0, jnp.sum(x * mask, axis=-1) / jnp.maximum(tokens_B, 1.0), jnp.nan)
    return jnp.nanmin(row_means(low.astype(jnp.float32))), jnp.nanmax(row_means(high.astype(jnp.float32)))


def cispo_clip_ratio(ratio_BxT: jax.Array, advantages_BxT: jax.Array, completion_mask_BxT: jax.Array, *,
                     epsilon_high: float) -> jax.Array:
    """Fraction of active tokens whose CISPO weight is capped: r > ε_high and A > 0 (TRL `cispo_clip_ratio`)."""
    capped = (jax.lax.stop_gradient(ratio_BxT) > epsilon_high) & (advantages_BxT > 0)
    return masked_mean(capped.astype(jnp.float32), completion_mask_BxT)
