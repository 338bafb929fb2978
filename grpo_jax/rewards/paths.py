"""A "package.module:function" path imported (`resolve_reward_fn`): the reward functions, tools, environments and
answer extractors a config names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def resolve_reward_fn(path: str, what: str = "reward function") -> Callable:
    """Import "package.module:function" and return the callable; errors call it ``what`` (a tool, a class)."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"{what} {path!r} has no ':': use 'package.module:function'")
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} is incomplete: use 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{what} {path!r}: module {module_name!r} could not be imported ({type(e).__name__}: {e}); "
            "check the module is on PYTHONPATH"
        ) from e
    except Exception as e:  # the module's own code failed while it was imported: said in one line, chained
        raise ValueError(f"{what} {path!r}: importing module {module_name!r} raised {type(e).__name__}: "
                         f"{e}; fix the module (the full error is chained to this one)") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj
