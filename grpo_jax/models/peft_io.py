"""PEFT LoRA adapter folders in and out, without the ``peft`` package: ``adapter_config.json`` and
``adapter_model.safetensors`` as ``peft.PeftModel.save_pretrained`` writes them and ``from_pretrained`` reads them.

Names: our ``layers.<block>.<module>.lora_a`` [L, in, r] is ``base_model.model.model.layers.<i>.<block>.<module>
.lora_A.weight`` [r, in] transposed (``dense_layers``: GLM-4-MoE's first layers, i from 0), ``lora_b`` [L, r, out]
is ``...lora_B.weight`` [out, r] transposed. Loading reads each device's slice from the memory-mapped file, as
`pretrained.from_pretrained` does.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx

from grpo_jax.config.model import LORA_TARGETS, LoRAConfig, ModelConfig
from grpo_jax.models import families
from grpo_jax.models import safetensors_io as st
from grpo_jax.models.pretrained import _flat, _read, _sharding_fn, _to_host, abstract_model

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model."
# adapter_config.json keys whose non-empty values describe adapters this decoder does not run
_UNSUPPORTED = ("use_dora", "modules_to_save", "layers_to_transform", "layers_pattern", "rank_pattern",
                "alpha_pattern", "fan_in_fan_out", "lora_bias", "target_parameters", "trainable_token_indices",
                "layer_replication", "use_qalora", "alora_invocation_tokens")


def peft_names(path: str, config: ModelConfig) -> list[str]:
    """PEFT's tensor names, one per layer of its stack (`families.stack_layers`), of our adapter path
    ``<stack>.<block>...<module>.lora_a|lora_b``."""
    stack, *inner, leaf = path.split(".")
    kind = {"lora_a": "lora_A", "lora_b": "lora_B"}[leaf]
    return [f"{_PREFIX}layers.{i}.{'.'.join(inner)}.{kind}.weight" for i in families.stack_layers(stack, config)]


def _read_config(folder: str) -> dict:
    file = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(file) or not os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
        raise ValueError(f"model.lora.path={folder!r} is not a PEFT adapter folder: it must hold {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE} (peft's save_pretrained writes both)")
    with open(file, encoding="utf-8") as f:
        raw = json.load(f)
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type={raw.get('peft_type')!r}: only LORA adapters are supported")
    set_keys = [k for k in _UNSUPPORTED if raw.get(k)]
    if raw.get("bias", "none") != "none":
        set_keys.append("bias")
    if set_keys:
        raise ValueError(f"{file}: {', '.join(f'{k}={raw[k]!r}' for k in set_keys)} not supported: plain LoRA on "
                         f"{', '.join(LORA_TARGETS)} of every layer only")
    return raw


def resolve_lora(lora: LoRAConfig) -> LoRAConfig:
    """Fill rank, alpha, targets and rsLoRA from ``lora.path``'s PEFT folder; no path: ``lora`` unchanged.

    The targets are the modules the tensors adapt. A field set to a non-default value that differs from the
    folder is an error naming both values (as `registry.resolve_config` does for the architecture).
    """
    if lora.path is None:
        return lora
    folder = os.fspath(lora.path)
    raw = _read_config(folder)
    modules = {name[len(_PREFIX):].split(".")[3] for name in st.read_header(os.path.join(folder, WEIGHTS_FILE))}
    if not modules <= set(LORA_TARGETS):
        raise ValueError(f"{os.path.join(folder, WEIGHTS_FILE)}: adapters on {sorted(modules - set(LORA_TARGETS))}: "
                         f"only {', '.join(LORA_TARGETS)} can be adapted")
    targets = tuple(n for n in LORA_TARGETS if n in modules)
    fields = dict(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]), use_rslora=bool(raw.get("use_rslora")),
                  target_modules="all-linear" if targets == LORA_TARGETS else targets)
    defaults = {f.name: f.default for f in dataclasses.fields(LoRAConfig)}
    for name, value in fields.items():
        given = getattr(lora, name)
        same = LoRAConfig(target_modules=given).targets == targets if name == "target_modules" else given == value
        if given != defaults[name] and not same:
            raise ValueError(f"model.lora.{name}={given!r} conflicts with {os.path.join(folder, CONFIG_FILE)} "
                             f"({name}={value!r}): remove the override (the adapters come from model.lora.path)")
    return dataclasses.replace(lora, **fields)


def load_adapters(config: ModelConfig, *, shardings=None) -> nnx.State:
    """The adapters of ``config.lora.path`` (resolved by `resolve_lora`) as the LoRA model's adapter state, float32.

    ``shardings``: None, a pytree of Shardings matching the model's params, or ``fn(path, shape) -> Sharding``.
    A missing tensor, a wrong shape or an unexpected tensor is an error naming the file and tensor.
    """
    folder = os.fspath(config.lora.path)
    file = os.path.join(folder, WEIGHTS_FILE)
    refs = st.read_header(file)
    abstract = nnx.filter_state(abstract_model(config)[1], nnx.LoRAParam)
    sharding_of = _sharding_fn(shardings)
    maps: dict = {}
    nested: dict = {}
    used = set()
    for path, leaf in _flat(abstract).items():
        names = peft_names(path, config)
        want = tuple(leaf.shape[1:])[::-1]
        for name in names:
            if name not in refs:
                raise ValueError(f"{file}: tensor {name} (for {path}) is missing: every layer needs its adapters")
            if refs[name].shape != want:
                raise ValueError(f"{file}: tensor {name} has shape {list(refs[name].shape)}, expected {list(want)} "
                                 f"(rank {config.lora.rank} on {config.model_type} of config.json)")
        used.update(names)
        read = _read([refs[n] for n in names], 1, True, np.dtype(leaf.dtype), maps, tuple(leaf.shape))
        array = jax.make_array_from_callback(tuple(leaf.shape), sharding_of(path, tuple(leaf.shape)), read)
        *parents, last = path.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = array
    extra = sorted(set(refs) - used)
    if extra:
        raise ValueError(f"{file}: unexpected tensors {extra[:5]}: the adapters do not fit model.lora and config.json")
    maps.clear()
    nnx.replace_by_pure_dict(abstract, nested)
    return abstract


def host_adapters(config: ModelConfig, params) -> dict[str, np.ndarray]:
    """The adapters of ``params`` on the host under PEFT's saved names, [r, in] and [out, r] as PEFT holds them
    (what `save_adapters` writes)."""
    return {hf_name: np.ascontiguousarray(_to_host(array[i], True))
            for name, array in _flat(nnx.filter_state(params, nnx.LoRAParam)).items()
            for i, hf_name in enumerate(peft_names(name, config))}


def save_adapters(config: ModelConfig, params, path, *, base_model_name_or_path: str | None = None) -> None:
    """Write the adapters of ``params`` as a PEFT folder that ``peft.PeftModel.from_pretrained(base, path)`` loads.

    Every process takes part in the gathers; process 0 writes.
    """
    path = os.fspath(path)
    lora, entries = config.lora, []
    for name, array in _flat(nnx.filter_state(params, nnx.LoRAParam)).items():
        for i, hf_name in enumerate(peft_names(name, config)):
            shape = tuple(array.shape[1:])[::-1]
            entries.append(st.Entry(hf_name, shape, np.dtype(array.dtype),
                                    lambda a=array, i=i: _to_host(a[i], True)))
    write = jax.process_index() == 0
    if write:
        os.makedirs(path, exist_ok=True)
    st.write_file(os.path.join(path, WEIGHTS_FILE) if write else None,
                  sorted(entries, key=lambda e: (int(e.name.split(".")[4]), e.name)))
    if not write:
        return
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.use_rslora,
        "target_modules": list(lora.targets), "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "init_lora_weights": lora.init_lora_weights, "inference_mode": True}
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)
