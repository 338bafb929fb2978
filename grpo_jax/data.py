"""Prompts: read a JSONL file (other sources: `grpo_jax.sources`), check every row, tokenize to static left-padded
shapes, iterate in seeded epochs, repeat per group.

Rows follow TRL's dataset convention: a "prompt" column plus any other columns (e.g. "answer"), which are handed
to reward functions as keyword arguments. A prompt is a plain string (used as it is) or, in TRL's conversational
format, a list of {"role", "content"} messages rendered with the tokenizer's chat template. Shapes: P prompts per
round, L = max_prompt_length, G = num_generations.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class PromptBatch(NamedTuple):
    """P prompts, left-padded to L tokens, with their other dataset columns."""

    prompt_ids: np.ndarray  # [P, L] int32, pad id on the left
    prompt_mask: np.ndarray  # [P, L] int32, 1 on real tokens
    prompts: list  # [P] raw prompts: strings, or message lists (conversational rows)
    columns: dict[str, list]  # column name -> [P] values (every column but "prompt")
    num_truncated: int  # prompts (of these P) that were left-truncated to L


def load_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read one JSON object per line; each needs a string "prompt". Blank lines are skipped."""
    return read_jsonl(path)[0]


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[int]]:
    """`load_jsonl`'s rows and the line number (from 1) of each in the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist: check data.path")
    rows, lines = [], []
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {k} is not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {k} is a JSON {type(row).__name__}, not an object: "
                                 "each line needs a 'prompt' field (string)")
            if "prompt" not in row:
                raise ValueError(f"{path}: line {k} has no 'prompt' column (has {sorted(row)}): "
                                 "each line needs a 'prompt' field (string)")
            prompt = row["prompt"]
            if isinstance(prompt, list):
                problem = message_problem(prompt)
                if problem:
                    raise ValueError(f"{path}: line {k}: 'prompt' is a list but not chat messages ({problem}): "
                                     "use a string or a list of {\"role\": ..., \"content\": ...} objects")
            elif not isinstance(prompt, str):
                raise ValueError(f"{path}: line {k}: 'prompt' is a {type(prompt).__name__}, "
                                 "each line needs a 'prompt' field (string or list of chat messages)")
            rows.append(row)
            lines.append(k)
    if not rows:
        raise ValueError(f"data file {path!r} is empty: it needs at least one line with a 'prompt' field")
    return rows, lines


def check_prompts(where, prompts: Sequence, lines: list[int] | None, tokenizer, max_prompt_length: int | None,
                  truncation: str, chunk: int = 1024) -> np.ndarray:
    """Before the first step: every prompt renders and tokenizes to at least one token (and, with
    truncation="error", to at most `max_prompt_length`); a ValueError names the file (`where`) and line (`lines`,
    else the row's index) of the first that does not, so no row can stop a run halfway through its data.
    Returns each prompt's length in tokens."""
    lengths = np.zeros(len(prompts), np.int64)
    for start in range(0, len(prompts), chunk):
        part = list(prompts[start:start + chunk])
        try:
            token_lists = tokenizer([render_prompt(tokenizer, p) for p in part], add_special_tokens=False)
            token_lists = token_lists["input_ids"]
        except Exception:  # noqa: BLE001 - one row of the chunk failed: find it below
            token_lists = [None] * len(part)
        for i, (prompt, tokens) in enumerate(zip(part, token_lists)):
            row = f"line {lines[start + i]}" if lines is not None else f"row {start + i}"
            if tokens is None:
                try:
                    tokens = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
                except Exception as e:  # whatever the tokenizer rejects, name the row
                    raise ValueError(f"{where}: {row}: the prompt {_preview(prompt)} cannot be tokenized "
                                     f"({type(e).__name__}: {e}): fix or remove that row") from e
            if not tokens:
                raise ValueError(f"{where}: {row}: the prompt {_preview(prompt)} tokenizes to zero tokens: remove "
                                 "that row")
            if truncation == "error" and max_prompt_length is not None and len(tokens) > max_prompt_length:
                raise ValueError(f"{where}: {row}: the prompt {_preview(prompt)} has {len(tokens)} tokens > "
                                 f"data.max_prompt_length={max_prompt_length}: raise data.max_prompt_length (or "
                                 "null: fit the data), shorten that row, or set data.truncation=left")
            lengths[start + i] = len(tokens)
    return lengths


def prompt_column(rows) -> Sequence:
    """The 'prompt' of every row: a list of dicts' values, or a `datasets.Dataset`'s column."""
    return rows["prompt"] if hasattr(rows, "column_names") else [row["prompt"] for row in rows]


def message_problem(messages: list) -> str | None:
    """Why a list is not a TRL conversation (None when it is one)."""
    if not messages:
        return "it is empty"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is {m!r}, not an object with string 'role' and 'content'"
    return None


def is_conversational(prompt) -> bool:
    """True for a TRL conversational prompt (a list of {"role", "content"} messages)."""
    return isinstance(prompt, list)


def render_prompt(tokenizer, prompt) -> str:
    """A string prompt as it is; messages through the chat template with the generation prompt (TRL 1.16)."""
    if not is_conversational(prompt):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a prompt is a list of chat messages but the tokenizer has no chat template: use a chat "
                         "model's tokenizer (model.path / data.tokenizer_path) or plain string prompts")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def reward_inputs(prompts: list, completions: list[str]) -> tuple[list, list]:
    """(prompts, completions) as TRL's GRPOTrainer hands them to reward functions.

    Conversational rows keep their message list as the prompt and get ``[{"role": "assistant", "content":
    text}]`` as the completion; string rows pass through unchanged.
    """
    wrapped = [[{"role": "assistant", "content": text}] if is_conversational(prompt) else text
               for prompt, text in zip(prompts, completions, strict=True)]
    return list(prompts), wrapped


