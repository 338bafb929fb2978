"""TRL's flat names as config keys: `beta: 0.04` in a YAML file or `beta=0.04` on the command line means `loss.beta`.

Every field of TRL 1.16's `GRPOConfig` (its `TrainingArguments` included) and of its `ModelConfig` (the PEFT flags)
is one of: an alias of our dotted key where it means the same (`ALIASES`), converted to ours where TRL writes the
value another way (`CONVERTED`: `report_to=tensorboard` is `[tensorboard]`, `bf16=true` is `model.dtype=bfloat16`),
accepted only at the value that asks for nothing we lack (`OFF`: `use_vllm=false`), refused with the key to use
(`REFUSED`), or ignored with one warning where it only tunes PyTorch's trainer (`IGNORED`). A TRL name and ours for
the same option given different values in one file, or on one command line, is refused with both. Imports no jax.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import warnings
from typing import Any

# TRL 1.16 GRPOConfig / TrainingArguments / ModelConfig name -> our dotted key, where the two mean the same thing
ALIASES = {
    **{name: f"loss.{name}" for name in (
        "beta", "delta", "entropy_coef", "entropy_coef_delta", "entropy_coef_max", "entropy_coef_min",
        "entropy_target", "epsilon", "epsilon_high", "importance_sampling_level", "loss_type",
        "off_policy_mask_threshold", "router_aux_loss_coef", "sapo_temperature_neg", "sapo_temperature_pos",
        "top_entropy_quantile", "use_adaptive_entropy",
        "use_bias_correction_kl", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode")},
    **{name: f"train.{name}" for name in (
        "adam_beta1", "adam_beta2", "adam_epsilon", "gradient_accumulation_steps", "learning_rate",
        "lr_scheduler_type", "mask_truncated_completions", "max_grad_norm", "multi_objective_aggregation",
        "num_generations", "num_iterations", "per_device_train_batch_size", "ref_model_mixup_alpha",
        "ref_model_sync_steps", "sync_ref_model", "train_batch_size", "warmup_ratio", "warmup_steps", "weight_decay")},
    **{name: f"sampling.{name}" for name in (
        "max_completion_length", "max_tool_calling_iterations", "repetition_penalty", "temperature", "top_k",
        "top_p")},
    "reward_weights": "reward.weights",
    "max_prompt_length": "data.max_prompt_length",  # TRL < 1.0
    "model_name_or_path": "model.path",
    "num_train_epochs": "num_train_epochs",
    "lora_r": "model.lora.rank",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "use_rslora": "model.lora.use_rslora",
}
LORA_NAMES = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_rslora")
SKIP = object()  # a converter's answer for TRL's "unset" (None): our default stands


def _unset_or(value, converted):
    return SKIP if value is None else converted


def _names(value) -> list:
    """TRL's string-or-list options as a list ('tensorboard' -> ['tensorboard'])."""
    return [value] if isinstance(value, str) else value


def _report_to(value):
    names = [] if value is None else _names(value)
    if isinstance(names, list) and "all" in names:
        raise ValueError("report_to=all (TRL: every installed tracker): list them, e.g. report_to=[jsonl,tensorboard]")
    return [n for n in names if n != "none"] if isinstance(names, list) else names


def _bool(name: str, value, on, off):
    if value is None:
        return SKIP
    if not isinstance(value, bool):
        raise ValueError(f"config key {name}={value!r} must be true or false")
    return on if value else off


def _dtype(value):
    if value in (None, "float32", "bfloat16"):
        return _unset_or(value, value)
    raise ValueError(f"config key dtype={value!r} (TRL's model dtype): set model.param_dtype (the weights) and "
                     "model.dtype (the compute), each float32 or bfloat16")


# model_init_kwargs entries that only choose how PyTorch loads the weights (grpo_jax reads them into JAX itself)
LOADING_KWARGS = ("device_map", "attn_implementation", "low_cpu_mem_usage", "revision")


def _model_init_kwargs(value):
    """TRL's `model_init_kwargs` (from_pretrained's keywords): its `dtype` (or `torch_dtype`) is model.param_dtype;
    loading options are ignored; anything else is refused."""
    if value is None:
        return SKIP
    if not isinstance(value, dict):
        raise ValueError(f"config key model_init_kwargs={value!r} must be a mapping (TRL's from_pretrained keywords)")
    other = [k for k in value if k not in ("dtype", "torch_dtype", *LOADING_KWARGS)]
    if other:
        raise ValueError(f"config key model_init_kwargs.{other[0]} has no counterpart here (grpo_jax loads the "
                         "weights itself): keep dtype only, and set model.* keys for the rest")
    dtype = value.get("dtype", value.get("torch_dtype"))
    dtype = getattr(dtype, "__name__", None) or str(dtype).removeprefix("torch.") if dtype is not None else None
    return SKIP if dtype in (None, "auto") else _dtype(dtype)


