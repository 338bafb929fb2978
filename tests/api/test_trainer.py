"""The orchestrating loop end to end on the embedded task: learning, run directory, and bad input."""

import dataclasses
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from grpo_jax.algo import rounds
from grpo_jax.api import trainer
from grpo_jax.config import load_config, resolve_defaults
from grpo_jax.data import prompts as data
from grpo_jax.io.reporting import plain

ROOT = Path(__file__).resolve().parents[2]

# a short run of the embedded task: few steps, small rounds (the default run is the README's command)
QUICK = ["max_steps=4", "train.train_batch_size=16", "train.num_generations=4", "eval.num_examples=8",
         "sampling.max_completion_length=6"]
START = data.DataState(epoch=0, index=0, seed=0)  # a run's first data position (seed 0, the default)


def spy(run, **programs):
    """The run with some of its programs replaced (e.g. by wrappers that record their calls)."""
    return dataclasses.replace(run, programs=run.programs._replace(**programs))


def bad_count_reward(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def raising_reward(prompts, completions, **kwargs):
    raise KeyError("answer column missing")


TRL_STYLE = {"steps": []}


def trl_style_reward(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """A reward function written for TRL 1.16: it reads the trainer state and logs a metric and a column."""
    TRL_STYLE["steps"].append(trainer_state.global_step)
    lengths = [len(c) for c in completions]
    log_metric("judge/mean_chars", float(np.mean(lengths)))
    log_extra("chars", lengths)
    return [float(n % 2) for n in lengths]


async def async_reward(prompts, completions, **kwargs):
    import asyncio
    await asyncio.sleep(0)
    return [float(i % 2) for i in range(len(completions))]


def test_trl_style_and_async_reward_functions_in_a_run(tmp_path):
    TRL_STYLE["steps"].clear()
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "eval.num_examples=0", "log_completions=true",
                                "reward.functions=[tests.api.test_trainer:trl_style_reward,tests.api.test_trainer:async_reward]"])
    trainer.train(config, show_progress=False)
    # the module reward.functions imported (tests.api.test_trainer), not pytest's copy of this file
    steps = importlib.import_module("tests.api.test_trainer").TRL_STYLE["steps"]
    assert steps == [0, 0, 1, 2, 3]  # the check before compiling, then one round per step
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    for line in lines:
        chars = [r["chars"] for r in rows if r["step"] == line["step"]]
        assert len(chars) == 16 and line["judge/mean_chars"] == pytest.approx(np.mean(chars))
        assert line["rewards/async_reward/mean"] == 0.5
    assert [len(r["completion"]) for r in rows] == [r["chars"] for r in rows]


@pytest.mark.parametrize("overrides", [
    ["reward.functions=[tests.api.test_trainer:trl_style_reward]"],
    ["train.advantage_estimator=process", "reward.functions=[tests.api.test_trainer:step_reward]"],
    ["train.dynamic_sampling=true", "reward.functions=[tests.api.test_trainer:half_constant_reward]"]],
    ids=["outcome", "process", "dynamic_sampling"])
