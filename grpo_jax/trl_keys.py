"""TRL's flat `GRPOConfig` names as config keys: `beta: 0.04` in a YAML file or `beta=0.04` on the command line means
`loss.beta`. Where TRL's option means what ours does the flat name is an alias of our dotted key; where it means
something else (a batch counted per device, a ratio of steps) or has no counterpart here, it is refused with the key
to use instead. Unknown keys get the nearest valid ones suggested. Imports no jax.
"""

from __future__ import annotations

import difflib
from typing import Any

# TRL 1.16 GRPOConfig / TrainingArguments name -> our dotted key, where the two mean the same thing
ALIASES = {
    **{name: f"loss.{name}" for name in (
        "beta", "delta", "entropy_coef", "epsilon", "epsilon_high", "importance_sampling_level", "loss_type",
        "off_policy_mask_threshold", "sapo_temperature_neg", "sapo_temperature_pos", "top_entropy_quantile",
        "use_bias_correction_kl", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode")},
    **{name: f"train.{name}" for name in (
        "adam_beta1", "adam_beta2", "adam_epsilon", "gradient_accumulation_steps", "learning_rate",
        "lr_scheduler_type", "mask_truncated_completions", "max_grad_norm", "multi_objective_aggregation",
        "num_generations", "num_iterations", "ref_model_mixup_alpha", "ref_model_sync_steps", "scale_rewards",
        "steps_per_generation", "sync_ref_model", "warmup_steps", "weight_decay")},
    **{name: f"sampling.{name}" for name in (
        "max_completion_length", "max_tool_calling_iterations", "min_p", "temperature", "top_k", "top_p")},
    "reward_weights": "reward.weights",
    "max_prompt_length": "data.max_prompt_length",
    "model_name_or_path": "model.path",
}

# TRL names whose meaning differs here, or that have no counterpart: what to write instead
REFUSED = {
    "per_device_train_batch_size": "TRL counts it per device and micro-step; grpo_jax's train.train_batch_size "
                                   "counts a whole optimizer step's completions: set train.train_batch_size = "
                                   "per_device_train_batch_size x number of devices x gradient_accumulation_steps",
    "generation_batch_size": "grpo_jax derives it: train.train_batch_size x train.steps_per_generation",
    "num_train_epochs": "grpo_jax runs max_steps optimizer steps: set max_steps",
    "warmup_ratio": "set train.warmup_steps = warmup_ratio x max_steps",
    "bf16": "set model.dtype=bfloat16 (compute) and, for the weights, model.param_dtype",
    "fp16": "grpo_jax computes in float32 or bfloat16: set model.dtype=bfloat16",
    "gradient_checkpointing": "set model.remat=full (or dots)",
    "use_vllm": "grpo_jax samples with its own jitted sampler: remove the key",
    "dataset_name": "set data.path (a local file, folder or dataset)",
    "fsdp": "set mesh.fsdp to the number of devices that split the params",
}


def translate(values: dict) -> dict:
    """`values` (a config's plain data) with its top-level TRL names moved to our dotted keys; a refused name or a
    key given both ways is a ValueError naming it."""
    out = {k: v for k, v in values.items() if k not in ALIASES and k not in REFUSED}
    for name in values:
        if name in REFUSED:
            raise ValueError(f"config key {name} is TRL's: {REFUSED[name]}")
    for name, dotted in ALIASES.items():
        if name not in values:
            continue
        section, _, key = dotted.rpartition(".")
        target = out.setdefault(section, {}) if section else out
        if not isinstance(target, dict):
            raise ValueError(f"config key {name} (TRL's name for {dotted}): {section} is not a section")
        if key in target:
            raise ValueError(f"config keys {name} and {dotted} are the same option (TRL's name and ours): give one")
        target[key] = values[name]
    return out


def dotted(key: str) -> str:
    """A command-line override's key: TRL's flat name as our dotted key; a refused one is a ValueError."""
    if key in REFUSED:
        raise ValueError(f"config key {key} is TRL's: {REFUSED[key]}")
    return ALIASES.get(key, key)


def suggestions(unknown: str, valid: list[str], every_key: list[str]) -> str:
    """' (did you mean X?)' for an unknown key: the nearest names of its section, or keys of other sections with
    the same last part ('train.beta' -> 'loss.beta'); '' when nothing is close."""
    prefix, _, leaf = unknown.rpartition(".")
    near = difflib.get_close_matches(leaf, list(valid) + ([] if prefix else list(ALIASES)), n=3, cutoff=0.75)
    near = [f"{prefix}.{n}" if prefix else n for n in near]
    near += [k for k in every_key if k.rpartition(".")[2] == leaf and k != unknown and k not in near]
    return f" (did you mean {' or '.join(near[:3])}?)" if near else ""


def every_key(config: Any) -> list[str]:
    """The dotted names of every leaf key of a config's plain data."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += [f"{key}.{sub}" for sub in every_key(value)]
        else:
            out.append(key)
    return out
