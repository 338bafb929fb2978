"""Round-level options: truncation masking, DAPO dynamic sampling, and the advantage-estimator dispatch."""

import numpy as np
import pytest

from grpo_jax.algo import advantages, rounds

G, T = 2, 3


def make_draw(rewards_N, tag: int, *, truncated=None, steps=None) -> rounds.Draw:
    """A fake sampling pass whose arrays carry `tag` (pass id) and the row index, to trace rows through."""
    n = len(rewards_N)
    rows = np.arange(n)
    ids = (tag * 100 + rows)[:, None] * np.ones((1, T), np.int32)
    truncated = np.zeros(n, bool) if truncated is None else np.asarray(truncated)
    mask = np.ones((n, T), np.int32)
    extra = {} if steps is None else {"step_rewards": steps[0], "step_end_indices": steps[1]}
    return rounds.Draw(prompts=[f"{tag}-{r}" for r in rows], columns={"answer": [f"a{tag}-{r}" for r in rows]},
                       completion_ids=ids, completion_mask=mask, is_truncated=truncated,
                       rewards=np.asarray(rewards_N, np.float32)[:, None], num_prompts_truncated=tag, **extra)


def test_mask_truncated_zeroes_rows_without_eos_and_their_tokens():
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], np.int32)
    truncated = np.array([False, True, False, True])
    out = rounds.mask_truncated(mask, truncated)
    np.testing.assert_array_equal(out, [[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]])
    assert out.sum() == 3 and out.dtype == mask.dtype  # the step's token count drops the truncated rows


def test_zero_std_groups_on_outcome_rewards():
    draw = make_draw([1, 1, 0, 1, 0, 0, np.nan, 1, np.nan, np.nan], tag=0)
    np.testing.assert_array_equal(rounds.zero_std_groups(draw, np.ones(1), G), [True, False, True, True, True])
    # weights do not make equal rewards unequal; a second function can
    two = draw._replace(rewards=np.array([[1, 0], [1, 1], [0, 0], [0, 0], [1, 1], [1, 1], [0, 1], [1, 0],
                                          [0, 0], [1, 1]], np.float32))
    np.testing.assert_array_equal(rounds.zero_std_groups(two, np.array([1.0, 1.0]), G),
                                  [False, True, True, True, False])


def test_zero_std_groups_on_step_rewards():
    step_rewards = np.array([[1.0, np.nan], [1.0, 1.0], [0.5, np.nan], [1.0, np.nan]], np.float32)
    indices = np.array([[0, -1], [0, 2], [1, -1], [2, -1]], np.int32)
    draw = make_draw([0, 0, 0, 0], tag=0, steps=(step_rewards, indices))
    np.testing.assert_array_equal(rounds.zero_std_groups(draw, np.ones(1), G), [True, False])


def test_dynamic_sampling_keeps_only_mixed_groups_and_counts_passes():
    """P = 3 groups per round; pass 0 has 1 mixed group, pass 1 has 1, pass 2 has 2: three passes, first 3 kept."""
    passes = [[1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0]]
    state, weights = rounds.init(), np.ones(1)
    for tag, r in enumerate(passes):
        assert not rounds.is_full(state, 3)
        draw = make_draw(r, tag)
        state = rounds.update(state, draw, rounds.zero_std_groups(draw, weights, G))
    assert rounds.is_full(state, 3)
    round_, rows, metrics = rounds.finalize(state, 3, G)
    # kept groups in sampling order: pass 0 group 1, pass 1 group 2, pass 2 group 0 (group 2 of pass 2 unused)
    np.testing.assert_array_equal(round_.completion_ids[:, 0], [2, 3, 104, 105, 200, 201])
    np.testing.assert_array_equal(rows, [2, 3, 6 + 4, 6 + 5, 12 + 0, 12 + 1])  # into the passes' rows in order
    np.testing.assert_array_equal(round_.rewards[:, 0], [0, 1, 1, 0, 0, 1])
    assert round_.prompts == ["0-2", "0-3", "1-4", "1-5", "2-0", "2-1"]
    assert round_.columns["answer"] == ["a0-2", "a0-3", "a1-4", "a1-5", "a2-0", "a2-1"]
    assert not rounds.zero_std_groups(round_, weights, G).any()
    assert metrics == {"dynamic_sampling/num_gen_batches": 3, "dynamic_sampling/num_filled_groups": 0,
                       "dynamic_sampling/frac_zero_std_drawn": pytest.approx(5 / 9)}
    assert round_.num_prompts_truncated == 0 + 1 + 2


