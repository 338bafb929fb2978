"""Prompts: read a JSONL file (other sources: `grpo_jax.data.sources`), check and tokenize every row once (`Dataset`), and
draw batches left-padded to static shapes in seeded epochs from a position that is state (`DataState`, `next_batch`),
repeated per group.

Rows follow TRL's dataset convention: a "prompt" column plus any other columns (e.g. "answer"), which are handed
to reward functions as keyword arguments. A prompt is a plain string (used as it is) or, in TRL's conversational
format, a list of {"role", "content"} messages rendered with the tokenizer's chat template. Shapes: P prompts per
round, L = max_prompt_length, G = num_generations.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
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
    with open(path, "rb") as f:  # decoded line by line, so a byte that is not UTF-8 is named by its line
        for k, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {k} is not UTF-8 text (byte {raw[e.start]:#04x}, the line's byte "
                                 f"{e.start + 1}): save the file as UTF-8, which JSON Lines requires") from e
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer.json is the whole tokenizer


def load_tokenizer(folder: str | os.PathLike, key: str = "model.path"):
    """The tokenizer of a Hugging Face folder (`key` names the setting in errors: one line with the fix).

    A folder whose tokenizer_config.json names the generic class loads as its tokenizer.json says: AutoTokenizer
    would take the class of config.json's model type (transformers 5: Qwen2Tokenizer for a grpo_jax export), which
    rebuilds the pipeline from the vocabulary and adds its own special tokens.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{key}={str(folder)!r} is not a folder: point it at a Hugging Face folder holding a "
                         "tokenizer (tokenizer.json + tokenizer_config.json)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{key}={str(folder)!r} holds no tokenizer files (tokenizer.json, or tokenizer.model, "
                         "vocab.json + merges.txt, vocab.txt; with tokenizer_config.json): save the model's tokenizer "
                         "there (tokenizer.save_pretrained) or set data.tokenizer_path to a folder holding it")
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # absent or unreadable: transformers says what is wrong below
        declared = None
    try:
        if declared in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as e:  # transformers' many ways of saying "no tokenizer here"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{key}={str(folder)!r}: no tokenizer could be loaded from it ({first}): point it at a "
                         "Hugging Face folder holding tokenizer.json and tokenizer_config.json") from e


def check_prompts(where, prompts: Sequence, lines: list[int] | None, tokenizer, max_prompt_length: int | None,
                  truncation: str, chunk: int = 1024, tools: Sequence | None = None,
                  chat_template: str | None = None, template_kwargs: dict | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Before the first step: every prompt renders and tokenizes to at least one token (and, with
    truncation="error", to at most `max_prompt_length`); a ValueError names the file (`where`) and line (`lines`,
    else the row's index) of the first that does not, so no row can stop a run halfway through its data.
    Returns every prompt's token ids, kept for the run (`Dataset`): (flat int32 ids, offsets [n + 1]). ``tools``:
    each prompt's tools, rendered into it (`render_prompt`)."""
    lengths = np.zeros(len(prompts), np.int64)
    pieces = []
    for start in range(0, len(prompts), chunk):
        part = list(prompts[start:start + chunk])
        try:
            token_lists = tokenizer([render_prompt(tokenizer, p, tools and tools[start + i], chat_template,
                                                   template_kwargs) for i, p in enumerate(part)],
                                    add_special_tokens=False)
            token_lists = token_lists["input_ids"]
        except Exception:  # noqa: BLE001 - one row of the chunk failed: find it below
            token_lists = [None] * len(part)
        for i, (prompt, tokens) in enumerate(zip(part, token_lists)):
            row = f"line {lines[start + i]}" if lines is not None else f"row {start + i}"
            if tokens is None:
                try:
                    text = render_prompt(tokenizer, prompt, tools and tools[start + i], chat_template,
                                         template_kwargs)
                    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
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
            pieces.append(np.asarray(tokens, np.int32))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)), offsets


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


def render_prompt(tokenizer, prompt, tools: list | None = None, chat_template: str | None = None,
                  template_kwargs: dict | None = None) -> str:
    """A string prompt as it is; messages through the chat template with the generation prompt and the JSON schemas
    of ``tools`` (TRL 1.16; ``chat_template``: TRL's training template where the tokenizer's is not
    prefix-preserving; ``template_kwargs``: `data.chat_template_kwargs`)."""
    if not is_conversational(prompt):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a prompt is a list of chat messages but the tokenizer has no chat template: use a chat "
                         "model's tokenizer (model.path / data.tokenizer_path) or plain string prompts")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, tools=tools or None,
                                         chat_template=chat_template, **(template_kwargs or {}))


def completion_text(completion) -> str:
    """A completion's answer text: a string as it is; of TRL's message list (a multi-turn rollout's assistant and
    tool messages), its last assistant message's content, not a tool's result."""
    if isinstance(completion, str):
        return completion
    return next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")


def reward_inputs(prompts: list, completions: list[str]) -> tuple[list, list]:
    """(prompts, completions) as TRL's GRPOTrainer hands them to reward functions.

    Conversational rows keep their message list as the prompt and get ``[{"role": "assistant", "content":
    text}]`` as the completion; string rows pass through unchanged.
    """
    wrapped = [[{"role": "assistant", "content": text}] if is_conversational(prompt) else text
               for prompt, text in zip(prompts, completions, strict=True)]
    return list(prompts), wrapped


