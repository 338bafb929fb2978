"""GRPO policy loss from per-token log-probabilities (ALGORITHMS.md §3–§5, §7, §9).

Dimension letters: B rows of this (micro-)batch, T completion tokens. A loss never calls the model: it
takes `per_token_logps` (carries gradient), `old_per_token_logps` and `ref_per_token_logps` (no gradient).

The pieces are pure and composable; `compute_loss` is one way to chain them:

    log_w  = log_importance_weights(logp, old)                       # §3
    l      = clipped_surrogate(exp(log_w), A, ε_low, ε_high, delta)  # §4
    l     += beta · kl_divergence(logp, ref, estimator) [· r]        # §5
    loss   = aggregate(l, mask, loss_type, ...)                      # §7

Example: a new variant (clip-higher, token-mean normaliser, k1 KL) without touching library code::

    def my_loss(logp_BxT, old_BxT, ref_BxT, adv_B, mask_BxT, num_items_in_batch):
        valid = mask_BxT > 0
        logp_BxT = jnp.where(valid, logp_BxT, 0.0)        # garbage on padding must not reach the grads
        old_BxT = jnp.where(valid, old_BxT, 0.0)
        ref_BxT = jnp.where(valid, ref_BxT, 0.0)
        ratio_BxT = jnp.exp(log_importance_weights(logp_BxT, old_BxT))
        l_BxT = clipped_surrogate(ratio_BxT, adv_B[:, None], epsilon_low=0.2, epsilon_high=0.28)
        l_BxT = l_BxT + 0.01 * kl_divergence(logp_BxT, ref_BxT, estimator="k1")
        return aggregate(l_BxT, mask_BxT, loss_type="dapo", num_items_in_batch=num_items_in_batch)

Micro-batching: every normaliser is global to the optimizer step (`num_sequences` rows,
`num_items_in_batch` active tokens), so summing `compute_loss` over micro-batches (and devices) gives the
full-batch loss and gradient. Left at None they default to this batch's values (one micro-batch).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
# low_var_kl clamps k3 to this range (verl's low_var_kl) so one far-off token cannot dominate.
LOW_VAR_KL_BOUND = 10.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss options (TRL GRPOConfig names); hashable, so it can be a static jit argument."""

    loss_type: str = "grpo"             # grpo | bnpo | dr_grpo | dapo
    beta: float = 0.04                  # KL coefficient; 0 disables the KL and the reference model
    epsilon: float = 0.2                # ε_low
    epsilon_high: float | None = None   # None -> epsilon (DAPO clip-higher uses 0.28)
    delta: float | None = None          # two-sided clipping: cap on the unclipped ratio
    kl_estimator: str = "k3"            # k1 | k2 | k3 | low_var_kl
    use_bias_correction_kl: bool = False
    max_completion_length: int | None = None  # dr_grpo's normaliser; the trainer fills it from sampling

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss.loss_type={self.loss_type!r} is not supported: choose one of {LOSS_TYPES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"loss.kl_estimator={self.kl_estimator!r} is not supported: choose one of {KL_ESTIMATORS}")
        if self.beta < 0:
            raise ValueError(f"loss.beta={self.beta} is negative: use beta >= 0 (0 disables the KL term)")
        if self.epsilon < 0:
            raise ValueError(f"loss.epsilon={self.epsilon} is negative: use epsilon >= 0 (0.2 is typical)")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ValueError(
                f"loss.epsilon_high={self.epsilon_high} is negative: use epsilon_high >= 0 or None (= epsilon)")
        if self.delta is not None and self.delta <= 0:
            raise ValueError(
                f"loss.delta={self.delta} must be a positive cap on the ratio: use None or a value > 1 + epsilon_high")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"loss.max_completion_length={self.max_completion_length} must be >= 1, or None to take "
                "sampling.max_completion_length")

    @property
    def epsilon_high_resolved(self) -> float:
        """ε_high: `epsilon_high`, or `epsilon` when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class LossAux(NamedTuple):
    """Loss metrics: masked means over this batch's active tokens (float32 scalars, ALGORITHMS.md §9).

    kl is 0 when beta == 0 (no reference); it includes the bias correction when that is on, as in TRL.
    """

    kl: jax.Array
    clip_ratio_low: jax.Array     # r < 1 - ε_low and A < 0
    clip_ratio_high: jax.Array    # r > 1 + ε_high and A > 0
    clip_ratio_region: jax.Array  # either of the above


def log_importance_weights(per_token_logps: jax.Array, old_per_token_logps: jax.Array) -> jax.Array:
    """Token-level log importance weight: log_w = logp - old, [B, T] (ALGORITHMS.md §3)."""
    return per_token_logps - old_per_token_logps


def clipped_surrogate(ratio_BxT: jax.Array, advantages_BxT: jax.Array, *, epsilon_low: float,
                      epsilon_high: float, delta: float | None = None) -> jax.Array:
    """PPO clipped surrogate to minimise (ALGORITHMS.md §4), [B, T].

    r_c = clip(r, 1 - ε_low, 1 + ε_high); r ← min(r, delta) if delta is set (after r_c is taken from the
    unclamped r, as TRL does); ℓ = -min(r·A, r_c·A). `advantages_BxT` may be [B, 1] (broadcast).
    """
    clipped_BxT = jnp.clip(ratio_BxT, 1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        ratio_BxT = jnp.minimum(ratio_BxT, delta)
    return -jnp.minimum(ratio_BxT * advantages_BxT, clipped_BxT * advantages_BxT)


def kl_divergence(per_token_logps: jax.Array, ref_per_token_logps: jax.Array, *, estimator: str = "k3"
                  ) -> jax.Array:
    """Per-token estimate of KL(π_θ || π_ref) from the sampled token (ALGORITHMS.md §5), [B, T].

    d = ref - logp;  k1: -d;  k2: d²/2;  k3: exp(d) - d - 1 (DeepSeekMath eq. 4);
    low_var_kl: clip(k3, -10, 10).
    """
    d_BxT = ref_per_token_logps - per_token_logps
    if estimator == "k1":
        return -d_BxT
    if estimator == "k2":
        return 0.5 * d_BxT**2
    if estimator in ("k3", "low_var_kl"):
        k3_BxT = jnp.exp(d_BxT) - d_BxT - 1.0
        if estimator == "low_var_kl":
            return jnp.clip(k3_BxT, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
        return k3_BxT
    raise ValueError(f"loss.kl_estimator={estimator!r} is not supported: choose one of {KL_ESTIMATORS}")


def masked_sum(x_BxT: jax.Array, mask_BxT: jax.Array, axis=None) -> jax.Array:
    """Σ x·mask, with `where` so inf/NaN at mask == 0 cannot leak into the value."""
    return jnp.sum(jnp.where(mask_BxT > 0, x_BxT * mask_BxT, 0.0), axis=axis)


def masked_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Σ x·mask / max(Σ mask, 1) over the whole batch (scalar)."""
    return masked_sum(x_BxT, mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def aggregate(per_token_loss_BxT: jax.Array, completion_mask_BxT: jax.Array, *, loss_type: str,
              max_completion_length: int | None = None, num_items_in_batch=None, num_sequences=None
              ) -> jax.Array:
    """Reduce per-token losses to a scalar with the normaliser of `loss_type` (ALGORITHMS.md §7).

    grpo:         Σ_i (Σ_t ℓ·m / max(Σ_t m, 1)) / num_sequences   (an all-masked row adds 0, counts 1)
    bnpo, dapo:   Σ ℓ·m / max(num_items_in_batch, 1)
    dr_grpo:      Σ ℓ·m / (num_sequences · max_completion_length)
    `num_sequences` (rows) and `num_items_in_batch` (active tokens) are those of the whole optimizer step,
    so the sum over micro-batches is the full-batch value; None -> this batch's B / Σ m.
    Shapes: per_token_loss [B, T], completion_mask [B, T] (0/1, any dtype) -> scalar float32.
    """
    mask_BxT = completion_mask_BxT.astype(jnp.float32)
    if num_sequences is None:
        num_sequences = mask_BxT.shape[0]
    if num_items_in_batch is None:
        num_items_in_batch = jnp.sum(mask_BxT)
    if loss_type == "grpo":
        row_sum_B = masked_sum(per_token_loss_BxT, mask_BxT, axis=1)
        row_mean_B = row_sum_B / jnp.maximum(jnp.sum(mask_BxT, axis=1), 1.0)
        return jnp.sum(row_mean_B) / num_sequences
    total = masked_sum(per_token_loss_BxT, mask_BxT)
    if loss_type in ("bnpo", "dapo"):
        return total / jnp.maximum(jnp.asarray(num_items_in_batch, jnp.float32), 1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss.max_completion_length=None is required by loss_type='dr_grpo': set it to "
                             "sampling.max_completion_length (the trainer does this for you)")
        return total / (num_sequences * max_completion_length)
    raise ValueError(f"loss.loss_type={loss_type!r} is not supported: choose one of {LOSS_TYPES}")


def clip_ratio_metrics(ratio_BxT: jax.Array, advantages_BxT: jax.Array, completion_mask_BxT: jax.Array, *,
                       epsilon_low: float, epsilon_high: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fractions of active tokens clipped low / high / either (ALGORITHMS.md §9), scalars.

    low: r < 1 - ε_low and A < 0;  high: r > 1 + ε_high and A > 0 (the tokens whose gradient the clip stops).
    """
    low_BxT = (ratio_BxT < 1.0 - epsilon_low) & (advantages_BxT < 0)
    high_BxT = (ratio_BxT > 1.0 + epsilon_high) & (advantages_BxT > 0)
    mask_BxT = completion_mask_BxT.astype(jnp.float32)
    return (masked_mean(low_BxT.astype(jnp.float32), mask_BxT),
            masked_mean(high_BxT.astype(jnp.float32), mask_BxT),
            masked_mean((low_BxT | high_BxT).astype(jnp.float32), mask_BxT))


def compute_loss(per_token_logps: jax.Array, old_per_token_logps: jax.Array | None,
                 ref_per_token_logps: jax.Array | None, advantages: jax.Array, completion_mask: jax.Array, *,
                 config: LossConfig, num_items_in_batch=None, num_sequences=None) -> tuple[jax.Array, LossAux]:
    """GRPO-family policy loss and its metrics (ALGORITHMS.md §3–§5, §7, §9).

    r = exp(logp - old);  ℓ = -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A) + beta·kl(logp, ref)[·r]
    loss = aggregate(ℓ, mask, loss_type, num_items_in_batch, num_sequences)

    Args:
      per_token_logps: [B, T] under the current params (differentiated).
      old_per_token_logps: [B, T] under the sampling params, or None for on-policy (= sg(logp), r ≡ 1).
      ref_per_token_logps: [B, T] under the reference params; may be None iff config.beta == 0.
      advantages: [B] (per sequence) or [B, T] (per token).
      completion_mask: [B, T], 1 on generated tokens up to and including the first EOS.
      config: LossConfig (static under jit).
      num_items_in_batch, num_sequences: active tokens / rows of the whole optimizer step (see `aggregate`).
    Returns:
      (loss scalar float32, LossAux). Positions with mask == 0 get exactly zero gradient whatever they hold.
    """
    valid_BxT = completion_mask > 0

    def clean(x_BxT):
        # A `where` on the inputs (not a multiply on the output) keeps inf/NaN at padding out of both the
        # forward value and the backward pass (0 · inf = NaN otherwise).
        return jnp.where(valid_BxT, jnp.asarray(x_BxT, jnp.float32), 0.0)

    logp_BxT = clean(per_token_logps)
    if old_per_token_logps is None:
        old_BxT = jax.lax.stop_gradient(logp_BxT)
    else:
        old_BxT = jax.lax.stop_gradient(clean(old_per_token_logps))
    advantages = jnp.asarray(advantages, jnp.float32)
    adv_BxT = advantages[:, None] if advantages.ndim == 1 else clean(advantages)
    adv_BxT = jax.lax.stop_gradient(adv_BxT)

    ratio_BxT = jnp.exp(log_importance_weights(logp_BxT, old_BxT))
    eps_low, eps_high = config.epsilon, config.epsilon_high_resolved
    loss_BxT = clipped_surrogate(ratio_BxT, adv_BxT, epsilon_low=eps_low, epsilon_high=eps_high,
                                 delta=config.delta)

    kl_metric = jnp.zeros((), jnp.float32)
    if config.beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError(f"loss.beta={config.beta} needs ref_per_token_logps: pass them or set loss.beta=0")
        ref_BxT = jax.lax.stop_gradient(clean(ref_per_token_logps))
        kl_BxT = kl_divergence(logp_BxT, ref_BxT, estimator=config.kl_estimator)
        if config.use_bias_correction_kl:
            kl_BxT = kl_BxT * ratio_BxT
        loss_BxT = loss_BxT + config.beta * kl_BxT
        kl_metric = jax.lax.stop_gradient(masked_mean(kl_BxT, completion_mask))

    loss = aggregate(loss_BxT, completion_mask, loss_type=config.loss_type,
                     max_completion_length=config.max_completion_length,
                     num_items_in_batch=num_items_in_batch, num_sequences=num_sequences)
    low, high, region = clip_ratio_metrics(jax.lax.stop_gradient(ratio_BxT), adv_BxT, completion_mask,
                                           epsilon_low=eps_low, epsilon_high=eps_high)
    return loss, LossAux(kl=kl_metric, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_region=region)
