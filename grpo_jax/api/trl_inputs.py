"""TRL's Python objects as grpo_jax takes them (`grpo_jax.api.trl_api`): a transformers model object or a Hub id in
the local cache as a Hugging Face folder, PEFT's `LoraConfig` as `model.lora`, a tokenizer object as its folder, a
streamed held-out set as its rows, and the reward functions and tools as TRL names and lists them. No jax; torch and
transformers only for the objects that need them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from grpo_jax.config import LoRAConfig

__all__ = ["cached_reward_model", "lora_options", "model_and_adapters", "model_folder", "reward_func_names",
           "tokenizer_folder"]


# PEFT's LoraConfig fields with a model.lora counterpart, and their PEFT defaults (a dict leaves some out)
LORA_KEYS = {"r": ("rank", 8), "lora_alpha": ("alpha", 8), "lora_dropout": ("dropout", 0.0),
             "target_modules": ("target_modules", None), "use_rslora": ("use_rslora", False),
             "init_lora_weights": ("init_lora_weights", True)}
# fields that describe the adapter file or PEFT's runtime, not what is trained: any value does
LORA_IGNORED = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                "inference_mode", "runtime_config"}
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's target_modules=None for every supported model_type


def lora_options(peft_config: Any) -> dict:
    """A `peft.LoraConfig` (or a dict of its fields) as `model.lora` keys, PEFT's defaults where a dict leaves a field
    out. A field grpo_jax cannot honour (DoRA, bias or extra modules trained, per-layer patterns, another task) set
    away from PEFT's default is a ValueError naming it."""
    if isinstance(peft_config, Mapping):
        values, others = dict(peft_config), {k: v for k, v in peft_config.items() if k not in LORA_KEYS}
    elif dataclasses.is_dataclass(peft_config) and type(peft_config).__name__ == "LoraConfig":
        values = {name: getattr(peft_config, name) for name in LORA_KEYS}
        others = {f.name: getattr(peft_config, f.name) for f in dataclasses.fields(peft_config)
                  if f.name not in LORA_KEYS and getattr(peft_config, f.name) != _default(f)}
    else:
        kind = " (prompt-learning)" if getattr(peft_config, "is_prompt_learning", False) else ""
        raise ValueError(f"peft_config is a {type(peft_config).__name__}{kind}: grpo_jax trains LoRA adapters only; "
                         "pass a peft.LoraConfig or a dict of its fields (r, lora_alpha, target_modules, ...)")
    task = str(others.pop("task_type", None) or "CAUSAL_LM")
    if not task.endswith("CAUSAL_LM"):
        raise ValueError(f"peft_config.task_type={task!r}: grpo_jax trains causal language models; use CAUSAL_LM")
    for name, value in others.items():
        if name not in LORA_IGNORED:
            raise ValueError(f"peft_config.{name}={value!r} has no counterpart in grpo_jax's LoRA (it honours "
                             f"{', '.join(LORA_KEYS)}): leave it at PEFT's default")
    out = {ours: values.get(theirs, default) for theirs, (ours, default) in LORA_KEYS.items()}
    targets = out["target_modules"]
    if targets is None:
        out["target_modules"] = PEFT_DEFAULT_TARGETS
    elif not isinstance(targets, str):  # PEFT keeps a list as a set: our order, not the set's
        out["target_modules"] = tuple(sorted(targets))
    return out


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


MODEL_CACHE = Path("~/.cache/grpo_jax/models")  # model objects saved as folders, by the hash of their weights


