"""Hand-computed values and paper identities for the pieces of grpo_jax.losses (ratios, surrogates, masks,
aggregation), the module docstring's example, and the new LossConfig options' validation."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grpo_jax.losses as losses
from grpo_jax.losses import (LossConfig, aggregate, cispo_surrogate, clipped_surrogate, compute_loss, entropy_bonus,
                             high_entropy_mask, off_policy_sequence_mask, quantile, sampler_importance_weights,
                             sapo_surrogate, sequence_log_importance_weights, sequence_token_log_importance_weights,
                             vespo_weights)


def batch(seed=0, B=6, T=5, noise=0.3):
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-3.0, -0.1, size=(B, T)).astype(np.float32)
    old = (logp + rng.normal(scale=noise, size=(B, T))).astype(np.float32)
    ref = (logp + rng.normal(scale=0.3, size=(B, T))).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[1] = 0
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    adv = rng.normal(size=B).astype(np.float32)
    return logp, old, ref, adv, mask


# --- ratios --------------------------------------------------------------------------------------------------

def test_sequence_ratio_hand_values():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = jnp.array([[-1.5, -2.0, 9.0], [0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [0, 0, 0]])
    np.testing.assert_allclose(sequence_log_importance_weights(logp, old, mask), [[0.25], [0.0]])
    tok = sequence_token_log_importance_weights(logp, old, mask)
    np.testing.assert_allclose(tok, [[0.25] * 3, [0.0] * 3])
    # GSPO-token: each token's log weight moves one-for-one with its own logp only
    jac = jax.jacobian(lambda lp: sequence_token_log_importance_weights(lp, old, mask))(logp)
    np.testing.assert_allclose(jac.reshape(6, 6), np.eye(6))


def test_log_importance_weights_dispatches_on_level():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = jnp.array([[-1.5, -2.0, 9.0], [0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(losses.log_importance_weights(logp, old), logp - old)  # token level by default
    np.testing.assert_array_equal(losses.log_importance_weights(logp, old, mask, level="sequence"),
                                  sequence_log_importance_weights(logp, old, mask))
    np.testing.assert_array_equal(losses.log_importance_weights(logp, old, mask, level="sequence_token"),
                                  sequence_token_log_importance_weights(logp, old, mask))
    with pytest.raises(ValueError, match="needs completion_mask"):
        losses.log_importance_weights(logp, old, level="sequence")
    with pytest.raises(ValueError, match="importance_sampling_level='word'"):
        losses.log_importance_weights(logp, old, mask, level="word")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo"])
def test_gspo_token_equals_gspo_for_per_sequence_advantages(loss_type):
    logp, old, ref, adv, mask = batch(seed=1)
    grads, values = [], []
    for level in ("sequence", "sequence_token"):
        cfg = LossConfig(loss_type=loss_type, importance_sampling_level=level, max_completion_length=5)
        def f(lp):
            return compute_loss(lp, jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask),
                                config=cfg)[0]

        v, g = jax.value_and_grad(f)(jnp.asarray(logp))
        values.append(float(v))
        grads.append(np.asarray(g))
    np.testing.assert_allclose(values[0], values[1], rtol=1e-6)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert np.abs(grads[0]).max() > 1e-3


# --- surrogates ----------------------------------------------------------------------------------------------

def test_dual_clip_caps_negative_advantage_loss():
    ratio = jnp.array([[10.0, 3.5, 2.0, 0.1]])
    adv = jnp.full((1, 4), -2.0)
    got = clipped_surrogate(ratio, adv, epsilon_low=0.2, epsilon_high=0.28, delta=3.0)
    np.testing.assert_allclose(got, [[6.0, 6.0, 4.0, 1.6]], rtol=1e-6)  # |A|·delta = 6 caps the first two
    # through compute_loss: one token, r = 10, A = -2 -> loss 6 and no gradient (the cap is flat)
    def f(lp):
        return compute_loss(lp, jnp.log(jnp.array([[0.01]])), None, jnp.array([-2.0]), jnp.ones((1, 1)),
                            config=LossConfig(loss_type="dapo", beta=0.0, delta=3.0))[0]

    v, g = jax.value_and_grad(f)(jnp.log(jnp.array([[0.1]])))
    np.testing.assert_allclose(v, 6.0, rtol=1e-5)
    assert float(g[0, 0]) == 0.0


def test_cispo_hand_values_and_detached_weight():
    ratio = jnp.array([[0.5, 7.0, 2.0]])
    adv = jnp.array([[2.0, 2.0, -1.0]])
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    np.testing.assert_allclose(cispo_surrogate(ratio, adv, logp, epsilon_high=5.0), [[1.0, 20.0, -1.0]])
    g = jax.grad(lambda r: cispo_surrogate(r, adv, logp, epsilon_high=5.0).sum())(ratio)
    np.testing.assert_array_equal(g, np.zeros((1, 3)))
    g = jax.grad(lambda lp: cispo_surrogate(ratio, adv, lp, epsilon_high=5.0).sum())(logp)
    np.testing.assert_allclose(g, [[-1.0, -10.0, 2.0]])


def test_sapo_hand_values():
    got = sapo_surrogate(jnp.array([[1.0, 1.5]]), jnp.array([[2.0, -1.0]]), temperature_pos=1.0,
                         temperature_neg=1.05)
    sig = 1 / (1 + math.exp(-1.05 * 0.5))
    np.testing.assert_allclose(got, [[-4.0, sig * 4 / 1.05]], rtol=1e-6)


@pytest.mark.parametrize("tau", [(1.0, 1.05), (0.3, 4.0)])
def test_sapo_gradient_is_vanilla_policy_gradient_at_ratio_one(tau):
    logp, _, _, adv, mask = batch(seed=2)
    cfg = LossConfig(loss_type="sapo", beta=0.0, sapo_temperature_pos=tau[0], sapo_temperature_neg=tau[1])
    g = jax.grad(lambda lp: compute_loss(lp, None, None, jnp.asarray(adv), jnp.asarray(mask), config=cfg)[0])(
        jnp.asarray(logp))
    lengths = np.maximum(mask.sum(1, keepdims=True), 1)
    np.testing.assert_allclose(g, -adv[:, None] * mask / (len(adv) * lengths), rtol=1e-5, atol=1e-8)


def test_vespo_weights_hand_values():
    mask = jnp.ones((1, 2))
    lr = jnp.array([[math.log(2.0) / 2, math.log(2.0) / 2]])  # s = log 2, w = 2
    np.testing.assert_allclose(vespo_weights(lr, jnp.array([[1.0]]), mask), [[4 * math.exp(-3)]], rtol=1e-5)
    np.testing.assert_allclose(vespo_weights(lr, jnp.array([[-1.0]]), mask), [[8 * math.exp(-2)]], rtol=1e-5)
    np.testing.assert_allclose(vespo_weights(jnp.zeros((1, 2)), jnp.array([[0.0]]), mask), [[1.0]])  # φ(1) = 1
    # s clamped at log 1e-8; a non-finite φ (here overflow with a negative k) becomes 0
    tiny = vespo_weights(jnp.full((1, 2), -1000.0), jnp.array([[1.0]]), mask)
    np.testing.assert_allclose(tiny, [[math.exp(3 + 2 * math.log(1e-8) - 3e-8)]], rtol=1e-4)
    assert float(vespo_weights(jnp.full((1, 2), -1000.0), jnp.array([[1.0]]), mask, k_pos=-100.0)[0, 0]) == 0.0
    # a token-level sampler correction adds Σ log ρ to s
    with_is = vespo_weights(jnp.zeros((1, 2)), jnp.array([[1.0]]), mask,
                            log_is_correction_BxT=jnp.array([[math.log(2.0), 0.0]]))
    np.testing.assert_allclose(with_is, [[4 * math.exp(-3)]], rtol=1e-5)


# --- masks ---------------------------------------------------------------------------------------------------

def test_quantile_matches_numpy_linear_on_valid_entries():
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 3, size=(5, 7)).astype(np.float32)
    m = rng.integers(0, 2, size=(5, 7))
    for q in (0.0, 0.13, 0.5, 0.8, 1.0):
        np.testing.assert_allclose(quantile(jnp.asarray(x), jnp.asarray(m), q),
                                   np.quantile(x[m == 1].astype(np.float64), q), rtol=1e-6)
    assert np.isnan(float(quantile(jnp.asarray(x), jnp.zeros((5, 7)), 0.5)))


def test_high_entropy_mask_hand_values():
    ent = jnp.array([[0.1, 0.5, 9.0], [0.9, 2.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 0]])
    # valid {0.1, 0.5, 0.9, 2.0}; ρ = 0.5 -> the 0.5 quantile = 0.7
    np.testing.assert_array_equal(high_entropy_mask(ent, mask, top_quantile=0.5), [[0, 0, 0], [1, 1, 0]])
    np.testing.assert_array_equal(high_entropy_mask(ent, mask, top_quantile=0.0), [[0, 0, 0], [0, 1, 0]])
    np.testing.assert_array_equal(high_entropy_mask(ent, mask, top_quantile=1.0), [[1, 1, 0], [1, 1, 0]])
    np.testing.assert_array_equal(high_entropy_mask(ent, jnp.zeros((2, 3)), top_quantile=0.5), np.zeros((2, 3)))


def test_off_policy_sequence_mask_hand_values():
    logp = jnp.zeros((4, 2))
    sampler = jnp.array([[0.2, 0.2], [0.01, 0.01], [0.5, 0.5], [0.3, jnp.nan]])
    adv = jnp.array([[-1.0], [-1.0], [1.0], [-1.0]])
    mask = jnp.ones((4, 2))
    # mean KL 0.2 > 0.1 with A < 0 -> drop; 0.01 -> keep; A > 0 -> keep; NaN counts 0: mean 0.15 -> drop
    np.testing.assert_array_equal(off_policy_sequence_mask(adv, logp, sampler, mask, threshold=0.1),
                                  [[0.0], [1.0], [1.0], [0.0]])


@pytest.mark.parametrize("mode,lo,hi,expected", [
    ("token_truncate", 0.5, 1.5, [[1.5, 0.5, 1.0]]),
    ("token_mask", 0.5, 1.5, [[0.0, 0.0, 1.0]]),
    ("token_mask", None, 3.0, [[math.exp(0.5), math.exp(-1.5), 1.0]]),
    ("sequence_truncate", 0.5, 1.5, [[0.5]]),
    ("sequence_mask", 0.5, 1.5, [[0.0]]),
    ("sequence_mask", None, 3.0, [[math.exp(-1.0)]]),
])
def test_sampler_importance_weights_hand_values(mode, lo, hi, expected):
    old = jnp.array([[-1.0, -2.0, 5.0]])
    sampler = jnp.array([[-1.5, -0.5, jnp.nan]])  # old - sampler = 0.5, -1.5, (padding)
    mask = jnp.array([[1, 1, 0]])
    got = sampler_importance_weights(old, sampler, mask, mode=mode, clip_min=lo, clip_max=hi)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


# --- aggregation ---------------------------------------------------------------------------------------------

def test_fully_masked_row_counts_as_trl_counts():
    loss = jnp.array([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # grpo / sapo: row means over all 3 rows; luspo: row sums over all 3 rows; token types: 3 active tokens
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="sapo"), 5.5 / 3, rtol=1e-6)
    np.testing.assert_allclose(aggregate(loss, mask, loss_type="luspo"), 7.0 / 3, rtol=1e-6)
    for loss_type in ("cispo", "vespo"):
        np.testing.assert_allclose(aggregate(loss, mask, loss_type=loss_type), 7.0 / 3, rtol=1e-6)
    np.testing.assert_allclose(aggregate(jnp.array([[2.0], [4.0], [8.0]]), mask, loss_type="luspo"),
                               (4.0 + 4.0) / 3, rtol=1e-6)  # a [B, 1] loss broadcasts over the row's tokens


def test_entropy_bonus_hand_values():
    ent = jnp.array([[1.0, 3.0, 99.0], [2.0, 99.0, 99.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_allclose(entropy_bonus(ent, mask, coef=0.1), 0.1 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(entropy_bonus(ent, mask, coef=0.1, num_items_in_batch=6), 0.1, rtol=1e-6)
    emask = jnp.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(entropy_bonus(ent, mask, coef=1.0, entropy_mask_BxT=emask), 2.5, rtol=1e-6)
    logp, old, ref, adv, m = batch(seed=4)
    e = np.random.default_rng(5).uniform(0, 2, size=logp.shape).astype(np.float32)
    args = (jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(m))
    plain, aux = compute_loss(*args, config=LossConfig(), entropies=jnp.asarray(e))
    bonus, _ = compute_loss(*args, config=LossConfig(entropy_coef=0.3), entropies=jnp.asarray(e))
    np.testing.assert_allclose(plain - bonus, 0.3 * e[m == 1].mean(), rtol=1e-5)
    np.testing.assert_allclose(aux.entropy, e[m == 1].mean(), rtol=1e-6)
    # the bonus differentiates through entropies passed with gradient
    g = jax.grad(lambda h: compute_loss(*args, config=LossConfig(entropy_coef=0.3), entropies=h)[0])(jnp.asarray(e))
    np.testing.assert_allclose(g, -0.3 * m / m.sum(), rtol=1e-6)


def test_cispo_clip_ratio_metric():
    logp, old, ref, adv, mask = batch(seed=7, noise=1.5)
    _, aux = compute_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv),
                          jnp.asarray(mask), config=LossConfig(loss_type="cispo", epsilon_high=1.5))
    r = np.exp(logp.astype(np.float64) - old)
    capped = (r > 1.5) & (adv[:, None] > 0) & (mask == 1)
    assert capped.sum() > 0
    np.testing.assert_allclose(aux.cispo_clip_ratio, capped.sum() / mask.sum(), rtol=1e-6)
    assert float(aux.clip_ratio_region) == 0.0


# --- docstring example ---------------------------------------------------------------------------------------

def test_module_docstring_example_runs_and_matches_compute_loss():
    code = re.search(r"::\n\n((?:    .*\n|\n)+)", losses.__doc__).group(1)
    namespace = {}
    exec(compile("\n".join(line[4:] for line in code.splitlines()), "<losses docstring>", "exec"), namespace)
    logp, old, ref, adv, mask = batch(seed=7)
    args = [jnp.asarray(x) for x in (logp, old, ref, adv, mask)]
    mine, grad = jax.value_and_grad(namespace["my_loss"])(*args)
    cfg = LossConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.01, kl_estimator="k1")
    ref_loss, ref_grad = jax.value_and_grad(lambda lp: compute_loss(lp, *args[1:], config=cfg)[0])(args[0])
    np.testing.assert_allclose(mine, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-9)


# --- call-time and config errors -----------------------------------------------------------------------------

def test_missing_entropies_and_vespo_sequence_correction_raise():
    x, m = jnp.zeros((2, 3)), jnp.ones((2, 3))
    with pytest.raises(ValueError, match="entropies="):
        compute_loss(x, None, None, jnp.ones(2), m, config=LossConfig(beta=0.0, top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        compute_loss(x, None, None, jnp.ones(2), m, config=LossConfig(loss_type="vespo", beta=0.0),
                     sampler_per_token_logps=x)


@pytest.mark.parametrize("kwargs,field", [
    (dict(importance_sampling_level="seq"), "loss.importance_sampling_level"),
    (dict(vllm_importance_sampling_mode="clip"), "loss.vllm_importance_sampling_mode"),
    (dict(delta=1.1), "loss.delta"), (dict(epsilon_high=0.28, delta=1.25), "loss.delta"),
    (dict(loss_type="cispo", delta=2.0), "loss.delta"),
    (dict(sapo_temperature_neg=0.0), "loss.sapo_temperature_neg"),
    (dict(vespo_lambda_pos=-1.0), "loss.vespo_lambda_pos"),
    (dict(top_entropy_quantile=1.5), "loss.top_entropy_quantile"),
    (dict(off_policy_mask_threshold=-0.1), "loss.off_policy_mask_threshold"),
    (dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5),
     "loss.vllm_importance_sampling_clip_min"),
    (dict(vllm_importance_sampling_clip_max=0.9), "loss.vllm_importance_sampling_clip_min"),
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
     "loss.vllm_importance_sampling_mode")])
def test_new_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LossConfig(**kwargs)


def test_every_option_is_hashable():
    cfg = LossConfig(loss_type="vespo", importance_sampling_level="sequence_token", top_entropy_quantile=0.2,
                     entropy_coef=0.01, off_policy_mask_threshold=0.5, vllm_importance_sampling_mode="token_mask")
    assert hash(cfg) == hash(LossConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}))


def test_jit_equals_eager_with_every_option():
    logp, old, ref, adv, mask = batch(seed=8)
    rng = np.random.default_rng(9)
    ent = jnp.asarray(rng.uniform(0, 3, size=logp.shape), jnp.float32)
    smp = jnp.asarray(old + rng.normal(scale=0.1, size=logp.shape), jnp.float32)
    args = tuple(jnp.asarray(x) for x in (logp, old, ref, adv, mask))
    for cfg in (LossConfig(loss_type="dapo", importance_sampling_level="sequence_token", delta=2.0, entropy_coef=0.01,
                           top_entropy_quantile=0.3, off_policy_mask_threshold=0.05, use_bias_correction_kl=True,
                           vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.9),
                LossConfig(loss_type="vespo", vllm_importance_sampling_mode="token_truncate", kl_estimator="k2")):
        kw = dict(config=cfg, entropies=ent, sampler_per_token_logps=smp)
        eager = compute_loss(*args, **kw)
        jitted = jax.jit(compute_loss, static_argnames="config")(*args, **kw, num_items_in_batch=jnp.sum(args[4]))
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