def tokenize_prompts(tokenizer, prompts: list, max_prompt_length: int,
                     truncation: str = "left") -> tuple[np.ndarray, np.ndarray, int]:
    """Tokenize without special tokens and left-pad to exactly L; returns (ids_PxL, mask_PxL, num_truncated).

    Message-list prompts are rendered with the chat template first (``render_prompt``). Longer prompts keep
    their last L tokens (truncation="left") or raise (truncation="error").
    """
    ids_PxL, mask_PxL, truncated_P = _tokenize(tokenizer, prompts, max_prompt_length, truncation)
    return ids_PxL, mask_PxL, int(truncated_P.sum())


def _check_truncation(truncation: str) -> None:
    if truncation not in ("left", "error"):
        raise ValueError(f"data.truncation={truncation!r} is unknown: use 'left' or 'error'")


def _tokenize(tokenizer, prompts: list, max_prompt_length: int, truncation: str):
    """`tokenize_prompts` with a per-prompt truncation flag [P] bool in place of the count."""
    _check_truncation(truncation)
    if max_prompt_length < 1:
        raise ValueError(f"data.max_prompt_length={max_prompt_length} must be >= 1")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token: set tokenizer.pad_token")
    texts = [render_prompt(tokenizer, p) for p in prompts]
    token_lists = tokenizer(texts, add_special_tokens=False)["input_ids"] if prompts else []
    ids_PxL = np.full((len(prompts), max_prompt_length), pad_id, dtype=np.int32)
    mask_PxL = np.zeros((len(prompts), max_prompt_length), dtype=np.int32)
    truncated_P = np.zeros(len(prompts), bool)
    for i, tokens in enumerate(token_lists):
        if not tokens:
            # An all-padding row has no position to generate from.
            raise ValueError(f"prompt {i} ({prompts[i]!r}) tokenizes to zero tokens: remove empty prompts")
        if len(tokens) > max_prompt_length:
            if truncation == "error":
                raise ValueError(
                    f"prompt {i} ({_preview(prompts[i])}) has {len(tokens)} tokens > data.max_prompt_length="
                    f"{max_prompt_length}: raise data.max_prompt_length or set data.truncation=left"
                )
            tokens = tokens[-max_prompt_length:]
            truncated_P[i] = True
        ids_PxL[i, max_prompt_length - len(tokens):] = tokens
        mask_PxL[i, max_prompt_length - len(tokens):] = 1
    return ids_PxL, mask_PxL, truncated_P


def _preview(prompt, limit: int = 60) -> str:
    text = repr(prompt)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _make_batches(tokenizer, batches: list[list[dict[str, Any]]], max_prompt_length: int,
                  truncation: str) -> list[PromptBatch]:
    """Rows into PromptBatches, all tokenized in one call; columns are the union of a batch's keys (missing
    values -> None)."""
    rows = [row for batch in batches for row in batch]
    ids, mask, truncated = _tokenize(tokenizer, [row["prompt"] for row in rows], max_prompt_length, truncation)
    out, start = [], 0
    for batch in batches:
        keys = list(dict.fromkeys(k for row in batch for k in row if k != "prompt"))
        part = slice(start, start + len(batch))
        out.append(PromptBatch(ids[part], mask[part], [row["prompt"] for row in batch],
                               {k: [row.get(k) for row in batch] for k in keys}, int(truncated[part].sum())))
        start += len(batch)
    return out


