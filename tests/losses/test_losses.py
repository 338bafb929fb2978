"""Tests for grpo_jax.losses against hand-computed numbers, a naive Python loop and DeepSeekMath's gradient."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.losses import (LossConfig, aggregate, clipped_surrogate, compute_loss, kl_divergence,
                             log_importance_weights)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ESTIMATORS = ["k1", "k2", "k3", "low_var_kl"]


def make_batch(seed=0, B=8, T=6, off_policy=True):
    """Random logps with ragged masks, including one fully masked row."""
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-3.0, -0.1, size=(B, T)).astype(np.float32)
    old = (logp + rng.normal(scale=0.3, size=(B, T))).astype(np.float32) if off_policy else None
    ref = (logp + rng.normal(scale=0.3, size=(B, T))).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[2] = 0
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    adv = rng.normal(size=B).astype(np.float32)
    return logp, old, ref, adv, mask


def naive_loss(logp, old, ref, adv, mask, cfg, num_items=None, num_seqs=None):
    """Token-by-token Python loop of docs/algorithms.md §3-§7 (float64), masks of §6 left out."""
    B, T = logp.shape
    eps_lo = cfg.epsilon
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    old = logp if old is None else old
    per_tok = np.zeros((B, T))
    for i in range(B):
        n_i = int(mask[i].sum())
        diffs = [float(logp[i, t]) - float(old[i, t]) for t in range(T) if mask[i, t]]
        seq_log_w = sum(diffs) / max(n_i, 1)
        vespo_s = sum(min(max(d, -20.0), 20.0) for d in diffs)
        for t in range(T):
            if not mask[i, t]:
                continue
            log_w = seq_log_w if cfg.importance_sampling_level != "token" else diffs[t]
            r = math.exp(log_w)
            a = float(adv[i])
            lp = float(logp[i, t])
            if cfg.loss_type == "cispo":
                loss = -min(r, eps_hi) * a * lp
            elif cfg.loss_type == "sapo":
                tau = cfg.sapo_temperature_pos if a > 0 else cfg.sapo_temperature_neg
                loss = -(1 / (1 + math.exp(-tau * (r - 1))) * 4 / tau) * a
            elif cfg.loss_type == "vespo":
                log_w_seq = min(max(vespo_s, math.log(1e-8)), 20.0)
                k, lam = ((cfg.vespo_k_pos, cfg.vespo_lambda_pos) if a >= 0
                          else (cfg.vespo_k_neg, cfg.vespo_lambda_neg))
                loss = -math.exp(lam + k * log_w_seq - lam * math.exp(log_w_seq)) * a * lp
            else:
                rc = min(max(r, 1 - eps_lo), 1 + eps_hi)
                ru = r if cfg.delta is None else min(r, cfg.delta)
                loss = -min(ru * a, rc * a)
            beta = 0.04 if cfg.beta is None else cfg.beta  # None: DeepSeekMath's 0.04
            if beta:
                d = float(ref[i, t]) - lp
                kl = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1,
                      "low_var_kl": min(max(math.exp(d) - d - 1, -10), 10)}[cfg.kl_estimator]
                if cfg.use_bias_correction_kl:
                    kl *= r
                loss += beta * kl
            per_tok[i, t] = loss
    n_items = mask.sum() if num_items is None else num_items
    n_seqs = B if num_seqs is None else num_seqs
    if cfg.loss_type in ("grpo", "sapo"):
        return sum(per_tok[i].sum() / max(mask[i].sum(), 1) for i in range(B)) / n_seqs
    if cfg.loss_type == "luspo":
        return per_tok.sum() / n_seqs
    if cfg.loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return per_tok.sum() / max(n_items, 1)
    return per_tok.sum() / (n_seqs * cfg.max_completion_length)


def cfg_for(loss_type, **kw):
    if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        kw.pop("delta", None)
    if loss_type == "cispo":
        kw["epsilon_high"] = 5.0
    return LossConfig(loss_type=loss_type, max_completion_length=6 if loss_type == "dr_grpo" else None, **kw)


# --- pieces, hand-computed ---------------------------------------------------------------------------------

def test_clipped_surrogate_hand_values():
    ratio = jnp.array([[1.5, 0.5, 1.5, 0.5, 1.0, 1.1]])
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0, 2.0, -3.0]])
    got = clipped_surrogate(ratio, adv, epsilon_low=0.2, epsilon_high=0.28)
    # A>0 clipped at 1.28; A>0 below 1-eps unclipped (pessimistic min); A<0 above unclipped; A<0 clipped at 0.8
    np.testing.assert_allclose(got, [[-1.28, -0.5, 1.5, 0.8, -2.0, 3.3]], rtol=1e-6)


def test_clipped_surrogate_delta():
    ratio = jnp.array([[3.0, 3.0, 0.1]])
    adv = jnp.array([[-1.0, 1.0, -1.0]])
    no_delta = clipped_surrogate(ratio, adv, epsilon_low=0.2, epsilon_high=0.28)
    with_delta = clipped_surrogate(ratio, adv, epsilon_low=0.2, epsilon_high=0.28, delta=1.4)
    np.testing.assert_allclose(no_delta, [[3.0, -1.28, 0.8]], rtol=1e-6)
    np.testing.assert_allclose(with_delta, [[1.4, -1.28, 0.8]], rtol=1e-6)


def test_log_importance_weights():
    np.testing.assert_allclose(log_importance_weights(jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])),
                               [0.5, -1.0])


@pytest.mark.parametrize("estimator,expected", [
    ("k1", [0.5, -1.0]), ("k2", [0.125, 0.5]),
    ("k3", [math.exp(-0.5) + 0.5 - 1, math.e - 2]),
    ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, math.e - 2])])
def test_kl_estimators_hand_values(estimator, expected):
    logp = jnp.array([[-1.0, -1.0]])
    ref = jnp.array([[-1.5, 0.0]])  # d = ref - logp = [-0.5, 1.0], exact in float32
    np.testing.assert_allclose(kl_divergence(logp, ref, estimator=estimator), [expected], rtol=1e-6)


def test_low_var_kl_clamps():
    got = kl_divergence(jnp.array([-30.0]), jnp.array([-1.0]), estimator="low_var_kl")  # k3 = e^29 - 30
    assert float(got[0]) == 10.0


def test_aggregate_hand_values_with_fully_masked_row():
    loss = jnp.array([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # grpo: row means (1.5, 4, 0 for the empty row) over 3 rows, the empty row still counted
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="grpo"), 5.5 / 3, rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="bnpo"), 7.0 / 3, rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="dapo"), 7.0 / 3, rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="dr_grpo", max_completion_length=4),
                               7.0 / 12, rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="dapo", num_items_in_batch=10), 0.7, rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="grpo", num_sequences=11), 0.5, rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, jnp.zeros_like(mask), loss_type="bnpo"), 0.0)


# --- compute_loss ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_compute_loss_matches_naive_loop(loss_type, estimator, level):
    logp, old, ref, adv, mask = make_batch(seed=1)
    cfg = cfg_for(loss_type, kl_estimator=estimator, epsilon_high=0.28, delta=1.5, importance_sampling_level=level,
                  use_bias_correction_kl=estimator == "k3")
    loss, _ = compute_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv),
                           jnp.asarray(mask), config=cfg)
    np.testing.assert_allclose(loss, naive_loss(logp, old, ref, adv, mask, cfg), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.04, 0.5])
def test_deepseekmath_gradient_coefficient(beta):
    # App. A.1.6: on-policy grpo, one group, k3: d loss / d logp_it = -(A_i + beta (e^{ref-logp} - 1)) m / (G |o_i|)
    G, T = 4, 5
    logp, _, ref, _, _ = make_batch(seed=2, B=G, T=T, off_policy=False)
    adv = np.array([1.2, -0.4, 0.3, -1.1], np.float32)
    mask = (np.arange(T)[None, :] < np.array([5, 3, 1, 4])[:, None]).astype(np.int32)
    cfg = LossConfig(beta=beta)
    grad = jax.grad(lambda lp: compute_loss(lp, None, jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask),
                                            config=cfg)[0])(jnp.asarray(logp))
    lengths = mask.sum(1, keepdims=True)
    expected = -(adv[:, None] + beta * (np.exp(ref.astype(np.float64) - logp) - 1)) * mask / (G * lengths)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)


def test_on_policy_beta0_loss_zero_gradient_nonzero():
    logp, _, _, _, mask = make_batch(seed=3, off_policy=False)
    adv = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25], np.float32)  # centred
    mask[2] = 1  # every row active so the row means are exactly -A_i
    f = lambda lp: compute_loss(lp, None, None, jnp.asarray(adv), jnp.asarray(mask), config=LossConfig(beta=0.0))
    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    assert abs(float(loss)) < 1e-6
    assert float(jnp.abs(grad).sum()) > 0.1
    assert float(aux.kl) == 0.0 and float(aux.clip_ratio_region) == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("estimator,level", [("k1", "token"), ("k2", "sequence"), ("k3", "sequence_token"),
                                             ("low_var_kl", "token")])
def test_garbage_at_masked_positions(loss_type, estimator, level):
    logp, old, ref, adv, mask = make_batch(seed=4)
    adv_tok = np.repeat(adv[:, None], logp.shape[1], axis=1)
    rng = np.random.default_rng(40)
    entropies = rng.uniform(0.0, 3.0, size=logp.shape).astype(np.float32)
    sampler = (old + rng.normal(scale=0.1, size=logp.shape)).astype(np.float32)
    garbage = np.array([1e30, np.inf, -np.inf, np.nan, -1e30], np.float32)
    pads = np.argwhere(mask == 0)
    dirty = [x.copy() for x in (logp, old, ref, adv_tok, entropies, sampler)]
    for k, (i, t) in enumerate(pads):
        for j, x in enumerate(dirty):
            x[i, t] = garbage[(k + j) % len(garbage)]
    token_is = loss_type == "vespo"
    cfg = cfg_for(loss_type, kl_estimator=estimator, use_bias_correction_kl=True, top_entropy_quantile=0.6,
                  entropy_coef=0.01, off_policy_mask_threshold=0.05, importance_sampling_level=level,
                  vllm_importance_sampling_mode="token_truncate" if token_is else "sequence_mask")

    def f(lp, o, r, a, e, smp):
        return compute_loss(lp, jnp.asarray(o), jnp.asarray(r), jnp.asarray(a), jnp.asarray(mask), config=cfg,
                            entropies=jnp.asarray(e), sampler_per_token_logps=jnp.asarray(smp))

    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(dirty[0]), *dirty[1:])
    (clean_loss, clean_aux), clean_grad = jax.value_and_grad(f, has_aux=True)(
        jnp.asarray(logp), old, ref, adv_tok, entropies, sampler)
    assert np.isfinite(float(loss))
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)
    np.testing.assert_array_equal(loss, clean_loss)
    np.testing.assert_array_equal(grad, clean_grad)
    for a, b in zip(aux, clean_aux):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("num_micro", [2, 4])
@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batched_sum_equals_full_batch(loss_type, num_micro, on_policy, level):
    logp, old, ref, adv, mask = make_batch(seed=5, off_policy=not on_policy)
    rng = np.random.default_rng(50)
    entropies = rng.uniform(0.0, 3.0, size=logp.shape).astype(np.float32)
    sampler = (logp + rng.normal(scale=0.1, size=logp.shape)).astype(np.float32)
    # every option whose statistic is per row or per token (the top-entropy quantile is per batch: left out)
    cfg = cfg_for(loss_type, epsilon_high=0.28, importance_sampling_level=level, entropy_coef=0.02,
                  off_policy_mask_threshold=0.05, use_bias_correction_kl=True, vllm_importance_sampling_mode=(
                      "token_mask" if loss_type == "vespo" else "sequence_truncate"))
    B = logp.shape[0]

    def f(lp, o, r, a, m, e, smp, **kw):
        return compute_loss(lp, o, r, a, m, config=cfg, entropies=e, sampler_per_token_logps=smp, **kw)[0]

    full, full_grad = jax.value_and_grad(f)(jnp.asarray(logp), old, ref, adv, mask, entropies, sampler)
    n_items, total, grads = int(mask.sum()), 0.0, []
    for rows in np.split(np.arange(B), num_micro):
        o = None if old is None else old[rows]
        val, g = jax.value_and_grad(f)(jnp.asarray(logp[rows]), o, ref[rows], adv[rows], mask[rows],
                                       entropies[rows], sampler[rows], num_items_in_batch=n_items, num_sequences=B)
        total, grads = total + val, grads + [g]
    np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.concatenate(grads), full_grad, rtol=1e-5, atol=1e-8)


def test_clip_ratio_metrics_against_naive_count():
    logp, old, ref, adv, mask = make_batch(seed=6, B=16, T=8)
    old = (logp + np.random.default_rng(7).normal(scale=0.4, size=logp.shape)).astype(np.float32)
    cfg = LossConfig(epsilon=0.2, epsilon_high=0.28)
    _, aux = compute_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv),
                          jnp.asarray(mask), config=cfg)
    low = high = active = 0
    row_low, row_high = [], []  # each row's fractions, for TRL's clip_ratio/low_min and high_max
    for i in range(logp.shape[0]):
        row = [0, 0, 0]
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = math.exp(float(logp[i, t]) - float(old[i, t]))
                row[0] += 1
                row[1] += r < 0.8 and adv[i] < 0
                row[2] += r > 1.28 and adv[i] > 0
        active, low, high = active + row[0], low + row[1], high + row[2]
        if row[0]:
            row_low.append(row[1] / row[0])
            row_high.append(row[2] / row[0])
    assert low > 0 and high > 0 and min(row_low) != max(row_low)
    np.testing.assert_allclose(aux.clip_ratio_low_min, min(row_low), rtol=1e-6)
    np.testing.assert_allclose(aux.clip_ratio_high_max, max(row_high), rtol=1e-6)
    np.testing.assert_allclose(aux.clip_ratio_low, low / active, rtol=1e-6)
    np.testing.assert_allclose(aux.clip_ratio_high, high / active, rtol=1e-6)
    np.testing.assert_allclose(aux.clip_ratio_region, (low + high) / active, rtol=1e-6)


def test_kl_metric_is_masked_mean():
    logp, old, ref, adv, mask = make_batch(seed=8)
    _, aux = compute_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv),
                          jnp.asarray(mask), config=LossConfig())
    d = (ref.astype(np.float64) - logp)[mask == 1]
    np.testing.assert_allclose(aux.kl, np.mean(np.exp(d) - d - 1), rtol=1e-5)


def test_bias_correction_multiplies_kl_by_ratio():
    logp, old, ref, _, mask = make_batch(seed=9)
    zero_adv = jnp.zeros(logp.shape[0])  # surrogate vanishes: the loss is beta * masked_mean(kl [* r])
    args = (jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), zero_adv, jnp.asarray(mask))
    plain, _ = compute_loss(*args, config=LossConfig(loss_type="bnpo", beta=1.0))
    corrected, aux = compute_loss(*args, config=LossConfig(loss_type="bnpo", beta=1.0,
                                                           use_bias_correction_kl=True))
    lp, o, rf = (x.astype(np.float64)[mask == 1] for x in (logp, old, ref))
    k3 = np.exp(rf - lp) - (rf - lp) - 1
    np.testing.assert_allclose(plain, k3.mean(), rtol=1e-5)
    np.testing.assert_allclose(corrected, (k3 * np.exp(lp - o)).mean(), rtol=1e-5)
    np.testing.assert_allclose(aux.kl, corrected, rtol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_jit_equals_eager(loss_type):
    logp, old, ref, adv, mask = make_batch(seed=10)
    cfg = cfg_for(loss_type)
    args = tuple(jnp.asarray(x) for x in (logp, old, ref, adv, mask))
    eager = compute_loss(*args, config=cfg)
    jitted = jax.jit(compute_loss, static_argnames="config")(*args, config=cfg)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    # the global normalisers may be traced values
    n = jnp.asarray(mask.sum())
    got = jax.jit(compute_loss, static_argnames="config")(*args, config=cfg, num_items_in_batch=n)
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-6)


def test_per_token_advantages_equal_broadcast():
    logp, old, ref, adv, mask = make_batch(seed=11)
    args = (jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref))
    per_seq, _ = compute_loss(*args, jnp.asarray(adv), jnp.asarray(mask), config=LossConfig())
    adv_tok = jnp.broadcast_to(jnp.asarray(adv)[:, None], logp.shape)
    per_tok, _ = compute_loss(*args, adv_tok, jnp.asarray(mask), config=LossConfig())
    np.testing.assert_allclose(per_seq, per_tok, rtol=1e-6)


# --- config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(loss_type="ppo"), "loss.loss_type"), (dict(kl_estimator="k4"), "loss.kl_estimator"),
    (dict(beta=-0.1), "loss.beta"), (dict(epsilon=-0.1), "loss.epsilon"),
    (dict(epsilon_high=-1.0), "loss.epsilon_high"), (dict(delta=0.0), "loss.delta"),
    (dict(max_completion_length=0), "loss.max_completion_length")])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LossConfig(**kwargs)


def test_dr_grpo_needs_max_completion_length_when_called():
    mask = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="loss.max_completion_length=None is required by loss_type='dr_grpo'"):
        compute_loss(jnp.zeros((2, 3)), None, None, jnp.ones(2), mask, config=LossConfig(loss_type="dr_grpo", beta=0.0))


def test_config_error_lists_allowed_values_and_resolves_epsilon_high():
    with pytest.raises(ValueError, match="grpo.*bnpo.*dr_grpo.*dapo"):
        LossConfig(loss_type="nope")
    assert LossConfig(epsilon=0.3).epsilon_high_resolved == 0.3
    assert LossConfig(epsilon=0.2, epsilon_high=0.28).epsilon_high_resolved == 0.28
    hash(LossConfig())  # static-argument ready


def test_beta_nonzero_requires_ref():
    logp, _, _, adv, mask = make_batch(seed=12)
    with pytest.raises(ValueError, match="loss.beta"):
        compute_loss(jnp.asarray(logp), None, None, jnp.asarray(adv), jnp.asarray(mask), config=LossConfig())
