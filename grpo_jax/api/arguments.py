"""The Python API's arguments, checked up front: `check_arguments` runs first in `grpo_jax.train` and in
`GRPOTrainer(...)`, before any folder, import or compilation, so a wrong type is a TypeError (a wrong value a
ValueError) naming the argument and what to pass, not a traceback from deep inside the run. Imports no jax.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from grpo_jax.config import Config

__all__ = ["check_arguments"]


def _kind(value: Any) -> str:
    return f"{type(value).__name__} ({value!r:.60})" if isinstance(value, (int, float, bool, bytes)) \
        else type(value).__name__


def _check_config(config: Any) -> None:
    if isinstance(config, Config):
        return
    if isinstance(config, Mapping):
        raise TypeError(f"config is a {type(config).__name__}: build a Config from it with "
                        "grpo_jax.make_config(**config) (or GRPOConfig(**config), or load_config(file))")
    raise TypeError(f"config is a {_kind(config)}: pass a grpo_jax Config, from grpo_jax.make_config(...), "
                    "GRPOConfig(...) or load_config(file)")


def _is_spec(value: Any) -> bool:
    """A 'module:function' path, a folder, or a callable (a function, a transformers model object)."""
    return isinstance(value, (str, os.PathLike)) or callable(value)


def _check_specs(name: str, value: Any, what: str) -> None:
    """``value``: None, one spec or a non-empty list/tuple of them."""
    if value is None:
        return
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, (list, tuple)) and not items:
        raise ValueError(f"{name} is an empty {type(value).__name__}: give at least one, or leave it None")
    for i, item in enumerate(items):
        if not _is_spec(item):
            where = name if not isinstance(value, (list, tuple)) else f"{name}[{i}]"
            raise TypeError(f"{where} is a {_kind(item)}, not callable: pass {what}")


def _check_dataset(name: str, dataset: Any) -> None:
    """None, a list of dicts or a `datasets.Dataset` (checked further, row by row, when the run is built)."""
    if dataset is None or hasattr(dataset, "column_names") or isinstance(dataset, list):
        if isinstance(dataset, list):
            bad = next((i for i, row in enumerate(dataset) if not isinstance(row, Mapping)), None)
            if bad is not None:
                raise TypeError(f"{name}[{bad}] is a {_kind(dataset[bad])}: each row is a dict with a 'prompt'")
        return
    raise TypeError(f"{name} is a {_kind(dataset)}: pass a datasets.Dataset or a list of dicts with a 'prompt'")


def check_arguments(config: Any, *, loss_fn: Any = None, reward_funcs: Any = None, train_dataset: Any = None,
                    eval_dataset: Any = None, tools: Any = None, environment_factory: Any = None,
                    eval_reward_funcs: Any = None) -> None:
    """Raises a TypeError (a wrong type) or ValueError (an empty list) naming the argument and what to pass:
    `config` a `Config`; `loss_fn` a callable with `compute_loss`'s signature; `reward_funcs` and
    `eval_reward_funcs` a callable, a 'module:function' path or a reward model folder, or a list of them;
    `train_dataset` / `eval_dataset` a `datasets.Dataset` or a list of dicts; `tools` a list of callables or
    paths; `environment_factory` a class (or callable, or path), or a dict of them by name."""
    _check_config(config)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn is a {_kind(loss_fn)}, not callable: pass a function with "
                        "grpo_jax.losses.compute_loss's signature, or leave it None")
    reward = "a function, a 'module:function' path or a reward model folder (or a list of them)"
    _check_specs("reward_funcs", reward_funcs, reward)
    _check_specs("eval_reward_funcs", eval_reward_funcs, reward)
    _check_dataset("train_dataset", train_dataset)
    _check_dataset("eval_dataset", eval_dataset)
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools is a {_kind(tools)}: pass a list of functions (or 'module:function' paths)")
    _check_specs("tools", tools, "a function or a 'module:function' path")
    factories = environment_factory.items() if isinstance(environment_factory, Mapping) \
        else [(None, environment_factory)]
    for key, factory in factories:
        where = "environment_factory" if key is None else f"environment_factory[{key!r}]"
        if factory is not None and not (isinstance(factory, str) or callable(factory)):
            raise TypeError(f"{where} is a {_kind(factory)}: pass a class (called once per rollout) or a "
                            "'module:Class' path")
