"""Math answer accuracy as a reward function: ``grpo_jax.math_rewards:accuracy`` (reads an "answer" column).

With ``math_verify`` installed (``pip install math-verify``) it is TRL's ``trl.rewards.accuracy_reward``
(LaTeX parsing, symbolic equality). Without it a small fallback compares the last ``\\boxed{...}`` of the
completion (else its last number) with the answer: equal as exact fractions when both are numbers
(``0.5 == 1/2 == \\frac{1}{2}``), else equal as strings after removing spaces, ``$`` and ``\\left``/``\\right``.
"""

from __future__ import annotations

import importlib.util
import re
from fractions import Fraction

from grpo_jax.data import completion_text

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The last boxed expression, else the last number in ``text``, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str | Fraction:
    text = re.sub(r"\\left|\\right|\\!|\\,|\$|\s", "", answer).rstrip(".")
    text = re.sub(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", text)
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return text


def fallback_accuracy(completion: str, answer: str) -> float:
    """1.0 when the extracted answer equals ``answer`` (see the module docstring), else 0.0."""
    predicted = extract_answer(completion)
    return float(predicted is not None and _normalize(predicted) == _normalize(str(answer)))


def has_math_verify() -> bool:
    """Whether ``math_verify`` (and so TRL's accuracy_reward) can be used."""
    return importlib.util.find_spec("math_verify") is not None


def accuracy(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 / 0.0 per completion for matching the row's ``answer``; None (skipped) where the answer is None."""
    texts = [completion_text(c) for c in completions]
    out: list[float | None] = [None] * len(texts)
    rows = [i for i, a in enumerate(answer) if a is not None]
    if has_math_verify():
        from trl.rewards import accuracy_reward
        scores = accuracy_reward([[{"role": "assistant", "content": texts[i]}] for i in rows],
                                 [str(answer[i]) for i in rows])
    else:
        scores = [fallback_accuracy(texts[i], answer[i]) for i in rows]
    for i, score in zip(rows, scores):
        out[i] = score
    return out
