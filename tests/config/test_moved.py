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
