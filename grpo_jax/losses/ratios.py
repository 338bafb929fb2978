"""Importance ratios between the current and the sampling policy (docs/algorithms.md §3).

B rows, T completion tokens. Inputs are per-token log-probabilities; `per_token_logps` carries gradient,
`old_per_token_logps` does not. Every function returns the *log* weight; the ratio is `exp` of it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.losses import contracts


def sequence_log_importance_weights(per_token_logps: jax.Array, old_per_token_logps: jax.Array,
                                    completion_mask: jax.Array) -> jax.Array:
    """GSPO sequence-level log weight: masked mean over T of (logp - old), [B, 1].

    log_w_i = Σ_t (logp - old)·m / max(Σ_t m, 1); an all-masked row gets 0 (ratio 1), as in TRL.
    """
    mask_BxT = completion_mask.astype(jnp.float32)
    diff_BxT = jnp.where(mask_BxT > 0, (per_token_logps - old_per_token_logps) * mask_BxT, 0.0)
    return (jnp.sum(diff_BxT, axis=-1, keepdims=True)
            / jnp.maximum(jnp.sum(mask_BxT, axis=-1, keepdims=True), 1.0))


def sequence_token_log_importance_weights(per_token_logps: jax.Array, old_per_token_logps: jax.Array,
                                          completion_mask: jax.Array) -> jax.Array:
    """GSPO-token log weight: logp - sg(logp) + sg(sequence log_w), [B, T].

    Its value is the sequence weight on every token while each token's gradient flows through its own logp,
    so per-token advantages can be used; with a per-sequence advantage it equals GSPO in value and gradient.
    """
    seq_Bx1 = sequence_log_importance_weights(per_token_logps, old_per_token_logps, completion_mask)
    return per_token_logps - jax.lax.stop_gradient(per_token_logps) + jax.lax.stop_gradient(seq_Bx1)


def log_importance_weights(per_token_logps: jax.Array, old_per_token_logps: jax.Array,
                           completion_mask: jax.Array | None = None, *, level: str = "token") -> jax.Array:
    """log_w at `level` (docs/algorithms.md §3): token (default) -> logp - old, [B, T]; sequence -> [B, 1];
    sequence_token -> [B, T]. The sequence levels need `completion_mask` [B, T].
    """
    if level == "token":  # elementwise: any shape, the two alike
        contracts.same_shape(per_token_logps=per_token_logps, old_per_token_logps=old_per_token_logps)
        return per_token_logps - old_per_token_logps
    contracts.per_token(per_token_logps=per_token_logps, old_per_token_logps=old_per_token_logps,
                        completion_mask=completion_mask)
    if level not in ("sequence", "sequence_token"):
        raise ValueError(f"loss.importance_sampling_level={level!r} is not supported: choose token, sequence or "
                         "sequence_token")
    if completion_mask is None:
        raise ValueError(f"log_importance_weights at level={level!r} needs completion_mask")
    if level == "sequence":
        return sequence_log_importance_weights(per_token_logps, old_per_token_logps, completion_mask)
    return sequence_token_log_importance_weights(per_token_logps, old_per_token_logps, completion_mask)
