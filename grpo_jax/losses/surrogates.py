"""Per-token surrogates to minimise, one per loss family (docs/algorithms.md §4).

B rows, T tokens. `ratio` is exp(log_w) from `ratios` ([B, T] or [B, 1]); `advantages` is [B, 1] or [B, T]
and carries no gradient. The results broadcast to [B, T] (or stay [B, 1] when everything is per sequence);
masking and the normaliser are applied later by `aggregation.aggregate`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# VESPO clamps the sequence log-ratio to [log 1e-8, 20] (as the original implementation and TRL do).
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_W_MAX = 20.0


def clipped_surrogate(ratio_BxT: jax.Array, advantages_BxT: jax.Array, *, epsilon_low: float,
                      epsilon_high: float, delta: float | None = None) -> jax.Array:
    """PPO clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo): ℓ = -min(r·A, r_c·A).

    r_c = clip(r, 1 - ε_low, 1 + ε_high); with `delta` (INTELLECT-2 two-sided clipping) r ← min(r, delta)
    after r_c is taken from the unclamped r, as TRL does, so a negative-advantage loss is at most |A|·delta.
    """
    clipped = jnp.clip(ratio_BxT, 1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        ratio_BxT = jnp.minimum(ratio_BxT, delta)
    return -jnp.minimum(ratio_BxT * advantages_BxT, clipped * advantages_BxT)


def cispo_surrogate(ratio_BxT: jax.Array, advantages_BxT: jax.Array, per_token_logps: jax.Array, *,
                    epsilon_high: float) -> jax.Array:
    """CISPO (MiniMax-M1): ℓ = -sg(min(r, ε_high))·A·logp — the ratio is capped and detached, never the token.

    Here ε_high caps the ratio itself (MiniMax uses 5.0).
    """
    weight = jax.lax.stop_gradient(jnp.minimum(ratio_BxT, epsilon_high))
    return -weight * advantages_BxT * per_token_logps


def sapo_surrogate(ratio_BxT: jax.Array, advantages_BxT: jax.Array, *, temperature_pos: float = 1.0,
                   temperature_neg: float = 1.05) -> jax.Array:
    """SAPO soft gate: ℓ = -(sigmoid(τ(r - 1))·4/τ)·A, τ = τ_pos where A > 0 else τ_neg.

    d/dr of sigmoid(τ(r-1))·4/τ is 1 at r = 1, so on-policy the gradient is the vanilla policy gradient.
    """
    tau = jnp.where(advantages_BxT > 0, temperature_pos, temperature_neg)
    return -(jax.nn.sigmoid(tau * (ratio_BxT - 1.0)) * 4.0 / tau) * advantages_BxT


def vespo_weights(log_ratio_BxT: jax.Array, advantages_Bx1: jax.Array, completion_mask: jax.Array, *,
                  k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
                  log_is_correction_BxT: jax.Array | None = None) -> jax.Array:
    """VESPO gamma weight φ per sequence, [B, 1] (no gradient).

    s = Σ_t clip(log_ratio, -20, 20)·m [+ Σ_t clip(log ρ_t, log 1e-8, 20) with a token-level sampler
    correction ρ]; log_w = clip(s, log 1e-8, 20); w = exp(log_w); (k, λ) = (k_pos, λ_pos) if A >= 0 else
    (k_neg, λ_neg); φ = exp(λ + k·log_w - λ·w), NaN/inf -> 0. φ(1) = 1.
    """
    mask_BxT = completion_mask.astype(jnp.float32)
    log_ratio_BxT = jax.lax.stop_gradient(log_ratio_BxT)
    clamped = jnp.where(mask_BxT > 0, jnp.clip(log_ratio_BxT, -20.0, 20.0) * mask_BxT, 0.0)
    seq_Bx1 = jnp.sum(clamped, axis=-1, keepdims=True)
    if log_is_correction_BxT is not None:
        log_is = jnp.clip(jax.lax.stop_gradient(log_is_correction_BxT), VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        seq_Bx1 = seq_Bx1 + jnp.sum(log_is, axis=-1, keepdims=True)
    log_w = jnp.clip(seq_Bx1, VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    w = jnp.exp(log_w)
    nonneg = advantages_Bx1 >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.where(nonneg, lambda_pos, lambda_neg)
    phi = jnp.exp(lam + k * log_w - lam * w)
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(phi), phi, 0.0))


def vespo_surrogate(phi_Bx1: jax.Array, advantages_BxT: jax.Array, per_token_logps: jax.Array) -> jax.Array:
    """VESPO: ℓ = -sg(φ)·A·logp (φ from `vespo_weights`)."""
    return -jax.lax.stop_gradient(phi_Bx1) * advantages_BxT * per_token_logps
