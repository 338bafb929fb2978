"""Per-token KL estimators to the reference policy (docs/algorithms.md §5)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.config.loss import KL_ESTIMATORS
from grpo_jax.losses import contracts

# low_var_kl clamps k3 to this range (verl's low_var_kl) so one far-off token cannot dominate.
LOW_VAR_KL_BOUND = 10.0


def kl_divergence(per_token_logps: jax.Array, ref_per_token_logps: jax.Array, *, estimator: str = "k3"
                  ) -> jax.Array:
    """Per-token estimate of KL(π_θ || π_ref) from the sampled token, [B, T].

    d = ref - logp;  k1: -d;  k2: d²/2;  k3: exp(d) - d - 1 (DeepSeekMath eq. 4, TRL's only estimator);
    low_var_kl: clip(k3, -10, 10).
    """
    contracts.same_shape(per_token_logps=per_token_logps, ref_per_token_logps=ref_per_token_logps)
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


def bias_corrected_kl(kl_BxT: jax.Array, ratio_BxT: jax.Array) -> jax.Array:
    """DeepSeek-V3.2 / TRL `use_bias_correction_kl`: kl · r with r differentiable (r is [B, T] or [B, 1]).

    Makes the k3 gradient the unbiased reverse-KL gradient off-policy; it changes the gradient on-policy too.
    """
    return kl_BxT * ratio_BxT
