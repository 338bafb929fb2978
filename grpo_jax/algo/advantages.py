"""Rewards -> advantages, once per round on the whole global round (docs/algorithms.md §2).

Dimension letters: N rows (= P prompts x G generations, group-major: rows [g*G:(g+1)*G] are the G
completions of prompt g), F reward functions, P prompts, G generations.

Every reward may be NaN (a reward function returned None); NaN is skipped in every statistic and a
row that ends up with a NaN advantage (unscorable row, singleton group) gets advantage 0.

The module is a set of small pure pieces (`nanmean`, `nanstd`, `weighted_reward_sum`,
`group_mean`, `group_std`, `batch_std`) plus estimators built from them, all jittable:
- `group_advantages`: GRPO, `sum_then_normalize` (default) or GDPO's `normalize_then_sum`, with
  `scale_rewards` group / batch / none (Dr. GRPO) — TRL 1.16's numbers.
- `rloo_advantages`: leave-one-out baseline (RLOO).
- `reinforce_pp_baseline_advantages`: group-centred reward whitened over the batch's valid tokens.
- `process_advantages`: DeepSeekMath §4.1.3 process supervision, step rewards -> per-token advantages.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.config.sections import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from grpo_jax.losses import contracts


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


def _num_groups(n: int, num_generations: int) -> int:
    """P = N / G; raises if N is not a multiple of G."""
    if num_generations < 1 or n % num_generations:
        raise ValueError(
            f"num_generations={num_generations} does not divide the number of rows N={n}: pass all G "
            "completions of every prompt, group-major")
    return n // num_generations


def _to_groups(x_N: jax.Array, num_generations: int) -> jax.Array:
    """[N, ...] -> [P, G, ...] (group-major rows); raises if N is not a multiple of G."""
    return x_N.reshape(_num_groups(x_N.shape[0], num_generations), num_generations, *x_N.shape[1:])


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
    """NaN -> 0: unscorable rows and singleton groups get advantage 0 (docs/algorithms.md §2)."""
    return jnp.where(jnp.isnan(x), 0.0, x)


def group_advantages(rewards_NxF: jax.Array, reward_weights_F: jax.Array, *, num_generations: int,
                     scale_rewards: str = "group", multi_objective_aggregation: str = "sum_then_normalize"
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GRPO group-relative advantages (docs/algorithms.md §2), TRL 1.16's `multi_objective_aggregation`.

    "normalize_then_sum" (GDPO) is `normalize_then_sum_advantages` (`scale_rewards` does not apply to it);
    "sum_then_normalize" (default):

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
      multi_objective_aggregation: "sum_then_normalize" | "normalize_then_sum" (static).
    Returns:
      (advantages_N, rewards_N, std_N): float32 [N] each. `std_N` is the std of `scale_rewards`
      ("none" reports the per-group std, as TRL does, so `frac_reward_zero_std` stays meaningful);
      it is NaN for singleton / all-NaN groups.
    """
    contracts.grouped_rewards(rewards_NxF, reward_weights_F)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}: pick one of them")
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={multi_objective_aggregation!r} is not one of "
                         f"{MULTI_OBJECTIVE_AGGREGATIONS}: pick one of them")
    if multi_objective_aggregation == "normalize_then_sum":
        return normalize_then_sum_advantages(rewards_NxF, reward_weights_F, num_generations=num_generations)
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


