"""grpo_jax.losses.compute_loss against TRL 1.16's own `GRPOTrainer._compute_loss` (loss, gradient, metrics).

The trainer is built without a model (`GRPOTrainer.__new__`) with the attributes `_compute_loss` reads, a
one-process accelerator stub, and `_get_per_token_logps_and_entropies` returning our per-token log-probs as a
leaf tensor, so its `.grad` is TRL's gradient w.r.t. per_token_logps. One micro-batch per step (GA = 1,
steps_per_generation = 1, one process): there TRL's normalisers equal ours. float32 throughout.
"""
import math
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from grpo_jax.losses import LossConfig, compute_loss  # noqa: E402

B, T = 6, 7


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def make_case(seed, on_policy=False, noise=0.35):
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-3.0, -0.05, size=(B, T)).astype(np.float32)
    old = None if on_policy else (logp + rng.normal(scale=noise, size=(B, T))).astype(np.float32)
    ref = (logp + rng.normal(scale=0.3, size=(B, T))).astype(np.float32)
    sampler = ((logp if old is None else old) + rng.normal(scale=0.15, size=(B, T))).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[1] = 0  # a fully masked row
    lengths[4] = T
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    adv = rng.normal(size=B).astype(np.float32)
    adv[3] = 0.0
    entropies = rng.uniform(0.0, 3.0, size=(B, T)).astype(np.float32)
    return dict(logp=logp, old=old, ref=ref, sampler=sampler, mask=mask, adv=adv, entropies=entropies)