def tokenize_prompts(tokenizer, prompts: list, max_prompt_length: int, truncation: str = "left",
                     tools: Sequence | None = None, chat_template: str | None = None,
                     template_kwargs: dict | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokenize without special tokens and left-pad to exactly L; returns (ids_PxL, mask_PxL, num_truncated).

    Message-list prompts are rendered with the chat template first (``render_prompt``). Longer prompts keep
    their last L tokens (truncation="left") or raise (truncation="error"). ``tools``: each prompt's tools.
    """
    ids_PxL, mask_PxL, truncated_P = _tokenize(tokenizer, prompts, max_prompt_length, truncation, tools,
                                               chat_template, template_kwargs)
    return ids_PxL, mask_PxL, int(truncated_P.sum())


def _check_truncation(truncation: str) -> None:
    if truncation not in ("left", "error"):
        raise ValueError(f"data.truncation={truncation!r} is unknown: use 'left' or 'error'")


def _tokenize(tokenizer, prompts: list, max_prompt_length: int, truncation: str, tools=None, chat_template=None,
              template_kwargs=None):
    """`tokenize_prompts` with a per-prompt truncation flag [P] bool in place of the count."""
    _check_truncation(truncation)
    if max_prompt_length < 1:
        raise ValueError(f"data.max_prompt_length={max_prompt_length} must be >= 1")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token: set tokenizer.pad_token")
    texts = [render_prompt(tokenizer, p, tools and tools[i], chat_template, template_kwargs)
             for i, p in enumerate(prompts)]
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


class DataState(NamedTuple):
    """Where a run is in its data, a pytree of three ints saved in every checkpoint: the next prompt is position
    ``index`` of epoch ``epoch``'s order, ``np.random.default_rng([seed, epoch]).permutation(n)`` (the rows' own
    order 0 .. n - 1 when the `Dataset` is not shuffled)."""

    epoch: int
    index: int
    seed: int


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A run's training prompts, tokenized once when the run is built (`check_prompts`): the rows (TRL's columns;
    a list of dicts or a `datasets.Dataset`) and every prompt's token ids, flat (``offsets`` [n + 1]). Never
    changes: a batch is `next_batch` of it and a `DataState`."""

    rows: Sequence
    token_ids: np.ndarray  # int32, every prompt's tokens one after another
    offsets: np.ndarray  # [n + 1]: prompt i is token_ids[offsets[i]:offsets[i + 1]]
    max_prompt_length: int  # L: batches are left-padded (and left-truncated) to it
    pad_token_id: int
    fingerprint: dict | None = None  # what checkpoints record of the rows (`sources.fingerprint`)
    shuffle: bool = True  # `data.shuffle`: false reads every epoch in the rows' order (TRL's shuffle_dataset=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1


@functools.lru_cache(maxsize=4)
def _order(seed: int, epoch: int, n: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.setflags(write=False)  # shared by every batch of the epoch
    return order


def next_batch(dataset: Dataset, state: DataState, num_prompts: int) -> tuple[PromptBatch, DataState]:
    """The next ``num_prompts`` prompts [P, L] and the position after them. Epochs follow one another: a batch
    that runs past the end of an epoch continues with the start of the next, so every prompt is seen once an epoch
    and a batch may span several epochs."""
    n = len(dataset)
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if state.epoch < 0 or not 0 <= state.index < n:
        raise ValueError(f"data position {dict(state._asdict())} is out of range for {n} rows")
    indices, epoch, index = [], int(state.epoch), int(state.index)
    while len(indices) < num_prompts:
        take = min(num_prompts - len(indices), n - index)
        order = _order(int(state.seed), epoch, n) if dataset.shuffle else range(n)
        indices.extend(int(i) for i in order[index:index + take])
        epoch, index = (epoch + 1, 0) if index + take == n else (epoch, index + take)
    L = dataset.max_prompt_length
    ids_PxL = np.full((num_prompts, L), dataset.pad_token_id, np.int32)
    mask_PxL = np.zeros((num_prompts, L), np.int32)
    truncated = 0
    for p, i in enumerate(indices):
        tokens = dataset.token_ids[dataset.offsets[i]:dataset.offsets[i + 1]][-L:]  # left truncation keeps the end
        truncated += int(dataset.offsets[i + 1] - dataset.offsets[i] > L)
        ids_PxL[p, L - len(tokens):] = tokens
        mask_PxL[p, L - len(tokens):] = 1
    rows = [dataset.rows[i] for i in indices]
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "prompt"))
    batch = PromptBatch(ids_PxL, mask_PxL, [row["prompt"] for row in rows],
                        {k: [row.get(k) for row in rows] for k in keys}, truncated)
    return batch, DataState(epoch, index, state.seed)


def epochs_read(dataset: Dataset, state: DataState) -> float:
    """Epochs read so far, fractional (TrainerState's `epoch`)."""
    return state.epoch + state.index / len(dataset)


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
