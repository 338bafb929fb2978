"""The orchestrating loop end to end on the embedded task: learning, run directory, and bad input."""

import json

import jax
import numpy as np
import pytest

from grpo_jax import trainer
from grpo_jax.config import load_config

# a short run of the embedded task: few steps, small rounds (the default run is the README's command)
QUICK = ["max_steps=4", "train.train_batch_size=16", "train.num_generations=4", "eval.num_examples=8",
         "sampling.max_completion_length=6"]


def bad_count_reward(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def raising_reward(prompts, completions, **kwargs):
    raise KeyError("answer column missing")


def test_reward_rises_on_the_embedded_task(tmp_path):
    """A short GRPO run (well under 60 s) lifts the reward well above its start on the default task."""
    # a higher learning rate than the default's 5e-4 climbs faster early (and plateaus lower later)
    config = load_config(None, [f"output_dir={tmp_path}", "max_steps=500", "train.learning_rate=2e-3",
                                "eval.num_examples=0"])
    summary = trainer.train(config, show_progress=False)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = np.array([h["reward"] for h in history])
    first, last = rewards[:50].mean(), rewards[-50:].mean()
    assert last > 3 * first and last - first > 0.1, (first, last)
    assert summary["reward_last_10pct"] == pytest.approx(last)


def test_run_directory_contents(tmp_path):
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "train.steps_per_generation=2",
                                "train.num_iterations=2", "train.gradient_accumulation_steps=2"])
    summary = trainer.train(config, show_progress=False)
    assert load_config(str(tmp_path / "config.yaml")) == config
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    required = {"step", "reward", "reward_std", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "completions/mean_length", "entropy", "grad_norm", "learning_rate",
                "step_time", "step_time/sample", "step_time/score", "step_time/logps", "step_time/update",
                "frac_reward_zero_std", "rewards/char_accuracy/mean"}
    assert required <= set(lines[0])
    # one round feeds steps 1-4 (2 slices x 2 passes): the round's reward metrics repeat, the updates differ
    assert len({line["reward"] for line in lines}) == 1
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first update starts at the reference
    assert (tmp_path / "reward.png").stat().st_size > 1000
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert set(summary["eval_after"]) == {"exact_match", "char_accuracy"}


def test_on_policy_round_skips_old_logps(tmp_path, monkeypatch):
    """With one update per round the old-policy forward is never run (old = sg(logp))."""
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "max_steps=2", "eval.num_examples=0",
                                "loss.beta=0"])
    run = trainer.build(config)
    calls = []
    logps_fn = run.logps_fn
    run.logps_fn = lambda *a: calls.append(1) or logps_fn(*a)
    writer = trainer.MetricsWriter(tmp_path, max_steps=2, show_progress=False)
    trainer.run_round(run, writer, 0)
    assert calls == [] and int(run.state.step) == 1


@pytest.mark.parametrize("path, match", [
    ("tests.test_trainer:bad_count_reward", "returned 15 rewards for 16 completions"),
    ("tests.test_trainer:raising_reward", "raising_reward"),
])
def test_bad_reward_functions_stop_with_their_name(tmp_path, path, match):
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "eval.num_examples=0",
                                f"reward.functions=[{path}]"])
    with pytest.raises((ValueError, RuntimeError), match=match):
        trainer.train(config, show_progress=False)


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "eval.num_examples=0",
                                "train.max_nonfinite_steps=2"])
    real = trainer._advantages_jit

    def nan_advantages(*args, **kwargs):
        advantages, r, std = real(*args, **kwargs)
        return advantages * np.nan, r, std

    monkeypatch.setattr(trainer, "_advantages_jit", nan_advantages)
    with pytest.raises(RuntimeError, match="3 optimizer steps had a non-finite loss .*train.max_nonfinite_steps=2"):
        trainer.train(config, show_progress=False)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["skipped"] for line in lines] == [1, 1, 1]


def test_output_dir_must_be_empty(tmp_path):
    (tmp_path / "something").write_text("x")
    with pytest.raises(ValueError, match="output_dir=.* is not empty"):
        trainer.build(load_config(None, [f"output_dir={tmp_path}"]))


def test_long_prompts_are_truncated_and_counted_or_refused(tmp_path):
    config = load_config(None, [f"output_dir={tmp_path}/a", *QUICK, "max_steps=1", "eval.num_examples=0",
                                "data.max_prompt_length=3"])
    trainer.train(config, show_progress=False)
    line = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["prompts/num_truncated"] == 4  # every "ddd>" prompt of the task is 4 or 5 chars
    config = load_config(None, [f"output_dir={tmp_path}/b", *QUICK, "eval.num_examples=0",
                                "data.max_prompt_length=3", "data.truncation=error"])
    with pytest.raises(ValueError, match="raise data.max_prompt_length"):
        trainer.train(config, show_progress=False)


def test_no_recompilation_across_rounds(tmp_path):
    """Static shapes: sampler, log-prob and step programs compile once, whatever the prompts and completions."""
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "max_steps=6", "eval.num_examples=0",
                                "train.steps_per_generation=2"])
    run = trainer.build(config)
    writer = trainer.MetricsWriter(run.output_dir, max_steps=6, show_progress=False)
    for round_index in range(3):
        trainer.run_round(run, writer, round_index)
    assert int(run.state.step) == 6
    assert run.sample_fn._cache_size() == run.logps_fn._cache_size() == run.step_fn._cache_size() == 1


def test_seeded_runs_are_reproducible(tmp_path):
    params = []
    for name in ("a", "b"):
        config = load_config(None, [f"output_dir={tmp_path / name}", *QUICK, "max_steps=2", "eval.num_examples=0"])
        run = trainer.build(config)
        writer = trainer.MetricsWriter(run.output_dir, max_steps=2, show_progress=False)
        trainer.run_round(run, writer, 0)
        trainer.run_round(run, writer, 1)
        params.append(jax.device_get(run.state.params))
    jax.tree.map(np.testing.assert_array_equal, *params)
