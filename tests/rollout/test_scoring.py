"""The logged reward metrics are TRL 1.16's: `reward` / `reward_std` over the rows' weighted raw reward sums (also
with GDPO's normalize_then_sum, whose advantages normalise first: `rounds.round_advantages` returns the raw sum),
Bessel-corrected stds, `frac_reward_zero_std` over rows; checked against TRL's own `nanstd` on the same numbers, and
against hand counts."""

import math

import numpy as np
import pytest

from grpo_jax.algo import rounds
from grpo_jax.rollout import scoring

# 2 groups of 3 rows, 2 reward functions; row 5 unscored by both, row 2 by the second only
REWARDS = np.array([[1.0, 0.0], [1.0, 0.5], [1.0, np.nan], [0.0, 1.0], [0.5, 1.0], [np.nan, np.nan]], np.float32)
WEIGHTS = np.array([0.7, 0.3], np.float32)


def _r_N(aggregation: str) -> np.ndarray:
    _, r_N, _ = rounds.round_advantages(REWARDS, WEIGHTS, np.ones((6, 4), np.int32), estimator="grpo",
                                        scale_rewards="group", multi_objective_aggregation=aggregation,
                                        num_generations=3)
    return np.asarray(r_N)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_reward_is_the_weighted_raw_sum_with_trls_bessel_corrected_stds(aggregation):
    std_N = np.array([0.0, 0.0, 0.0, 0.25, 0.25, 0.25])  # the advantage scales: group 0's is 0
    out = scoring.reward_metrics(REWARDS, _r_N(aggregation), std_N, ["m:first", "second"])
    weighted = np.array([0.7, 0.85, 0.7, 0.3, 0.65])  # row 5 left out
    assert out["reward"] == pytest.approx(weighted.mean())
    assert out["reward_std"] == pytest.approx(np.std(weighted, ddof=1))
    assert out["frac_reward_zero_std"] == 0.5
    assert out["rewards/first/mean"] == pytest.approx(0.7) and out["rewards/second/mean"] == pytest.approx(2.5 / 4)
    assert out["rewards/first/std"] == pytest.approx(np.std([1, 1, 1, 0, 0.5], ddof=1))
    one = scoring.reward_metrics(REWARDS[:1], _r_N(aggregation)[:1], std_N[:1], ["a", "b"])
    assert math.isnan(one["reward_std"]) and one["reward"] == pytest.approx(0.7)  # TRL: NaN std of one value


def test_the_stds_are_trls_nanstd():
    torch = pytest.importorskip("torch")
    utils = pytest.importorskip("trl.trainer.utils")
    trl_weighted = (torch.tensor(REWARDS) * torch.tensor(WEIGHTS)).nansum(dim=1)
    trl_weighted[torch.isnan(torch.tensor(REWARDS)).all(dim=1)] = torch.nan  # TRL's unscorable rows
    np.testing.assert_allclose(_r_N("normalize_then_sum"), trl_weighted.numpy(), rtol=1e-6)
    assert scoring.nanstd(_r_N("sum_then_normalize")) == pytest.approx(utils.nanstd(trl_weighted).item())
    for i in range(2):
        assert scoring.nanstd(REWARDS[:, i]) == pytest.approx(utils.nanstd(torch.tensor(REWARDS[:, i])).item())
