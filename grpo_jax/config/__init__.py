"""Run configuration: a schema of nested frozen dataclasses, YAML files and dotted command-line overrides.

Importing this package (and building a `Config`) reads no file, imports no user code and no jax: each section checks
its own values (`grpo_jax.config.sections`, `.model`, `.loss`), the root `Config` what spans sections (batch
geometry); what needs the filesystem or the reward modules is checked when the run is built
(`grpo_jax.api.run.check_inputs`). Option names follow TRL's `GRPOConfig` where the concept exists.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from grpo_jax.config import trl_keys
from grpo_jax.config.loss import DEFAULT_BETA, LossConfig
from grpo_jax.config.model import LoRAConfig, ModelConfig
from grpo_jax.config.sections import (HOST_ALLOCATORS, REPORT_TO, DataConfig, DistributedConfig, EvalConfig,
                                      JSONObject, MeshConfig, RefSyncConfig, RewardConfig, SamplingConfig, TrainConfig,
                                      check)

__all__ = ["Config", "DataConfig", "DistributedConfig", "EvalConfig", "LoRAConfig", "LossConfig", "MeshConfig",
           "ModelConfig", "RefSyncConfig", "RewardConfig", "SamplingConfig", "TrainConfig", "apply_overrides",
           "for_run", "from_dict", "load_config", "make_config", "recipes", "resolve_defaults", "to_dict",
           "with_defaults"]

PRETRAINED_LEARNING_RATE = 1e-6  # TRL's default, for model.path's weights
RANDOM_INIT_BETA = 0.1  # the default run's 8 seeds all end >= 0.8 with it; with 0.04 one ends at 0.56 (RESULTS.md)
RANDOM_INIT_LEARNING_RATE = 5e-4  # the embedded tasks' random 64-wide model learns in a few hundred steps with it


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run. Top-level keys follow TRL's TrainingArguments."""

    seed: int = 0
    output_dir: str | None = None  # None: runs/<task>-<timestamp>
    max_steps: int = 5000  # optimizer steps; -1 with num_train_epochs: that many passes over the prompts (TRL)
    num_train_epochs: float | None = None  # TRL's: with max_steps -1, the steps of this many passes (`for_run`)
    disable_tqdm: bool = False  # TRL's: no progress bar (the console line every logging_steps instead; --no-progress)
    logging_steps: int = 1  # period of the progress bar, console line and completion tables; metrics: every step
    report_to: tuple[str, ...] = ("jsonl",)  # jsonl, tensorboard, wandb (TRL's name); [] logs to none
    log_completions: bool = False  # every logging_steps: the round's completions, rewards and advantages (TRL)
    num_completions_to_print: int | None = None  # of those, rows printed to the console; None: all (TRL)
    # checkpoint every N optimizer steps (0: only at the end and on SIGTERM/SIGINT; -1: once an epoch, `for_run`)
    save_steps: int = 500
    save_total_limit: int | None = 2  # checkpoints kept (oldest deleted first); None: keep all
    resume: bool = True  # continue from output_dir's newest checkpoint; false: a non-empty output_dir is an error
    resume_from_checkpoint: bool | str | None = None  # TRL's: true / a run folder: continue that run (grpo_jax.io.runs)
    cpu_speedups: bool | None = None  # XLA:CPU speed-ups (grpo_jax.device.cpu), same numbers; None: on when backend is cpu
    host_allocator: str = "retain"  # with cpu_speedups: retain keeps freed blocks in glibc; system: leave malloc
    compilation_cache_dir: str | None = "~/.cache/grpo_jax/jax"  # JAX's persistent compilation cache; None: off
    compile_threads: int | None = None  # programs compiled at once before the first step; None: CPUs / 2, 1 to 4
    tools: tuple[str, ...] = ()  # TRL's tools: 'module:function' the policy may call between turns
    environment_factory: str | dict | None = None  # TRL's: 'module:Class', one per rollout, or {name: 'module:Class'}
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
        check(0 <= self.seed < 2**63, f"seed={self.seed} must be in [0, 2**63) (numpy's generators take no negative "
              "seed)")
        check(self.max_steps >= 1 or (self.max_steps == -1 and self.num_train_epochs is not None),
              f"max_steps={self.max_steps} must be >= 1 (-1 only with num_train_epochs, as in TRL)")
        check(self.num_train_epochs is None or self.num_train_epochs > 0,
              f"num_train_epochs={self.num_train_epochs} must be > 0, or null (max_steps counts the steps)")
        check(self.logging_steps >= 1, f"logging_steps={self.logging_steps} must be >= 1")
        check(self.compile_threads is None or self.compile_threads >= 1,
              f"compile_threads={self.compile_threads} must be >= 1, or null (half the CPUs, 1 to 4)")
        check(all(r in REPORT_TO for r in self.report_to) and len(set(self.report_to)) == len(self.report_to),
               f"report_to={list(self.report_to)}: list each of {', '.join(REPORT_TO)} at most once ([] for none)")
        check(self.num_completions_to_print is None or self.num_completions_to_print >= 0,
               f"num_completions_to_print={self.num_completions_to_print} must be >= 0, or null to print them all")
        check(self.data.path is None or self.data.tokenizer_path is not None or self.model.path is not None,
               "data.path is set but neither data.tokenizer_path nor model.path is: point one of them at a Hugging "
               "Face folder holding the tokenizer")
        check(self.resume_from_checkpoint is None or isinstance(self.resume_from_checkpoint, (bool, str)),
              f"resume_from_checkpoint={self.resume_from_checkpoint!r}: give true (the newest run of this config, or "
              "output_dir's) or a run folder")
        check(self.save_steps >= -1, f"save_steps={self.save_steps} must be >= 0 (0: save only at the end; -1: once "
              "an epoch)")
        check(self.cpu_speedups is None or isinstance(self.cpu_speedups, bool),
               f"cpu_speedups={self.cpu_speedups!r} must be true, false or null (null: on when jax's backend is cpu)")
        check(self.host_allocator in HOST_ALLOCATORS, f"host_allocator={self.host_allocator!r} is not supported: "
               f"use one of {', '.join(HOST_ALLOCATORS)}")
        check(all(isinstance(t, str) and ":" in t for t in self.tools),
              f"tools={list(self.tools)}: list each tool as 'module:function'")
        factories = self.environment_factory
        check(factories is None or (isinstance(factories, str) and ":" in factories) or (isinstance(factories, dict)
              and factories and all(isinstance(v, str) and ":" in v for v in factories.values())),
            f"environment_factory={factories!r}: give 'module:Class', or a mapping of environment names (a row's "
            "'environment' column) to 'module:Class'")
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
        if self.sampling.num_beams > 1:  # a beam search is one static program, of one turn a row
            check(not self.tools and self.environment_factory is None,
                  f"sampling.num_beams={self.sampling.num_beams} with tools or an environment: a beam search "
                  "decodes one turn a row; set sampling.num_beams=1")
            check(not self.model.routing_replay, f"sampling.num_beams={self.sampling.num_beams} with "
                  "model.routing_replay: a beam search keeps no experts to replay; set one of them off")
            check(not self.sampling.max_batch_rows, f"sampling.max_batch_rows={self.sampling.max_batch_rows} with "
                  f"sampling.num_beams={self.sampling.num_beams}: a beam search decodes every row at once; leave "
                  "max_batch_rows at 0 or null")
        check(self.reward.soft_punish_cache <= self.sampling.max_completion_length,
               f"reward.soft_punish_cache={self.reward.soft_punish_cache} exceeds sampling.max_completion_length="
               f"{self.sampling.max_completion_length}: the punishment zone must fit inside the completion length")


