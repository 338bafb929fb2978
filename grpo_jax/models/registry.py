"""What goes through the model families by model_type: a transformers config's fields (`config_fields`), a model
folder's architecture (`resolve_config`), the config to export (`to_hf_config`) and the model types supported
(`supported_model_types`). The family lookup (`family`, re-exported here) is `models.transformer`'s, which builds
the decoder from it: this module sits above the driver and the family modules (`llama`, `gemma`, `qwen3_moe`).
"""

from __future__ import annotations

import dataclasses
import os

from grpo_jax.config.model import ModelConfig
from grpo_jax.models.folder_check import check_folder
from grpo_jax.models.transformer import FAMILIES, family


def supported_model_types() -> list[str]:
    """Every model_type some family reads and writes."""
    return sorted(mt for f in FAMILIES for mt in f.architectures)


def config_fields(hf, where: str = "config.json") -> dict:
    """ModelConfig field values that describe a transformers config, by its family."""
    mt = getattr(hf, "model_type", None)
    try:
        fam = family(mt)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return fam.config_fields(hf, where)


def resolve_config(config: ModelConfig) -> ModelConfig:
    """Fill the architecture from ``config.path``'s config.json; no path: the config unchanged.

    ``path``, ``dtype``, ``param_dtype`` and ``remat`` stay as given. A field set to a non-default value that
    differs from config.json is an error naming both values.
    """
    if config.path is None:
        return config
    import transformers

    path = os.fspath(config.path)
    where = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"model.path={path!r} is not a folder: point it at a local Hugging Face model folder")
    if not os.path.isfile(where):
        raise ValueError(f"model.path={path!r} has no config.json: it must be a Hugging Face model folder "
                         "(config.json + model.safetensors)")
    # config.json against itself and the weights' shapes, before transformers validates it
    check_folder(path, model_types=supported_model_types())
    try:
        hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{where}: transformers cannot read it ({type(e).__name__}: {e}); supported model_type: "
                         f"{supported_model_types()}") from e
    fields = config_fields(hf, where)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for name, value in fields.items():
        given = getattr(config, name)
        if given != defaults[name] and given != value:
            raise ValueError(f"model.{name}={given!r} conflicts with {where} ({name}={value!r}): remove the "
                             f"override (the architecture comes from model.path) or point model.path elsewhere")
    return dataclasses.replace(config, **fields)


def to_hf_config(config: ModelConfig, **extra):
    """The transformers config (with ``architectures``) of a ModelConfig, by its family."""
    import transformers

    try:
        fam = family(config.model_type)
    except ValueError as e:
        raise ValueError(f"model.model_type={config.model_type!r} cannot be exported: {e}") from None
    hf = transformers.AutoConfig.for_model(config.model_type, **fam.hf_kwargs(config), **extra)
    hf.architectures = [fam.architectures[config.model_type]]
    return hf
