"""The embedded default task: tiny verifiable digit puzzles, a character tokenizer, graded rewards.

Used when the user gives no model or data. A random-init tiny transformer has to learn these with GRPO on a
CPU in minutes, so the main reward (`char_accuracy`) gives partial credit from the first step: a completion of
the right length with a few right digits already scores above zero, which gives groups non-zero std. The default
run adds `exact_match`, so that a whole answer beats one with a digit wrong by more than that digit's share.

Tasks (the separator char tells them apart, so tasks can be mixed in one dataset):
  reverse: "4821>" -> "1284"
  sort:    "4821^" -> "1248"      (digits ascending)
  add:     "12+345=" -> "357"
Reward functions follow TRL's GRPOTrainer convention `fn(prompts, completions, **columns) -> list[float|None]`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

EOS_TOKEN, UNK_TOKEN = "<eos>", "<unk>"
# EOS doubles as padding, and "<unk>" decodes to visible text: a special token that decodes to nothing
# (a distinct pad or unk) would let the policy hide characters from the length-aware reward
SPECIAL_TOKENS = (EOS_TOKEN, UNK_TOKEN)  # ids 0, 1
CHARS = "0123456789+=>^ "
TASKS = ("reverse", "sort", "add")
_DIGITS = "0123456789"


def build_tokenizer(path: str | os.PathLike | None = None):
    """Character-level tokenizer over SPECIAL_TOKENS + CHARS; saved to `path` (if given) for AutoTokenizer."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # One pre-token per character (spaces included), so WordLevel maps each char to its own id.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse joins decoded chars with no separator; the default would put spaces between tokens.
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if path is not None:
        tokenizer.save_pretrained(os.fspath(path))
    return tokenizer


def digit_string(rng: np.random.Generator, length: int, *, leading_zero: bool) -> str:
    """A random string of `length` digits (first digit non-zero unless leading_zero or length == 1)."""
    digits = rng.integers(0, 10, size=length)
    if not leading_zero and length > 1:
        digits[0] = rng.integers(1, 10)
    return "".join(_DIGITS[d] for d in digits)


def _reverse(rng: np.random.Generator, length: int) -> tuple[str, str]:
    s = digit_string(rng, length, leading_zero=True)
    return f"{s}>", s[::-1]


def _sort(rng: np.random.Generator, length: int) -> tuple[str, str]:
    s = digit_string(rng, length, leading_zero=True)
    return f"{s}^", "".join(sorted(s))


def _add(rng: np.random.Generator, length: int) -> tuple[str, str]:
    # `length` is the digit count of the first operand; the second gets its own draw in [1, length].
    b_len = int(rng.integers(1, length + 1))
    a = digit_string(rng, length, leading_zero=False)
    b = digit_string(rng, b_len, leading_zero=False)
    return f"{a}+{b}=", str(int(a) + int(b))


_GENERATORS: dict[str, Callable[[np.random.Generator, int], tuple[str, str]]] = {
    "reverse": _reverse,
    "sort": _sort,
    "add": _add,
}


def check_sizes(n: int, min_len: int, max_len: int) -> None:
    """A ValueError unless `n` rows of `min_len`..`max_len` digits can be made."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"min_len={min_len}, max_len={max_len}: need 1 <= min_len <= max_len")


def make_examples(task: str, n: int, seed: int, min_len: int = 3, max_len: int = 5) -> list[dict[str, str]]:
    """`n` rows {"prompt", "answer"} of `task`, lengths uniform in [min_len, max_len]; deterministic in seed.

    Length means digits of the string (reverse, sort) or of the first operand (add).
    """
    if task not in _GENERATORS:
        raise ValueError(f"task={task!r} is unknown: choose one of {', '.join(TASKS)}")
    check_sizes(n, min_len, max_len)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        prompt, answer = _GENERATORS[task](rng, length)
        rows.append({"prompt": prompt, "answer": answer})
    return rows


def write_jsonl(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Write rows as one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _check_lengths(completions: list[str], answer: list[str]) -> None:
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")


def char_accuracy(prompts: list[str], completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """Per completion: #{i : c[i] == a[i]} / max(len(a), len(c)); 1.0 iff c == a (both empty -> 1.0)."""
    del prompts, kwargs
    _check_lengths(completions, answer)
    rewards = []
    for c, a in zip(completions, answer):
        denom = max(len(a), len(c))
        matches = sum(x == y for x, y in zip(c, a))
        rewards.append(1.0 if denom == 0 else matches / denom)
    return rewards


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """Per completion: 1.0 if c == a else 0.0."""
    del prompts, kwargs
    _check_lengths(completions, answer)
    return [float(c == a) for c, a in zip(completions, answer)]
