"""pass@k, maj@n and the sampled evaluation's metrics as pure host functions, against direct counts."""

import itertools

import numpy as np
import pytest

from grpo_jax.evaluation import majority_vote, pass_at_k, sampled_metrics


def _direct_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of the k-subsets of the n samples that hold a correct one: what pass@k estimates."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("correct", [[1, 0, 0, 1, 0, 0], [0] * 6, [1] * 6, [0, 0, 0, 0, 0, 1]])
def test_pass_at_k_is_the_direct_count_over_subsets(correct):
    n = len(correct)
    for k in range(1, n + 1):
        assert pass_at_k([sum(correct)], n, k)[0] == pytest.approx(_direct_pass_at_k(correct, k), abs=1e-12), k
    assert pass_at_k([sum(correct)], n, 1)[0] == pytest.approx(np.mean(correct))  # pass@1: the fraction correct


def test_pass_at_k_stored_case_and_bad_k():
    # n = 10, c = 3, k = 5: 1 - C(7, 5) / C(10, 5) = 1 - 21/252
    np.testing.assert_allclose(pass_at_k([3, 0, 10], 10, 5), [1 - 21 / 252, 0.0, 1.0])
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k([1], 4, 5)


def test_majority_vote():
    answers = [["7", "7", "3", None],  # 7 wins and is correct
               ["1", "2", "2", "1"],  # a tie: the first seen ("1") wins, and it is wrong
               [None, None, None, None],  # no answer: wrong
               ["5", None, "4", "4"]]  # 4 wins; its first sample (index 2) is correct
    correct = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]], bool)
    np.testing.assert_array_equal(majority_vote(answers, correct), [True, False, False, True])


def test_sampled_metrics_names_and_values():
    # 2 prompts x 3 samples, group-major; functions: correctness (first: decides pass@k), a length score
    rewards = np.array([[1, 0.5], [0, 0.25], [np.nan, 1.0], [0, 0.0], [0, 0.5], [1, np.nan]], np.float32)
    answers = ["4", "5", "4", None, "8", "9"]
    metrics = sampled_metrics(rewards, ["m:correct", "m:short"], answers, np.array([3, 4, 5, 6, 7, 8]),
                              num_generations=3, ks=(1, 3))
    assert set(metrics) == {"eval/reward", "eval/rewards/correct/mean", "eval/rewards/correct/std",
                            "eval/rewards/short/mean", "eval/rewards/short/std", "eval/completions/mean_length",
                            "eval/pass@1", "eval/pass@3", "eval/maj@3"}
    assert metrics["eval/reward"] == pytest.approx(np.mean([1.5, 0.25, 1.0, 0.0, 0.5, 1.0]))
    assert metrics["eval/rewards/correct/mean"] == pytest.approx(2 / 5)  # the unscored sample is skipped
    assert metrics["eval/pass@1"] == pytest.approx((1 / 3 + 1 / 3) / 2)  # NaN counts as not correct
    assert metrics["eval/pass@3"] == 1.0
    assert metrics["eval/maj@3"] == 0.5  # prompt 0: "4" (correct); prompt 1: a tie, "8" first (wrong)
    assert metrics["eval/completions/mean_length"] == 5.5