# TRL name -> (our dotted key, value as TRL writes it -> ours, or SKIP)
CONVERTED = {
    "report_to": ("report_to", _report_to),  # a string, or "none", as TRL takes it
    "reward_funcs": ("reward.functions", _names),  # GRPOTrainer's argument: 'module:function' paths
    "scale_rewards": ("train.scale_rewards", lambda v: ("group" if v else "none") if isinstance(v, bool) else v),
    "min_p": ("sampling.min_p", lambda v: _unset_or(v, v)),
    "eval_steps": ("eval.steps", lambda v: _unset_or(v, v)),
    "num_generations_eval": ("eval.num_generations", lambda v: _unset_or(v, v)),
    "lora_target_modules": ("model.lora.target_modules", lambda v: _unset_or(v, v)),
    "vllm_importance_sampling_cap": ("loss.vllm_importance_sampling_clip_max", lambda v: _unset_or(v, v)),
    "bf16": ("model.dtype", lambda v: _bool("bf16", v, "bfloat16", "float32")),
    "gradient_checkpointing": ("model.remat", lambda v: _bool("gradient_checkpointing", v, "full", "none")),
    "activation_checkpointing": ("model.remat", lambda v: _bool("activation_checkpointing", v, "full", "none")),
    "dtype": ("model.param_dtype", _dtype),
    "model_init_kwargs": ("model.param_dtype", _model_init_kwargs),
    "disable_tqdm": ("disable_tqdm", lambda v: _bool("disable_tqdm", v, True, False)),
    # TRL's RepeatSampler tests it for truth: None reads the rows in order, as false does
    "shuffle_dataset": ("data.shuffle", lambda v: False if v is None else _bool("shuffle_dataset", v, True, False)),
    # a dict, or TRL's JSON string of one (its command line)
    "chat_template_kwargs": ("data.chat_template_kwargs", lambda v: v if v is None or isinstance(v, str)
                             else json.dumps(v)),
}

# TRL names whose meaning differs here, or that have no counterpart: what to write instead
REFUSED = {
    "dataset_name": "set data.path (a local file, folder or dataset)",
}

# TRL names accepted only at the values listed (they ask for nothing); any other value is refused with the reason
OFF = {
    "use_vllm": ((False,), "grpo_jax samples with its own jitted sampler: remove the key"),
    "fp16": ((False,), "grpo_jax computes in float32 or bfloat16: set model.dtype=bfloat16"),
    "fsdp": ((None, "", False), "set mesh.fsdp to the number of devices that split the params"),
    "fsdp_config": ((None,), "set mesh.fsdp / mesh.tensor"),
    "deepspeed": ((None,), "grpo_jax shards with its device mesh: set mesh.fsdp / mesh.tensor"),
    "accelerator_config": ((None,), "grpo_jax shards with its device mesh: set mesh.*"),
    "parallelism_config": ((None,), "grpo_jax shards with its device mesh: set mesh.data / mesh.fsdp / mesh.tensor"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "grpo_jax's optimizer is AdamW (optax.adamw): remove the key"),
    "optim_args": ((None,), "grpo_jax's AdamW takes train.adam_beta1/adam_beta2/adam_epsilon/weight_decay"),
    "optim_target_modules": ((None,), "grpo_jax's AdamW updates every trained parameter: remove the key"),
    "lr_scheduler_kwargs": ((None,), "grpo_jax's schedules (train.lr_scheduler_type) take no arguments"),
    "label_smoothing_factor": ((0, 0.0), "GRPO has no labels to smooth: remove the key"),
    "bf16_full_eval": ((False,), "evaluation runs in model.dtype: set model.dtype=bfloat16"),
    "fp16_full_eval": ((False,), "grpo_jax computes in float32 or bfloat16: set model.dtype=bfloat16"),
    "neftune_noise_alpha": ((None,), "grpo_jax adds no embedding noise: remove the key"),
    "auto_find_batch_size": ((False,), "TRL's GRPO refuses it too: set train.train_batch_size"),
    "logging_strategy": (("steps",), "grpo_jax logs every logging_steps optimizer steps: set logging_steps"),
    "push_to_hub": ((False,), "write a Hugging Face folder with `grpo-jax export`, then upload it "
                              "(`huggingface-cli upload`)"),
    "log_completions_hub_repo": ((None,), "completions go to completions.jsonl in output_dir (log_completions)"),
    "load_best_model_at_end": ((False,), "grpo_jax keeps the newest checkpoints (save_total_limit)"),
    "data_seed": ((None,), "the prompt order follows seed"),
    "use_cpu": ((False,), "pass it to GRPOConfig(use_cpu=True) before JAX starts, or run with the environment "
                "variable JAX_PLATFORMS=cpu"),
    "train_sampling_strategy": (("random",), "grpo_jax shuffles the prompts every epoch (by seed)"),
    "trust_remote_code": ((False,), "grpo_jax runs its own model code (the Llama, Gemma, Qwen3-MoE, Cohere 2 and "
                                    "GPT-OSS families)"),
    "vllm_structured_outputs_regex": ((None,), "grpo_jax's sampler has no constrained decoding"),
    "log_unique_prompts": ((False,), "completions.jsonl logs every row (log_completions)"),
    "model_revision": (("main",), "model.path is a local folder: download the revision first"),
    "use_dora": ((False,), "grpo_jax's adapters are LoRA only (model.lora)"),
    "lora_target_parameters": ((None,), "set model.lora.target_modules"),
    "lora_modules_to_save": ((None,), "grpo_jax trains the adapters only; train without model.lora to train all"),
    "lora_task_type": (("CAUSAL_LM",), "grpo_jax trains causal language models"),
    "load_in_8bit": ((False,), "grpo_jax does not quantise: set model.param_dtype=bfloat16 to halve the memory"),
    "load_in_4bit": ((False,), "grpo_jax does not quantise: set model.param_dtype=bfloat16 to halve the memory"),
}

