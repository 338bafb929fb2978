"""TRL's eval_loss (`rollout.eval_loss.sampled_loss`) against the paper's objective at ratio 1: on-policy, with the
reference equal to the policy (KL 0), the loss is -A aggregated as `loss_type` aggregates it, A the group-normalised
weighted reward (TRL 1.16: std with Bessel's correction, + 1e-4)."""

import numpy as np
import pytest

from grpo_jax.api import trainer
from grpo_jax.config import load_config
from grpo_jax.rollout import eval_loss, evaluation

N_GEN = 4


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sampled_loss_is_minus_the_aggregated_advantage_on_policy(tmp_path, loss_type):
    config = load_config(None, [f"output_dir={tmp_path}", "max_steps=1", "train.train_batch_size=8",
                                f"train.num_generations={N_GEN}", "eval.num_examples=2", f"loss.loss_type={loss_type}",
                                "reward.weights=[1.0,0.5]", "sampling.max_completion_length=6"])
    run, state, held = trainer.build(config)
    try:
        batch = evaluation._eval_batch(run.eval_rows, N_GEN, 1, run.tokenizer, None, run.dataset.max_prompt_length)
        N, T = 2 * N_GEN, 6
        rng = np.random.default_rng(0)
        lengths = rng.integers(1, T + 1, N)
        mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
        ids = rng.integers(3, 12, (N, T)).astype(np.int32) * mask
        rows = evaluation.Rows(batch.prompt_ids[:N], batch.prompt_mask[:N], ids, mask, mask, np.zeros(N, bool))
        rewards = rng.random((N, 2)).astype(np.float32)
        assert state.reference_params is not None  # beta 0.1 (a random model's): the KL term runs, 0 at the start
        loss = eval_loss.sampled_loss(run, state.params, state.reference_params, rows, rewards, N_GEN)
    finally:
        held.release()
    r = (rewards * np.array([1.0, 0.5])).sum(1).reshape(-1, N_GEN)
    advantages = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    expected = -advantages.mean() if loss_type == "grpo" else -(advantages * lengths).sum() / lengths.sum()
    assert loss == pytest.approx(expected, abs=1e-5)
