"""Where the modules of the flat layout went when they moved into subpackages (issue 43): the "module:function"
paths that a run folder's config.yaml or a checkpoint's code fingerprints may name, old and new alike, read as the
same path; and the same modules imported by their old names (`grpo_jax.decoder`, `grpo_jax.rewards.accuracy`, ...),
as users' scripts wrote them (`spec`, `forward`). Imports nothing at import time.
"""

from __future__ import annotations

import importlib
import types
from importlib.abc import Loader
from importlib.util import spec_from_loader

# the flat module -> its subpackage module; a run written before the move names the left side
MOVED = {
    "grpo_jax.trl_keys": "grpo_jax.config.trl_keys", "grpo_jax.cli": "grpo_jax.api.cli",
    "grpo_jax.trainer": "grpo_jax.api.trainer", "grpo_jax.trl_api": "grpo_jax.api.trl_api",
    "grpo_jax.arguments": "grpo_jax.api.arguments", "grpo_jax.run": "grpo_jax.api.run",
    "grpo_jax.trajectory": "grpo_jax.algo.trajectory", "grpo_jax.advantages": "grpo_jax.algo.advantages",
    "grpo_jax.state": "grpo_jax.algo.state", "grpo_jax.reference": "grpo_jax.algo.reference",
    "grpo_jax.logprobs": "grpo_jax.algo.logprobs", "grpo_jax.train_step": "grpo_jax.algo.train_step",
    "grpo_jax.rounds": "grpo_jax.algo.rounds", "grpo_jax.decoder": "grpo_jax.algo.decoder",
    "grpo_jax.decoder_pages": "grpo_jax.algo.decoder_pages", "grpo_jax.sampling": "grpo_jax.algo.sampling",
    "grpo_jax.stream": "grpo_jax.rollout.stream", "grpo_jax.multiturn": "grpo_jax.rollout.multiturn",
    "grpo_jax.rollout": "grpo_jax.rollout.round", "grpo_jax.async_rounds": "grpo_jax.rollout.async_rounds",
    "grpo_jax.evaluation": "grpo_jax.rollout.evaluation", "grpo_jax.rewards": "grpo_jax.rewards.functions",
    "grpo_jax.math_rewards": "grpo_jax.rewards.math", "grpo_jax.reward_specs": "grpo_jax.rewards.reward_specs",
    "grpo_jax.reward_model": "grpo_jax.rewards.reward_model",
    "grpo_jax.code_fingerprints": "grpo_jax.rewards.code_fingerprints", "grpo_jax.tools": "grpo_jax.tools.calls",
    "grpo_jax.toolbox": "grpo_jax.tools.toolbox", "grpo_jax.sandbox": "grpo_jax.tools.sandbox",
    "grpo_jax.tool_parsers": "grpo_jax.tools.tool_parsers", "grpo_jax.tool_task": "grpo_jax.tools.tool_task",
    "grpo_jax.journal": "grpo_jax.tools.journal", "grpo_jax.data": "grpo_jax.data.prompts",
    "grpo_jax.sources": "grpo_jax.data.sources", "grpo_jax.task": "grpo_jax.data.task",
    "grpo_jax.sharding": "grpo_jax.device.sharding", "grpo_jax.cpu": "grpo_jax.device.cpu",
    "grpo_jax.distributed": "grpo_jax.device.distributed", "grpo_jax.programs": "grpo_jax.algo.programs",
    "grpo_jax.plan": "grpo_jax.api.plan", "grpo_jax.chips": "grpo_jax.device.chips",
    "grpo_jax.shapes": "grpo_jax.rollout.shapes", "grpo_jax.checkpoint": "grpo_jax.io.checkpoint",
    "grpo_jax.export": "grpo_jax.io.export", "grpo_jax.runs": "grpo_jax.io.runs", "grpo_jax.lock": "grpo_jax.io.lock",
    "grpo_jax.preemption": "grpo_jax.io.preemption", "grpo_jax.reporting": "grpo_jax.io.reporting",
    "grpo_jax.trackers": "grpo_jax.io.trackers",
}


def current_module(name: str) -> str:
    """The module `name` is now ("grpo_jax.math_rewards" -> "grpo_jax.rewards.math"); other names unchanged."""
    return MOVED.get(name, name)


def current_path(value):
    """A "package.module:attribute" string with its module as it is now; anything else unchanged (lists too)."""
    if isinstance(value, (list, tuple)):
        return type(value)(current_path(v) for v in value)
    if not isinstance(value, str) or ":" not in value:
        return value
    module, _, attr = value.partition(":")
    return f"{current_module(module)}:{attr}"


class _Alias(Loader):
    """Loads an old module name as the module it moved to (the same object)."""

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system stamped the alias's spec on the module: its own back


def spec(name: str):
    """The import spec of an old module name (`grpo_jax/__init__.py`'s finder asks, last on `sys.meta_path`, so only
    for names nothing else finds), or None."""
    return spec_from_loader(name, _Alias()) if name in MOVED else None


def forward(package: str, module: str):
    """A package's `__getattr__` for the four flat modules a package took the name of (`grpo_jax.rewards` was
    `rewards.functions`): their functions still read from the package; submodules are left to the import system."""

    def __getattr__(name: str):
        value = getattr(importlib.import_module(module), name, None)
        if value is None or isinstance(value, types.ModuleType):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return value

    return __getattr__
