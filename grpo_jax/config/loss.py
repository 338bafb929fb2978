"""`LossConfig`: the policy-loss options, TRL 1.16 `GRPOConfig` names and validation (docs/algorithms.md §3–§7)."""
from __future__ import annotations

import dataclasses
import math

from grpo_jax.config.sections import check_interval

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# The loss types whose per-token surrogate is the PPO clipped one (and whose clip ratios TRL logs).
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# "sequence_token" (GSPO-token) is ours: TRL 1.16 has only token and sequence.
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OFF_POLICY_CORRECTIONS = ("none", "decoupled")
DEFAULT_BETA = 0.04  # DeepSeekMath's KL coefficient


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss options (TRL GRPOConfig names); frozen and hashable, so it can be a static jit argument.

    Defaults are the paper's GRPO (DeepSeekMath), not TRL's: loss_type "grpo" (TRL: "dapo"), beta None meaning 0.04
    (TRL: 0.0; a run resolves None to 0.04 with model.path and 0.1 for a random model, `config.resolve_defaults`),
    use_bias_correction_kl False (TRL: True). Every other default is TRL 1.16's.
    """

    loss_type: str = "grpo"             # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo
    beta: float | None = None           # KL coefficient (None: DEFAULT_BETA); 0 disables the KL and the reference
    epsilon: float = 0.2                # ε_low
    epsilon_high: float | None = None   # None -> epsilon (DAPO clip-higher: 0.28; cispo: the ratio cap, e.g. 5.0)
    delta: float | None = None          # two-sided clipping (INTELLECT-2): cap on the unclipped ratio, > 1 + ε
    importance_sampling_level: str = "token"  # token | sequence (GSPO) | sequence_token (GSPO-token)
    kl_estimator: str = "k3"            # k1 | k2 | k3 | low_var_kl (TRL 1.16 has k3 only)
    use_bias_correction_kl: bool = False  # kl <- kl · r (DeepSeek-V3.2)
    max_completion_length: int | None = None  # dr_grpo's normaliser; the trainer fills it from sampling
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0   # ρ: keep the top-ρ tokens by entropy in the policy term (1.0 = all)
    entropy_coef: float = 0.0           # entropy bonus: loss -= coef · mean entropy
    # Skywork-OR1's adaptive coefficient (TRL's): from entropy_coef, + delta after a step whose entropy is at or
    # below entropy_target, - delta after one above, within [min, max]; applied only while entropy <= target
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2 off-policy sequence mask (None = off)
    # Sampler/learner mismatch correction; applied only when compute_loss gets sampler_per_token_logps (our
    # sampler plays vLLM's role in TRL).
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | ..._mask
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    # mixture-of-experts models: loss += coef * the routers' load-balancing loss (TRL's router_aux_loss_coef); None:
    # the model's own (model.router_aux_loss_coef, config.json's), 0 for a dense model; 0: off
    router_aux_loss_coef: float | None = None
    # Stale rounds (train.max_staleness): none clips against the behaviour policy (the sampling params); decoupled
    # (AReaL's decoupled PPO) clips against the proximal policy (the params at the round's first update) and weights
    # by the proximal/behaviour ratio, shaped by the vllm_importance_sampling_* options (TRL's truncated/masked IS)
    off_policy_correction: str = "none"

    @property
    def resolved_beta(self) -> float:
        """The KL coefficient in use: ``beta``, DEFAULT_BETA where it is None."""
        return DEFAULT_BETA if self.beta is None else self.beta

    def __post_init__(self):
        def choose(field, allowed):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"loss.{field}={value!r} is not supported: choose one of {allowed}")

        choose("loss_type", LOSS_TYPES)
        choose("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)
        choose("kl_estimator", KL_ESTIMATORS)
        choose("vllm_importance_sampling_mode", IS_CORRECTION_MODES)
        choose("off_policy_correction", OFF_POLICY_CORRECTIONS)
        if self.off_policy_correction == "decoupled" and not self.vllm_importance_sampling_correction:
            raise ValueError("loss.off_policy_correction='decoupled' weights by the proximal/behaviour ratio that "
                             "loss.vllm_importance_sampling_* shape: set vllm_importance_sampling_correction=true")
        if self.beta is not None and self.beta < 0:
            raise ValueError(f"loss.beta={self.beta} is negative: use beta >= 0 (0 disables the KL term)")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"loss.{field.name}={value} must be a finite number (it would make every loss NaN or "
                                 "infinite)")
        if self.loss_type in CLIPPED_LOSS_TYPES:  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
            check_interval("loss.epsilon", self.epsilon, "(0, 1)", f"loss_type={self.loss_type} clips the ratio "
                           "to [1 - epsilon, 1 + epsilon_high]; 0.2 is typical")
            if self.epsilon_high is not None:
                check_interval("loss.epsilon_high", self.epsilon_high, "(0, inf)", "the upper clip is 1 + "
                               "epsilon_high; DAPO uses 0.28, null takes epsilon")
        elif self.loss_type == "cispo":
            check_interval("loss.epsilon_high" if self.epsilon_high is not None else "loss.epsilon",
                           self.epsilon_high_resolved, "(0, inf)", "cispo caps the ratio at epsilon_high, or at "
                           "epsilon when it is null; 5.0 is typical")
        check_interval("loss.epsilon", self.epsilon, "[0, inf)", "0.2 is typical")
        if self.delta is not None:
            if self.loss_type not in CLIPPED_LOSS_TYPES:
                raise ValueError(
                    f"loss.delta={self.delta} only applies to the clipped losses {CLIPPED_LOSS_TYPES}, not "
                    f"loss.loss_type={self.loss_type!r}: set delta=None")
            bound = 1.0 + max(self.epsilon, self.epsilon_high_resolved)
            if self.delta <= bound:
                raise ValueError(
                    f"loss.delta={self.delta} must exceed 1 + epsilon / epsilon_high = {bound:g} (it caps the ratio "
                    "above the clip range; at or below it, it cuts into the trust region): raise delta or set None")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"loss.max_completion_length={self.max_completion_length} must be >= 1, or None to take "
                "sampling.max_completion_length")
        for field in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            if getattr(self, field) <= 0:
                raise ValueError(f"loss.{field}={getattr(self, field)} must be > 0")
        if self.use_adaptive_entropy and self.top_entropy_quantile < 1.0:
            raise ValueError(f"loss.use_adaptive_entropy with loss.top_entropy_quantile={self.top_entropy_quantile}: "
                             "grpo_jax's controller measures every token's entropy, TRL's only the kept ones; set "
                             "top_entropy_quantile=1.0 or use_adaptive_entropy=false")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(
                f"loss.top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1.0 keeps every token; "
                "the Beyond-80/20 paper uses 0.2)")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise ValueError(
                f"loss.off_policy_mask_threshold={self.off_policy_mask_threshold} must be >= 0 (a KL bound, e.g. "
                "0.5), or None to disable the off-policy sequence mask")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(
                f"loss.vllm_importance_sampling_clip_min={lo} must be < loss.vllm_importance_sampling_clip_max={hi}")
        if (lo is not None and lo > 1.0) or (hi is not None and hi < 1.0):
            raise ValueError(
                f"loss.vllm_importance_sampling_clip_min={lo} / clip_max={hi} must bracket 1 (a ratio of 1 means "
                "no sampler/learner mismatch and must be kept): use clip_min <= 1 <= clip_max")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("_truncate")
                and lo is None and hi is None):
            raise ValueError(
                f"loss.vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} needs "
                "loss.vllm_importance_sampling_clip_min or loss.vllm_importance_sampling_clip_max: set one (3.0 is "
                "TRL's default cap)")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(f"loss.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (0: off, null: the "
                             "model's own)")

    @property
    def epsilon_high_resolved(self) -> float:
        """ε_high: `epsilon_high`, or `epsilon` when unset (cispo's ratio cap falls back the same way, as in TRL)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
