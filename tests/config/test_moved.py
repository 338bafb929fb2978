"""Module paths from before the subpackage split (grpo_jax/config/moved.py): a run folder's config.yaml and a
checkpoint's code fingerprints that name an old "module:function" resume as the same function."""

import importlib

from grpo_jax.api import trainer
from grpo_jax.config import load_config
from grpo_jax.config.moved import MOVED, current_module, current_path
from grpo_jax.data import task
from grpo_jax.rewards import reward_specs
from tests.io.test_checkpoint import TINY


def test_every_old_module_names_a_module_that_is_there_now():
    for old, new in MOVED.items():
        assert old != new and current_module(old) == new
        importlib.import_module(new)
    assert current_module("grpo_jax.models") == "grpo_jax.models"  # never moved: unchanged
    assert current_path(["grpo_jax.math_rewards:accuracy", "my.mod:f", 3]) == ["grpo_jax.rewards.math:accuracy",
                                                                              "my.mod:f", 3]


def test_an_old_path_resolves_to_the_function_at_its_new_path():
    assert reward_specs.resolve_reward_fn("grpo_jax.task:char_accuracy") is task.char_accuracy
    assert reward_specs.resolve_reward_fn("grpo_jax.rewards:soft_overlong_punishment") is \
        reward_specs.resolve_reward_fn("grpo_jax.rewards.functions:soft_overlong_punishment")


def test_a_run_that_named_an_old_module_resumes_under_either_name(tmp_path):
    """The first start names the flat layout's path, as every run folder written before the split does (its
    config.yaml and its checkpoint's fingerprints hold that string); the next starts name the new path, then the old
    one again: each continues from the checkpoint, where a rename read as a change would refuse."""
    out = tmp_path / "run"

    def run(path, max_steps):
        config = load_config(None, [f"output_dir={out}", *TINY, "save_steps=1", "model.init=random",
                                    f"reward.functions=[{path}]", f"max_steps={max_steps}"])
        return trainer.train(config, show_progress=False)["steps"]

    assert run("grpo_jax.task:char_accuracy", 1) == 1
    assert run("grpo_jax.data.task:char_accuracy", 2) == 2
    assert run("grpo_jax.task:char_accuracy", 3) == 3
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir())[-1] == 3


def test_an_old_module_path_imports_the_module_where_it_lives_now():
    """Users' scripts import the flat layout's modules (`from grpo_jax.decoder import generate`, the composition
    example docs/modules.md showed): each old name gives the same module object, or, where a package took the old
    module's name, the package reads out the old module's functions (never a stray module: rewards.functions
    imports stdlib modules a package attribute must not shadow)."""
    import subprocess
    import sys

    script = """
import importlib, sys
from grpo_jax.config.moved import MOVED
for old, new in MOVED.items():
    module, moved = importlib.import_module(old), importlib.import_module(new)
    if old in ("grpo_jax.rewards", "grpo_jax.tools", "grpo_jax.data", "grpo_jax.rollout"):
        names = [n for n, v in vars(moved).items() if callable(v) and getattr(v, "__module__", "") == new]
        assert names and all(getattr(module, n) is getattr(moved, n) for n in names), old
    elif old == "grpo_jax.cli":  # a file of its own: installed grpo-jax scripts name grpo_jax.cli:main
        assert module.main is moved.main
    else:
        assert module is moved, old
        assert module.__spec__.name == new, (old, module.__spec__.name)
from grpo_jax.decoder import generate
from grpo_jax.algo.decoder import generate as now
assert generate is now
from grpo_jax.rewards import math, soft_overlong_punishment
assert math.__name__ == "grpo_jax.rewards.math"
from grpo_jax.rewards.functions import soft_overlong_punishment as now
assert soft_overlong_punishment is now
print("ok")
"""
    # a fresh interpreter: this session has imported every module by its new name already
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
