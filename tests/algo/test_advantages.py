"""Tests for grpo_jax.algo.advantages against hand-computed numbers and a naive numpy loop."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algo.advantages import (group_advantages, nanstd, process_advantages, reinforce_pp_baseline_advantages,
                                 rloo_advantages)

NAN = float("nan")


def naive_advantages(rewards, weights, G, scale):
    """Per-row Python loop over plain lists: the independent reference for docs/algorithms.md §2."""
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


@pytest.mark.parametrize("scale,aggregation", [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"),
                                               ("none", "sum_then_normalize"), ("group", "normalize_then_sum")])
def test_jit_equals_eager(scale, aggregation):
    rewards = jnp.asarray(np.random.default_rng(1).normal(size=(8, 2)), jnp.float32).at[3, :].set(NAN)
    fn = jax.jit(group_advantages, static_argnames=("num_generations", "scale_rewards", "multi_objective_aggregation"))
    eager = group_advantages(rewards, jnp.ones(2), num_generations=4, scale_rewards=scale,
                             multi_objective_aggregation=aggregation)
    jitted = fn(rewards, jnp.ones(2), num_generations=4, scale_rewards=scale, multi_objective_aggregation=aggregation)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(jnp.ones((4, 1)), jnp.ones(1), num_generations=2, scale_rewards="row")
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(jnp.ones((5, 1)), jnp.ones(1), num_generations=2)


# --- normalize_then_sum (GDPO), RLOO, REINFORCE++-baseline, process supervision ----------------------------

def naive_normalize_then_sum(rewards, weights, G):
    """Per-function, per-group Python loops of TRL 1.16's normalize_then_sum."""
    rewards = np.asarray(rewards, np.float64)
    n, f = rewards.shape

    def stats(xs):
        xs = [x for x in xs if not math.isnan(x)]
        mu = sum(xs) / len(xs) if xs else NAN
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else NAN
        return mu, sd

    s = []
    for i in range(n):
        g = i // G
        total, any_scored = 0.0, False
        for k in range(f):
            if not math.isnan(rewards[i, k]):
                any_scored = True
            mu, sd = stats(rewards[g * G:(g + 1) * G, k])
            z = (rewards[i, k] - mu) / (sd + 1e-4)
            if not math.isnan(z):
                total += weights[k] * z
        s.append(total if any_scored else NAN)
    mu, sd = stats(s)
    return np.array([0.0 if math.isnan(x) else (x - mu) / (sd + 1e-4) for x in s]), np.array(s)


def test_normalize_then_sum_against_naive_loop():
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=(12, 3)).astype(np.float32)
    rewards[2, :] = NAN        # unscorable row
    rewards[5, 1] = NAN        # one function unscored
    rewards[8:12, 2] = NAN     # group 2: function 2 unscored everywhere
    rewards[9:12, 0] = NAN     # group 2: function 0 scored once (std undefined)
    weights = np.array([1.0, 0.5, -2.0], np.float32)
    adv, s, std = group_advantages(jnp.asarray(rewards), jnp.asarray(weights), num_generations=4,
                                   multi_objective_aggregation="normalize_then_sum")
    ref_adv, ref_s = naive_normalize_then_sum(rewards, weights, 4)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, ref_s, rtol=1e-5, atol=1e-5)
    assert adv[2] == 0.0 and np.isnan(s[2])
    np.testing.assert_allclose(std, np.nanstd(ref_s, ddof=1), rtol=1e-5)


def test_normalize_then_sum_hand_values():
    # One group of 2, two functions: each normalises to ±1/(√2 + 1e-4) (std of {0, 1} is 1/√2).
    rewards = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    adv, s, _ = group_advantages(rewards, jnp.array([1.0, 3.0]), num_generations=2,
                                 multi_objective_aggregation="normalize_then_sum")
    z = 0.5 / (math.sqrt(0.5) + 1e-4)
    np.testing.assert_allclose(s, [z - 3 * z, -z + 3 * z, 4 * z, -4 * z], rtol=1e-5)
    ref = np.asarray(s, np.float64)
    np.testing.assert_allclose(adv, (ref - ref.mean()) / (ref.std(ddof=1) + 1e-4), rtol=1e-5)


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        group_advantages(jnp.ones((4, 1)), jnp.ones(1), num_generations=2, multi_objective_aggregation="max")


def test_rloo_leave_one_out_definition():
    rng = np.random.default_rng(4)
    r = rng.normal(size=12).astype(np.float32)
    r[5] = NAN
    got = rloo_advantages(jnp.asarray(r), num_generations=4)
    for i in range(12):
        g = i // 4
        others = [r[j] for j in range(g * 4, g * 4 + 4) if j != i and not math.isnan(r[j])]
        expected = 0.0 if math.isnan(r[i]) else r[i] - sum(others) / len(others)
        np.testing.assert_allclose(got[i], expected, rtol=1e-5, atol=1e-6)
    # fully scored groups: G/(G-1)·(r - mean_g)
    full = np.asarray(r[:4], np.float64)
    np.testing.assert_allclose(got[:4], 4 / 3 * (full - full.mean()), rtol=1e-5)
    np.testing.assert_array_equal(rloo_advantages(jnp.array([1.0, 2.0]), num_generations=1), [0.0, 0.0])