def normalize_then_sum_advantages(rewards_NxF: jax.Array, reward_weights_F: jax.Array, *, num_generations: int
                                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GDPO: normalise each reward function within its group, sum, then normalise over the batch (TRL 1.16).

    R̃_k = (R_k - nanmean_g(R_k)) / (nanstd_g(R_k) + 1e-4)   per function k, within each group (ddof=1)
    s   = nansum_k(w_k · R̃_k)                               NaN where every function gave NaN
    A   = (s - nanmean(s)) / (nanstd(s) + 1e-4)             over all N rows; NaN -> 0
    A function that gave NaN, or whose group has one scored row (std NaN), adds nothing to s.
    Returns (advantages_N, s_N, std_N) with std_N the batch std of s, as TRL reports it.
    """
    rewards_NxF = jnp.asarray(rewards_NxF, jnp.float32)
    grouped_PxGxF = _to_groups(rewards_NxF, num_generations)
    normed_PxGxF = ((grouped_PxGxF - nanmean(grouped_PxGxF, axis=1, keepdims=True))
                    / (nanstd(grouped_PxGxF, axis=1, keepdims=True) + STD_EPS))
    normed_NxF = normed_PxGxF.reshape(rewards_NxF.shape) * jnp.asarray(reward_weights_F, jnp.float32)[None, :]
    s_N = jnp.sum(jnp.where(jnp.isnan(normed_NxF), 0.0, normed_NxF), axis=1)
    s_N = jnp.where(jnp.all(jnp.isnan(rewards_NxF), axis=1), jnp.nan, s_N)
    std_N = batch_std(s_N)
    return nan_to_zero((s_N - nanmean(s_N)) / (std_N + STD_EPS)), s_N, std_N


def rloo_advantages(rewards_N: jax.Array, *, num_generations: int) -> jax.Array:
    """RLOO (arXiv 2402.14740): A_i = r_i - mean_{j≠i, j scored} r_j within i's group, [N].

    With every row scored this is G/(G-1)·(r_i - mean_g). NaN rewards are skipped; a row with no other
    scored row in its group (singleton group) or a NaN reward gets 0.
    """
    r_PxG = _to_groups(jnp.asarray(rewards_N, jnp.float32), num_generations)
    valid = ~jnp.isnan(r_PxG)
    r0_PxG = jnp.where(valid, r_PxG, 0.0)
    others_sum = jnp.sum(r0_PxG, axis=1, keepdims=True) - r0_PxG
    others_count = jnp.sum(valid, axis=1, keepdims=True) - valid.astype(jnp.int32)
    baseline = jnp.where(others_count > 0, others_sum / jnp.maximum(others_count, 1), jnp.nan)
    return nan_to_zero(r_PxG - baseline).reshape(-1)


# REINFORCE++ (OpenRLHF) floors the whitening variance here.
WHITEN_VAR_EPS = 1e-8


def reinforce_pp_baseline_advantages(rewards_N: jax.Array, completion_mask_NxT: jax.Array, *,
                                     num_generations: int) -> jax.Array:
    """REINFORCE++-baseline (arXiv 2501.03262, OpenRLHF `reinforce_baseline`): per-row advantage [N].

    a_i = r_i - nanmean_g(r); then whiten over every valid token of the batch (each row's a_i counted
    |o_i| times): A_i = (a_i - μ) / sqrt(max(σ², 1e-8)), μ, σ² the token-weighted mean and (ddof=0) variance.
    Unscored rows (NaN) and rows without tokens are left out of μ, σ² and get 0. Broadcast over T with the mask.
    """
    r_N = jnp.asarray(rewards_N, jnp.float32)
    centred_N = r_N - group_mean(r_N, num_generations)
    tokens_N = jnp.sum(jnp.asarray(completion_mask_NxT, jnp.float32), axis=1)
    weight_N = jnp.where(jnp.isnan(centred_N), 0.0, tokens_N)
    a_N = jnp.where(jnp.isnan(centred_N), 0.0, centred_N)
    total = jnp.maximum(jnp.sum(weight_N), 1.0)
    mu = jnp.sum(weight_N * a_N) / total
    var = jnp.sum(weight_N * (a_N - mu) ** 2) / total
    return jnp.where(weight_N > 0, (a_N - mu) / jnp.sqrt(jnp.maximum(var, WHITEN_VAR_EPS)), 0.0)


def process_advantages(step_rewards_NxS: jax.Array, step_end_indices_NxS: jax.Array,
                       completion_mask_NxT: jax.Array, *, num_generations: int) -> jax.Array:
    """DeepSeekMath §4.1.3 process supervision: per-step rewards -> per-token advantages [N, T].

    Format (S = the most steps any completion has; pad the rest):
      step_rewards_NxS[i, j]: reward of step j of completion i; NaN = padding / unscored step.
      step_end_indices_NxS[i, j]: completion-token index (0-based, in [0, T)) of the last token of step j;
        -1 (or anything outside [0, T)) = padding. A step is used only if its reward is not NaN and its
        index is in range.
    r̃ = (r - mean) / (std + 1e-4), mean and std (ddof=1) over every used step reward of the group;
    A_{i,t} = Σ_{j: index(j) >= t} r̃_i^(j) (reverse cumulative sum along T), times the completion mask.
    A group with fewer than two used steps (std undefined) gets 0, as singleton groups do in §2.
    """
    rewards_NxS = jnp.asarray(step_rewards_NxS, jnp.float32)
    idx_NxS = jnp.asarray(step_end_indices_NxS, jnp.int32)
    mask_NxT = jnp.asarray(completion_mask_NxT, jnp.float32)
    n, s = rewards_NxS.shape
    t = mask_NxT.shape[1]
    used_NxS = ~jnp.isnan(rewards_NxS) & (idx_NxS >= 0) & (idx_NxS < t)
    masked_NxS = jnp.where(used_NxS, rewards_NxS, jnp.nan)
    group_PxGS = masked_NxS.reshape(_num_groups(n, num_generations), num_generations * s)
    mean_P1 = nanmean(group_PxGS, axis=1, keepdims=True)
    std_P1 = nanstd(group_PxGS, axis=1, keepdims=True)
    normed_NxS = ((group_PxGS - mean_P1) / (std_P1 + STD_EPS)).reshape(n, s)
    normed_NxS = jnp.where(used_NxS, nan_to_zero(normed_NxS), 0.0)
    at_step_end_NxT = jnp.zeros((n, t), jnp.float32).at[
        jnp.arange(n)[:, None], jnp.where(used_NxS, idx_NxS, 0)].add(normed_NxS)
    returns_NxT = jnp.flip(jnp.cumsum(jnp.flip(at_step_end_NxT, axis=1), axis=1), axis=1)
    return returns_NxT * mask_NxT