def test_a_streamed_round_calls_each_reward_once_a_pass_and_equals_the_static_round(tmp_path, overrides):
    """sampling.max_batch_rows: the rows reach the host group by group as the sampler finishes them, yet each reward
    function is called once a sampling pass on all its rows in order, as TRL calls it once a generation batch
    (before: once a batch of finished groups), and the round (rewards, logged columns at their rows, advantages,
    the step) is the static round's."""
    out = {}
    for slots in (0, 2):
        config = load_config(None, [f"output_dir={tmp_path / str(slots)}", *QUICK, "max_steps=1",
                                    "log_completions=true", "eval.num_examples=0", "sampling.max_completion_length=12",
                                    f"sampling.max_batch_rows={slots}", *overrides])
        run, state, held = trainer.build(config)
        calls = []
        run = dataclasses.replace(run, reward_fns=[(name, lambda fn=fn, **kw: calls.append(len(kw["completions"]))
                                                    or fn(**kw)) for name, fn in run.reward_fns])
        _, _, round_batch, lines = trainer.run_round(run, state, START, 0)
        out[slots] = calls, round_batch, lines
    (static_calls, static, static_lines), (calls, streamed, lines) = out[0], out[2]
    passes = lines[0].get("dynamic_sampling/num_gen_batches", 1)
    assert static_calls == calls == [16] * passes
    assert len({len(r["completion"]) for r in streamed.completions}) > 2  # groups end at different steps
    if "chars" in streamed.completions[0]:
        assert [r["chars"] for r in streamed.completions] == [len(r["completion"]) for r in streamed.completions]
    assert streamed.completions == static.completions  # same rows, rewards, advantages, logged columns, in order
    np.testing.assert_array_equal(*jax.device_get((streamed.rows.advantages, static.rows.advantages)))
    for key in ("loss", "grad_norm", "reward"):  # the sampler's log-probs: a batch's rounding
        np.testing.assert_allclose(lines[0][key], static_lines[0][key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_a_bad_reward_function_fails_before_anything_compiles(tmp_path, monkeypatch):
    def compiled(*args, **kwargs):
        raise AssertionError("the reward functions were not checked before compiling")

    monkeypatch.setattr(trainer.build.__globals__["programs"], "init_state", compiled)
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK,
                                "reward.functions=[tests.api.test_trainer:raising_reward]"])
    with pytest.raises(ValueError, match="reward function 'tests.api.test_trainer:raising_reward' raised KeyError"):
        trainer.train(config, show_progress=False)


def test_reward_rises_on_the_embedded_task(tmp_path):
    """The README's command, as a user runs it (one CPU device, XLA's default flags, not the suite's), lifts the
    reward well above its start on the default task in a short run."""
    # a higher learning rate than the default's 5e-4 climbs faster early (and plateaus lower later). Seed 1: seed 0
    # climbs late at this rate, and where it stands at step 500 swings with float rounding (2.8x-5.1x between two
    # matmul formulations; seeds 1 and 2 reach 8.6x-14x with either)
    cmd = [sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={tmp_path}", "seed=1", "max_steps=500",
           "train.learning_rate=2e-3", "eval.num_examples=0"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "devices=1 (cpu)" in result.stdout
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = np.array([h["reward"] for h in history])
    first, last = rewards[:50].mean(), rewards[-50:].mean()
    assert last > 3 * first and last - first > 0.1, (first, last)
    assert f"last 10%={last:.3f}" in result.stdout


def test_run_directory_contents(tmp_path):
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "train.steps_per_generation=2",
                                "train.num_iterations=2", "train.gradient_accumulation_steps=2"])
    summary = trainer.train(config, show_progress=False)
    assert load_config(str(tmp_path / "config.yaml")) == resolve_defaults(config)  # the learning rate it ran with
    assert summary["compile_seconds"] > 0  # the programs compiled ahead of the first step (`grpo_jax.rollout.shapes`)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 4]  # held-out evaluation before and after
    evals, lines = [lines[0], lines[-1]], lines[1:-1]
    assert set(evals[0]) == {"step", "eval/greedy/exact_match", "eval/greedy/char_accuracy"}
    assert summary["eval_after"] == {"greedy/exact_match": evals[1]["eval/greedy/exact_match"],
                                     "greedy/char_accuracy": evals[1]["eval/greedy/char_accuracy"]}
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


def test_on_policy_round_skips_old_logps(tmp_path, monkeypatch):
    """With one update per round the old-policy forward is never run (old = sg(logp))."""
    # the programs of test_a_step_gets_its_rows[16-1] and _one_round (compiled once per session)
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "max_steps=1", "eval.num_examples=0"])
    run, state, held = trainer.build(config)
    calls = []
    run = spy(run, logps=lambda *a: calls.append(1) or run.programs.logps(*a))
    state, _, _, _ = trainer.run_round(run, state, START, 0)
    assert calls == [] and int(state.step) == 1


