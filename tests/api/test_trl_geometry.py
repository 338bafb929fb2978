"""TRL's batch geometry and defaults (grpo_jax/config/trl_keys.py `_geometry`, grpo_jax/config `for_run`,
grpo_jax/api/trl_api.py `TRL_DEFAULTS`), each checked against TRL 1.16's own GRPOConfig, RepeatSampler and
transformers' step count where installed."""

import dataclasses
import math

import pytest

from grpo_jax import GRPOConfig
from grpo_jax.config import Config, for_run, load_config, resolve_defaults, to_dict

trl = pytest.importorskip("trl")


def trl_config(**kwargs):
    return trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to="none", **kwargs)


GEOMETRIES = [dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
              dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=6),
              dict(per_device_train_batch_size=3, num_generations=3, steps_per_generation=4),
              dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=2,
                   num_generations=4, num_iterations=2)]


@pytest.mark.parametrize("kwargs", GEOMETRIES)
def test_per_device_batch_and_steps_per_generation_mean_what_they_mean_in_trl(kwargs):
    theirs = trl_config(**kwargs)  # one process here: TRL's world size is 1
    ours = for_run(GRPOConfig(**kwargs), row_devices=1, num_prompts=64).train
    # rows of one optimizer step, rows of one generation, optimizer steps on one generation
    assert ours.train_batch_size == theirs.per_device_train_batch_size * theirs.gradient_accumulation_steps
    assert ours.generation_batch_size == theirs.generation_batch_size
    assert ours.steps_per_generation == theirs.steps_per_generation // theirs.gradient_accumulation_steps
    # over 4 devices TRL's processes: 4x the rows of each, the same steps
    four = for_run(GRPOConfig(**kwargs), row_devices=4, num_prompts=64).train
    assert (four.train_batch_size, four.steps_per_generation) == (4 * ours.train_batch_size, ours.steps_per_generation)


def test_generation_batch_size_converts_with_a_whole_step_batch():
    theirs = trl_config(per_device_train_batch_size=8, generation_batch_size=32)
    ours = GRPOConfig(train_batch_size=8, generation_batch_size=32).train
    assert (ours.generation_batch_size, ours.steps_per_generation) == (32, theirs.steps_per_generation)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gradient_accumulation_steps=2, steps_per_generation=3), "must be a multiple of gradient_accumulation_steps"),
    (dict(generation_batch_size=32), "depend on the device count"),
    (dict(train_batch_size=8, generation_batch_size=20), "must be a multiple of train.train_batch_size=8"),
    (dict(train_batch_size=8, steps_per_generation=2, generation_batch_size=16), "cannot both be set"),
    (dict(steps_per_generation=2, train={"steps_per_generation": 2}), "give one"),
    (dict(per_device_train_batch_size=2, train={"train_batch_size": 16}), "give one"),
])
def test_what_has_no_exact_conversion_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        GRPOConfig(**kwargs)
    assert "\n" not in str(error.value)


def test_rows_that_do_not_hold_whole_groups_are_refused_once_devices_are_known():
    config = GRPOConfig(per_device_train_batch_size=3, num_generations=4)
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=3 x 1 devices .* = 3 rows per step: .*"
                                         r"not divisible by train.num_generations=4"):
        for_run(config, row_devices=1, num_prompts=64)
    assert for_run(config, row_devices=4, num_prompts=64).train.train_batch_size == 12  # 12 rows: 3 groups


@pytest.mark.parametrize("prompts, epochs, kwargs", [
    (64, 3.0, dict(per_device_train_batch_size=4, num_generations=4)),
    (50, 1.5, dict(per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=2,
                   steps_per_generation=4)),
    (30, 2.0, dict(per_device_train_batch_size=6, num_generations=3, num_iterations=3)),
])
def test_num_train_epochs_gives_trls_step_count(prompts, epochs, kwargs):
    """TRL's steps: its RepeatSampler's length over the dataloader's batches (a generation per process), as
    transformers' Trainer turns them into optimizer steps (`set_initial_training_values`)."""
    from trl.trainer.utils import RepeatSampler

    theirs = trl_config(num_train_epochs=epochs, **kwargs)
    sampler = RepeatSampler(range(prompts), mini_repeat_count=theirs.num_generations,
                            batch_size=theirs.generation_batch_size // theirs.num_generations,
                            repeat_count=theirs.num_iterations * theirs.steps_per_generation)
    batches = len(sampler) // (theirs.per_device_train_batch_size * theirs.steps_per_generation)
    accumulation = theirs.gradient_accumulation_steps
    expected = math.ceil(epochs * max(batches // accumulation + int(batches % accumulation > 0), 1))
    ours = for_run(GRPOConfig(num_train_epochs=epochs, **kwargs), row_devices=1, num_prompts=prompts)
    assert ours.max_steps == expected
    assert for_run(GRPOConfig(num_train_epochs=epochs, max_steps=7, **kwargs), row_devices=1,
                   num_prompts=prompts).max_steps == 7  # TRL: max_steps > 0 wins over epochs


def test_warmup_ratio_is_transformers_warmup_count():
    from transformers import TrainingArguments

    ours = for_run(GRPOConfig(warmup_ratio=0.15, max_steps=10, train_batch_size=8), row_devices=1, num_prompts=8)
    theirs = TrainingArguments(output_dir="unused", use_cpu=True, warmup_steps=0.15).get_warmup_steps(10)
    assert ours.train.warmup_steps == theirs == 2


def test_grpo_config_takes_trls_defaults_and_the_cli_keeps_its_own():
    from grpo_jax.api.trl_api import TRL_DEFAULTS
    from grpo_jax.config import trl_keys

    theirs = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert all(theirs[name] == value for name, value in TRL_DEFAULTS.items())
    ours = to_dict(GRPOConfig())
    for name, value in TRL_DEFAULTS.items():
        *sections, leaf = trl_keys.ALIASES.get(name, name).split(".")
        node = ours
        for section in sections:
            node = node[section]
        assert node[leaf] == value, name
    assert load_config(None) == Config()  # the CLI's embedded demo: our defaults, untouched
    # TRL's trainer goes on through steps of gradient norm 0; the CLI stops a run that no longer trains
    assert GRPOConfig().train.stop_on_zero_gradient is False and Config().train.stop_on_zero_gradient is True
    assert GRPOConfig(**{"train.stop_on_zero_gradient": True}).train.stop_on_zero_gradient is True
    assert Config().loss.beta is None and Config().max_steps == 5000  # null: 0.1 for the demo's random model
    assert resolve_defaults(Config()).loss.beta == 0.1
