"""Round-level options between sampling and the updates (docs/algorithms.md §2, §6, §8), as pure host functions.

Dimension letters: N rows of one sampling pass (P prompts x G generations, group-major), T completion
tokens, F reward functions. A round's arrays are the host copies the trainer already fetched (the reward
functions run on the host), so these are NumPy functions of NamedTuples, with no I/O, except
`round_advantages`: the estimators of `grpo_jax.algo.advantages`, which `grpo_jax.algo.programs` runs on the devices.

- `mask_truncated`: TRL's `mask_truncated_completions` (DAPO overlong filtering).
- DAPO dynamic sampling, an `init` / `update` / `finalize` triple on `DynamicSamplingState`: each sampling
  pass is added to the state; groups whose rewards are all equal (zero std: advantage 0 whatever the
  estimator) are set aside; the trainer keeps sampling until the informative groups fill the round or
  `train.max_num_gen_batches` passes were drawn. At that cap the round is filled with set-aside
  zero-std groups (oldest first), counted in `dynamic_sampling/num_filled_groups`: the step keeps its
  static shape and its KL term, and the shortfall is visible in the metrics rather than an error.
- `round_advantages`: the `train.advantage_estimator` dispatch (grpo, rloo, reinforce_pp_baseline, process).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grpo_jax.algo import advantages


class Draw(NamedTuple):
    """One sampling pass, scored, on the host: the rows as the reward functions saw them and what they gave. Its
    rows on the devices are a `trajectory.Trajectory`, in the same order."""

    prompts: list  # N prompts (strings or message lists)
    columns: dict  # dataset columns, N values each
    completion_ids: np.ndarray  # [N, T]
    completion_mask: np.ndarray  # [N, T]
    is_truncated: np.ndarray  # [N] bool
    rewards: np.ndarray  # [N, F] (NaN: None)
    num_prompts_truncated: int = 0
    step_rewards: np.ndarray | None = None  # [N, S] weighted step rewards (process supervision), NaN padding
    step_end_indices: np.ndarray | None = None  # [N, S] their end-token indices, -1 padding
    loss_mask: np.ndarray | None = None  # [N, T] multi-turn: the tokens the policy sampled (None: completion_mask)
    tool_counts: np.ndarray | None = None  # [N, 4] multi-turn: calls, failures, malformed turns, turns

    @property
    def trained_mask(self) -> np.ndarray:
        """[N, T] the tokens the loss trains (TRL's completion_mask x tool_mask)."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask


def mask_truncated(mask_NxT, is_truncated_N):
    """mask_truncated_completions: rows that ended without EOS get mask 0 (so also 0 active tokens). NumPy or jax
    arrays."""
    return mask_NxT * (~is_truncated_N)[:, None].astype(mask_NxT.dtype)


def zero_std_groups(draw: Draw, weights_F: np.ndarray, num_generations: int) -> np.ndarray:
    """[P] bool: groups whose rewards are all equal (or fewer than 2 of them are scored).

    Outcome rewards compare r = nansum(R·w) over the G rows; process supervision compares every step reward
    of the group. Such groups get advantage 0 from every estimator (docs/algorithms.md §2): no policy gradient.
    """
    if draw.step_rewards is not None:
        values_PxK = np.asarray(draw.step_rewards, np.float64).reshape(-1, num_generations * draw.step_rewards.shape[1])
    else:
        r_N = np.asarray(advantages.weighted_reward_sum(draw.rewards, weights_F))
        values_PxK = r_N.reshape(-1, num_generations)
    valid_PxK = ~np.isnan(values_PxK)
    high_P = np.max(np.where(valid_PxK, values_PxK, -np.inf), axis=1)
    low_P = np.min(np.where(valid_PxK, values_PxK, np.inf), axis=1)
    return (valid_PxK.sum(axis=1) < 2) | (high_P == low_P)


class DynamicSamplingState(NamedTuple):
    """Sampling passes of the round so far and which of their groups are kept or set aside."""

    draws: tuple  # Draw per pass
    kept: tuple  # (pass index, group index) of groups with distinct rewards, in sampling order
    spare: tuple  # (pass index, group index) of zero-std groups, in sampling order


def init() -> DynamicSamplingState:
    """An empty round."""
    return DynamicSamplingState(draws=(), kept=(), spare=())


def update(state: DynamicSamplingState, draw: Draw, zero_std_P: np.ndarray) -> DynamicSamplingState:
    """Adds one sampling pass: its groups with distinct rewards are kept, the others set aside."""
    index = len(state.draws)
    kept = tuple((index, int(g)) for g in np.flatnonzero(~zero_std_P))
    spare = tuple((index, int(g)) for g in np.flatnonzero(zero_std_P))
    return DynamicSamplingState(draws=state.draws + (draw,), kept=state.kept + kept, spare=state.spare + spare)


def is_full(state: DynamicSamplingState, num_groups: int) -> bool:
    """Enough informative groups for a round of `num_groups` prompts."""
    return len(state.kept) >= num_groups


def finalize(state: DynamicSamplingState, num_groups: int, num_generations: int) -> tuple[Draw, np.ndarray, dict]:
    """The round's rows (first `num_groups` kept groups, topped up with set-aside ones), their indices into the
    passes' rows one after another (pass d's row r is d * N + r: where the devices' rows are), and its metrics.

    Metrics: `dynamic_sampling/num_gen_batches` (passes drawn, 1 = no extra sampling),
    `dynamic_sampling/num_filled_groups` (zero-std groups used to fill the round at the cap),
    `dynamic_sampling/frac_zero_std_drawn` (zero-std groups among all drawn).
    """
    chosen = list(state.kept[:num_groups])
    filled = num_groups - len(chosen)
    chosen += list(state.spare[:filled])
    if len(chosen) < num_groups:
        raise ValueError(f"dynamic sampling drew {len(state.draws)} passes with {len(chosen)} groups for a round "
                         f"of {num_groups}")
    rows = [(d, g * num_generations + k) for d, g in chosen for k in range(num_generations)]

    def gather(field):
        return np.stack([getattr(state.draws[d], field)[r] for d, r in rows])

    steps = {}
    if state.draws[0].step_rewards is not None:  # passes may differ in their most steps S: pad to the widest
        width = max(d.step_rewards.shape[1] for d in state.draws)
        for field, fill in (("step_rewards", np.nan), ("step_end_indices", -1)):
            steps[field] = np.stack([np.pad(getattr(state.draws[d], field)[r],
                                            (0, width - state.draws[d].step_rewards.shape[1]), constant_values=fill)
                                     for d, r in rows])
    keys = dict.fromkeys(k for d in state.draws for k in d.columns)
    columns = {key: [state.draws[d].columns.get(key, [None] * (r + 1))[r] for d, r in rows] for key in keys}
    round_ = Draw(prompts=[state.draws[d].prompts[r] for d, r in rows], columns=columns,
                  **{f: gather(f) for f in ("completion_ids", "completion_mask", "is_truncated", "rewards")},
                  **{f: gather(f) for f in ("loss_mask", "tool_counts") if getattr(state.draws[0], f) is not None},
                  num_prompts_truncated=sum(d.num_prompts_truncated for d in state.draws), **steps)
    sizes = np.cumsum([0] + [len(d.prompts) for d in state.draws])
    drawn = len(state.kept) + len(state.spare)
    metrics = {"dynamic_sampling/num_gen_batches": len(state.draws),
               "dynamic_sampling/num_filled_groups": filled,
               "dynamic_sampling/frac_zero_std_drawn": len(state.spare) / max(drawn, 1)}
    return round_, np.array([sizes[d] + r for d, r in rows]), metrics


def round_advantages(rewards_NxF, weights_F, mask_NxT, step_rewards_NxS=None, step_end_indices_NxS=None, *,
                     estimator: str, scale_rewards: str, multi_objective_aggregation: str, num_generations: int):
    """The round's advantages by `train.advantage_estimator`: ([N] or [N, T] for process, r_N, std_N).

    r_N = nansum(R·w) (whatever `multi_objective_aggregation` normalises: TRL 1.16 logs the raw weighted sum) and
    std_N (the std that scales the advantages) feed the round's reward metrics. `mask_NxT` is the training
    mask (after `mask_truncated`): REINFORCE++ whitens over its tokens and process supervision's per-token
    advantages are zero outside it. Process step arrays come padded by `pad_steps`.
    """
    r_N = advantages.weighted_reward_sum(rewards_NxF, weights_F)
    std_N = advantages.group_std(r_N, num_generations)
    if estimator == "grpo":
        advantages_N, _, std_N = advantages.group_advantages(
            rewards_NxF, weights_F, num_generations=num_generations, scale_rewards=scale_rewards,
            multi_objective_aggregation=multi_objective_aggregation)
        return advantages_N, r_N, std_N
    if estimator == "rloo":
        return advantages.rloo_advantages(r_N, num_generations=num_generations), r_N, std_N
    if estimator == "reinforce_pp_baseline":
        return advantages.reinforce_pp_baseline_advantages(r_N, mask_NxT, num_generations=num_generations), r_N, std_N
    if estimator == "process":
        return advantages.process_advantages(step_rewards_NxS, step_end_indices_NxS, mask_NxT,
                                             num_generations=num_generations), r_N, std_N
    raise ValueError(f"train.advantage_estimator={estimator!r} is unknown: use grpo, rloo, reinforce_pp_baseline "
                     "or process")


def pad_steps(draw: Draw, num_tokens: int) -> tuple:
    """A process-supervision round's (step_rewards, step_end_indices) padded to a multiple of T steps, so the
    jitted estimator sees few distinct shapes; (None, None) for outcome rewards."""
    if draw.step_rewards is None:
        return None, None
    pad = -draw.step_rewards.shape[1] % num_tokens
    return (np.pad(draw.step_rewards, ((0, 0), (0, pad)), constant_values=np.nan),
            np.pad(draw.step_end_indices, ((0, 0), (0, pad)), constant_values=-1))
