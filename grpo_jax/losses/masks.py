"""Multiplicative masks and weights on the per-token loss, all without gradient (docs/algorithms.md §6).

B rows, T tokens. Each returns a float32 array that multiplies ℓ: [B, T], or [B, 1] per sequence.
Also the masked reductions every other piece uses.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_jax.config.loss import IS_CORRECTION_MODES


def masked_sum(x_BxT: jax.Array, mask_BxT: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """Σ x·mask, with `where` so inf/NaN at mask == 0 cannot leak into the value."""
    mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
    return jnp.sum(jnp.where(mask_BxT > 0, x_BxT * mask_BxT, 0.0), axis=axis, keepdims=keepdims)


def masked_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Σ x·mask / max(Σ mask, 1) over the whole batch (scalar); x may be [B, 1] (broadcast over T)."""
    mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
    return masked_sum(jnp.broadcast_to(x_BxT, mask_BxT.shape), mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def quantile(values_BxT: jax.Array, mask_BxT: jax.Array, q: float) -> jax.Array:
    """The q-quantile of the valid entries (mask > 0), linear interpolation (torch.quantile's default).

    Jittable with a data-dependent count n: sorts with invalid entries pushed to +inf and interpolates at
    rank q·(n-1) computed in float32, with torch's lerp, so ties at the threshold resolve as in TRL.
    NaN (as torch gives) when no entry is valid.
    """
    valid = jnp.asarray(mask_BxT) > 0
    flat = jnp.sort(jnp.where(valid, values_BxT.astype(jnp.float32), jnp.inf).reshape(-1))
    n = jnp.sum(valid)
    rank = jnp.float32(q) * (n - 1).astype(jnp.float32)
    below = jnp.clip(jnp.floor(rank).astype(jnp.int32), 0, flat.shape[0] - 1)
    above = jnp.clip(jnp.ceil(rank).astype(jnp.int32), 0, flat.shape[0] - 1)
    weight = rank - below.astype(jnp.float32)
    lo, hi = flat[below], flat[above]
    value = jnp.where(weight < 0.5, lo + weight * (hi - lo), hi - (hi - lo) * (1.0 - weight))
    return jnp.where(n > 0, value, jnp.nan)


def high_entropy_mask(entropies_BxT: jax.Array, completion_mask: jax.Array, *, top_quantile: float
                      ) -> jax.Array:
    """Beyond-80/20 mask: 1 where entropy >= the (1 - ρ) quantile of this batch's valid entropies, [B, T].

    ρ = `top_quantile` (TRL `top_entropy_quantile`). Padding is always 0; an all-padding batch is all 0.
    The quantile is over the entropies passed (TRL: the micro-batch, gathered over processes).
    """
    valid = jnp.asarray(completion_mask) > 0
    entropies_BxT = jax.lax.stop_gradient(jnp.where(valid, entropies_BxT.astype(jnp.float32), 0.0))
    threshold = quantile(entropies_BxT, valid, 1.0 - top_quantile)
    return ((entropies_BxT >= threshold) & valid).astype(jnp.float32)


def off_policy_sequence_mask(advantages_BxT: jax.Array, per_token_logps: jax.Array,
                             sampling_per_token_logps: jax.Array, completion_mask: jax.Array, *,
                             threshold: float) -> jax.Array:
    """DeepSeek-V3.2 off-policy sequence mask (OPSM), [B, 1] (or [B, T] with per-token advantages).

    Keep a sequence unless A < 0 and masked_mean_t(sampler_logp - sg(logp)) > threshold. A NaN sampler
    log-prob (unscorable token) counts as no evidence (0), as in TRL.
    """
    mask_BxT = completion_mask.astype(jnp.float32)
    kl_BxT = sampling_per_token_logps - jax.lax.stop_gradient(per_token_logps)
    kl_BxT = jnp.where(jnp.isnan(kl_BxT), 0.0, kl_BxT)
    avg_Bx1 = (masked_sum(kl_BxT, mask_BxT, axis=1, keepdims=True)
               / jnp.maximum(jnp.sum(mask_BxT, axis=1, keepdims=True), 1.0))
    return ((advantages_BxT >= 0) | (avg_Bx1 <= threshold)).astype(jnp.float32)


def sampler_log_ratio(old_per_token_logps: jax.Array, sampler_per_token_logps: jax.Array,
                      completion_mask: jax.Array, *, mode: str) -> jax.Array:
    """log ρ of the sampler/learner mismatch: (old - sampler)·m per token [B, T], or its sum over T [B, 1].

    `old` is the learner's log-prob at sampling time, `sampler` the sampler's (vLLM's in TRL). NaN (a token
    the sampler could not score) gives 0, i.e. no correction.
    """
    valid = jnp.asarray(completion_mask) > 0
    diff_BxT = jnp.where(valid, (old_per_token_logps - sampler_per_token_logps)
                         * jnp.asarray(completion_mask, jnp.float32), 0.0)
    diff_BxT = jax.lax.stop_gradient(jnp.where(jnp.isnan(diff_BxT), 0.0, diff_BxT))
    if mode.startswith("sequence"):
        return jnp.sum(diff_BxT, axis=-1, keepdims=True)
    return diff_BxT


def sampler_importance_weights(old_per_token_logps: jax.Array, sampler_per_token_logps: jax.Array,
                               completion_mask: jax.Array, *, mode: str = "sequence_mask",
                               clip_min: float | None = None, clip_max: float | None = 3.0) -> jax.Array:
    """Sampler/learner IS correction ρ (TRL `vllm_importance_sampling_*`), [B, T] (token_*) or [B, 1].

    ρ = exp(log ρ) from `sampler_log_ratio`; `*_truncate`: clip(ρ, C_min, C_max); `*_mask`: ρ outside
    [C_min, C_max] -> 0 (an unset bound is open).
    """
    if mode not in IS_CORRECTION_MODES:
        raise ValueError(f"loss.vllm_importance_sampling_mode={mode!r} is not supported: choose one of "
                         f"{IS_CORRECTION_MODES}")
    rho = jnp.exp(sampler_log_ratio(old_per_token_logps, sampler_per_token_logps, completion_mask, mode=mode))
    if mode.endswith("_truncate"):
        return jnp.clip(rho, clip_min, clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return jnp.where((rho < lo) | (rho > hi), 0.0, rho)
