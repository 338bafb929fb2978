"""Tests for grpo_jax.advantages against hand-computed numbers and a naive numpy loop."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.advantages import group_advantages, nanstd

NAN = float("nan")


def naive_advantages(rewards, weights, G, scale):
    """Per-row Python loop over plain lists: the independent reference for ALGORITHMS.md §2."""
    rewards = np.asarray(rewards, np.float64)
    n = rewards.shape[0]
    r = []
    for i in range(n):
        vals = [rewards[i, f] * weights[f] for f in range(rewards.shape[1]) if not math.isnan(rewards[i, f])]
        r.append(sum(vals) if vals else NAN)

    def std1(xs):
        xs = [x for x in xs if not math.isnan(x)]
        if len(xs) < 2:
            return NAN
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))

    def mean(xs):
        xs = [x for x in xs if not math.isnan(x)]
        return sum(xs) / len(xs) if xs else NAN

    adv, stds = [], []
    for i in range(n):
        g = i // G
        grp = r[g * G:(g + 1) * G]
        std = std1(r) if scale == "batch" else std1(grp)
        a = r[i] - mean(grp)
        if scale != "none":
            a = a / (std + 1e-4)
        adv.append(0.0 if math.isnan(a) else a)
        stds.append(std)
    return np.array(adv), np.array(r), np.array(stds)


def test_hand_computed_group_of_four():
    adv, r, std = group_advantages(jnp.array([[1.0], [0.0], [0.0], [1.0]]), jnp.ones(1), num_generations=4)
    # mean 0.5; Bessel std = sqrt(4 * 0.25 / 3) = 0.57735 (ddof=0 would give 0.5)
    np.testing.assert_allclose(std, [0.5773503] * 4, rtol=1e-6)
    a = 0.5 / (0.5773503 + 1e-4)
    np.testing.assert_allclose(adv, [a, -a, -a, a], rtol=1e-6)
    np.testing.assert_allclose(r, [1, 0, 0, 1])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_against_naive_loop(scale):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(12, 3)).astype(np.float32)
    weights = np.array([1.0, 0.5, -2.0], np.float32)
    adv, r, std = group_advantages(jnp.asarray(rewards), jnp.asarray(weights), num_generations=4,
                                   scale_rewards=scale)
    ref_adv, ref_r, ref_std = naive_advantages(rewards, weights, 4, scale)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r, ref_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std, ref_std, rtol=1e-5)


def test_batch_scale_keeps_group_mean():
    # Two groups with different means: the per-group mean is still subtracted under "batch".
    rewards = jnp.array([[0.0], [2.0], [10.0], [12.0]])
    adv, _, std = group_advantages(rewards, jnp.ones(1), num_generations=2, scale_rewards="batch")
    batch_std = np.std([0.0, 2.0, 10.0, 12.0], ddof=1)
    np.testing.assert_allclose(std, [batch_std] * 4, rtol=1e-6)
    np.testing.assert_allclose(adv, np.array([-1, 1, -1, 1]) / (batch_std + 1e-4), rtol=1e-6)


def test_none_scale_is_centred_reward():
    adv, _, _ = group_advantages(jnp.array([[3.0], [1.0], [2.0], [6.0]]), jnp.ones(1), num_generations=2,
                                 scale_rewards="none")
    np.testing.assert_allclose(adv, [1.0, -1.0, -2.0, 2.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_nan_rows_skipped_and_zeroed(scale):
    # Row 1 unscored by every function; row 5 scored by one function only.
    rewards = np.array([[1.0, 0.0], [NAN, NAN], [0.0, 0.0], [1.0, 1.0],
                        [0.5, 0.5], [NAN, 2.0], [0.0, 1.0], [1.0, 0.0]], np.float32)
    weights = np.array([1.0, 1.0], np.float32)
    adv, r, std = group_advantages(jnp.asarray(rewards), jnp.asarray(weights), num_generations=4,
                                   scale_rewards=scale)
    assert np.isnan(r[1]) and adv[1] == 0.0
    assert r[5] == 2.0
    ref_adv, _, _ = naive_advantages(rewards, weights, 4, scale)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-6)
    if scale == "group":
        # group 0 is {1, 0, 2}: mean 1, std 1 (ddof=1) over the three scored rows
        np.testing.assert_allclose(adv[:4], [0.0, 0.0, -1 / (1 + 1e-4), 1 / (1 + 1e-4)], rtol=1e-6)


def test_identical_rewards_give_zero():
    adv, _, std = group_advantages(jnp.full((6, 2), 0.7), jnp.ones(2), num_generations=3)
    np.testing.assert_array_equal(adv, np.zeros(6))
    np.testing.assert_allclose(std, np.zeros(6), atol=1e-7)


def test_weights_applied():
    rewards = jnp.array([[1.0, 1.0], [0.0, 1.0]])
    _, r, _ = group_advantages(rewards, jnp.array([2.0, -3.0]), num_generations=2)
    np.testing.assert_allclose(r, [-1.0, -3.0])


def test_singleton_groups_get_zero():
    rewards = jnp.array([[1.0], [5.0], [-2.0]])
    for scale in ("group", "none"):
        adv, _, std = group_advantages(rewards, jnp.ones(1), num_generations=1, scale_rewards=scale)
        np.testing.assert_array_equal(adv, np.zeros(3))
    assert np.all(np.isnan(group_advantages(rewards, jnp.ones(1), num_generations=1)[2]))


def test_group_of_single_scored_row_gets_zero():
    rewards = jnp.array([[NAN], [3.0], [NAN], [1.0], [0.0], [2.0]])
    adv, _, _ = group_advantages(rewards, jnp.ones(1), num_generations=3)
    np.testing.assert_array_equal(adv[:3], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(adv[3:], np.array([0.0, -1.0, 1.0]) / (1.0 + 1e-4), rtol=1e-6)


def test_nanstd_matches_numpy_ddof1():
    x = np.array([[1.0, 2.0, NAN, 7.0], [NAN, NAN, 3.0, NAN]], np.float32)
    got = nanstd(jnp.asarray(x), axis=1)
    np.testing.assert_allclose(got[0], np.nanstd(x[0], ddof=1), rtol=1e-6)
    assert np.isnan(got[1])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_jit_equals_eager(scale):
    rewards = jnp.asarray(np.random.default_rng(1).normal(size=(8, 2)), jnp.float32).at[3, :].set(NAN)
    fn = jax.jit(group_advantages, static_argnames=("num_generations", "scale_rewards"))
    eager = group_advantages(rewards, jnp.ones(2), num_generations=4, scale_rewards=scale)
    jitted = fn(rewards, jnp.ones(2), num_generations=4, scale_rewards=scale)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(jnp.ones((4, 1)), jnp.ones(1), num_generations=2, scale_rewards="row")
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(jnp.ones((5, 1)), jnp.ones(1), num_generations=2)
