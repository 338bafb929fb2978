"""Rewards -> advantages, once per round on the whole global round (ALGORITHMS.md §2).

Dimension letters: N rows (= P prompts x G generations, group-major: rows [g*G:(g+1)*G] are the G
completions of prompt g), F reward functions, P prompts, G generations.

Every reward may be NaN (a reward function returned None); NaN is skipped in every statistic and a
row that ends up with a NaN advantage (unscorable row, singleton group) gets advantage 0.

The module is a set of small pure pieces (`nanmean`, `nanstd`, `weighted_reward_sum`,
`group_mean`, `group_std`, `batch_std`) plus estimators built from them; a new estimator
(normalize_then_sum, RLOO, REINFORCE++ baseline, process supervision) is one more small function
next to `group_advantages`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_REWARDS = ("group", "batch", "none")

# Added to the std so a group of identical rewards gives A = 0 / 1e-4 = 0 rather than 0 / 0 (TRL).
STD_EPS = 1e-4


def nanmean(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """Mean over `axis` ignoring NaN; NaN where every entry is NaN.

    nanmean(x) = Σ_{x not NaN} x / #{x not NaN}.
    """
    valid = ~jnp.isnan(x)
    count = jnp.sum(valid, axis=axis, keepdims=keepdims)
    total = jnp.sum(jnp.where(valid, x, 0.0), axis=axis, keepdims=keepdims)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)


def nanstd(x: jax.Array, axis=None, keepdims: bool = False, ddof: int = 1) -> jax.Array:
    """Standard deviation over `axis` ignoring NaN, Bessel-corrected by default (ddof=1).

    std = sqrt(Σ_{valid} (x - nanmean(x))² / (n_valid - ddof)); NaN where n_valid <= ddof
    (torch's `std` on one element is NaN too, which later turns that row's advantage into 0).
    Written by hand rather than with `jnp.nanstd` so the ddof and empty-slice behaviour is explicit.
    """
    valid = ~jnp.isnan(x)
    count = jnp.sum(valid, axis=axis, keepdims=True)
    mean = jnp.sum(jnp.where(valid, x, 0.0), axis=axis, keepdims=True) / jnp.maximum(count, 1)
    sq_dev = jnp.where(valid, (x - mean) ** 2, 0.0)
    dof = count - ddof
    var = jnp.where(dof > 0, jnp.sum(sq_dev, axis=axis, keepdims=True) / jnp.maximum(dof, 1), jnp.nan)
    std = jnp.sqrt(var)
    return std if keepdims else jnp.squeeze(std, axis=axis)


def weighted_reward_sum(rewards_NxF: jax.Array, reward_weights_F: jax.Array) -> jax.Array:
    """Weighted NaN-skipping sum of the reward functions per row: r = nansum(R·w, axis=1) [N].

    A row where every function gave NaN stays NaN (so it is skipped downstream and gets A = 0).
    """
    rewards_NxF = jnp.asarray(rewards_NxF, jnp.float32)
    weighted_NxF = rewards_NxF * jnp.asarray(reward_weights_F, jnp.float32)[None, :]
    valid_NxF = ~jnp.isnan(weighted_NxF)
    total_N = jnp.sum(jnp.where(valid_NxF, weighted_NxF, 0.0), axis=1)
    return jnp.where(jnp.any(valid_NxF, axis=1), total_N, jnp.nan)


def _to_groups(x_N: jax.Array, num_generations: int) -> jax.Array:
    """[N] -> [P, G] (group-major rows); raises if N is not a multiple of G."""
    (n,) = x_N.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(
            f"num_generations={num_generations} does not divide the number of rows N={n}: pass all G "
            "completions of every prompt, group-major")
    return x_N.reshape(n // num_generations, num_generations)


def group_mean(r_N: jax.Array, num_generations: int) -> jax.Array:
    """Per-group NaN-aware mean, broadcast back to rows: mean_g [N]."""
    r_PxG = _to_groups(r_N, num_generations)
    return jnp.broadcast_to(nanmean(r_PxG, axis=1, keepdims=True), r_PxG.shape).reshape(-1)


def group_std(r_N: jax.Array, num_generations: int) -> jax.Array:
    """Per-group NaN-aware Bessel std (ddof=1), broadcast back to rows: std_g [N]."""
    r_PxG = _to_groups(r_N, num_generations)
    return jnp.broadcast_to(nanstd(r_PxG, axis=1, keepdims=True), r_PxG.shape).reshape(-1)


def batch_std(r_N: jax.Array) -> jax.Array:
    """NaN-aware Bessel std (ddof=1) over all N rows, broadcast back to rows [N]."""
    return jnp.broadcast_to(nanstd(r_N), r_N.shape)


def nan_to_zero(x: jax.Array) -> jax.Array:
    """NaN -> 0: unscorable rows and singleton groups get advantage 0 (ALGORITHMS.md §2)."""
    return jnp.where(jnp.isnan(x), 0.0, x)


def group_advantages(rewards_NxF: jax.Array, reward_weights_F: jax.Array, *, num_generations: int,
                     scale_rewards: str = "group") -> tuple[jax.Array, jax.Array, jax.Array]:
    """GRPO group-relative advantages, `sum_then_normalize` (ALGORITHMS.md §2).

    r = nansum(R·w, axis=1)                       (NaN if every function gave NaN)
    A = (r - nanmean_g(r)) / (std + 1e-4)         scale_rewards "group": std = per-group nanstd (ddof=1)
                                                  scale_rewards "batch": std = nanstd over all N rows
    A = r - nanmean_g(r)                          scale_rewards "none" (Dr. GRPO)
    A = 0 where NaN.

    Args:
      rewards_NxF: [N, F] rewards, NaN where a function returned None. Rows group-major.
      reward_weights_F: [F] weights.
      num_generations: G (static).
      scale_rewards: "group" | "batch" | "none" (static).
    Returns:
      (advantages_N, rewards_N, std_N): float32 [N] each. `std_N` is the std of `scale_rewards`
      ("none" reports the per-group std, as TRL does, so `frac_reward_zero_std` stays meaningful);
      it is NaN for singleton / all-NaN groups.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}: pick one of them")
    r_N = weighted_reward_sum(rewards_NxF, reward_weights_F)
    centred_N = r_N - group_mean(r_N, num_generations)
    if scale_rewards == "batch":
        std_N = batch_std(r_N)
    else:
        std_N = group_std(r_N, num_generations)
    if scale_rewards == "none":
        advantages_N = centred_N
    else:
        advantages_N = centred_N / (std_N + STD_EPS)
    return nan_to_zero(advantages_N), r_N, std_N