# TRL names that tune PyTorch's trainer (loaders, DDP, kernels, the Hub, its logging) and change nothing here
IGNORED = (
    "average_tokens_across_devices", "tf32", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs",
    "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_liger_kernel", "liger_kernel_config",
    "use_cache", "torch_empty_cache_steps", "logging_first_step", "log_on_each_node", "logging_nan_inf_filter",
    "include_num_input_tokens_seen", "log_level", "log_level_replica", "run_name", "project", "trackio_space_id",
    "trackio_bucket_id", "trackio_static_space_id", "eval_strategy", "eval_delay", "per_device_eval_batch_size",
    "prediction_loss_only", "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object",
    "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics", "save_only_model", "save_on_each_node",
    "enable_jit_checkpoint", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
    "hub_revision", "metric_for_best_model", "greater_is_better", "ignore_data_skip",
    "restore_callback_states_from_checkpoint", "full_determinism", "dataloader_drop_last", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns", "label_names",
    "length_column_name", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
    "ddp_static_graph", "ddp_backend", "ddp_timeout", "debug", "skip_memory_metrics", "do_train", "do_eval",
    "do_predict", "local_rank", "cast_lm_head_to_fp32", "ds3_gather_for_generation",
    "pad_to_multiple_of", "cache_implementation", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size", "log_multimodal",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged",
    "attn_implementation", "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage",
)


def _same(a: Any, b: Any) -> bool:
    """Equal values as a file or command line writes them (0 == 0.0; YAML 1.1 reads 1e-6 as a string)."""
    def number(x):
        if isinstance(x, bool) or not isinstance(x, (int, float, str)):
            return None
        try:
            return float(x)
        except ValueError:
            return None
    if a == b:
        return True
    x, y = number(a), number(b)
    return x is not None and y is not None and (x == y or math.isnan(x) and math.isnan(y))


def _target(out: dict, dotted: str, name: str) -> tuple[dict, str]:
    """The dict that holds `dotted`'s leaf in `out` (sections made as needed), and the leaf's name."""
    *sections, leaf = dotted.split(".")
    node = out
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ValueError(f"config key {name} (TRL's name for {dotted}): {section} is not a section")
    return node, leaf


