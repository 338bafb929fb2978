"""TRL's `eval_loss`: the training loss of the sampled held-out rows, as TRL's `prediction_step` computes it.

TRL evaluates by generating `num_generations_eval` completions per held-out prompt, scoring them with the training
reward functions and weights, taking their group advantages, and running `compute_loss` on-policy (the old
log-probs are the current ones, so every ratio is 1): what remains is -A (per `loss_type`'s aggregation), plus
beta x KL to the reference and the entropy terms where they are on. Here the sampled pass's rows are that batch, all
at once (TRL averages the loss over its evaluation batches; one batch normalises `dapo`'s tokens over all of them).
The process-reward estimator has no TRL counterpart and no loss here.
Dimension letters: N rows (prompts x n), T completion tokens, F reward functions.
"""

from __future__ import annotations

import jax
import numpy as np

from grpo_jax.algo import rounds
from grpo_jax.rollout import scoring


def sampled_loss(run, params, reference_params, rows, rewards_NxF: np.ndarray, num_generations: int
                 ) -> float | None:
    """The loss of the N sampled held-out ``rows`` (`evaluation.Rows`) under ``params`` with the training
    ``rewards_NxF`` (the run's reward functions, in order) grouped ``num_generations`` a prompt;
    ``reference_params``: the state's reference (None: the run keeps none; LoRA's is the base itself). None for
    the process-reward estimator."""
    tc = run.config.train
    if tc.advantage_estimator == "process":
        return None
    mask = rounds.mask_truncated(rows.loss_mask, rows.is_truncated) if tc.mask_truncated_completions \
        else rows.loss_mask
    weights = scoring.reward_weights(run.config.reward.weights, rewards_NxF.shape[1])
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        advantages, _, _ = rounds.round_advantages(
            rewards_NxF, weights, mask, estimator=tc.advantage_estimator, scale_rewards=tc.scale_rewards,
            multi_objective_aggregation=tc.multi_objective_aggregation, num_generations=num_generations)
        advantages = np.asarray(advantages)
    program = run.programs.eval_loss(params, reference_params)
    if program is None:  # a run without a reference (the caller has none to give)
        return None
    return float(program(rows.prompt_ids, rows.prompt_mask, rows.completion_ids, rows.completion_mask, mask,
                         advantages))