def resolve_defaults(config: Config, saved: dict | None = None) -> Config:
    """`config` with the defaults that depend on other keys filled in, as config.yaml and checkpoints record them: a
    null train.learning_rate is a resumed run's (`saved`: its config as plain data), else 1e-6 with model.path (TRL's)
    and 5e-4 for a random model; a null loss.beta likewise the resumed run's, else 0.04 with model.path
    (DeepSeekMath's) and 0.1 for a random model (whose random reference holds the default run together)."""
    random_model = config.model.path is None

    def resolve(section: str, key: str, random_init: float, pretrained: float):
        value = getattr(getattr(config, section), key)
        if value is None:
            value = ((saved or {}).get(section) or {}).get(key)
        return float(random_init if random_model else pretrained) if value is None else float(value)

    return dataclasses.replace(
        config, train=dataclasses.replace(config.train, learning_rate=resolve(
            "train", "learning_rate", RANDOM_INIT_LEARNING_RATE, PRETRAINED_LEARNING_RATE)),
        loss=dataclasses.replace(config.loss, beta=resolve("loss", "beta", RANDOM_INIT_BETA, DEFAULT_BETA)))


def for_run(config: Config, *, row_devices: int, num_prompts: int | None) -> Config:
    """`config` with TRL's run-dependent options turned into ours once the run is built: `per_device_train_batch_size`
    as `train.train_batch_size` (x `row_devices`, the devices the rows are split over, x gradient accumulation),
    `max_steps=-1` as the steps of `num_train_epochs` passes over `num_prompts` prompts (TRL's count: whole rounds
    per pass x optimizer steps per round), `save_steps=-1` as the steps of one such pass, and `train.warmup_ratio` as
    `train.warmup_steps` (ceil of ratio x steps, transformers' `get_warmup_steps`)."""
    tc = config.train
    if tc.per_device_train_batch_size is not None:
        rows = tc.per_device_train_batch_size * row_devices * tc.gradient_accumulation_steps
        try:
            tc = dataclasses.replace(tc, train_batch_size=rows, per_device_train_batch_size=None)
        except ValueError as e:
            raise ValueError(f"per_device_train_batch_size={config.train.per_device_train_batch_size} x {row_devices} "
                             f"devices x gradient_accumulation_steps={tc.gradient_accumulation_steps} = {rows} rows "
                             f"per step: {e}") from e
    max_steps, save_steps = config.max_steps, config.save_steps
    if max_steps == -1 or save_steps == -1:
        what = "max_steps=-1 with num_train_epochs" if max_steps == -1 else "save_steps=-1 (save_strategy=epoch)"
        check(num_prompts is not None, f"{what} needs a dataset of known size: set "
              f"{'max_steps' if max_steps == -1 else 'save_steps'}")
        rounds = num_prompts // tc.prompts_per_round  # TRL's sampler drops the last partial generation batch
        check(rounds >= 1, f"{what} with {num_prompts} prompts: a round takes {tc.prompts_per_round} "
              "prompts, so an epoch holds no whole round; set max_steps or use more prompts")
        if max_steps == -1:
            max_steps = max(1, math.ceil(config.num_train_epochs * rounds * tc.steps_per_round))
        if save_steps == -1:
            save_steps = rounds * tc.steps_per_round
    if tc.warmup_ratio and not tc.warmup_steps:
        tc = dataclasses.replace(tc, warmup_steps=math.ceil(max_steps * tc.warmup_ratio))
    return dataclasses.replace(config, train=tc, max_steps=max_steps, save_steps=save_steps)