@pytest.mark.parametrize("path, match", [
    ("tests.api.test_trainer:bad_count_reward", "returned 1 rewards for 2 completions .checked before compiling"),
    ("tests.api.test_trainer:raising_reward", "raising_reward"),
])
def test_bad_reward_functions_stop_with_their_name(tmp_path, path, match):
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "eval.num_examples=0",
                                f"reward.functions=[{path}]"])
    with pytest.raises((ValueError, RuntimeError), match=match):
        trainer.train(config, show_progress=False)


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    """Rounds of two steps, every one non-finite, a limit of 2: the run stops right after the third skipped step,
    inside its round (not at the round's end), and saves that state first."""
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "eval.num_examples=0",
                                "train.max_nonfinite_steps=2", "train.steps_per_generation=2"])
    real = rounds.round_advantages

    def nan_advantages(*args, **kwargs):
        advantages, r, std = real(*args, **kwargs)
        return advantages * np.nan, r, std

    monkeypatch.setattr(rounds, "round_advantages", nan_advantages)
    with pytest.raises(RuntimeError, match="3 optimizer steps had a non-finite loss .*train.max_nonfinite_steps=2.*"
                                           "The state after step 3 was saved first"):
        trainer.train(config, show_progress=False)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["skipped"] for line in lines] == [1, 1, 1]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["3"]


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
    run, state, held = trainer.build(config)
    position = START
    for round_index in range(3):
        state, position, _, _ = trainer.run_round(run, state, position, round_index)
    assert int(state.step) == 6
    programs = run.programs
    # a static batch decodes in one program; the round's rows and its steps are one program each
    assert programs.decoder.generate._cache_size() == programs.step._cache_size() == programs.rows._cache_size() == 1
    if programs.ref_logps is not None:
        assert programs.ref_logps._cache_size() == 1
    assert programs.logps._cache_size() == 0  # float32: the sampler's log-probs serve as the old ones


@pytest.mark.parametrize("batch_size, gathers", [(32, 0), (16, 1)])
def test_a_step_gets_its_rows(tmp_path, batch_size, gathers):
    """A step of the whole round in order (whole groups per device) takes the round's rows as they are, without a
    gather program; a shuffled step gathers its rows. Either way it trains on exactly its rows."""
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "max_steps=1", "eval.num_examples=0",
                                f"train.train_batch_size={batch_size}"])
    run, state, held = trainer.build(config)
    taken, batches = [], []
    take, step = run.programs.take, run.programs.step
    run = spy(run, take=lambda batch, rows: taken.append(rows) or take(batch, rows),
              step=lambda state, batch, *packed: batches.append(jax.device_get(batch))
              or step(state, batch, *packed))
    _, _, round_batch, _ = trainer.run_round(run, state, START, 0)
    assert len(taken) == gathers and len(batches) == 1
    in_order = np.array_equal(round_batch.step_rows[0], np.arange(batch_size))
    assert in_order == (gathers == 0)
    for name in ("prompt_ids", "completion_ids", "completion_mask", "advantages", "ref_per_token_logps"):
        np.testing.assert_array_equal(getattr(batches[0], name),
                                      jax.device_get(getattr(round_batch.rows, name))[round_batch.step_rows[0]],
                                      err_msg=name)


def test_sampler_logps_serve_as_old_logps(tmp_path):
    """With float32 compute the sampler's log-probs equal a fresh forward pass of the same params."""
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "max_steps=2", "eval.num_examples=0",
                                "train.steps_per_generation=2"])
    run, state, held = trainer.build(config)
    rows = trainer.prepare_round(run, state, START, 0)[0].rows
    fresh = run.programs.logps(state.params, rows.prompt_ids, rows.prompt_mask, rows.completion_ids,
                               rows.completion_mask, None)
    mask = np.asarray(rows.completion_mask, bool)
    assert mask.sum() > 0
    np.testing.assert_allclose(np.asarray(rows.old_per_token_logps)[mask], np.asarray(fresh)[mask],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices, overrides, expected", [
    (1, [], (4, 4)),  # a step is the whole round in one micro-batch
    (1, ["train.steps_per_generation=2"], (4, 1)),  # steps take shuffled slices of the round, as TRL
    (1, ["train.gradient_accumulation_steps=2"], (4, 1)),  # micro-batches take every other row
    (1, ["train.share_prompt_prefix=false"], (1, 1)),
    (4, [], (4, 4)),  # 4 rows per device: one group each
    (8, [], (1, 1)),  # 2 rows per device: half a group
    (8, ["train.steps_per_generation=2"], (4, 1)),  # the round's 32 rows: 4 per device
])
def test_prompt_group_sizes(devices, overrides, expected):
    from grpo_jax.api import run as run_module
    from grpo_jax.device import sharding
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} devices")
    config = load_config(None, [*QUICK, *overrides])
    mesh = sharding.make_mesh(devices, 1, 1, devices=jax.devices()[:devices])
    assert run_module.prompt_group_sizes(config, mesh) == expected