def layer(values: dict) -> dict:
    """One source's values (a file's data, or one command line's) with TRL's names moved to our dotted keys.

    A refused name, or a TRL name and ours (or two TRL names) set to different values, is a ValueError naming
    both; `use_peft` stays at the top level for `resolve`, once every source is merged. Ignored names warn once.
    """
    names = set(ALIASES) | set(CONVERTED) | set(REFUSED) | set(OFF) | set(IGNORED)
    out = copy.deepcopy({k: v for k, v in values.items() if k not in names or k == "report_to"})
    section = values.get("train") if isinstance(values.get("train"), dict) else {}
    for name, ours in (("steps_per_generation", "steps_per_generation"),
                       ("generation_batch_size", "steps_per_generation"),
                       ("per_device_train_batch_size", "train_batch_size"),
                       ("train_batch_size", "per_device_train_batch_size")):
        if name in values and ours in section:  # the two count rows differently: which one was meant is unclear
            raise ValueError(f"config keys {name} (TRL's) and train.{ours} both set the batch geometry: give one")
    for name in [n for n in values if n in REFUSED]:
        raise ValueError(f"config key {name} is TRL's: {REFUSED[name]}")
    for name in [n for n in values if n in OFF and not any(_same(values[n], ok) for ok in OFF[n][0])]:
        raise ValueError(f"config key {name}={values[name]!r} is TRL's: {OFF[name][1]}")
    ignored = [n for n in values if n in IGNORED]
    if ignored:
        # explicit: one line naming the keys, not a line of grpo_jax's source
        warnings.warn_explicit(f"TRL keys ignored (they tune PyTorch's trainer, not this one): {', '.join(ignored)}",
                               UserWarning, "grpo-jax config", 0)
    peft_off = values.get("use_peft") is False  # TRL reads its lora_* flags only with use_peft
    given: dict[str, str] = {}
    for name in [n for n in values if n in ALIASES or n in CONVERTED]:
        if peft_off and name in LORA_NAMES:
            continue
        dotted, convert = CONVERTED.get(name, (ALIASES.get(name), None))
        value = values[name] if convert is None else convert(values[name])
        if value is SKIP:
            continue
        node, leaf = _target(out, dotted, name)
        if dotted != name and leaf in node and not _same(node[leaf], value):
            other = given.get(dotted, dotted)
            shown = values[other] if other in values else node[leaf]
            raise ValueError(f"config keys {name}={values[name]!r} and {other}={shown!r} set the same option "
                             f"({dotted}) to different values: give one")
        node[leaf] = value
        given[dotted] = name
    return out


def _geometry(values: dict) -> None:
    """TRL's `steps_per_generation` (micro-batches per generation) or `generation_batch_size` (rows per generation)
    as our `train.steps_per_generation` (optimizer steps per round), in place; where no exact conversion exists
    (not a whole number of optimizer steps, or rows that depend on the device count) a ValueError says what to set."""
    steps, rows = values.pop("steps_per_generation", None), values.pop("generation_batch_size", None)
    if steps is None and rows is None:
        return
    if steps is not None and rows is not None:
        raise ValueError("config keys steps_per_generation and generation_batch_size (TRL's) cannot both be set: give "
                         "one (TRL refuses both too)")
    train, _ = _target(values, "train.steps_per_generation", "steps_per_generation")
    accumulation = train.get("gradient_accumulation_steps", 1)
    if steps is not None:
        if not isinstance(steps, int) or steps < 1 or steps % accumulation:
            raise ValueError(f"config key steps_per_generation={steps!r} (TRL's: micro-batches per generation) must "
                             f"be a multiple of gradient_accumulation_steps={accumulation}: grpo_jax samples once "
                             "per whole number of optimizer steps (train.steps_per_generation counts those)")
        train["steps_per_generation"] = steps // accumulation
        return
    if train.get("per_device_train_batch_size") is not None:
        raise ValueError(f"config key generation_batch_size={rows!r} with per_device_train_batch_size: its steps "
                         "depend on the device count; set steps_per_generation (micro-batches per generation) instead")
    step_rows = train.get("train_batch_size", 64)
    if not isinstance(rows, int) or rows < 1 or rows % step_rows:
        raise ValueError(f"config key generation_batch_size={rows!r} (TRL's: rows per generation) must be a multiple "
                         f"of train.train_batch_size={step_rows} (the rows of one optimizer step)")
    train["steps_per_generation"] = rows // step_rows


# TRL's generation_kwargs (transformers' GenerationConfig names) -> our sampling keys; the rest is refused
GENERATION_KWARGS = {
    **{name: name for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "num_beams",
                               "length_penalty", "early_stopping")},
    "max_new_tokens": "max_completion_length",
}