def to_dict(config: Any) -> dict:
    """A config as plain YAML-able data (tuples become lists)."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x
    return plain(config)


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested dicts (a config as `to_dict` gives it) as one dict of dotted keys: {"train.learning_rate": ...}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def with_defaults(saved: dict, defaults: dict | None = None) -> dict:
    """A saved config (plain data) with the keys added since it was written at their defaults, which is what it ran
    with: a resume compares like with like (`checkpoint.check_compatible`)."""
    defaults = to_dict(Config()) if defaults is None else defaults
    out = dict(saved)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = with_defaults(out[key], value)
    return out


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
    if annotation is JSONObject:
        check(isinstance(value, (dict, str)), f"{where}={value!r} must be a mapping (or its JSON text)")
        if isinstance(value, dict):
            return json.dumps(value)
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where}={value!r} is not JSON ({e}): write a JSON object, e.g. "
                             "'{\"enable_thinking\": false}'") from None
        check(isinstance(parsed, dict), f"{where}={value!r} must be a JSON object, e.g. '{{\"enable_thinking\": "
              "false}'")
        return value
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


RECIPES = Path(__file__).parent.parent / "recipes"  # the packaged copy of configs/ (a link in a source checkout)


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


# the keys of a file that name files or folders: relative ones are read from the working directory, else from the
# file's own folder (a recipe's shipped example data, from any folder)
PATH_KEYS = ("model.path", "model.lora.path", "data.path", "data.tokenizer_path", "eval.path")


def _beside(values: dict, folder: Path) -> dict:
    """A file's `values` with each relative `PATH_KEYS` entry that is missing from the working directory but present
    in `folder` (the file's) made to point there."""
    for dotted in PATH_KEYS:
        *sections, leaf = dotted.split(".")
        node = values
        for name in sections:
            node = node.get(name) if isinstance(node, dict) else None
        value = node.get(leaf) if isinstance(node, dict) else None
        if isinstance(value, str) and not Path(value).is_absolute() and not Path(value).exists() \
                and (folder / value).exists():
            node[leaf] = str(folder / value)
    return values


def _needs(path: str, values: dict) -> None:
    """A recipe that trains on data with no model or tokenizer given: the one line that says what to set, before
    the checks of `Config` that do not know it came from a recipe."""
    data = values.get("data") or {}
    model = values.get("model") or {}
    if data.get("path") and not data.get("tokenizer_path") and not model.get("path") and model.get("init") != "random":
        raise ValueError(f"recipe {path!r} trains a pretrained model on {data['path']}: add model.path=<a Hugging Face "
                         "folder> (it gives the tokenizer and weights), e.g. grpo-jax --config "
                         f"{path} model.path=models/Qwen2.5-0.5B-Instruct")


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds a `Config` from an optional YAML file (or packaged recipe name, `recipes()`) and `dotted.key=value`
    overrides (values parsed as YAML; TRL's flat names allowed, `grpo_jax.config.trl_keys`). The command line wins over
    the file; within one of them a TRL name and ours set to different values are refused. A relative path in the
    file that is missing from the working directory is read beside the file (`PATH_KEYS`)."""
    values: dict = {}
    if path is not None:
        file = _config_file(path)
        try:
            values = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path!r} is not valid YAML: {e}") from e
        check(isinstance(values, dict), f"config file {path!r} must hold a mapping of keys")
        values = _beside(values, file.parent.absolute())
    merged = trl_keys.resolve(_merged(trl_keys.layer(values), _override_layer(overrides)))
    if path is not None:
        _needs(path, merged)
    return from_dict(Config, merged)


def make_config(**values: Any) -> Config:
    """A `Config` from keywords, checked as `load_config` checks a file: sections as mappings (or section configs),
    our dotted keys, or TRL's flat names, e.g. `make_config(beta=0.0, train={"learning_rate": 1e-6},
    **{"sampling.temperature": 0.7})`. A key given two ways is a ValueError naming both."""
    tree: dict = {}
    for key, value in values.items():
        if "." not in key:
            tree[key] = to_dict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    for key, value in values.items():
        if "." in key:
            *sections, leaf = key.split(".")
            node = tree
            for name in sections:
                node = node.setdefault(name, {})
                check(isinstance(node, dict), f"config key {key}: {name} is not a section")
            check(leaf not in node, f"config key {key} is given twice (dotted and in its section's mapping): give one")
            node[leaf] = value
    return from_dict(Config, trl_keys.translate(tree))


def apply_overrides(config: Config, overrides: typing.Sequence[str]) -> Config:
    """``config`` with `dotted.key=value` overrides (values parsed as YAML), checked as a file's would be."""
    return from_dict(Config, trl_keys.resolve(_merged(to_dict(config), _override_layer(overrides))))


def _override_layer(overrides: typing.Sequence[str]) -> dict:
    """The command line's `key=value` items as one source's data (a repeated key: the last wins)."""
    values: dict = {}
    for item in overrides:
        check("=" in item, f"override {item!r} must look like section.key=value, e.g. train.learning_rate=1e-4")
        key, raw = item.split("=", 1)
        _set_dotted(values, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return trl_keys.layer(values)


def _merged(base: dict, top: dict) -> dict:
    """`base` with `top`'s keys over it, section by section."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out
