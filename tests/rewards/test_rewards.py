"""Tests for grpo_jax.rewards.functions: resolving "module:function" and scoring with every error path."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_jax.data import task
from grpo_jax.rewards import reward_specs, functions as rewards


def test_resolve_reward_fn_ok(tmp_path, monkeypatch):
    assert reward_specs.resolve_reward_fn("grpo_jax.data.task:char_accuracy") is task.char_accuracy
    (tmp_path / "my_rewards_mod.py").write_text("class K:\n    @staticmethod\n    def f(**kw):\n        return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert callable(reward_specs.resolve_reward_fn("my_rewards_mod:K.f"))


@pytest.mark.parametrize("path, match", [
    ("grpo_jax.data.task.char_accuracy", r"'grpo_jax.data.task.char_accuracy' has no ':'.*package.module:function"),
    ("grpo_jax.data.task:", r"incomplete.*package.module:function"),
    ("no_such_module_xyz:f", r"'no_such_module_xyz:f'.*could not be imported.*No module named 'no_such_module_xyz'"),
    ("grpo_jax.data.task:nope", r"'grpo_jax.data.task:nope'.*no attribute 'nope'"),
    ("grpo_jax.data.task:CHARS", r"'grpo_jax.data.task:CHARS'.*str, not callable"),
])
def test_resolve_reward_fn_errors(path, match):
    with pytest.raises(ValueError, match=match):
        reward_specs.resolve_reward_fn(path)


def test_resolve_reward_fn_module_raising_import_error(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="broken_rewards_mod.*not_installed_dep_xyz"):
        reward_specs.resolve_reward_fn("broken_rewards_mod:f")


def test_score_completions_values_and_none():
    def half_none(prompts, completions, **kw):
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    def np_out(prompts, completions, answer, **kw):
        return np.array([len(c) for c in completions], dtype=np.int64)

    fns = [("acc", task.char_accuracy), ("exact", task.exact_match), ("half", half_none), ("np", np_out)]
    out = rewards.score_completions(fns, ["a>", "b>", "c>"], ["123", "12", "321"], {"answer": ["123"] * 3})
    assert out.dtype == np.float32 and out.shape == (3, 4)
    expected = np.array([[1, 1, 0.5, 3], [2 / 3, 0, np.nan, 2], [1 / 3, 0, 0.5, 3]], dtype=np.float32)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert math.isnan(out[1, 2])


def test_score_completions_passes_columns_as_kwargs():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return [1.0] * len(completions)

    rewards.score_completions([("spy", spy)], ["p1", "p2"], ["c1", "c2"], {"answer": ["a", "b"], "id": [3, 4]})
    assert seen == {"prompts": ["p1", "p2"], "completions": ["c1", "c2"], "answer": ["a", "b"], "id": [3, 4]}


def _raises(prompts, completions, **kw):
    raise KeyError("answer")


@pytest.mark.parametrize("ret, exc, match", [
    ([1.0], ValueError, r"'bad' returned 1 rewards for 2 completions"),
    (1.0, ValueError, r"'bad' returned float: it must return a list"),
    ("10", ValueError, r"'bad' returned str"),
    ([1.0, float("inf")], ValueError, r"'bad' returned inf at index 1: return None to skip a completion instead"),
    ([float("nan"), 1.0], ValueError, r"'bad' returned nan at index 0: return None to skip"),
    ([1.0, "1"], ValueError, r"'bad' returned str '1' at index 1: rewards must be numbers"),
    ([1.0, 1e39], ValueError, r"'bad' returned 1e\+39 at index 1: beyond float32's range"),
])
def test_score_completions_bad_returns(ret, exc, match):
    with pytest.raises(exc, match=match):
        rewards.score_completions([("ok", task.exact_match), ("bad", lambda **kw: ret)],
                                  ["p", "q"], ["1", "2"], {"answer": ["1", "2"]})


def test_score_completions_function_raises():
    with pytest.raises(RuntimeError, match=r"'boom' raised KeyError") as info:
        rewards.score_completions([("boom", _raises)], ["p"], ["c"], {})
    assert isinstance(info.value.__cause__, KeyError)


def test_each_reward_function_gets_its_own_copy_of_its_arguments():
    def editing(prompts, completions, completion_ids, answer):
        prompts[0], completions[0], answer[1] = "edited", "edited", "edited"
        completion_ids[0].append(99)
        return [0.0, 0.0]

    seen = []

    def spy(**kwargs):
        seen.append(kwargs)
        return [1.0, 1.0]

    columns = {"answer": ["a", "b"], "completion_ids": [[1], [2, 1]]}
    scores = rewards.score_completions([("editing", editing), ("spy", spy)], ["p", "q"], ["c", "d"], columns)
    assert seen == [{"prompts": ["p", "q"], "completions": ["c", "d"], **columns}]
    assert columns == {"answer": ["a", "b"], "completion_ids": [[1], [2, 1]]}
    np.testing.assert_array_equal(scores, [[0.0, 1.0], [0.0, 1.0]])


def test_score_completions_column_length_mismatch():
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        rewards.score_completions([("acc", task.char_accuracy)], ["p", "q"], ["1", "2"], {"answer": ["1"]})


def test_soft_overlong_punishment_hand_computed():
    """DAPO eq. 13 with L_max = 10, L_cache = 4: 0 up to 6 tokens, then -(L - 6)/4, and -1 beyond 10."""
    ids = [[0] * n for n in (0, 5, 6, 7, 9, 10, 11)]
    expected = [0.0, 0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert rewards.soft_overlong_punishment(completion_ids=ids, max_completion_len=10, soft_punish_cache=4) == expected
    trl_style = rewards.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    assert trl_style(completion_ids=ids, prompts=None, completions=None) == expected
    with pytest.raises(ValueError, match="soft_punish_cache=0"):
        rewards.get_soft_overlong_punishment(10, 0)


def test_score_steps_merges_weighted_steps_into_padded_arrays():
    def steps_a(prompts, completions, **kw):
        return [[(0, 1.0), (2, 0.5)], None, [(1, None)]]

    def steps_b(prompts, completions, **kw):
        return [[(1, 2.0)], [(0, 1.0)], None]

    out, step_rewards, indices = rewards.score_steps([("a", steps_a), ("b", steps_b)], [1.0, 0.5], ["p"] * 3,
                                                    ["x", "y", "z"], {}, [3, 1, 2])
    np.testing.assert_array_equal(out, [[1.5, 2.0], [np.nan, 1.0], [np.nan, np.nan]])
    np.testing.assert_array_equal(indices, [[0, 2, 1], [0, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(step_rewards, [[1.0, 0.5, 1.0], [0.5, np.nan, np.nan], [np.nan] * 3])


@pytest.mark.parametrize("ret, match", [
    ([[(3, 1.0)]], r"step index 3 at index 0: it must be an int in \[0, 3\)"),
    ([[1.0]], "each step is an \\(end_token_index, reward\\) pair"),
    ([0.5], "process supervision needs a list of"),
])
def test_score_steps_rejects_malformed_steps(ret, match):
    with pytest.raises(ValueError, match=match):
        rewards.score_steps([("bad", lambda **kw: ret)], [1.0], ["p"], ["c"], {}, [3])


def test_trl_keywords_reach_the_functions_that_take_them():
    """TRL 1.16 passes trainer_state, log_metric and log_extra to every reward function; here a function gets them
    when it names them or takes **kwargs, and one with neither keeps working."""
    log = rewards.RewardLog()
    state = rewards.trainer_state(7, 100, 0.25)
    seen = {}

    def named(prompts, completions, trainer_state, log_metric, log_extra, answer):
        seen["named"] = trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch
        log_metric("named/score", 2.0)
        log_metric("named/score", 4.0)
        log_extra("judge", ["a", "b"])
        return [1.0, 2.0]

    def catch_all(prompts, completions, **kwargs):
        seen["catch_all"] = sorted(k for k in kwargs if k != "answer")
        return [0.0, 0.0]

    def plain_fn(prompts, completions, answer):
        return [float(a == c) for a, c in zip(answer, completions)]

    context = {"trainer_state": state, "log_metric": log.log_metric, "log_extra": log.log_extra}
    out = rewards.score_completions([("n", named), ("c", catch_all), ("p", plain_fn)], ["x", "y"], ["1", "2"],
                                    {"answer": ["1", "0"]}, context)
    np.testing.assert_array_equal(out, [[1.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    assert seen == {"named": (7, 100, 0.25), "catch_all": ["log_extra", "log_metric", "trainer_state"]}
    assert log.metric_means() == {"named/score": 3.0} and dict(log.extra) == {"judge": ["a", "b"]}


def test_async_reward_functions_are_awaited_concurrently():
    """Each of two async functions waits for the other to have started: awaited one after the other they would
    never finish (the timeout fails the test), awaited together both return."""
    import asyncio

    events: dict = {}

    def make(me, other):
        async def judge(prompts, completions, **kwargs):
            events.setdefault(me, asyncio.Event()).set()
            await asyncio.wait_for(events.setdefault(other, asyncio.Event()).wait(), timeout=10)
            return [len(c) for c in completions]
        return judge

    out = rewards.score_completions([("a", make("a", "b")), ("b", make("b", "a")), ("len", lambda prompts,
                                     completions, **kw: [0.5] * len(completions))], ["p", "q"], ["xy", "z"], {})
    np.testing.assert_array_equal(out, [[2.0, 2.0, 0.5], [1.0, 1.0, 0.5]])


def test_a_coroutine_from_a_synchronous_call_is_an_error_naming_the_function():
    async def scores(completions):
        return [1.0] * len(completions)

    def wrapper(prompts, completions, **kwargs):  # forgot to await
        return scores(completions)

    with pytest.raises(ValueError, match="reward function 'wrapper' returned a coroutine"):
        rewards.score_completions([("wrapper", wrapper)], ["p"], ["c"], {})


@pytest.mark.parametrize("fn, match", [
    (lambda prompts, completions, **kw: "1.0", "reward function 'f' returned str"),
    (lambda prompts, completions, answer: [1.0] * len(completions), "unexpected keyword argument 'level'"),
    (lambda prompts, completions, **kw: [completions[0][0]["content"][0]] * len(completions),
     "raised IndexError"),
])
def test_reward_functions_are_checked_on_the_first_rows_with_empty_completions(fn, match):
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "level": 1}] * 2
    with pytest.raises(ValueError, match=match) as info:
        rewards.check_reward_fns([("f", fn)], rows, eos_token_id=0, where="train.jsonl")
    assert "checked before compiling, on the first 2 rows of train.jsonl with empty completions" in str(info.value)
    rewards.check_reward_fns([("f", lambda prompts, completions, **kw: [None] * len(prompts))], rows, 0,
                             where="train.jsonl")


def test_trainer_state_has_transformers_fields_and_defaults():
    from transformers import TrainerState

    names = [f.name for f in dataclasses.fields(TrainerState)]
    assert [f.name for f in dataclasses.fields(rewards.TrainerState)] == names
    assert dataclasses.asdict(rewards.TrainerState()) == dataclasses.asdict(TrainerState())
    assert dataclasses.asdict(rewards.trainer_state(7, 100, 0.25)) \
        == dataclasses.asdict(TrainerState(global_step=7, max_steps=100, epoch=0.25))


def test_checking_reward_functions_leaves_the_trainer_stack_unimported():
    """A run's start (its modules, the reward functions' check with TRL's keywords) imports neither transformers'
    Trainer nor peft: with torch and peft installed they would cost every start seconds."""
    script = ("import sys, grpo_jax.api.run; from grpo_jax.rewards import functions as rewards; rewards.check_reward_fns("
              "[('f', lambda prompts, completions, trainer_state, **kw: [1.0] * len(prompts))], [{'prompt': 'p'}], 0, "
              "where='rows'); print(sorted(m for m in ('peft', 'transformers.trainer_callback') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def no_opinion(prompts, completions, **kwargs):
    """A reward function that scores nothing (a column it needs is missing, a parser that never matches)."""
    return [None] * len(completions)


def test_unscored_names_the_functions_that_scored_nothing_and_counts_the_rows_nobody_scored():
    nan = math.nan
    rewards_NxF = np.array([[1.0, nan, nan], [nan, nan, nan], [0.0, nan, 2.0]], np.float32)
    assert rewards.unscored(rewards_NxF, ["a", "b", "c"]) == (("b",), 1)  # b: no row; row 1: no function
    assert rewards.unscored(np.full((2, 2), nan, np.float32), ["a", "b"]) == (("a", "b"), 2)
    assert rewards.unscored(np.zeros((2, 1), np.float32), ["a"]) == ((), 0)


def test_a_reward_function_that_returns_none_for_everything_is_warned_about_once_on_stderr(tmp_path):
    """Every round trains on nothing: one warning names the function and the first round (not one per round), and
    numpy's "Mean of empty slice" warnings about the NaN metrics are not printed."""
    import json
    import subprocess
    import sys

    from tests.io.test_checkpoint import ROOT, TINY

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={out}", *TINY, "max_steps=4",
           "reward.functions=[tests.rewards.test_rewards:no_opinion]"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["rewards/no_opinion/mean"] is None for line in lines)  # 2 rounds of 2 steps
    warned = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1, result.stderr
    assert ("every reward function ('tests.rewards.test_rewards:no_opinion') returned None for every completion of round 0 "
            "(step 1): the round trains on nothing") in warned[0]
    assert "Mean of empty slice" not in result.stderr and "Degrees of freedom" not in result.stderr, result.stderr
    # TRL's own line on its logger, with the first unscored row's keywords, once a run too (TRL: every batch)
    assert result.stderr.count("All reward functions returned None for the following kwargs:\n{") == 1, result.stderr
    assert "'prompt': '" in result.stderr and "'completion': '" in result.stderr and "'answer': '" in result.stderr