def _generation_kwargs(values: dict) -> None:
    """TRL's `generation_kwargs` (a dict, or its JSON string) as our sampling keys, in place: they override the
    options they name, as TRL's update of its generation config does; ``do_sample`` may only be true (TRL's own)."""
    given = values.pop("generation_kwargs", None)
    if isinstance(given, str):  # TRL's command line gives it as JSON
        try:
            given = json.loads(given)
        except json.JSONDecodeError as e:
            raise ValueError(f"config key generation_kwargs={given!r} is not JSON ({e.msg}): give a mapping") from None
    if given is None:
        return
    if not isinstance(given, dict):
        raise ValueError(f"config key generation_kwargs={given!r} must be a mapping of generation options")
    given = dict(given)
    if given.pop("do_sample", True) is not True:
        raise ValueError("config key generation_kwargs do_sample=false would give every completion of a group the "
                         "same tokens (no advantage to learn from): remove it")
    unknown = sorted(set(given) - set(GENERATION_KWARGS))
    if unknown:
        raise ValueError(f"config key generation_kwargs {', '.join(unknown)}: grpo_jax's sampler takes "
                         f"{', '.join(sorted(GENERATION_KWARGS))} (or do_sample=true) there; remove the others")
    sampling, _ = _target(values, "sampling.temperature", "generation_kwargs")
    for name, value in given.items():
        sampling[GENERATION_KWARGS[name]] = value


SAVE_STRATEGIES = {"no": 0, "epoch": -1}  # TRL's save_strategy as our save_steps ("steps": save_steps as given)


def _save_strategy(values: dict) -> None:
    """TRL's `save_strategy` as our `save_steps`, in place: "no" is no checkpoint between the steps (0: grpo_jax
    still saves at the end and when a run stops, so that it can resume), "epoch" one an epoch (-1), "steps" every
    `save_steps`."""
    strategy = values.pop("save_strategy", "steps")
    strategy = "no" if strategy is False else strategy  # YAML 1.1 reads a bare no as false
    if strategy == "steps":
        return
    if strategy not in SAVE_STRATEGIES:
        raise ValueError(f"config key save_strategy={strategy!r} is TRL's: use no, epoch or steps (grpo_jax keeps the "
                         "newest checkpoints, not the best: save_total_limit)")
    values["save_steps"] = SAVE_STRATEGIES[strategy]


def resolve(values: dict) -> dict:
    """Merged values with TRL's batch geometry (`_geometry`), `use_peft` and `disable_dropout` applied: use_peft true
    turns on LoRA with TRL's rank 16, alpha 32 and dropout 0.05 unless given (`lora_r`, `model.lora.rank`, ...);
    false refuses adapters given another way. disable_dropout true zeroes the adapters' dropout, as TRL's
    `disable_dropout_in_model` zeroes every ``nn.Dropout`` of the PEFT model (grpo_jax's models have no other)."""
    _geometry(values)
    _save_strategy(values)
    _generation_kwargs(values)
    disable_dropout = values.pop("disable_dropout", False)
    if not isinstance(disable_dropout, bool):
        raise ValueError(f"config key disable_dropout={disable_dropout!r} must be true or false")
    use_peft = values.pop("use_peft", None)
    if use_peft is not None:
        _peft(values, use_peft)
    if disable_dropout:
        lora, _ = _target(values, "model.lora.dropout", "disable_dropout")
        lora["dropout"] = 0.0
    return values


def _peft(values: dict, use_peft: Any) -> None:
    """TRL's `use_peft` on merged values, in place (`resolve`)."""
    if not isinstance(use_peft, bool):
        raise ValueError(f"config key use_peft={use_peft!r} must be true or false")
    lora, _ = _target(values, "model.lora.rank", "use_peft")
    if use_peft:
        if not lora.get("rank") and lora.get("path") is None:
            lora["rank"] = 16
        lora.setdefault("alpha", 32.0)
        lora.setdefault("dropout", 0.05)  # TRL's ModelConfig.lora_dropout
    elif lora.get("rank") or lora.get("path") is not None:
        raise ValueError(f"use_peft=false with model.lora.rank={lora.get('rank')!r} / model.lora.path="
                         f"{lora.get('path')!r}: drop use_peft=false to train adapters, or the adapter keys")


def translate(values: dict) -> dict:
    """One source's values (a config built from keywords) with TRL's names as our dotted keys (`layer`, `resolve`)."""
    return resolve(layer(values))


def suggestions(unknown: str, valid: list[str], every_key: list[str]) -> str:
    """' (did you mean X?)' for an unknown key: the nearest names of its section, or keys of other sections with
    the same last part ('train.beta' -> 'loss.beta'); '' when nothing is close."""
    prefix, _, leaf = unknown.rpartition(".")
    trl_names = list(ALIASES) + list(CONVERTED) + ["use_peft"]
    near = difflib.get_close_matches(leaf, list(valid) + ([] if prefix else trl_names), n=3, cutoff=0.75)
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
