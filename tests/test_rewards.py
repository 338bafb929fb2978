"""Tests for grpo_jax.rewards: resolving "module:function" and scoring with every error path."""

import math

import numpy as np
import pytest

from grpo_jax import rewards, task


def test_resolve_reward_fn_ok(tmp_path, monkeypatch):
    assert rewards.resolve_reward_fn("grpo_jax.task:char_accuracy") is task.char_accuracy
    (tmp_path / "my_rewards_mod.py").write_text("class K:\n    @staticmethod\n    def f(**kw):\n        return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert callable(rewards.resolve_reward_fn("my_rewards_mod:K.f"))


@pytest.mark.parametrize("path, match", [
    ("grpo_jax.task.char_accuracy", r"'grpo_jax.task.char_accuracy' has no ':'.*package.module:function"),
    ("grpo_jax.task:", r"incomplete.*package.module:function"),
    ("no_such_module_xyz:f", r"'no_such_module_xyz:f'.*could not be imported.*No module named 'no_such_module_xyz'"),
    ("grpo_jax.task:nope", r"'grpo_jax.task:nope'.*no attribute 'nope'"),
    ("grpo_jax.task:CHARS", r"'grpo_jax.task:CHARS'.*str, not callable"),
])
def test_resolve_reward_fn_errors(path, match):
    with pytest.raises(ValueError, match=match):
        rewards.resolve_reward_fn(path)


def test_resolve_reward_fn_module_raising_import_error(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="broken_rewards_mod.*not_installed_dep_xyz"):
        rewards.resolve_reward_fn("broken_rewards_mod:f")


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
])
def test_score_completions_bad_returns(ret, exc, match):
    with pytest.raises(exc, match=match):
        rewards.score_completions([("ok", task.exact_match), ("bad", lambda **kw: ret)],
                                  ["p", "q"], ["1", "2"], {"answer": ["1", "2"]})


def test_score_completions_function_raises():
    with pytest.raises(RuntimeError, match=r"'boom' raised KeyError") as info:
        rewards.score_completions([("boom", _raises)], ["p"], ["c"], {})
    assert isinstance(info.value.__cause__, KeyError)


def test_score_completions_column_length_mismatch():
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        rewards.score_completions([("acc", task.char_accuracy)], ["p", "q"], ["1", "2"], {"answer": ["1"]})