def test_reinforce_pp_baseline_whitens_over_tokens():
    r = np.array([1.0, 0.0, 0.5, 2.0, NAN, 1.0], np.float32)
    lengths = np.array([3, 1, 4, 2, 5, 0])
    mask = (np.arange(5)[None, :] < lengths[:, None]).astype(np.int32)
    got = np.asarray(reinforce_pp_baseline_advantages(jnp.asarray(r), jnp.asarray(mask), num_generations=3))
    # naive: centre per group, repeat per valid token, whiten (ddof 0) over the tokens
    centred = []
    for i in range(6):
        g = [x for x in r[(i // 3) * 3:(i // 3) * 3 + 3] if not math.isnan(x)]
        centred.append(r[i] - sum(g) / len(g))
    tokens = [c for c, n in zip(centred, lengths) if not math.isnan(c) for _ in range(n)]
    mu, sd = np.mean(tokens), np.std(tokens)
    expected = [0.0 if math.isnan(c) or n == 0 else (c - mu) / sd for c, n in zip(centred, lengths)]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # token-weighted: the whitened per-token advantages have mean 0 and variance 1
    per_token = np.repeat(got, np.where(np.isnan(r), 0, lengths))  # the unscored row is out of the statistics
    np.testing.assert_allclose([per_token.mean(), per_token.var()], [0.0, 1.0], atol=1e-5)


def naive_process_advantages(step_rewards, step_ends, mask, G):
    """DeepSeekMath §4.1.3 with per-group Python loops: normalise the group's step rewards, then
    A_{i,t} = Σ of the normalised rewards of the steps ending at or after t."""
    n, T = mask.shape
    out = np.zeros((n, T))
    for g in range(n // G):
        rows = range(g * G, (g + 1) * G)
        used = [(i, int(e), float(r)) for i in rows for r, e in zip(step_rewards[i], step_ends[i])
                if not math.isnan(r) and 0 <= e < T]
        vals = [r for _, _, r in used]
        if len(vals) < 2:
            continue
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
        for i, e, r in used:
            for t in range(T):
                if e >= t and mask[i, t]:
                    out[i, t] += (r - mu) / (sd + 1e-4)
    return out


def test_process_supervision_against_naive_loop():
    rng = np.random.default_rng(5)
    N, S, T, G = 8, 4, 10, 4
    lengths = rng.integers(2, T + 1, size=N)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    step_rewards = rng.normal(size=(N, S)).astype(np.float32)
    step_ends = np.sort(rng.integers(0, T, size=(N, S)), axis=1).astype(np.int32)
    step_rewards[0, 3] = NAN                 # padding by reward
    step_ends[1, 2:] = -1                    # padding by index
    step_rewards[1, 2:] = NAN
    step_ends[2, 3] = -1                     # index padding with a reward: ignored
    got = process_advantages(jnp.asarray(step_rewards), jnp.asarray(step_ends), jnp.asarray(mask),
                             num_generations=G)
    expected = naive_process_advantages(step_rewards, step_ends, mask, G)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    jitted = jax.jit(process_advantages, static_argnames="num_generations")(
        jnp.asarray(step_rewards), jnp.asarray(step_ends), jnp.asarray(mask), num_generations=G)
    np.testing.assert_allclose(jitted, got, rtol=1e-6, atol=1e-6)


def test_process_supervision_hand_values():
    # One group of two completions, T = 4. Steps: row 0 -> rewards (1 at t=1, 0 at t=3); row 1 -> (0 at t=2).
    # Group rewards {1, 0, 0}: mean 1/3, std = sqrt(1/3) (ddof 1).
    rewards = jnp.array([[1.0, 0.0], [0.0, NAN]])
    ends = jnp.array([[1, 3], [2, -1]])
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 1, 0]])
    got = process_advantages(rewards, ends, mask, num_generations=2)
    sd = math.sqrt(1 / 3) + 1e-4
    hi, lo = (1 - 1 / 3) / sd, (0 - 1 / 3) / sd
    np.testing.assert_allclose(got, [[hi + lo, hi + lo, lo, lo], [lo, lo, lo, 0.0]], rtol=1e-5)


def test_process_supervision_singleton_and_empty_groups_get_zero():
    rewards = jnp.array([[1.0], [NAN]])
    ends = jnp.array([[0], [0]])
    got = process_advantages(rewards, ends, jnp.ones((2, 3)), num_generations=2)  # one used step: std undefined
    np.testing.assert_array_equal(got, np.zeros((2, 3)))
    got = process_advantages(jnp.array([[1.0], [2.0]]), ends, jnp.ones((2, 3)), num_generations=1)
    np.testing.assert_array_equal(got, np.zeros((2, 3)))