def _hash(model: Any) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_128(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _cached(folder: Path, marker: str, write: Callable[[Path], None]) -> str:
    """`folder`, written by `write(partial)` unless it already holds `marker` (the same weights, saved before)."""
    if not (folder / marker).is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write(partial)
        if folder.exists():  # another process saved the same weights meanwhile
            shutil.rmtree(partial)
        else:
            partial.replace(folder)
    return str(folder)


def _save_tokenizer(model: Any, folder: Path) -> None:
    """The tokenizer of the model's `name_or_path` beside it, when one is there (else processing_class gives it, or
    the run says it is missing)."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    try:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(name, local_files_only=True).save_pretrained(folder)
    except Exception:  # noqa: BLE001 - no tokenizer beside it
        pass


def saved_model_object(model: Any, cache: str | os.PathLike | None = None) -> str:
    """A transformers model object (TRL's `model=AutoModelForCausalLM...`) as a Hugging Face folder, as reward model
    objects are converted: saved with its tokenizer (from its `name_or_path`, when one is there) to
    `cache/<xxh3 of its config and weights>`, so the same weights give the same folder and a rerun resumes."""
    def write(partial: Path) -> None:
        model.save_pretrained(partial)
        _save_tokenizer(model, partial)

    return _cached(Path(MODEL_CACHE if cache is None else cache).expanduser() / _hash(model), "config.json", write)


def is_peft_model(model: Any) -> bool:
    """A `peft.PeftModel` (told without importing peft: its adapter configs and its wrapped base)."""
    return isinstance(getattr(model, "peft_config", None), Mapping) and hasattr(model, "get_base_model")


def saved_peft_model(model: Any, cache: str | os.PathLike | None = None) -> tuple[str, str, dict]:
    """A `peft.PeftModel` (TRL's `model=get_peft_model(...)`) as (base model folder, PEFT adapter folder, its
    `model.lora` keys): the base's weights under their transformers names (PEFT's `base_layer` unwrapped, the
    adapters left out) with its config and tokenizer, and the adapters as `save_pretrained` writes them, both under
    `cache/<xxh3 of the config and every weight>`. One LoRA adapter only (PEFT's "default")."""
    if list(model.peft_config) != ["default"]:
        raise ValueError(f"model is a PeftModel with adapters {list(model.peft_config)}: grpo_jax trains one LoRA "
                         "adapter; pass a model with only PEFT's 'default' adapter")
    try:
        options = lora_options(model.peft_config["default"])
    except ValueError as e:
        raise ValueError(f"model's peft_config: {e}") from e
    base = model.get_base_model()
    folder = Path(MODEL_CACHE if cache is None else cache).expanduser() / _hash(model)

    def write_base(partial: Path) -> None:
        from safetensors.torch import save_file

        tied = getattr(base.config, "tie_word_embeddings", False)
        weights = {name.replace(".base_layer.", "."): tensor.detach().cpu().contiguous()
                   for name, tensor in base.state_dict().items()
                   if ".lora_" not in name and not (tied and name == "lm_head.weight")}
        partial.mkdir(parents=True)
        save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
        base.config.save_pretrained(partial)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(partial)
        _save_tokenizer(base, partial)

    base_folder = _cached(folder.with_name(folder.name + "-base"), "config.json", write_base)
    adapter_folder = _cached(folder.with_name(folder.name + "-adapter"), "adapter_config.json", model.save_pretrained)
    return base_folder, adapter_folder, options


def model_and_adapters(model: Any, peft_config: Any, *, beta: float):
    """TRL's `model` and `peft_config` as (model folder, `LoRAConfig` or None): a `PeftModel` trains from its own
    adapters (`saved_peft_model`), a `peft_config` adds fresh ones (`lora_options`)."""
    if not is_peft_model(model):
        if peft_config is None:
            return model_folder(model), None
        try:
            return model_folder(model), LoRAConfig(**lora_options(peft_config))
        except ValueError as e:
            raise ValueError(f"peft_config: {e}") from e
    if peft_config is not None:  # TRL's words
        raise ValueError("You passed a `PeftModel` instance together with a `peft_config` to the trainer. Please first "
                         "merge and unload the existing adapter, save the resulting base model, and then pass that "
                         "base model along with the new `peft_config` to the trainer.")
    if beta != 0.0 and any(t.any() for n, t in model.named_parameters() if ".lora_B." in n):
        # TRL's reference is a frozen copy of the adapters as given; grpo_jax's is the base (adapters off), the same
        # policy only while B is zero
        raise ValueError("model is a PeftModel with trained adapters and beta != 0: grpo_jax's reference is the base "
                         "model, not the adapters as given; merge them into the base and pass a peft_config, or set "
                         "beta=0")
    path, adapters, options = saved_peft_model(model)
    return path, LoRAConfig(**options, path=adapters)


def model_folder(model: Any) -> str:
    """TRL's `model` as a folder: a local Hugging Face model folder, a model id already in the local Hugging Face
    cache (never downloaded), or a transformers model object (`saved_model_object`)."""
    if hasattr(model, "config") and hasattr(model, "state_dict") and hasattr(model, "save_pretrained"):
        return saved_model_object(model)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model is a {type(model).__name__}: grpo_jax reads Hugging Face folders into JAX itself; "
                         "pass a folder, a cached model id or a transformers model object")
    path = os.fspath(model)
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id=path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - not cached, or not a repo id: the same advice
        raise ValueError(f"model={path!r} is neither a folder nor a model id in the local Hugging Face cache: "
                         f"download it first (`hf download {path} --local-dir models/NAME`) and pass the folder") from e


def cached_reward_model(spec: Any) -> Any:
    """A reward function as TRL takes it, with a Hub id (`org/name`, no ':') of a reward model in the local Hugging
    Face cache as its snapshot folder (never downloaded); anything else as it is."""
    if not isinstance(spec, str) or ":" in spec or os.path.exists(spec) or spec.count("/") != 1:
        return spec
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id=spec, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - not cached, or not a repo id: the same advice
        raise ValueError(f"reward_funcs entry {spec!r} is neither a 'module:function', a reward model folder nor a "
                         f"model id in the local Hugging Face cache: download it first (`hf download {spec} "
                         "--local-dir models/NAME`) and pass the folder") from e


def tokenizer_folder(processing_class: Any) -> str:
    """TRL's `processing_class` as a folder: a path, or a tokenizer loaded from a folder, which is read again."""
    if isinstance(processing_class, (str, os.PathLike)):
        return os.fspath(processing_class)
    folder = getattr(processing_class, "name_or_path", None)
    if not folder or not os.path.isdir(folder):
        raise ValueError(f"processing_class is a {type(processing_class).__name__} not loaded from a folder: save it "
                         "with tokenizer.save_pretrained(folder) and pass the folder, or leave it None for the model's")
    return folder


def reward_func_names(reward_funcs: list | None, environment_factory: Any = None) -> list[str]:
    """TRL 1.16's `GRPOTrainer.reward_func_names`: a reward model's id (its folder's or Hub id's last part), a
    function's `__name__` (a `functools.partial` unwrapped, a callable object its class's name), then each
    environment class with a `get_reward`, by its class name (TRL logs `rewards/<name>/...` under these)."""
    names = []
    for spec in reward_funcs or []:
        if isinstance(spec, (str, os.PathLike)):
            path = os.fspath(spec)
            names.append(path.rsplit(":", 1)[1] if ":" in path and not os.path.exists(path)
                         else path.rstrip("/").split("/")[-1])
        elif hasattr(spec, "config") and hasattr(spec, "state_dict"):  # TRL: get_config_model_id(config)
            names.append(str(getattr(spec.config, "_name_or_path", "")).split("/")[-1])
        else:
            while isinstance(spec, functools.partial):
                spec = spec.func
            names.append(getattr(spec, "__name__", type(spec).__name__))
    return names + [cls.__name__ for cls in env_reward_classes(environment_factory)]


def env_reward_classes(environment_factory: Any) -> list[type]:
    """The environment classes that own a reward (a `get_reward` method), each once, in order."""
    factories = environment_factory.values() if isinstance(environment_factory, Mapping) else [environment_factory]
    seen = []
    for factory in factories:
        if isinstance(factory, type) and callable(getattr(factory, "get_reward", None)) and factory not in seen:
            seen.append(factory)
    return seen


def env_reward_func(env_type: type) -> Callable:
    """TRL's reward function for an environment that owns its reward: each rollout's `get_reward()` where its
    environment is exactly ``env_type``, else None (what `trainer.reward_funcs` lists after the given ones; the run
    scores environments itself, `grpo_jax.tools`)."""
    def get_reward(environments, **kwargs):
        return [e.get_reward() if type(e) is env_type else None for e in environments]
    return get_reward


def trl_tools(tools: list | None, environment_factory: Any) -> list:
    """TRL's `trainer.tools`: the given tools, then each environment's own (the public methods of a probe instance
    but `reset` and `get_reward`, as TRL lists them), each once. The run builds its own (`grpo_jax.tools`)."""
    from grpo_jax.tools import calls

    out = list(tools or [])
    for name, factory in (calls.environment_factories(environment_factory) or {}).items():
        if callable(factory):  # a 'module:Class' path is read when the run is built
            out += [m for m in calls.methods(calls.make_environment(name, factory)) if m not in out]
    return out


def is_stream(dataset: Any) -> bool:
    """A `datasets.IterableDataset` (TRL's `streaming=True`), without importing datasets."""
    return type(dataset).__name__ == "IterableDataset" and hasattr(dataset, "__iter__")


def held_out(dataset: Any, name: str | None = None) -> Any:
    """A held-out set as the run reads it: a streamed `datasets.IterableDataset` (TRL's `streaming=True`) as its
    rows (a held-out set is finite); anything else as it is. ``name``: its key in a dict of them, for messages."""
    if is_stream(dataset):
        return list(dataset)
    if name is not None and isinstance(dataset, Mapping):
        raise ValueError(f"eval_dataset[{name!r}] is a {type(dataset).__name__}: give a dataset per name")
    return dataset
