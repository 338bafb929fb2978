"""Run configuration: nested frozen dataclasses, YAML files and dotted command-line overrides.

Each section validates itself in `__post_init__` with a message that names the field and the fix; the root
`Config` checks what spans sections (batch geometry). Option names follow TRL's `GRPOConfig` where the concept
exists. Sections owned by a maths module (`ModelConfig`, `SamplingConfig`, `LossConfig`) live there.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from grpo_jax import trl_keys
from grpo_jax.advantages import MULTI_OBJECTIVE_AGGREGATIONS
from grpo_jax.cpu import HOST_ALLOCATORS
from grpo_jax.distributed import DistributedConfig
from grpo_jax.losses import LossConfig
from grpo_jax.models import ModelConfig
from grpo_jax.models.configuration import check
from grpo_jax.reference import RefSyncConfig
from grpo_jax.reporting import REPORT_TO
from grpo_jax.rewards import SOFT_OVERLONG, resolve_reward_fn
from grpo_jax.sampling import SamplingConfig

TASK_REWARDS = ("grpo_jax.task:char_accuracy",)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "process")


def _check_importable(field: str, paths: tuple[str, ...]) -> None:
    """Imports every reward path now, so a typo fails before any compilation (a reward model folder is loaded
    at build, `grpo_jax.reward_model`)."""
    from grpo_jax.reward_model import is_reward_model

    for path in paths:
        try:
            if not is_reward_model(path):
                resolve_reward_fn(path)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from e


def _check_data_file(key: str, path: str | None) -> None:
    """A path that names a data file (not a glob, folder or dataset id) must exist: known before anything loads."""
    if path is not None and Path(path).suffix.lower() in (".jsonl", ".json", ".parquet", ".csv") \
            and not any(c in path for c in "*?[") and not Path(path).exists():
        raise ValueError(f"{key}={path!r} does not exist: point it at a JSONL, JSON, Parquet or CSV file (or a glob, a "
                         "save_to_disk folder, a cached dataset id)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from: a file, folder or cached dataset (`grpo_jax.sources`), or the embedded synthetic
    task when `path` is None."""

    path: str | None = None  # JSONL/JSON/Parquet/CSV file or glob, save_to_disk folder, or cached dataset id
    split: str = "train"  # the split of a save_to_disk DatasetDict or a cached dataset id
    config_name: str | None = None  # a cached dataset's configuration (datasets' `name`)
    tokenizer_path: str | None = None  # Hugging Face tokenizer folder; None: model.path's, else the built-in one
    task: str = "reverse"  # embedded task when path is None: reverse, sort, add
    task_min_len: int = 3
    task_max_len: int = 4
    task_num_train: int = 2000
    max_prompt_length: int | None = None  # left-padded (static shapes) to this; None: the data's longest prompt
    truncation: str = "left"  # left: keep the last tokens (warned once); error: refuse long prompts

    def __post_init__(self):
        check(self.task in ("reverse", "sort", "add"),
               f"data.task={self.task!r} is unknown: use reverse, sort or add (or set data.path to a JSONL file)")
        check(1 <= self.task_min_len <= self.task_max_len,
               f"data.task_min_len={self.task_min_len}, data.task_max_len={self.task_max_len}: "
               "need 1 <= task_min_len <= task_max_len")
        check(self.task_num_train >= 1, f"data.task_num_train={self.task_num_train} must be >= 1")
        check(self.max_prompt_length is None or self.max_prompt_length >= 1,
              f"data.max_prompt_length={self.max_prompt_length} must be >= 1, or null (fit the data)")
        check(self.truncation in ("left", "error"),
               f"data.truncation={self.truncation!r}: use 'left' (truncate and count) or 'error'")
        _check_data_file("data.path", self.path)
        if self.tokenizer_path is not None:
            check(Path(self.tokenizer_path).is_dir(),
                   f"data.tokenizer_path={self.tokenizer_path!r} is not a folder: point it at a saved tokenizer")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward functions by import path `module:function`, TRL's `fn(prompts, completions, **columns)`."""

    functions: tuple[str, ...] = TASK_REWARDS
    weights: tuple[float, ...] | None = None  # TRL's reward_weights; None: all 1
    soft_punish_cache: int = 0  # DAPO L_cache in tokens for grpo_jax.rewards:soft_overlong_punishment

    def __post_init__(self):
        check(len(self.functions) >= 1, "reward.functions is empty: list at least one 'module:function'")
        _check_importable("reward.functions", self.functions)
        check(self.soft_punish_cache >= 0, f"reward.soft_punish_cache={self.soft_punish_cache} must be >= 0")
        listed = SOFT_OVERLONG in self.functions
        check(listed == (self.soft_punish_cache > 0),
               f"reward.soft_punish_cache={self.soft_punish_cache} and reward.functions "
               f"{'lists' if listed else 'does not list'} {SOFT_OVERLONG}: the soft overlong punishment needs "
               "both (a cache > 0 and the function listed) or neither")
        if self.weights is not None:
            check(len(self.weights) == len(self.functions),
                   f"reward.weights has {len(self.weights)} entries for {len(self.functions)} reward.functions: "
                   "give one weight per function")
            check(all(math.isfinite(w) for w in self.weights),
                   f"reward.weights={list(self.weights)}: every weight must be a finite number (a NaN or infinite "
                   "weight turns every reward into NaN, i.e. no reward)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """GRPO batch geometry, advantage scaling and the optimizer (TRL names)."""

    num_generations: int = 8  # G completions per prompt
    train_batch_size: int = 64  # rows (completions) per optimizer step, over all devices
    gradient_accumulation_steps: int = 1  # micro-batches inside one optimizer step
    steps_per_generation: int = 1  # optimizer steps per sampling round, on disjoint slices
    num_iterations: int = 1  # mu: passes over each round
    scale_rewards: str = "group"  # group, batch, none
    multi_objective_aggregation: str = "sum_then_normalize"  # or normalize_then_sum (GDPO)
    advantage_estimator: str = "grpo"  # grpo, rloo, reinforce_pp_baseline, process
    mask_truncated_completions: bool = False  # rows without EOS get mask 0 (DAPO overlong filtering)
    use_sampler_logps: bool = False  # hand the sampler's log-probs to the loss (TRL's vLLM log-probs role)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more
    max_num_gen_batches: int = 10  # dynamic sampling: sampling passes per round at most (then fill)
    sync_ref_model: bool = False  # TR-DPO: mix the policy into the reference every ref_model_sync_steps
    ref_model_mixup_alpha: float = 0.6  # 1.0: iterative GRPO (reset the reference to the policy)
    ref_model_sync_steps: int = 512
    learning_rate: float = 5e-4  # the embedded random-init model; real checkpoints want ~1e-6 (TRL)
    lr_scheduler_type: str = "constant"  # constant, linear, cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    logps_chunk_size: int = 0  # rows per chunk for log-probs; 0: whole micro-batch at once
    share_prompt_prefix: bool = True  # run each group's prompt once in log-prob/update forwards (same numbers)
    packing: bool = False  # log-prob/update forwards over packed groups: no padding tokens run (same numbers)
    ref_param_dtype: str | None = None  # reference params' storage dtype (float32, bfloat16); None: the params'
    offload_ref_params: bool = False  # keep the reference in pinned host memory (copied in for its log-probs)
    max_nonfinite_steps: int = 10  # steps skipped for a non-finite loss/gradient before the run stops

    def __post_init__(self):
        for name in ("num_generations", "train_batch_size", "gradient_accumulation_steps",
                     "steps_per_generation", "num_iterations", "max_nonfinite_steps"):
            check(getattr(self, name) >= 1, f"train.{name}={getattr(self, name)} must be >= 1")
        check(self.num_generations >= 2,
               f"train.num_generations={self.num_generations}: GRPO needs >= 2 completions per prompt")
        check(self.train_batch_size % self.gradient_accumulation_steps == 0,
               f"train.train_batch_size={self.train_batch_size} is not divisible by "
               f"train.gradient_accumulation_steps={self.gradient_accumulation_steps}: change either")
        check(self.generation_batch_size % self.num_generations == 0,
               f"train.train_batch_size * train.steps_per_generation = {self.generation_batch_size} rows per "
               f"round is not divisible by train.num_generations={self.num_generations}: make it a multiple")
        check(self.scale_rewards in ("group", "batch", "none"),
               f"train.scale_rewards={self.scale_rewards!r}: use group, batch or none")
        check(self.multi_objective_aggregation in MULTI_OBJECTIVE_AGGREGATIONS,
               f"train.multi_objective_aggregation={self.multi_objective_aggregation!r}: use "
               + " or ".join(MULTI_OBJECTIVE_AGGREGATIONS))
        check(self.advantage_estimator in ADVANTAGE_ESTIMATORS,
               f"train.advantage_estimator={self.advantage_estimator!r} is unknown: use "
               + ", ".join(ADVANTAGE_ESTIMATORS))
        check(self.advantage_estimator == "grpo" or self.multi_objective_aggregation == "sum_then_normalize",
               f"train.multi_objective_aggregation={self.multi_objective_aggregation!r} only applies to "
               f"train.advantage_estimator='grpo', not {self.advantage_estimator!r}: set it to sum_then_normalize")
        check(self.advantage_estimator == "grpo" or self.scale_rewards == "group",
               f"train.scale_rewards={self.scale_rewards!r} only applies to train.advantage_estimator='grpo': "
               f"{self.advantage_estimator!r} has its own scaling; leave scale_rewards at group")
        check(self.multi_objective_aggregation == "sum_then_normalize" or self.scale_rewards == "group",
               f"train.scale_rewards={self.scale_rewards!r} does not apply to train.multi_objective_aggregation="
               "'normalize_then_sum' (it normalises per function, then over the batch): leave scale_rewards at group")
        check(self.max_num_gen_batches >= 1, f"train.max_num_gen_batches={self.max_num_gen_batches} must be >= 1")
        check(0.0 < self.ref_model_mixup_alpha <= 1.0,
               f"train.ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in (0, 1] (1.0: iterative GRPO)")
        check(self.ref_model_sync_steps >= 1, f"train.ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1")
        for name in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"):
            check(math.isfinite(getattr(self, name)),
                   f"train.{name}={getattr(self, name)} must be a finite number (it would make every update NaN)")
        check(self.learning_rate > 0, f"train.learning_rate={self.learning_rate} must be > 0")
        check(self.lr_scheduler_type in ("constant", "linear", "cosine"),
               f"train.lr_scheduler_type={self.lr_scheduler_type!r}: use constant, linear or cosine")
        check(self.warmup_steps >= 0, f"train.warmup_steps={self.warmup_steps} must be >= 0")
        check(self.max_grad_norm >= 0, f"train.max_grad_norm={self.max_grad_norm} must be >= 0")
        check(self.logps_chunk_size >= 0, f"train.logps_chunk_size={self.logps_chunk_size} must be >= 0")
        check(self.ref_param_dtype in (None, "float32", "bfloat16"),
               f"train.ref_param_dtype={self.ref_param_dtype!r}: use float32, bfloat16 or null (the params' dtype)")

    @property
    def generation_batch_size(self) -> int:
        """Rows sampled per round: one optimizer step's batch per step of the round."""
        return self.train_batch_size * self.steps_per_generation

    @property
    def prompts_per_round(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def ref_sync(self) -> RefSyncConfig:
        """The reference-update options `train_step` needs (static)."""
        return RefSyncConfig(self.sync_ref_model, self.ref_model_mixup_alpha, self.ref_model_sync_steps)

    @property
    def needs_old_logps(self) -> bool:
        """Old log-probs differ from the current ones only when a round feeds more than one update."""
        return self.num_iterations > 1 or self.steps_per_generation > 1


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape (data, fsdp, tensor; see grpo_jax/sharding.py): -1 on one axis takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        check(sizes.count(-1) <= 1, "mesh: at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
        check(all(s == -1 or s >= 1 for s in sizes), f"mesh sizes {sizes} must be >= 1 or -1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation before, after and every `steps` steps of training: greedy, and `num_generations`
    sampled completions per prompt for pass@k and maj@n (`grpo_jax.evaluation`)."""

    num_examples: int = 200  # embedded task: held-out prompts generated with another seed
    path: str | None = None  # held-out prompts, any form data.path takes (with the columns the rewards need)
    split: str = "test"  # the split of a save_to_disk DatasetDict or a cached dataset id
    reward_functions: tuple[str, ...] = ("grpo_jax.task:exact_match", "grpo_jax.task:char_accuracy")
    steps: int = 0  # also evaluate every N optimizer steps (TRL's eval_steps); 0: before and after training only
    num_generations: int = 0  # n sampled completions per prompt (pass@k, maj@n); 0: greedy only
    temperature: float = 1.0  # of the sampled completions
    pass_at_k: tuple[int, ...] | None = None  # k of the pass@k reported; None: 1 and num_generations
    answer_extractor: str = "grpo_jax.math_rewards:extract_answer"  # completion text -> answer (or None), for maj@n

    def __post_init__(self):
        _check_data_file("eval.path", self.path)
        _check_importable("eval.reward_functions", self.reward_functions)
        _check_importable("eval.answer_extractor", (self.answer_extractor,))
        check(self.num_examples >= 0, f"eval.num_examples={self.num_examples} must be >= 0")
        check(self.steps >= 0, f"eval.steps={self.steps} must be >= 0 (0: evaluate before and after training only)")
        check(self.num_generations >= 0, f"eval.num_generations={self.num_generations} must be >= 0 (0: greedy only)")
        check(self.temperature > 0, f"eval.temperature={self.temperature} must be > 0")
        if self.pass_at_k is not None:
            check(all(1 <= k <= self.num_generations for k in self.pass_at_k),
                   f"eval.pass_at_k={list(self.pass_at_k)} needs 1 <= k <= eval.num_generations="
                   f"{self.num_generations} for every k: raise eval.num_generations or drop the larger k")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of the pass@k reported (none without sampled completions)."""
        if self.pass_at_k is not None:
            return tuple(sorted(set(self.pass_at_k)))
        return tuple(sorted({1, self.num_generations})) if self.num_generations else ()


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run. Top-level keys follow TRL's TrainingArguments."""

    seed: int = 0
    output_dir: str | None = None  # None: runs/<task>-<timestamp>
    max_steps: int = 5000
    logging_steps: int = 1  # period of the progress bar, console line and completion tables; metrics: every step
    report_to: tuple[str, ...] = ("jsonl",)  # jsonl, tensorboard, wandb (TRL's name); [] logs to none
    log_completions: bool = False  # every logging_steps: the round's completions, rewards and advantages (TRL)
    num_completions_to_print: int | None = None  # of those, rows printed to the console; None: all (TRL)
    save_steps: int = 500  # checkpoint every N optimizer steps (0: only at the end and on SIGTERM/SIGINT)
    save_total_limit: int | None = 2  # checkpoints kept (oldest deleted first); None: keep all
    resume: bool = True  # continue from output_dir's newest checkpoint; false: a non-empty output_dir is an error
    cpu_speedups: bool | None = None  # XLA:CPU speed-ups (grpo_jax.cpu), same numbers; None: on when backend is cpu
    host_allocator: str = "retain"  # with cpu_speedups: retain keeps freed blocks in glibc; system: leave malloc
    compilation_cache_dir: str | None = "~/.cache/grpo_jax/jax"  # JAX's persistent compilation cache; None: off
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        check(self.max_steps >= 1, f"max_steps={self.max_steps} must be >= 1")
        check(self.logging_steps >= 1, f"logging_steps={self.logging_steps} must be >= 1")
        check(all(r in REPORT_TO for r in self.report_to) and len(set(self.report_to)) == len(self.report_to),
               f"report_to={list(self.report_to)}: list each of {', '.join(REPORT_TO)} at most once ([] for none)")
        check(self.num_completions_to_print is None or self.num_completions_to_print >= 0,
               f"num_completions_to_print={self.num_completions_to_print} must be >= 0, or null to print them all")
        check(self.data.path is None or self.data.tokenizer_path is not None or self.model.path is not None,
               "data.path is set but neither data.tokenizer_path nor model.path is: point one of them at a Hugging "
               "Face folder holding the tokenizer")
        check(self.save_steps >= 0, f"save_steps={self.save_steps} must be >= 0 (0: save only at the end)")
        check(self.cpu_speedups is None or isinstance(self.cpu_speedups, bool),
               f"cpu_speedups={self.cpu_speedups!r} must be true, false or null (null: on when jax's backend is cpu)")
        check(self.host_allocator in HOST_ALLOCATORS, f"host_allocator={self.host_allocator!r} is not supported: "
               f"use one of {', '.join(HOST_ALLOCATORS)}")
        check(self.save_total_limit is None or self.save_total_limit >= 1,
               f"save_total_limit={self.save_total_limit} must be >= 1, or null to keep every checkpoint")
        check(self.loss.loss_type != "dr_grpo" or self.loss.max_completion_length
               in (None, self.sampling.max_completion_length),
               f"loss.max_completion_length={self.loss.max_completion_length} differs from "
               f"sampling.max_completion_length={self.sampling.max_completion_length}: leave it unset")
        check(not self.train.sync_ref_model or self.loss.beta != 0.0,
               "train.sync_ref_model=true with loss.beta=0: there is no reference to sync (beta 0 drops the KL "
               "and the reference model); set loss.beta > 0 or train.sync_ref_model=false")
        if self.model.lora.enabled:  # the reference is the base with the adapters off: there is no copy of it
            check(not self.train.sync_ref_model, "train.sync_ref_model=true with model.lora: the reference is the "
                  "frozen base with the adapters off, which TR-DPO cannot mix the policy into; set "
                  "train.sync_ref_model=false, or train without model.lora")
            check(not self.train.offload_ref_params and self.train.ref_param_dtype is None,
                  "train.offload_ref_params / train.ref_param_dtype with model.lora: the reference is the frozen "
                  "base itself, not a copy to offload or cast; leave them at false / null")
            check(self.model.lora.path is None or self.model.path is not None,
                  f"model.lora.path={self.model.lora.path!r} without model.path: adapters need the base model they "
                  "were trained on; set model.path to its Hugging Face folder")
        check(self.reward.soft_punish_cache <= self.sampling.max_completion_length,
               f"reward.soft_punish_cache={self.reward.soft_punish_cache} exceeds sampling.max_completion_length="
               f"{self.sampling.max_completion_length}: the punishment zone must fit inside the completion length")


def to_dict(config: Any) -> dict:
    """A config as plain YAML-able data (tuples become lists)."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x
    return plain(config)


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Checks a YAML value against a field annotation, converting lists to tuples and ints to floats."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is tuple:
        check(isinstance(value, (list, tuple)), f"{where}={value!r} must be a list")
        (item_type, _) = typing.get_args(annotation)
        return tuple(_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        check(isinstance(value, dict), f"{where} must be a mapping of keys, got {value!r}")
        return from_dict(annotation, value, where + ".")
    if annotation is bool:
        check(isinstance(value, bool), f"{where}={value!r} must be true or false")
    elif annotation is int:
        check(isinstance(value, int) and not isinstance(value, bool), f"{where}={value!r} must be an integer")
    elif annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        check(isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}={value!r} must be a number")
        return float(value)
    elif annotation is str:
        check(isinstance(value, str), f"{where}={value!r} must be a string")
    return value


def from_dict(cls: type, values: dict, prefix: str = "") -> Any:
    """The config dataclass `cls` (any section, or `Config`) from plain data, each value checked and converted.

    `prefix` is the section's dotted name ("model.") for error messages; unknown keys are an error.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        hint = trl_keys.suggestions(prefix + unknown[0], names, trl_keys.every_key(to_dict(Config())))
        raise ValueError(f"unknown config key {prefix}{unknown[0]}{hint}: valid keys here are {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in values.items()}
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = tree.setdefault(key, {})
        check(isinstance(node, dict), f"override {dotted}: {key} is not a section")
        tree = node
    tree[keys[-1]] = value


RECIPES = Path(__file__).parent / "recipes"  # the packaged copy of configs/ (a link in a source checkout)


def recipes() -> list[str]:
    """The names of the packaged recipes (`configs/*.yaml`), for `--config NAME`."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def _config_file(path: str) -> Path:
    """`--config`'s file: a YAML path, or the name of a packaged recipe ('dapo' is configs/dapo.yaml)."""
    file = Path(path)
    if file.is_file():
        return file
    recipe = RECIPES / (path if path.endswith((".yaml", ".yml")) else f"{path}.yaml")
    if "/" not in path and recipe.is_file():
        return recipe
    raise ValueError(f"config file {path!r} does not exist: pass an existing YAML file to --config, or the name of "
                     f"a packaged recipe: {', '.join(recipes())}")


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds a `Config` from an optional YAML file (or packaged recipe name, `recipes()`) and `dotted.key=value`
    overrides (values parsed as YAML; TRL's flat names allowed, `grpo_jax.trl_keys`)."""
    values: dict = {}
    if path is not None:
        file = _config_file(path)
        try:
            values = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path!r} is not valid YAML: {e}") from e
        check(isinstance(values, dict), f"config file {path!r} must hold a mapping of keys")
    return from_dict(Config, _with_overrides(trl_keys.translate(values), overrides))


def apply_overrides(config: Config, overrides: typing.Sequence[str]) -> Config:
    """``config`` with `dotted.key=value` overrides (values parsed as YAML), checked as a file's would be."""
    return from_dict(Config, _with_overrides(to_dict(config), overrides))


def _with_overrides(values: dict, overrides: typing.Sequence[str]) -> dict:
    for item in overrides:
        check("=" in item, f"override {item!r} must look like section.key=value, e.g. train.learning_rate=1e-4")
        key, raw = item.split("=", 1)
        _set_dotted(values, trl_keys.dotted(key.strip()), yaml.safe_load(raw) if raw.strip() else None)
    return values