def test_shared_prompt_round_equals_per_row_round(tmp_path):
    """Reference log-probs and the first update with each group's prompt run once equal the per-row ones."""
    out = {}
    for share in (True, False):
        config = load_config(None, [f"output_dir={tmp_path / str(share)}", *QUICK, "max_steps=1",
                                    "eval.num_examples=0", "train.train_batch_size=32",  # one group per device
                                    f"train.share_prompt_prefix={str(share).lower()}"])
        run, state, held = trainer.build(config)
        assert run.step_prompt_group_size == (4 if share else 1)
        _, _, round_batch, lines = trainer.run_round(run, state, START, 0)
        rows = round_batch.rows
        out[share] = (*jax.device_get((rows.completion_ids, rows.completion_mask, rows.ref_per_token_logps)),
                      lines[0])
    (ids, mask, ref, metrics), (ids_1, _, ref_1, metrics_1) = out[True], out[False]
    np.testing.assert_array_equal(ids, ids_1)  # the same samples: sampling does not depend on the option
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(ref[real], ref_1[real], rtol=1e-5, atol=1e-5)
    # the step's loss and gradient norm (params after Adam's first step would turn rounding noise in near-zero
    # gradients into lr-sized moves; tests/algo/test_train_step.py compares updates under SGD)
    for key in ("loss", "grad_norm", "kl", "entropy"):
        np.testing.assert_allclose(metrics[key], metrics_1[key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("overrides", [[], ["train.steps_per_generation=2", "model.dtype=bfloat16"]])
def test_packed_round_equals_padded_round(tmp_path, overrides):
    """train.packing: the round's reference log-probs and its updates (groups packed, or rows one by one when
    steps take shuffled slices) equal the padded layout's; bfloat16 adds the old-policy pass."""
    out = {}
    for packing in (True, False):
        config = load_config(None, [f"output_dir={tmp_path / str(packing)}", *QUICK, "max_steps=2",
                                    "eval.num_examples=0", f"train.packing={str(packing).lower()}", *overrides])
        run, state, held = trainer.build(config)
        _, _, round_batch, lines = trainer.run_round(run, state, START, 0)
        rows = round_batch.rows
        out[packing] = (*jax.device_get((rows.completion_mask, rows.ref_per_token_logps, rows.old_per_token_logps)),
                        lines)
        if packing:  # a few buffer lengths compile, not one per round
            assert 1 <= run.programs.step._cache_size() <= len(lines)
    (mask, ref, old, lines), (_, ref_1, old_1, lines_1) = out[True], out[False]
    real = np.asarray(mask, bool)
    assert real.sum() < real.size  # rows end at different lengths: the layouts differ
    # float32 rounding, or with bfloat16 forwards bfloat16's (each layout computes a token's hidden state in
    # another order: the packed one runs a group's last prompt token once per completion)
    tol = 1e-5 if not overrides else 2e-2
    np.testing.assert_allclose(ref[real], ref_1[real], rtol=tol, atol=tol)
    if old is not None:
        np.testing.assert_allclose(old[real], old_1[real], rtol=tol, atol=tol)
    for line, line_1 in zip(lines, lines_1, strict=True):
        for key in ("loss", "grad_norm", "kl", "entropy"):
            np.testing.assert_allclose(line[key], line_1[key], rtol=tol, atol=tol * 1e-2, err_msg=key)


def test_seeded_runs_are_reproducible(tmp_path):
    params = []
    for name in ("a", "b"):
        config = load_config(None, [f"output_dir={tmp_path / name}", *QUICK, "max_steps=2", "eval.num_examples=0"])
        run, state, held = trainer.build(config)
        state, position, _, _ = trainer.run_round(run, state, START, 0)
        state, _, _, _ = trainer.run_round(run, state, position, 1)
        params.append(jax.device_get(state.params))
    jax.tree.map(np.testing.assert_array_equal, *params)


def half_constant_reward(prompts, completions, **kwargs):
    """Constant for prompts starting with an even digit (zero-std groups), alternating 0/1 otherwise."""
    return [1.0 if int(p[0]) % 2 == 0 else float(i % 2) for i, p in enumerate(prompts)]


def alternating_reward(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def constant_reward(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def step_reward(prompts, completions, completion_ids, **kwargs):
    """Process supervision: one step ending at the last token, rewarded 1 for odd rows and 0 for even ones."""
    return [[(len(ids) - 1, float(i % 2))] if ids else None for i, ids in enumerate(completion_ids)]


def _one_round(tmp_path, overrides, loss_fn=None):
    """Builds a quick run, spies on the reward calls and the step batches, and runs one round."""
    config = load_config(None, [f"output_dir={tmp_path}", *QUICK, "max_steps=1", "eval.num_examples=0", *overrides])
    run, state, held = trainer.build(config, loss_fn=loss_fn)
    calls, batches = [], []
    step = run.programs.step
    run = dataclasses.replace(spy(run, step=lambda state, batch, *packed: batches.append(batch)
                                  or step(state, batch, *packed)),
                              reward_fns=[(name, lambda fn=fn, **kw: calls.append(kw["completion_ids"]) or fn(**kw))
                                          for name, fn in run.reward_fns])
    state, _, _, lines = trainer.run_round(run, state, START, 0)
    return run, state, calls, batches, lines[0]


def test_dynamic_sampling_trains_only_on_mixed_groups(tmp_path):
    run, _, calls, batches, line = _one_round(tmp_path, ["train.dynamic_sampling=true",
                                                      "reward.functions=[tests.api.test_trainer:half_constant_reward]"])
    assert line["dynamic_sampling/num_gen_batches"] == len(calls) >= 1
    assert line["dynamic_sampling/num_filled_groups"] == 0 and line["frac_reward_zero_std"] == 0.0
    advantages = np.asarray(batches[0].advantages).reshape(-1, 4)
    assert (np.abs(advantages) > 0.5).all()  # every trained group is 0/1 alternating: |A| = 1/std ≈ 0.87


def test_dynamic_sampling_fills_zero_std_groups_at_the_cap(tmp_path):
    _, _, calls, batches, line = _one_round(tmp_path, ["train.dynamic_sampling=true", "train.max_num_gen_batches=3",
                                                    "reward.functions=[tests.api.test_trainer:constant_reward]"])
    assert len(calls) == line["dynamic_sampling/num_gen_batches"] == 3
    assert line["dynamic_sampling/num_filled_groups"] == 4 and line["frac_reward_zero_std"] == 1.0
    assert line["dynamic_sampling/frac_zero_std_drawn"] == 1.0
    np.testing.assert_array_equal(batches[0].advantages, 0.0)


def test_mask_truncated_and_soft_overlong_punishment_in_the_loop(tmp_path):
    """Truncated rows train with mask 0; the built-in length penalty matches eq. 13 on the sampled lengths."""
    _, _, calls, batches, line = _one_round(tmp_path, [
        "train.mask_truncated_completions=true", "train.use_sampler_logps=true", "sampling.max_completion_length=4",
        "reward.soft_punish_cache=2",
        "reward.functions=[grpo_jax.data.task:char_accuracy,grpo_jax.rewards.functions:soft_overlong_punishment]"])
    lengths = np.array([len(ids) for ids in calls[0]])
    assert (lengths == 4).any() and (lengths < 4).any()  # some rows are truncated, some ended with EOS
    expected = np.where(lengths <= 2, 0.0, (2 - lengths) / 2)
    assert line["rewards/soft_overlong_punishment/mean"] == pytest.approx(expected.mean(), abs=1e-6)
    mask, seen = np.asarray(batches[0].loss_mask), np.asarray(batches[0].completion_mask)
    ended_with_eos = lengths < 4  # every completion of length 4 hit max_completion_length
    assert mask.sum() == lengths[ended_with_eos].sum() and seen.sum() == lengths.sum()  # attention sees them all
    sampler = np.asarray(batches[0].sampler_per_token_logps)  # handed to the loss, zero where nothing was sampled
    assert (sampler[seen == 0] == 0).all() and (sampler[seen == 1] < 0).all()
    # the step's rows are a permutation of the round's: compare the multisets of row lengths
    assert sorted(mask.sum(axis=1).tolist()) == sorted(np.where(ended_with_eos, lengths, 0).tolist())


def test_process_supervision_gives_per_token_advantages(tmp_path):
    _, _, _, batches, line = _one_round(tmp_path, ["train.advantage_estimator=process", "loss.beta=0",
                                                "reward.functions=[tests.api.test_trainer:step_reward]"])
    advantages, mask = np.asarray(batches[0].advantages), np.asarray(batches[0].completion_mask)
    assert advantages.shape == mask.shape
    np.testing.assert_array_equal(advantages[mask == 0], 0.0)
    assert np.isfinite(line["loss"]) and line["reward"] == pytest.approx(0.5)


def test_iterative_grpo_resets_the_reference_every_step(tmp_path):
    _, state, _, _, _ = _one_round(tmp_path, ["train.sync_ref_model=true", "train.ref_model_mixup_alpha=1.0",
                                         "train.ref_model_sync_steps=1"])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.ref_params), jax.device_get(state.params))


def test_train_accepts_a_custom_loss(tmp_path):
    from grpo_jax.losses import compute_loss
    traced = []

    def my_loss(*args, **kwargs):
        traced.append(1)
        loss, aux = compute_loss(*args, **kwargs)
        return loss, {"kl": aux.kl, "my/ratio": aux.clip_ratio_region}

    _, _, _, _, line = _one_round(tmp_path, [], loss_fn=my_loss)
    assert traced and "my/ratio" in line and "clip_ratio/low_mean" not in line


def test_training_from_a_hugging_face_folder(tmp_path):
    """model.path: weights, architecture and tokenizer come from the folder; the final policy goes back to it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import hf_fixtures

    from grpo_jax.data import task
    from grpo_jax.models import Model

    folder = hf_fixtures.save_model(hf_fixtures.build_model("qwen2", tied=True), tmp_path / "hf")
    task.build_tokenizer(tmp_path / "hf")  # the embedded task's characters; the model's vocab is larger
    config = load_config(None, [f"output_dir={tmp_path}/run", *QUICK, "max_steps=2", "eval.num_examples=0",
                                f"model.path={folder}", "loss.beta=0.04", "train.learning_rate=1e-3",
                                # rewards that differ inside every group: the update cannot be zero
                                "reward.functions=[tests.api.test_trainer:alternating_reward]"])
    run, state, held = trainer.build(config)
    assert run.config.model.hidden_size == 64 and run.config.model.vocab_size == hf_fixtures.VOCAB
    ids = np.array([[3, 4, 5, 6], [0, 7, 8, 9]], np.int32)
    mask = np.array([[1, 1, 1, 1], [0, 1, 1, 1]], np.int32)
    ours = np.asarray(Model(run.graphdef, run.config.model)(state.params, ids, mask))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(ids, dtype=torch.long),
                           attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours[mask == 1], theirs[mask == 1], atol=1e-4)

    trainer.train(dataclasses.replace(config, output_dir=str(tmp_path / "run2")), show_progress=False)
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run2" / "final", dtype=torch.float32)
    moved = [not torch.equal(a, b) for a, b in zip(final.state_dict().values(), reference.state_dict().values())]
    assert any(moved)  # trained, then written back in Hugging Face format


@pytest.mark.parametrize("sync", [False, True], ids=["frozen_ref", "tr_dpo"])
def test_offloaded_reference_trains_like_one_on_the_devices(tmp_path, sync):
    """train.offload_ref_params keeps the reference in host memory: the same rounds, metrics and params bit for bit,
    with a frozen reference and with TR-DPO mixing it after every step."""
    out = {}
    for offload in (False, True):
        config = load_config(None, [f"output_dir={tmp_path / str(offload)}", *QUICK, "max_steps=2",
                                    "eval.num_examples=0", "train.steps_per_generation=2",
                                    f"train.offload_ref_params={str(offload).lower()}",
                                    f"train.sync_ref_model={str(sync).lower()}", "train.ref_model_sync_steps=1"])
        run, state, held = trainer.build(config)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.ref_params)}
        assert kinds == ({"pinned_host"} if offload else {"device"})
        initial_ref = jax.device_get(state.ref_params)
        state, _, _, lines = trainer.run_round(run, state, START, 0)
        out[offload] = ([{k: v for k, v in line.items() if not k.startswith("step_time")} for line in lines],
                        jax.device_get((state.params, state.ref_params)))
    (lines, trees), (lines_on_device, trees_on_device) = out[True], out[False]
    assert len(lines) == 2 and lines == lines_on_device and lines[1]["kl"] > 0
    jax.tree.map(np.testing.assert_array_equal, trees, trees_on_device)
    moved = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trees[1]), jax.tree.leaves(initial_ref)))
    assert moved == sync  # with TR-DPO the comparison covers the mixing path


def digit_start(prompts, completions, **kwargs):
    """1 for completions that start with a digit: some of a random policy's, so pass@k and maj@n move."""
    return [float(c[:1] in tuple("0123456789")) for c in completions]


def _wandb_history(output_dir, run: str = "offline-run-*") -> list[dict]:
    """The history rows of the offline W&B run in output_dir (its folder `run`), read from its .wandb file (LevelDB
    log records of W&B's protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (output_dir / "wandb").glob(f"{run}/run-*.wandb")
    data, block, position, records, part = path.read_bytes(), 32768, 7, [], b""  # 7: W&B's file header
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a record header is padding
            position += block - position % block
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        part += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(part)
            part = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_reporting_and_evaluation_during_training(tmp_path, monkeypatch, capsys):
    """One short run with every output on: metrics in metrics.jsonl, TensorBoard (read back with its own reader)
    and W&B (offline), completion tables every logging_steps, evaluation every 2 steps with pass@k and maj@n, the
    plots; and it trains exactly as the same rounds run without evaluation or reporting."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("tensorboardX")
    has_wandb = importlib.util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # 4 held-out prompts x 4 samples at the training temperature: the same sampler programs as training's
    config = load_config(None, [
        f"output_dir={tmp_path / 'run'}", *QUICK, "eval.num_examples=4", "eval.steps=2", "eval.num_generations=4",
        "eval.pass_at_k=[1,2,4]", "eval.reward_functions=[tests.api.test_trainer:digit_start,grpo_jax.data.task:exact_match]",
        f"report_to=[jsonl,tensorboard{',wandb' if has_wandb else ''}]", "log_completions=true",
        "num_completions_to_print=2", "logging_steps=2"])
    summary = trainer.train(config, show_progress=False)
    out = tmp_path / "run"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [h for h in lines if "reward" in h], {h["step"]: h for h in lines if "eval/pass@1" in h}
    assert [h["step"] for h in steps] == [1, 2, 3, 4] and sorted(evals) == [0, 2, 4] and len(lines) == 7

    # evaluation: pass@1 is the fraction correct, pass@k grows with k, maj@4 is a fraction of the 4 prompts
    for h in evals.values():
        assert h["eval/pass@1"] == pytest.approx(h["eval/sampled/rewards/digit_start/mean"])
        assert h["eval/pass@1"] <= h["eval/pass@2"] <= h["eval/pass@4"] and h["eval/maj@4"] in (0, 0.25, 0.5, 0.75, 1)
        assert {"eval/greedy/digit_start", "eval/greedy/exact_match", "eval/sampled/reward"} <= set(h)
    assert 0 < evals[0]["eval/pass@1"] < evals[0]["eval/pass@4"]
    assert summary["eval_after"]["pass@4"] == evals[4]["eval/pass@4"]
    assert summary["eval_before"]["greedy/digit_start"] == evals[0]["eval/greedy/digit_start"]

    # TensorBoard: every metric under TRL's name there, the completion tables as text
    events = accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for tag, expected in (("train/reward", {h["step"]: h["reward"] for h in steps}),
                          ("eval/pass@2", {s: h["eval/pass@2"] for s, h in evals.items()})):
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert sorted(logged) == sorted(expected)
        np.testing.assert_allclose([logged[s] for s in expected], list(expected.values()), rtol=1e-6)  # float32
    assert [e.step for e in events.Tensors("completions/text_summary")] == [2, 4]

    # completions.jsonl: the whole round of each logging step, its rows giving the round's reward metrics
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 16 + [4] * 16
    for h in steps[1::2]:
        table = [r for r in rows if r["step"] == h["step"]]
        assert np.mean([r["reward"] for r in table]) == pytest.approx(h["reward"], rel=1e-5)
        assert np.mean([r["char_accuracy"] for r in table]) == pytest.approx(h["rewards/char_accuracy/mean"], rel=1e-5)
        for group in np.array([[r["reward"], r["advantage"]] for r in table]).reshape(4, 4, 2):
            np.testing.assert_allclose(group[:, 1].sum(), 0.0, atol=1e-4)  # group-centred
            assert (np.sign(group[:, 1]) == np.sign(group[:, 0] - group[:, 0].mean())).all()
    console = capsys.readouterr()
    assert [line.split("  ")[0] for line in console.err.splitlines() if line.startswith("grpo step")] \
        == ["grpo step 2/4", "grpo step 4/4"]
    assert "Step 2" in console.out and "Step 4" in console.out and "held-out eval at step 2:" in console.out
    shown = next(line for line in console.out.splitlines() if line.startswith("held-out eval at step 2:"))
    names = [item.split("=")[0] for item in shown.split(": ", 1)[1].split("  ")]  # each says greedy or sampled
    assert names == ["greedy/digit_start", "greedy/exact_match", "sampled/reward", "sampled/rewards/digit_start/mean",
                     "sampled/rewards/exact_match/mean", "sampled/completions/mean_length", "pass@1", "pass@2",
                     "pass@4", "maj@4", "loss"], shown  # loss: TRL's eval_loss of the sampled rows

    if has_wandb:  # an offline W&B run with the same metrics
        history = _wandb_history(out)
        logged = {(r["_step"], k): v for r in history for k, v in r.items() if not k.startswith("_")}
        assert all(logged[(h["step"], "train/reward")] == pytest.approx(h["reward"]) for h in steps)
        assert all(logged[(s, "eval/maj@4")] == evals[s]["eval/maj@4"] for s in (0, 2, 4))
        assert logged[(2, "completions/nrows")] == logged[(4, "completions/nrows")] == 16  # the tables
    assert (out / "reward.png").stat().st_size > 1000 and (out / "training.png").stat().st_size > 1000

    # the same config without evaluation or outputs, its rounds run one by one: the same training, line for line
    quiet = dataclasses.replace(config, output_dir=str(tmp_path / "quiet"), report_to=(), log_completions=False,
                                eval=dataclasses.replace(config.eval, num_examples=0))
    run, state, held = trainer.build(quiet)
    expected, position, seen = [], START, 0
    for round_index in range(4):
        state, position, round_batch, round_lines = trainer.run_round(run, state, position, round_index)
        seen += int(round_batch.token_counts.sum())  # TRL's num_tokens: every round's so far, the trainer adds it
        expected += [{**line, "num_tokens": seen} for line in round_lines]

    def untimed(line):
        return {k: v for k, v in json.loads(json.dumps({k: plain(v) for k, v in line.items()})).items()
                if not k.startswith("step_time")}
    assert [untimed(h) for h in steps] == [untimed(h) for h in expected]


def test_a_failed_setup_leaves_the_folder_as_it_was_and_the_corrected_command_runs(tmp_path, capsys):
    """Setup errors from the command line are one line without a traceback; config.yaml is written only once the
    run has built, so the corrected command is not refused as a different run."""
    from grpo_jax.api.cli import main as cli_main

    out = tmp_path / "run"
    args = [f"output_dir={out}", *QUICK, "max_steps=1", "eval.num_examples=0", "--no-progress"]
    assert cli_main([*args, "reward.functions=[tests.api.test_trainer:raising_reward]"]) == 1
    err = capsys.readouterr().err
    assert "raising_reward' raised KeyError" in err and "Traceback" not in err and err.count("\n") == 1, err
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]  # no config.yaml, data/ or tokenizer/ left
    assert cli_main(args) == 0
    assert (out / "config.yaml").is_file() and (out / "final").is_dir()
    capsys.readouterr()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main([f"output_dir={tmp_path / 'other'}", f"data.tokenizer_path={empty}", *args[1:]]) == 1
    err = capsys.readouterr().err
    assert f"data.tokenizer_path='{empty}' holds no tokenizer files" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err