class PromptIterator:
    """Endless seeded epochs over rows, `prompts_per_round` at a time.

    Epoch e visits rows in order `np.random.default_rng([seed, e]).permutation(n)`. Epochs are concatenated:
    a batch that runs past the end of an epoch continues with the start of the next one, so every prompt is
    seen exactly once per epoch and prompts_per_round may exceed the number of rows (the batch then spans
    several epochs). `state()`/`restore()` give an explicit resumable position.

    Prompts are tokenized `TOKENIZE_AT_ONCE` or more at a time, the next batches' together: a tokenizer call
    hands its texts to the tokenizer's thread pool, whose wake-up costs more than encoding a few prompts while
    XLA's threads hold the cores. A prompt's tokens do not depend on the others in its call.
    """

    TOKENIZE_AT_ONCE = 64

    def __init__(self, rows: list[dict[str, Any]], tokenizer, *, prompts_per_round: int, max_prompt_length: int,
                 seed: int, truncation: str = "left"):
        if not rows:
            raise ValueError("PromptIterator needs at least one row")
        if prompts_per_round < 1:
            raise ValueError(f"prompts_per_round={prompts_per_round} must be >= 1")
        _check_truncation(truncation)
        self._rows = rows
        self._tokenizer = tokenizer
        self._prompts_per_round = prompts_per_round
        self._max_prompt_length = max_prompt_length
        self._seed = seed
        self._truncation = truncation
        self._epoch = 0
        self._index = 0
        self._order = self._permutation(0)
        self._ahead: dict = {}  # (epoch, index) -> the PromptBatch starting there, for the next few batches

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._rows))

    def state(self) -> dict[str, int]:
        """Position of the next prompt: epoch and index into that epoch's permutation."""
        return {"epoch": self._epoch, "index": self._index}

    @property
    def epoch(self) -> float:
        """Epochs read so far, fractional (TrainerState's `epoch`)."""
        return self._epoch + self._index / len(self._rows)

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position returned by `state()`."""
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self._rows):
            raise ValueError(f"data iterator state {state} is out of range for {len(self._rows)} rows")
        self._epoch, self._index = epoch, index
        self._order = self._permutation(epoch)
        self._ahead = {}

    def next_indices(self) -> list[int]:
        """Row indices of the next batch (advances the position)."""
        out = []
        while len(out) < self._prompts_per_round:
            take = min(self._prompts_per_round - len(out), len(self._rows) - self._index)
            out.extend(int(i) for i in self._order[self._index:self._index + take])
            self._index += take
            if self._index == len(self._rows):
                self._epoch, self._index = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
        return out

    def next_batch(self) -> PromptBatch:
        """The next `prompts_per_round` prompts as a PromptBatch [P, L]."""
        self.prefetch()
        batch = self._ahead.pop((self._epoch, self._index))
        self.next_indices()
        return batch

    def prefetch(self) -> None:
        """Tokenize the next batch now, with the few after it when it is not tokenized yet, without moving the
        position (the trainer calls it while the devices run an update); `next_batch` returns them."""
        if (self._epoch, self._index) in self._ahead:
            return
        saved = self._epoch, self._index, self._order
        count = -(-self.TOKENIZE_AT_ONCE // self._prompts_per_round)
        positions, batches = [], []
        for _ in range(count):
            positions.append((self._epoch, self._index))
            batches.append([self._rows[i] for i in self.next_indices()])
        self._epoch, self._index, self._order = saved
        self._ahead = dict(zip(positions, _make_batches(self._tokenizer, batches, self._max_prompt_length,
                                                        self._truncation)))


def repeat_groups(batch: PromptBatch, num_generations: int) -> PromptBatch:
    """Repeat every prompt G times consecutively: [P, L] -> [P*G, L]; row p*G + g is prompt p.

    num_truncated still counts distinct prompts.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations={num_generations} must be >= 1")
    g = num_generations
    return PromptBatch(
        prompt_ids=np.repeat(batch.prompt_ids, g, axis=0),
        prompt_mask=np.repeat(batch.prompt_mask, g, axis=0),
        prompts=[p for p in batch.prompts for _ in range(g)],
        columns={k: [v for v in vals for _ in range(g)] for k, vals in batch.columns.items()},
        num_truncated=batch.num_truncated,
    )
