"""Reward function plumbing: resolve "module:function" paths and score completions on the host.

Reward functions follow TRL's GRPOTrainer convention:
    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]
where every dataset column other than "prompt" arrives as a keyword argument (one value per completion) and None
means "no opinion on this completion" (it becomes NaN and is skipped by the advantage computation).
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def resolve_reward_fn(path: str) -> Callable:
    """Import "package.module:function" and return the callable."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"reward function {path!r} has no ':': use 'package.module:function'")
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {path!r} is incomplete: use 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward function {path!r}: module {module_name!r} could not be imported ({type(e).__name__}: {e}); "
            "check the module is on PYTHONPATH"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward function {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {path!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def _to_float(name: str, i: int, value: Any) -> float:
    """One reward value -> float (None -> NaN); rejects non-numbers and non-finite floats."""
    if value is None:
        return math.nan
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    # numbers.Real covers bool (True -> 1.0, as TRL's torch.tensor would) and numpy scalars.
    if not isinstance(value, numbers.Real):
        raise ValueError(
            f"reward function '{name}' returned {type(value).__name__} {value!r} at index {i}: "
            "rewards must be numbers (or None to skip a completion)"
        )
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(
            f"reward function '{name}' returned {out} at index {i}: return None to skip a completion instead"
        )
    return out


def score_completions(
    reward_fns: Sequence[tuple[str, Callable]],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
) -> np.ndarray:
    """Call every reward function on the N completions; returns rewards_NxF float32 (NaN where None)."""
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    rewards_NxF = np.full((n, len(reward_fns)), np.nan, dtype=np.float32)
    for f, (name, fn) in enumerate(reward_fns):
        try:
            out = fn(prompts=prompts, completions=completions, **columns)
        except Exception as e:
            raise RuntimeError(f"reward function '{name}' raised {type(e).__name__}: {e}") from e
        if isinstance(out, np.ndarray):
            out = out.tolist() if out.ndim == 1 else out
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise ValueError(
                f"reward function '{name}' returned {type(out).__name__}: it must return a list of floats "
                "(or None), one per completion"
            )
        if len(out) != n:
            raise ValueError(f"reward function '{name}' returned {len(out)} rewards for {n} completions")
        rewards_NxF[:, f] = [_to_float(name, i, v) for i, v in enumerate(out)]
    return rewards_NxF
