"""Math answer accuracy as a reward function: ``grpo_jax.rewards.math:accuracy`` (reads an "answer" column).

With ``math_verify`` installed (``pip install -e ".[math]"``; TRL is not needed) it scores as TRL's
``trl.rewards.accuracy_reward`` does (LaTeX parsing, symbolic equality; an answer it cannot parse is skipped, None).
Without it a small fallback compares the last ``\\boxed{...}`` of the
completion (else its last number) with the answer: equal as exact fractions when both are numbers
(``0.5 == 1/2 == \\frac{1}{2}``), else equal as strings after removing spaces, ``$`` and ``\\left``/``\\right``.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading
from fractions import Fraction

from grpo_jax.data.prompts import completion_text

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
    """Whether ``math_verify`` can be used."""
    return importlib.util.find_spec("math_verify") is not None


def math_verify_accuracy(texts: list[str], answers: list[str]) -> list[float | None]:
    """TRL 1.16's ``accuracy_reward`` scoring, with math-verify alone (tests/rewards/test_math_rewards.py compares the two):
    1.0 / 0.0 when the completion's first LaTeX answer (boxed first) verifies against the parsed answer, None when
    the answer does not parse."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()  # math-verify times out with signal.alarm
    parsing_timeout, verify_timeout = (10, 5) if main else (None, None)
    if not main:  # its warnings that timeouts are off, as TRL silences them
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                        try_extract_without_anchor=False)]
    scores: list[float | None] = []
    for text, answer in zip(texts, answers, strict=True):
        gold = parse(answer, parsing_timeout=parsing_timeout)
        if not gold:
            scores.append(None)
            continue
        predicted = parse(text, extraction_config=extraction, extraction_mode="first_match",
                          parsing_timeout=parsing_timeout)
        scores.append(float(verify(gold, predicted, timeout_seconds=verify_timeout)))
    return scores


def accuracy(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 / 0.0 per completion for matching the row's ``answer``; None (skipped) where the answer is None."""
    texts = [completion_text(c) for c in completions]
    out: list[float | None] = [None] * len(texts)
    rows = [i for i, a in enumerate(answer) if a is not None]
    if has_math_verify():
        scores = math_verify_accuracy([texts[i] for i in rows], [str(answer[i]) for i in rows])
    else:
        scores = [fallback_accuracy(texts[i], answer[i]) for i in rows]
    for i, score in zip(rows, scores):
        out[i] = score
    return out