def trl_is_ratio(old, sampler, mask, cfg):
    """TRL 1.16 `_generate_and_score_completions` lines computing `importance_sampling_ratio` (not reachable
    without vLLM), transcribed."""
    diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if cfg.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if cfg.vllm_importance_sampling_mode.endswith("_truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def run_trl(case, cfg, use_sampler, accumulation=1, num_items=None):
    """TRL's loss, gradient and metrics on ``case``: one micro-batch of ``accumulation`` per optimizer step (and per
    generation), ``num_items`` the generation batch's tokens (None: the case's)."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    args = types.SimpleNamespace(
        use_bias_correction_kl=cfg.use_bias_correction_kl, delta=cfg.delta, steps_per_generation=accumulation,
        sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
        vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
        vespo_lambda_neg=cfg.vespo_lambda_neg, entropy_target=0.2)
    attrs = dict(
        args=args, accelerator=_Accelerator(), model=types.SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, aux_loss_enabled=False,
        loss_type=cfg.loss_type, beta=cfg.resolved_beta, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high_resolved,
        importance_sampling_level=cfg.importance_sampling_level, top_entropy_quantile=cfg.top_entropy_quantile,
        off_policy_mask_threshold=cfg.off_policy_mask_threshold, max_completion_length=T,
        use_vllm=use_sampler, vllm_importance_sampling_correction=cfg.vllm_importance_sampling_correction,
        current_gradient_accumulation_steps=accumulation, entropy_coef=cfg.entropy_coef, use_adaptive_entropy=False,
        _entropy_bonus_enabled=cfg.entropy_coef != 0.0)
    for name, value in attrs.items():
        object.__setattr__(trainer, name, value)

    logp = torch.tensor(case["logp"], requires_grad=True)
    entropies = torch.tensor(case["entropies"])
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropies, None)
    mask = torch.tensor(case["mask"])
    rows = len(case["adv"])
    inputs = {"prompt_ids": torch.zeros((rows, 2), dtype=torch.long),
              "prompt_mask": torch.ones((rows, 2), dtype=torch.long),
              "completion_ids": torch.zeros((rows, T), dtype=torch.long), "completion_mask": mask,
              "advantages": torch.tensor(case["adv"]), "ref_per_token_logps": torch.tensor(case["ref"]),
              "num_items_in_batch": mask.sum() if num_items is None else torch.tensor(num_items)}
    old = None if case["old"] is None else torch.tensor(case["old"])
    if old is not None:
        inputs["old_per_token_logps"] = old
    if use_sampler:
        sampler = torch.tensor(case["sampler"])
        inputs["sampling_per_token_logps"] = sampler
        if cfg.vllm_importance_sampling_correction:
            learner_old = logp.detach() if old is None else old
            inputs["importance_sampling_ratio"] = trl_is_ratio(learner_old, sampler, mask, cfg)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), logp.grad.numpy(), metrics


def run_ours(case, cfg, use_sampler):
    def f(lp):
        return compute_loss(lp, None if case["old"] is None else jnp.asarray(case["old"]), jnp.asarray(case["ref"]),
                            jnp.asarray(case["adv"]), jnp.asarray(case["mask"]), config=cfg,
                            entropies=jnp.asarray(case["entropies"]),
                            sampler_per_token_logps=jnp.asarray(case["sampler"]) if use_sampler else None)
    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(case["logp"]))
    return float(loss), np.asarray(grad), aux


def check(cfg, seed=0, on_policy=False, use_sampler=False, noise=0.35):
    case = make_case(seed, on_policy, noise)
    trl_loss, trl_grad, metrics = run_trl(case, cfg, use_sampler)
    loss, grad, aux = run_ours(case, cfg, use_sampler)
    scale = max(abs(trl_loss), 1e-3)
    np.testing.assert_allclose(loss, trl_loss, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(grad, trl_grad, rtol=1e-5, atol=1e-5 * np.abs(trl_grad).max())
    assert np.abs(trl_grad).max() > 0
    if cfg.importance_sampling_level == "token":  # TRL weights sequence-level ratio metrics by sequences
        names = {"kl": "kl", "entropy": "entropy", "clip_ratio/low_mean": "clip_ratio_low",
                 "clip_ratio/high_mean": "clip_ratio_high", "clip_ratio/region_mean": "clip_ratio_region",
                 "cispo_clip_ratio": "cispo_clip_ratio", "policy_loss": "policy_loss",
                 "clip_ratio/low_min": "clip_ratio_low_min", "clip_ratio/high_max": "clip_ratio_high_max"}
        for trl_name, field in names.items():
            if trl_name in metrics:
                np.testing.assert_allclose(float(getattr(aux, field)), metrics[trl_name], rtol=1e-5, atol=1e-7)
    return trl_loss


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_matrix(loss_type, level, beta, bias_correction):
    cfg = LossConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                     use_bias_correction_kl=bias_correction, max_completion_length=T,
                     epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    check(cfg, seed=100 * LOSS_TYPES.index(loss_type) + 10 * (level == "token") + 2 * (beta > 0) + bias_correction)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy(loss_type):
    check(LossConfig(loss_type=loss_type, max_completion_length=T, use_bias_correction_kl=True), seed=11,
          on_policy=True)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo", "bnpo"])
def test_two_sided_clipping(loss_type):
    with_delta = check(LossConfig(loss_type=loss_type, delta=1.3, epsilon_high=0.28, max_completion_length=T),
                       seed=12, noise=0.8)
    without = check(LossConfig(loss_type=loss_type, epsilon_high=0.28, max_completion_length=T), seed=12, noise=0.8)
    assert abs(with_delta - without) > 1e-3  # the cap fires in this case


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_top_entropy_and_bonus(loss_type, rho, entropy_coef):
    check(LossConfig(loss_type=loss_type, top_entropy_quantile=rho, entropy_coef=entropy_coef,
                     max_completion_length=T), seed=13)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "sapo"])
def test_entropy_bonus_alone(loss_type):
    check(LossConfig(loss_type=loss_type, entropy_coef=0.05, max_completion_length=T), seed=14)


@pytest.mark.parametrize("use_sampler", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
def test_off_policy_mask(use_sampler, loss_type):
    cfg = LossConfig(loss_type=loss_type, off_policy_mask_threshold=0.05, max_completion_length=T,
                     vllm_importance_sampling_correction=False)
    check(cfg, seed=15, use_sampler=use_sampler)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.8, 1.25)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_sampler_importance_correction(mode, bounds, loss_type, on_policy):
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL rejects VESPO with a sequence-level correction (tested in test_losses)")
    cfg = LossConfig(loss_type=loss_type, vllm_importance_sampling_mode=mode,
                     vllm_importance_sampling_clip_min=bounds[0], vllm_importance_sampling_clip_max=bounds[1],
                     epsilon_high=5.0 if loss_type == "cispo" else None, off_policy_mask_threshold=0.1)
    check(cfg, seed=16, on_policy=on_policy, use_sampler=True)


def test_sapo_temperatures_and_vespo_shape():
    check(LossConfig(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0), seed=17)
    check(LossConfig(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=2.0, vespo_k_neg=4.0,
                     vespo_lambda_neg=1.5), seed=18)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo", "luspo"])
def test_policy_loss_over_micro_batches_is_trls(loss_type):
    """TRL logs policy_loss (with its entropy bonus) per micro-batch and averages them: with 2 micro-batches per
    step our step metric, each micro-batch's `LossAux.policy_loss` combined as the train step does
    (`POLICY_LOSS_SHARES`), is TRL's mean."""
    from grpo_jax.algo.train_step import POLICY_LOSS_SHARES

    cfg = LossConfig(loss_type=loss_type, entropy_coef=0.05, beta=0.04, max_completion_length=T,
                     epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    case = make_case(15)
    halves = [{k: None if v is None else v[rows] for k, v in case.items()} for rows in (slice(0, 3), slice(3, 6))]
    num_items = int(case["mask"].sum())
    trl = [run_trl(half, cfg, False, accumulation=2, num_items=num_items)[2]["policy_loss"] for half in halves]
    ours = []
    for half in halves:
        _, aux = compute_loss(jnp.asarray(half["logp"]), jnp.asarray(half["old"]), jnp.asarray(half["ref"]),
                              jnp.asarray(half["adv"]), jnp.asarray(half["mask"]), config=cfg,
                              entropies=jnp.asarray(half["entropies"]), num_items_in_batch=num_items,
                              num_sequences=B)
        ours.append(float(aux.policy_loss))
    share = 0.5 if loss_type in POLICY_LOSS_SHARES else 1.0
    np.testing.assert_allclose(sum(ours) * share, np.mean(trl), rtol=1e-5)
    assert abs(trl[0] - trl[1]) > 1e-3  # two different micro-batches


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_every_token_masked_is_trls_zero(loss_type, beta):
    """A micro-batch whose every completion token is masked (all truncated with mask_truncated_completions): TRL's
    normalisers are clamped to 1 (grpo_trainer.py `_compute_loss`), its loss and gradient are 0, and so are ours
    (`losses.aggregation.aggregate`'s max(·, 1)); entropy bonus off, as TRL's default."""
    case = make_case(7)
    case["mask"] = np.zeros_like(case["mask"])
    cfg = LossConfig(loss_type=loss_type, beta=beta, max_completion_length=T,
                     epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    trl_loss, trl_grad, _ = run_trl(case, cfg, use_sampler=False)
    loss, grad, _ = run_ours(case, cfg, use_sampler=False)
    assert trl_loss == 0.0 and not trl_grad.any()
    assert loss == 0.0 and not grad.any()
