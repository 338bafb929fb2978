"""The embedded multi-turn tool task: the answer to "<key>?" is only reachable by calling the `lookup` tool.

A row's value is a random digit string, so a policy that never calls the tool can only guess. The whole call is one
token (CALL) that also stops the turn, so a random-init policy finds the tool by emitting a single id; after the tool's
result is appended (TRL's `_get_tool_suffix_ids`), copying it from context earns the answer reward.

  "12?" CALL "<tool_response>5281</tool_response>" "5281<eos>"

Rewards follow TRL's GRPOTrainer convention `fn(prompts, completions, **columns) -> list[float]`; `LookupEnv` is a
TRL 1.16 `environment_factory`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from grpo_jax.data.prompts import completion_text
from grpo_jax.data.task import EOS_TOKEN, UNK_TOKEN, char_accuracy, check_sizes, digit_string

CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
CHARS = "0123456789?"

# No generation prompt: the prompt ends where the assistant starts, so a rollout's ids are the rendered chat with
# nothing between turns. An assistant turn that calls the tool ends with CALL (a stop token), a final turn with <eos>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{{ message.content or '' }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% set call = tool_call.function if tool_call.function is defined else tool_call %}"
    '<tool_call>{"name": "{{ call.name }}", "arguments": '
    "{{ call.arguments if call.arguments is string else call.arguments | tojson }}"
    "}</tool_call>"
    "{% endfor %}"
    "{% if not message.tool_calls %}<eos>{% endif %}"
    "{% elif message.role == 'tool' %}"
    "<tool_response>{{ message.content }}</tool_response>"
    "{% else %}"
    "{{ message.content }}"
    "{% endif %}"
    "{% endfor %}"
)

# transformers >= 5.13 response parsing. The anchor marks where the latest assistant turn starts in the prompt: after
# the user's "?" or after a tool response (without one the parser would read the whole prompt as content).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["?", TOOL_RESPONSE_CLOSE],
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close": EOS_TOKEN, "content": "text"},
    },
}


def build_tokenizer(path: str | os.PathLike | None = None):
    """Character-level tokenizer over <eos>, <unk>, CHARS plus CALL and the tool-response tags as single ids."""
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate((EOS_TOKEN, UNK_TOKEN, *CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # Not special: a decoded completion (skip_special_tokens=True) must still show the call and the tool's result.
    backend.add_tokens([AddedToken(t, normalized=False) for t in (CALL, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(os.fspath(path))
    return tokenizer


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids that end an assistant turn: (<eos>, CALL)."""
    return tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CALL)


def make_examples(n: int, seed: int, min_len: int = 3, max_len: int = 5) -> list[dict[str, Any]]:
    """`n` rows {"prompt": [user "<key>?"], "key", "answer"}: a 2-digit key and a random value of min_len..max_len
    digits, drawn per row (no table to memorise: only the tool knows a row's value); deterministic in seed."""
    check_sizes(n, min_len, max_len)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        key = f"{int(rng.integers(0, 100)):02d}"
        value = digit_string(rng, int(rng.integers(min_len, max_len + 1)), leading_zero=True)
        rows.append({"prompt": [{"role": "user", "content": f"{key}?"}], "key": key, "answer": value})
    return rows


class LookupEnv:
    """TRL `environment_factory` environment: `reset` takes a row, the one tool `lookup` returns its answer."""

    def __init__(self):
        self._answer = ""

    def reset(self, **row) -> None:
        """Store the row's answer for `lookup`."""
        self._answer = row["answer"]

    def lookup(self) -> str:
        """Look up the value stored under the key in the question.

        Returns:
            The value, a string of digits.
        """
        return self._answer


def answer_accuracy(prompts: list, completions: list, answer: list[str], **kwargs) -> list[float]:
    """Per completion: `task.char_accuracy` of the last assistant message's content against the answer."""
    del kwargs
    return char_accuracy(prompts, [completion_text(c) for c in completions], answer)


def tool_use(completions: list, **kwargs) -> list[float]:
    """Per completion: 1.0 if it called the tool (a tool message that is not an error: TRL renders errors
    "{'error': ...}") and then answered (its last message is an assistant turn with text and no call), else 0.0.
    Calling without answering earns nothing, so a policy is not paid to call over and over."""
    del kwargs

    def ok(message: dict[str, Any]) -> bool:
        return message.get("role") == "tool" and not str(message.get("content", "")).startswith("{'error':")

    def answered(completion: list) -> bool:
        last = completion[-1] if completion else {}
        return last.get("role") == "assistant" and bool(last.get("content")) and not last.get("tool_calls")

    return [float(not isinstance(c, str) and any(ok(m) for m in c) and answered(c)) for c in completions]