def test_dynamic_sampling_fills_with_zero_std_groups_at_the_cap():
    state, weights = rounds.init(), np.ones(1)
    for tag, r in enumerate([[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0]]):  # 1 mixed group in two passes
        draw = make_draw(r, tag)
        state = rounds.update(state, draw, rounds.zero_std_groups(draw, weights, G))
    round_, rows, metrics = rounds.finalize(state, 3, G)
    # the mixed group first, then the oldest set-aside groups: pass 0 groups 0 and 2
    np.testing.assert_array_equal(round_.completion_ids[:, 0], [2, 3, 0, 1, 4, 5])
    np.testing.assert_array_equal(rows, [2, 3, 0, 1, 4, 5])
    assert metrics["dynamic_sampling/num_filled_groups"] == 2
    assert metrics["dynamic_sampling/num_gen_batches"] == 2


def test_finalize_pads_step_rewards_of_passes_with_different_step_counts():
    one = make_draw([0, 0], 0, steps=(np.array([[1.0], [0.0]], np.float32), np.array([[0], [1]], np.int32)))
    two = make_draw([0, 0], 1, steps=(np.array([[1.0, 2.0], [0.0, np.nan]], np.float32),
                                       np.array([[0, 2], [1, -1]], np.int32)))
    state = rounds.update(rounds.update(rounds.init(), one, np.array([False])), two, np.array([False]))
    round_, _, _ = rounds.finalize(state, 2, G)
    np.testing.assert_array_equal(round_.step_end_indices, [[0, -1], [1, -1], [0, 2], [1, -1]])
    np.testing.assert_array_equal(round_.step_rewards, [[1, np.nan], [0, np.nan], [1, 2], [0, np.nan]])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_round_advantages_dispatches_to_the_estimator(estimator):
    rng = np.random.default_rng(0)
    draw = make_draw(rng.normal(size=6), 0)
    mask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], np.int32)
    adv, r, std = rounds.round_advantages(draw.rewards, np.ones(1), mask, estimator=estimator, scale_rewards="group",
                                          multi_objective_aggregation="sum_then_normalize", num_generations=G)
    r_N = draw.rewards[:, 0]
    expected = {"grpo": lambda: advantages.group_advantages(draw.rewards, np.ones(1), num_generations=G)[0],
                "rloo": lambda: advantages.rloo_advantages(r_N, num_generations=G),
                "reinforce_pp_baseline": lambda: advantages.reinforce_pp_baseline_advantages(
                    r_N, mask, num_generations=G)}[estimator]()
    np.testing.assert_allclose(adv, expected, rtol=1e-6)
    np.testing.assert_allclose(r, r_N, rtol=1e-6)
    if estimator == "rloo":  # and by hand: A_i = r_i - r_other in a group of two
        np.testing.assert_allclose(adv, r_N - r_N.reshape(-1, 2)[:, ::-1].reshape(-1), rtol=1e-6)


def test_round_advantages_process_supervision_per_token():
    """Two completions, one step each at token 1 and 2: r̃ = ±1/√2·(1/(1+1e-4·√2)); reverse cumsum along T."""
    steps = (np.array([[1.0], [0.0]], np.float32), np.array([[1], [2]], np.int32))
    draw = make_draw([0, 0], 0, steps=steps)
    mask = np.ones((2, T), np.int32)
    padded = rounds.pad_steps(draw, T)
    assert padded[0].shape == (2, T) and padded[1][0, 1:].tolist() == [-1] * (T - 1)
    adv, _, _ = rounds.round_advantages(draw.rewards, np.ones(1), mask, *padded, estimator="process",
                                        scale_rewards="group", multi_objective_aggregation="sum_then_normalize",
                                        num_generations=G)
    z = 0.5 / (np.sqrt(0.5) + 1e-4)
    np.testing.assert_allclose(adv, [[z, z, 0.0], [-z, -z, -z]], rtol=1e-5)
