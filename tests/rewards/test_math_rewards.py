"""Math accuracy reward: answer extraction, the fallback comparison, TRL's completion format, None answers."""

import subprocess
import sys
from pathlib import Path

import pytest

from grpo_jax.rewards import math as math_rewards


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}} and then \boxed{42}.", "42"),
    (r"\boxed{x^{2}+1}", "x^{2}+1"),
    ("The total is 1,234 apples; 7 were eaten.", "7"),
    ("no answer here", None),
    (r"\boxed{unclosed", None),
])
def test_extract_answer(text, expected):
    assert math_rewards.extract_answer(text) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"$\boxed{ 1/2 }$", r"\frac{1}{2}", 1.0),
    ("so it is 1,234.", "1234", 1.0),
    ("so it is 1234.5", "1234", 0.0),
    (r"\boxed{x^{2} + 1}", "x^{2}+1", 1.0),
    (r"\boxed{x+1}", "x+2", 0.0),
    ("nothing", "3", 0.0),
])
def test_fallback_accuracy(completion, answer, expected):
    assert math_rewards.fallback_accuracy(completion, answer) == expected


def test_accuracy_takes_strings_and_chat_completions_and_skips_missing_answers(monkeypatch):
    monkeypatch.setattr(math_rewards, "has_math_verify", lambda: False)
    completions = [r"\boxed{4}", [{"role": "assistant", "content": r"\boxed{5}"}], "3"]
    assert math_rewards.accuracy(None, completions, answer=["4", "4", None]) == [1.0, 0.0, None]


def test_accuracy_uses_math_verify_when_installed():
    pytest.importorskip("math_verify")
    completions = [[{"role": "assistant", "content": r"\boxed{\frac{1}{3}}"}], r"\boxed{\frac{1}{2}}"]
    assert math_rewards.accuracy(None, completions, answer=[r"\frac{1}{3}", r"\frac{1}{3}"]) == [1.0, 0.0]


def test_a_multi_turn_completion_is_scored_by_its_last_assistant_message():
    """Tool results are not the answer: a rollout's text is its last assistant turn, even when a tool ends it."""
    from grpo_jax.data.prompts import completion_text as _text

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "python"}}]}
    assert _text([call, {"role": "tool", "name": "python", "content": "42"},
                  {"role": "assistant", "content": "\\boxed{42}"}]) == "\\boxed{42}"
    assert _text([call, {"role": "tool", "name": "python", "content": "42"}]) == ""


def test_math_verify_scores_as_trl_and_needs_no_trl():
    """The same scores as TRL's accuracy_reward (symbolic equality, units, an unparseable answer skipped), and with
    TRL hidden too: `pip install -e ".[math]"` installs math-verify without it."""
    pytest.importorskip("math_verify")
    texts = [r"\boxed{(x+1)^2}", r"so \boxed{\frac{1}{2}}", "0.5", r"\boxed{3\text{ cm}}", r"$\boxed{-7}$", "none",
             r"\boxed{2}", r"\boxed{\sqrt{2}/2}"]
    answers = ["$x^2+2x+1$", "0.5", "1/2", "3", "-7", "4", "not math at all ?!", r"$\frac{1}{\sqrt{2}}$"]
    scores = math_rewards.math_verify_accuracy(texts, answers)
    assert scores == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, None, 1.0]  # symbolic, units dropped, "0.5" not in LaTeX
    assert [math_rewards.fallback_accuracy(t, a) for t, a in zip(texts, answers)][:4] == [0.0, 1.0, 1.0, 0.0]
    script = ("import sys; sys.modules['trl'] = None; from grpo_jax.rewards import math as math_rewards; "
              "print(math_rewards.accuracy(None, [r'\\boxed{(x+1)^2}'], answer=['$x^2+2x+1$']))")
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "[1.0]", result.stderr
    trl_rewards = pytest.importorskip("trl.rewards")
    assert scores == trl_rewards.accuracy_reward([[{"role": "assistant", "content": t}] for t in texts], answers)
