"""GRPO-family policy losses from per-token log-probabilities (docs/algorithms.md §3–§7, §9), TRL 1.16 numbers.

Dimension letters: B rows of this (micro-)batch, T completion tokens. A loss never calls the model: it takes
`per_token_logps` (carries gradient), `old_per_token_logps` and `ref_per_token_logps` (no gradient).

The pieces are small pure functions, one concern per module; `compute_loss` is one way to chain them:

    ratios       log_w = log_importance_weights(logp, old, mask, level=...)  token | sequence | sequence_token
    surrogates   ℓ = clipped_surrogate | cispo_surrogate | sapo_surrogate | vespo_surrogate(vespo_weights)
    masks        ℓ ·= off_policy_sequence_mask · high_entropy_mask · sampler_importance_weights
    kl           ℓ += beta · kl_divergence(logp, ref, estimator) [· r  via bias_corrected_kl]
    aggregation  loss = aggregate(ℓ, mask, loss_type, ...) - entropy_bonus(H, mask, coef)

Example: a new variant — clip-higher, token-mean normaliser, k1 KL — without touching library code::

    import jax.numpy as jnp
    from grpo_jax.losses import aggregate, clipped_surrogate, kl_divergence, log_importance_weights

    def my_loss(logp_BxT, old_BxT, ref_BxT, adv_B, mask_BxT, num_items_in_batch=None):
        valid = mask_BxT > 0
        logp_BxT = jnp.where(valid, logp_BxT, 0.0)   # garbage on padding must not reach the gradient
        old_BxT = jnp.where(valid, old_BxT, 0.0)
        ref_BxT = jnp.where(valid, ref_BxT, 0.0)
        ratio_BxT = jnp.exp(log_importance_weights(logp_BxT, old_BxT))
        l_BxT = clipped_surrogate(ratio_BxT, adv_B[:, None], epsilon_low=0.2, epsilon_high=0.28)
        l_BxT = l_BxT + 0.01 * kl_divergence(logp_BxT, ref_BxT, estimator="k1")
        return aggregate(l_BxT, mask_BxT, loss_type="dapo", num_items_in_batch=num_items_in_batch)

(tests/losses/test_losses.py runs this block.) Micro-batching: every normaliser is global to the optimizer step
(`num_sequences` rows, `num_items_in_batch` active tokens), so summing `compute_loss` over micro-batches (and
devices) gives the full-batch loss and gradient, for every loss_type; see `aggregation` for where TRL's
accumulated numbers differ. Two batch-dependent pieces are computed over the batch passed, as TRL does per
micro-batch: the top-entropy quantile threshold, and the entropy-bonus mean when top_entropy_quantile < 1.
`compute_loss` and the pieces check their arguments' shapes, ranks and dtypes while tracing (`contracts`): a wrong
array from a variant fails naming it and the shape it must have.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.config.loss import (CLIPPED_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, IS_CORRECTION_MODES,
                                    KL_ESTIMATORS, LOSS_TYPES, LossConfig)
from grpo_jax.losses import contracts
from grpo_jax.losses.aggregation import (aggregate, cispo_clip_ratio, clip_ratio_extremes, clip_ratio_metrics,
                                        entropy_bonus)
from grpo_jax.losses.kl import LOW_VAR_KL_BOUND, bias_corrected_kl, kl_divergence
from grpo_jax.losses.masks import (high_entropy_mask, masked_mean, masked_sum, off_policy_sequence_mask, quantile,
                                   sampler_importance_weights, sampler_log_ratio)
from grpo_jax.losses.ratios import (log_importance_weights, sequence_log_importance_weights,
                                    sequence_token_log_importance_weights)
from grpo_jax.losses.surrogates import (cispo_surrogate, clipped_surrogate, sapo_surrogate, vespo_surrogate,
                                        vespo_weights)

__all__ = [
    "LossConfig", "LossAux", "compute_loss",
    "LOSS_TYPES", "CLIPPED_LOSS_TYPES", "IMPORTANCE_SAMPLING_LEVELS", "KL_ESTIMATORS", "IS_CORRECTION_MODES",
    # ratios
    "log_importance_weights", "sequence_log_importance_weights", "sequence_token_log_importance_weights",
    # surrogates
    "clipped_surrogate", "cispo_surrogate", "sapo_surrogate", "vespo_weights", "vespo_surrogate",
    # KL
    "kl_divergence", "bias_corrected_kl", "LOW_VAR_KL_BOUND",
    # masks and masked reductions
    "masked_sum", "masked_mean", "quantile", "high_entropy_mask", "off_policy_sequence_mask", "sampler_log_ratio",
    "sampler_importance_weights",
    # aggregation and metrics
    "aggregate", "entropy_bonus", "clip_ratio_metrics", "clip_ratio_extremes", "cispo_clip_ratio",
]

class LossAux(NamedTuple):
    """Loss metrics (docs/algorithms.md §9, TRL's names): float32 scalars, each a masked *mean* over this batch's
    active tokens, so a token-weighted average over micro-batches is the step's value.

    kl is 0 when beta == 0 (TRL then logs none); it includes the bias correction when that is on, as in TRL.
    clip_ratio_* are 0 unless loss_type is clipped (grpo, bnpo, dr_grpo, dapo, luspo); cispo_clip_ratio is 0
    unless loss_type is cispo; entropy is 0 when no entropies are passed. Sequence-level ratios are weighted
    by tokens here (TRL weights them by sequences). policy_loss is not a mean: it is this batch's loss before the
    entropy bonus (its share of the step's, `aggregate`), which the train step sums into TRL's metric; nor are
    clip_ratio_low_min / clip_ratio_high_max, extremes over this batch's rows that the train step averages over
    micro-batches, as TRL averages its per-micro-batch values.
    """

    kl: jax.Array
    clip_ratio_low: jax.Array     # r < 1 - ε_low and A < 0
    clip_ratio_high: jax.Array    # r > 1 + ε_high and A > 0
    clip_ratio_region: jax.Array  # either of the above
    cispo_clip_ratio: jax.Array   # r > ε_high and A > 0 (cispo)
    entropy: jax.Array            # mean per-token entropy
    policy_loss: jax.Array        # the loss without the entropy bonus (a share of the step's, not a mean)
    clip_ratio_low_min: jax.Array   # the smallest row's clip_ratio_low (a batch's extreme, not a mean)
    clip_ratio_high_max: jax.Array  # the largest row's clip_ratio_high


def compute_loss(per_token_logps: jax.Array, old_per_token_logps: jax.Array | None,
                 ref_per_token_logps: jax.Array | None, advantages: jax.Array, completion_mask: jax.Array, *,
                 config: LossConfig, num_items_in_batch=None, num_sequences=None,
                 entropies: jax.Array | None = None, sampler_per_token_logps: jax.Array | None = None,
                 entropy_coef: jax.Array | None = None) -> tuple[jax.Array, LossAux]:
    """GRPO-family policy loss and its metrics: TRL 1.16 `GRPOTrainer._compute_loss`, number for number.

    log_w at config.importance_sampling_level, r = exp(log_w); ℓ = surrogate of config.loss_type;
    ℓ ·= off-policy mask · top-entropy mask · sampler IS weight; ℓ += beta·kl [·r];
    loss = aggregate(ℓ) - entropy_coef · mean entropy.

    Args:
      per_token_logps: [B, T] under the current params (differentiated).
      old_per_token_logps: [B, T] under the sampling params, or None for on-policy (= sg(logp), r ≡ 1).
      ref_per_token_logps: [B, T] under the reference params; may be None iff config.beta == 0.
      advantages: [B] (per sequence) or [B, T] (per token, e.g. process supervision).
      completion_mask: [B, T], 1 on generated tokens up to and including the first EOS.
      config: LossConfig (static under jit).
      num_items_in_batch, num_sequences: active tokens / rows of the whole optimizer step (see `aggregate`).
      entropies: [B, T] per-token entropies of the current policy; required when top_entropy_quantile < 1 or
        entropy_coef != 0. The entropy bonus differentiates through them only if they carry gradient (pass
        them without stop_gradient for that); the top-entropy mask never does.
      sampler_per_token_logps: [B, T] log-probs the sampler reported (vLLM's in TRL). When given, the
        off-policy mask compares against them (else against `old`) and, if
        config.vllm_importance_sampling_correction, ℓ is weighted by the sampler/learner IS correction
        (vespo folds a token-level correction into φ instead).
      entropy_coef: the entropy bonus's coefficient this step (a traced scalar: config.use_adaptive_entropy's,
        which the train step carries in its state); None: config.entropy_coef.
    Returns:
      (loss scalar float32, LossAux). Positions with mask == 0 get exactly zero gradient whatever they hold.
    """
    contracts.per_token(per_token_logps=per_token_logps, old_per_token_logps=old_per_token_logps,
                        ref_per_token_logps=ref_per_token_logps, completion_mask=completion_mask, entropies=entropies,
                        sampler_per_token_logps=sampler_per_token_logps)
    contracts.floating(per_token_logps=per_token_logps, old_per_token_logps=old_per_token_logps,
                       ref_per_token_logps=ref_per_token_logps, advantages=advantages, entropies=entropies,
                       sampler_per_token_logps=sampler_per_token_logps)
    contracts.advantages(advantages, per_token_logps)
    valid_BxT = completion_mask > 0
    mask_BxT = jnp.asarray(completion_mask, jnp.float32)

    def clean(x_BxT):
        # A `where` on the inputs (not a multiply on the output) keeps inf/NaN at padding out of both the
        # forward value and the backward pass (0 · inf = NaN otherwise).
        return jnp.where(valid_BxT, jnp.asarray(x_BxT, jnp.float32), 0.0)

    sg = jax.lax.stop_gradient
    logp_BxT = clean(per_token_logps)
    old_BxT = sg(logp_BxT) if old_per_token_logps is None else sg(clean(old_per_token_logps))
    advantages = jnp.asarray(advantages, jnp.float32)
    adv_BxT = sg(advantages[:, None] if advantages.ndim == 1 else clean(advantages))  # [B, 1] or [B, T]
    entropies_BxT = None if entropies is None else clean(entropies)
    sampler_BxT = None if sampler_per_token_logps is None else sg(clean(sampler_per_token_logps))
    bonus = config.entropy_coef != 0.0 or config.use_adaptive_entropy  # adaptive: on while its coefficient is 0
    needs_entropy = config.top_entropy_quantile < 1.0 or bonus
    if needs_entropy and entropies_BxT is None:
        raise ValueError(f"loss.top_entropy_quantile={config.top_entropy_quantile} / loss.entropy_coef="
                         f"{config.entropy_coef} need per-token entropies: pass entropies=... to compute_loss")

    log_ratio_BxT = log_importance_weights(logp_BxT, old_BxT)
    log_w = log_importance_weights(logp_BxT, old_BxT, mask_BxT, level=config.importance_sampling_level)
    ratio = jnp.exp(log_w)  # [B, T], or [B, 1] at sequence level
    eps_low, eps_high = config.epsilon, config.epsilon_high_resolved

    is_weights = None
    if sampler_BxT is not None and config.vllm_importance_sampling_correction:
        if config.loss_type == "vespo" and not config.vllm_importance_sampling_mode.startswith("token"):
            raise ValueError(
                f"loss.loss_type='vespo' with loss.vllm_importance_sampling_mode="
                f"{config.vllm_importance_sampling_mode!r}: VESPO needs a token-level correction, use "
                "'token_truncate' or 'token_mask' (or vllm_importance_sampling_correction=False)")
        is_weights = sampler_importance_weights(
            old_BxT, sampler_BxT, mask_BxT, mode=config.vllm_importance_sampling_mode,
            clip_min=config.vllm_importance_sampling_clip_min, clip_max=config.vllm_importance_sampling_clip_max)

    if config.loss_type == "cispo":
        loss_BxT = cispo_surrogate(ratio, adv_BxT, logp_BxT, epsilon_high=eps_high)
    elif config.loss_type in CLIPPED_LOSS_TYPES:
        loss_BxT = clipped_surrogate(ratio, adv_BxT, epsilon_low=eps_low, epsilon_high=eps_high,
                                     delta=config.delta)
    elif config.loss_type == "sapo":
        loss_BxT = sapo_surrogate(ratio, adv_BxT, temperature_pos=config.sapo_temperature_pos,
                                  temperature_neg=config.sapo_temperature_neg)
    elif config.loss_type == "vespo":
        phi = vespo_weights(log_ratio_BxT, adv_BxT, mask_BxT, k_pos=config.vespo_k_pos,
                            lambda_pos=config.vespo_lambda_pos, k_neg=config.vespo_k_neg,
                            lambda_neg=config.vespo_lambda_neg,
                            log_is_correction_BxT=None if is_weights is None else jnp.log(is_weights))
        loss_BxT = vespo_surrogate(phi, adv_BxT, logp_BxT)
    else:
        raise ValueError(f"loss.loss_type={config.loss_type!r} is not supported: choose one of {LOSS_TYPES}")

    if config.off_policy_mask_threshold is not None:
        reference_BxT = old_BxT if sampler_BxT is None else sampler_BxT
        loss_BxT = loss_BxT * off_policy_sequence_mask(adv_BxT, logp_BxT, reference_BxT, mask_BxT,
                                                       threshold=config.off_policy_mask_threshold)
    entropy_mask_BxT = None
    if config.top_entropy_quantile < 1.0:
        entropy_mask_BxT = high_entropy_mask(entropies_BxT, mask_BxT, top_quantile=config.top_entropy_quantile)
        loss_BxT = loss_BxT * entropy_mask_BxT
    if is_weights is not None and config.loss_type != "vespo":
        loss_BxT = loss_BxT * is_weights

    kl_metric = jnp.zeros((), jnp.float32)
    beta = config.resolved_beta
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError(f"loss.beta={beta} needs ref_per_token_logps: pass them or set loss.beta=0")
        kl_BxT = kl_divergence(logp_BxT, sg(clean(ref_per_token_logps)), estimator=config.kl_estimator)
        if config.use_bias_correction_kl:
            kl_BxT = bias_corrected_kl(kl_BxT, ratio)
        loss_BxT = loss_BxT + beta * kl_BxT
        kl_metric = sg(masked_mean(kl_BxT, mask_BxT))

    loss = aggregate(loss_BxT, mask_BxT, loss_type=config.loss_type,
                     max_completion_length=config.max_completion_length,
                     num_items_in_batch=num_items_in_batch, num_sequences=num_sequences)
    policy_loss = sg(loss)
    if bonus:
        coef = config.entropy_coef if entropy_coef is None else entropy_coef
        loss = loss - entropy_bonus(entropies_BxT, mask_BxT, coef=coef,
                                    entropy_mask_BxT=entropy_mask_BxT, num_items_in_batch=num_items_in_batch)

    zero = jnp.zeros((), jnp.float32)
    low = high = region = cispo = low_min = high_max = zero
    if config.loss_type in CLIPPED_LOSS_TYPES:
        low, high, region = clip_ratio_metrics(ratio, adv_BxT, mask_BxT, epsilon_low=eps_low,
                                               epsilon_high=eps_high)
        low_min, high_max = clip_ratio_extremes(ratio, adv_BxT, mask_BxT, epsilon_low=eps_low,
                                                epsilon_high=eps_high)
    elif config.loss_type == "cispo":
        cispo = cispo_clip_ratio(ratio, adv_BxT, mask_BxT, epsilon_high=eps_high)
    entropy = zero if entropies_BxT is None else sg(masked_mean(entropies_BxT, mask_BxT))
    return loss, LossAux(kl=kl_metric, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_region=region,
                         cispo_clip_ratio=cispo, entropy=entropy, policy_loss=policy_loss,
                         clip_ratio_low_min=low_min, clip_ratio_high_max=high_max)
