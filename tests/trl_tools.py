"""TRL 1.16's own multi-turn tool loop on scripted turns, as a reference for grpo_jax's tool calling.

``qwen_tokenizer`` builds a tiny byte-level BPE tokenizer (no download) that carries Qwen2.5's tool-calling tokens
and TRL's copy of Qwen2.5's chat template, so TRL's ``add_response_schema`` gives it the Qwen response parser.
``trl_tool_loop`` runs ``GRPOTrainer._generate`` (prompt tokenisation, response parsing, ``_tool_call_loop`` with its
tool-suffix ids, tool mask and overflow rollback) on a stand-in object instead of a trainer, with a scripted policy in
place of ``_generate_single_turn``: ``turns[i]`` are the token-id lists row ``i`` produces, one per turn.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import sys
import types

# Qwen2's pre-tokenizer split: contractions, letters with one leading non-letter, single digits, punctuation runs
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # special: dropped by skip_special_tokens
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # added but not special, as Qwen
CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n</tools>\n\nFor each function call, return a json object "
    'with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call>',
    '{"type": "function", "function": {"name": "multiply", "description": "Multiplies two integers.", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer", "description": "The first factor."}, "b": {"type": '
    '"integer", "description": "The second factor."}}, "required": ["a", "b"]}, "return": {"type": "integer"}}}',
    '{"name": "multiply", "arguments": {"a": 3, "b": 4}}', '{"error": "Tool not found."}',
    "What is 3 times 4? The answer is 12. What is the weather in Paris today? It is sunny and warm.",
    "user\nassistant\nsystem\ntool\nNumbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 100.",
]


def qwen_tokenizer(path=None, chat_template: str | None = None):
    """A ~500-token byte-level BPE tokenizer with Qwen2.5's chat tokens and ``chat_template`` (None: TRL's Qwen2.5
    chat template)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
    if chat_template is None:
        from trl.chat_template_utils import qwen2_5_chat_template as chat_template

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    # appended after the merges, as in Qwen's vocabulary
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768,
        clean_up_tokenization_spaces=False)
    hf.chat_template = chat_template
    if path is not None:
        hf.save_pretrained(path)
    return hf


class _ScriptedPolicy:
    """Stands in for ``_generate_single_turn``: gives each row its next scripted turn, with 0.0 log-probs."""

    def __init__(self, turns):
        self.turns, self.seen, self.calls = [list(map(list, t)) for t in turns], None, 0

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.seen is None:  # the first call renders every row, in order
            if len(prompt_ids) != len(self.turns):
                raise ValueError(f"{len(prompt_ids)} prompts for {len(self.turns)} scripted rows")
            rows = range(len(prompt_ids))
            self.seen, self.next_turn = [None] * len(rows), [0] * len(rows)
        else:  # later calls: the rows still calling tools, ascending, each prompt + its completion so far + suffix
            rows, start = [], 0
            for ids in prompt_ids:
                row = next((i for i in range(start, len(self.turns)) if self._continues(i, ids)), None)
                if row is None:
                    raise ValueError(f"call {self.calls}: no scripted row continues {ids}")
                rows.append(row)
                start = row + 1
        out = []
        for row, ids in zip(rows, prompt_ids):
            k = self.next_turn[row]
            if k >= len(self.turns[row]):
                raise ValueError(f"row {row} has no scripted turn {k}: its turn {k - 1} called a tool")
            out.append(self.turns[row][k])
            self.seen[row], self.next_turn[row] = list(ids) + self.turns[row][k], k + 1
        self.calls += 1
        return out, [[0.0] * len(t) for t in out]

    def _continues(self, row, ids):
        # A truncated turn never comes back (its row can't fit a tool suffix), so `seen` is the full history.
        seen = self.seen[row]
        return len(ids) > len(seen) and list(ids[:len(seen)]) == seen


def trl_tool_loop(tokenizer, prompts, turns, tools, *, max_completion_length, max_tool_calling_iterations=None,
                  max_model_len=32768, chat_template_kwargs=None):
    """Run TRL 1.16's ``GRPOTrainer._generate`` with tools on ``prompts`` (message lists) and scripted ``turns``.

    Returns one dict per row: prompt_ids, completion_ids, tool_mask, logprobs, completions (the message list TRL
    builds), and the batch totals tool_call_count and tool_failure_count (the same in every row).
    """
    import torch  # noqa: F401  (TRL's `_generate` builds tensors for its metrics)
    from trl.chat_template_utils import (add_response_schema, get_training_chat_template,
                                         is_chat_template_prefix_preserving, supports_tool_calling)
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import is_async_callable, shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    if not tools:
        raise ValueError("trl_tool_loop needs at least one tool; without tools TRL never enters the tool loop")
    # GRPOTrainer.__init__, in its order: tool-calling check, response template, training chat template
    if not supports_tool_calling(tokenizer):
        raise ValueError("the chat template does not support tool calling")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        tokenizer = add_response_schema(tokenizer)
    chat_template = None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
    # GRPOTrainer._generate_and_score_completions: one sync and one async dict per row, keyed by __name__
    sync_tools = {t.__name__: t for t in tools if not inspect.iscoroutinefunction(t)}
    async_tools = {t.__name__: t for t in tools if inspect.iscoroutinefunction(t)}
    eos_token_ids = [tokenizer.eos_token_id]

    obj = types.SimpleNamespace(
        processing_class=tokenizer, _tokenizer=tokenizer, _is_vlm=False, chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs or {}, tools=list(tools), environment_factories=None,
        rollout_func=None, use_vllm=False, num_generations=1, eos_token_ids=eos_token_ids,
        max_completion_length=max_completion_length,
        max_tool_calling_iterations=sys.maxsize if max_tool_calling_iterations is None else max_tool_calling_iterations,
        _sync_tool_dicts=[dict(sync_tools) for _ in prompts], _async_tool_dicts=[dict(async_tools) for _ in prompts],
        model=types.SimpleNamespace(training=True, config=types.SimpleNamespace(max_position_embeddings=max_model_len)),
        accelerator=types.SimpleNamespace(device="cpu", gather=lambda t: t),
        state=types.SimpleNamespace(num_input_tokens_seen=0),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _generate_single_turn=_ScriptedPolicy(turns))
    for name in ("_tokenize_prompts", "_get_tool_suffix_ids", "_generate"):
        setattr(obj, name, getattr(GRPOTrainer, name).__get__(obj))
    counts = {}

    def tool_call_loop(*args):  # TRL's loop; its call and failure counts only reach `_metrics` as frequencies
        out = GRPOTrainer._tool_call_loop(obj, *args)
        counts.update(tool_call_count=out[4], tool_failure_count=out[5])
        return out

    obj._tool_call_loop = tool_call_loop
    thread = None
    if any(is_async_callable(t) for t in tools):
        thread, obj.async_loop, ready = start_event_loop_in_daemon(name="trl_tools-AsyncLoop")
        ready.wait()
    try:
        prompt_ids, completion_ids, tool_mask, completions, logprobs, *_ = obj._generate(prompts)
    finally:
        if thread is not None:
            shutdown_event_loop_in_daemon(thread, obj.async_loop)
    return [dict(prompt_ids=list(p), completion_ids=c, tool_mask=m, logprobs=lp, completions=msgs, **counts)
            for p, c, m, lp, msgs in zip(prompt_ids, completion_ids, tool_mask, logprobs, completions)]


# example tools of the tool-loop tests (tests/tools/test_trl_tools.py, tests/rollout/test_multiturn.py)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: Any integer.
    """
    raise RuntimeError("boom")


async def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    await asyncio.sleep(0.01)
    return a + b
