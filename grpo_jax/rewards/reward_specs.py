"""What `reward.functions` (or TRL's `reward_funcs`) names, as (name, callable) pairs: "package.module:function"
paths imported, reward model folders and transformers objects scored in JAX (`grpo_jax.rewards.reward_model`), callables
as they are; checked before anything compiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from grpo_jax.rewards import reward_model
from grpo_jax.rewards.functions import soft_overlong_punishment
from grpo_jax.rewards.paths import resolve_reward_fn


def resolve_all(paths, mesh=None, *, max_completion_length: int, soft_punish_cache: int,
                processing_classes=None, template_kwargs: dict | None = None) -> list[tuple[str, Callable]]:
    """(name, callable) per reward function: 'module:function' paths, reward model folders or transformers objects
    (`grpo_jax.rewards.reward_model`, placed over `mesh`), callables named as TRL names them; the built-in soft overlong
    punishment gets its lengths bound. `processing_classes`: TRL's `reward_processing_classes`, a tokenizer for
    every model object or one per function (None where it is not one). `template_kwargs`: the chat template's
    arguments a reward model renders conversations with (`data.chat_template_kwargs`)."""
    classes = processing_classes if isinstance(processing_classes, (list, tuple)) else [processing_classes] * len(paths)
    if len(classes) != len(paths):
        raise ValueError(f"reward_processing_classes has {len(classes)} entries for {len(paths)} reward_funcs: give "
                         "one per function (None for those that are not models), or one tokenizer for all")
    out = []
    for path, tokenizer in zip(paths, classes):
        if reward_model.is_model_object(path):  # before `callable`: a torch module is callable, on tensors only
            fn = reward_model.RewardModel.from_object(path, mesh, tokenizer)
        elif callable(path):
            fn = path
        elif reward_model.is_reward_model(path):
            fn = reward_model.RewardModel(path, mesh)
        else:
            fn = resolve_reward_fn(path)
            if fn is soft_overlong_punishment:
                fn = functools.partial(fn, max_completion_len=max_completion_length,
                                       soft_punish_cache=soft_punish_cache)
            out.append((path, fn))
            continue
        if isinstance(fn, reward_model.RewardModel):
            fn.template_kwargs = dict(template_kwargs or {})
        out.append((getattr(fn, "__name__", type(fn).__name__), fn))
    return out


def check_importable(field: str, paths) -> None:
    """Imports every reward path now, so a typo fails before any compilation (a reward model is loaded later,
    `resolve_all`); a ValueError names `field`."""
    for path in paths:
        try:
            if isinstance(path, str) and not reward_model.is_reward_model(path):
                resolve_reward_fn(path)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from e
