"""The TRL tool-loop harness (tests/trl_tools.py) runs TRL 1.16's own loop as its code says it should."""

import pytest

pytest.importorskip("trl")

from trl_tools import add, explode, multiply, qwen_tokenizer, trl_tool_loop  # noqa: E402

PROMPT = [{"role": "user", "content": "What is 3 times 4?"}]
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def suffix(tok, *results):
    """Qwen2.5's rendering of a block of tool messages, from the end of the assistant turn to the next header."""
    responses = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    return ids(tok, f"\n<|im_start|>user{responses}<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_is_qwen_like_and_round_trips(tok, tmp_path):
    import transformers
    from trl.chat_template_utils import (add_response_schema, is_chat_template_prefix_preserving,
                                         qwen2_5_chat_template, qwen3_template, supports_tool_calling)

    assert 400 <= len(tok) <= 600 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template == qwen2_5_chat_template
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    text = CALL.format(name="multiply", args='{"a": 3, "b": 4}') + "<|im_end|>"
    assert tok.decode(ids(tok, text)) == text
    assert tok.decode(ids(tok, text), skip_special_tokens=True) == text.removesuffix("<|im_end|>")  # tool tags kept
    qwen_tokenizer(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == qwen2_5_chat_template and ids(loaded, text) == ids(tok, text)
    assert add_response_schema(loaded).response_template == qwen3_template


def test_one_tool_round_and_a_direct_answer(tok):
    turn0 = ids(tok, CALL.format(name="multiply", args='{"a": 3, "b": 4}') + "<|im_end|>")
    answer = ids(tok, "12<|im_end|>")
    rows = trl_tool_loop(tok, [PROMPT, PROMPT], [[turn0, answer], [answer]], [multiply, explode],
                         max_completion_length=256)
    tail = suffix(tok, "12")
    prompt_ids = tok.apply_chat_template(PROMPT, tools=[multiply, explode], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert [r["prompt_ids"] for r in rows] == [prompt_ids, prompt_ids]
    assert rows[0]["completion_ids"] == turn0 + tail + answer
    assert rows[0]["tool_mask"] == [1] * len(turn0) + [0] * len(tail) + [1] * len(answer)
    assert rows[0]["logprobs"] == [0.0] * len(rows[0]["completion_ids"])
    assert rows[1]["completion_ids"] == answer and rows[1]["tool_mask"] == [1] * len(answer)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    assert rows[0]["completions"] == [{"role": "assistant", "content": "", "tool_calls": [call]},
                                      {"role": "tool", "name": "multiply", "content": "12"},
                                      {"role": "assistant", "content": "12"}]
    assert rows[1]["completions"] == [{"role": "assistant", "content": "12"}]
    assert (rows[0]["tool_call_count"], rows[0]["tool_failure_count"]) == (1, 0)


def test_failures_are_counted_and_async_results_come_last(tok):
    turn0_row0 = ids(tok, CALL.format(name="explode", args='{"x": 1}') + "\n"
                     + CALL.format(name="nope", args="{}") + "<|im_end|>")
    turn0_row1 = ids(tok, CALL.format(name="add", args='{"a": 1, "b": 2}') + "\n"
                     + CALL.format(name="multiply", args='{"a": 2, "b": 5}') + "<|im_end|>")
    done = ids(tok, "ok<|im_end|>")
    rows = trl_tool_loop(tok, [PROMPT, PROMPT], [[turn0_row0, done], [turn0_row1, done]], [multiply, explode, add],
                         max_completion_length=256)
    assert (rows[0]["tool_call_count"], rows[0]["tool_failure_count"]) == (4, 2)
    errors = ["{'error': 'boom'}", "{'error': 'Tool nope not found.'}"]
    assert [m["content"] for m in rows[0]["completions"][1:3]] == errors
    assert rows[0]["completion_ids"] == turn0_row0 + suffix(tok, *errors) + done
    # TRL runs the synchronous tools first and gathers the async ones after: results leave call order
    assert [(m["name"], m["content"]) for m in rows[1]["completions"][1:3]] == [("multiply", "10"), ("add", "3")]
    assert rows[1]["completion_ids"] == turn0_row1 + suffix(tok, "10", "3") + done


@pytest.mark.parametrize("limit", ["completion", "model"])
def test_a_suffix_past_the_budget_is_rolled_back(tok, limit):
    turn0 = ids(tok, CALL.format(name="multiply", args='{"a": 3, "b": 4}') + "<|im_end|>")
    prompt_len = len(tok.apply_chat_template(PROMPT, tools=[multiply], add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    fits = len(turn0) + len(suffix(tok, "12"))
    budget = dict(max_completion_length=fits - 1) if limit == "completion" else dict(
        max_completion_length=256, max_model_len=prompt_len + fits)  # TRL's ceiling is `>= max_model_len`
    (row,) = trl_tool_loop(tok, [PROMPT], [[turn0]], [multiply], **budget)  # no turn 1: never asked for
    assert row["completion_ids"] == turn0 and row["tool_mask"] == [1] * len(turn0)
    assert [m["role"] for m in row["completions"]] == ["assistant"]  # the tool message is rolled back too
    assert (row["tool_call_count"], row["tool_failure_count"]) == (1, 0)  # the call still ran


def test_the_last_turn_is_cut_to_the_budget_and_iterations_are_capped(tok):
    turn0 = ids(tok, CALL.format(name="multiply", args='{"a": 3, "b": 4}') + "<|im_end|>")
    tail, answer = suffix(tok, "12"), ids(tok, "The answer is 12.<|im_end|>")
    (row,) = trl_tool_loop(tok, [PROMPT], [[turn0, answer]], [multiply],
                           max_completion_length=len(turn0) + len(tail) + 2)
    assert row["completion_ids"] == turn0 + tail + answer[:2]
    (row,) = trl_tool_loop(tok, [PROMPT], [[turn0, turn0]], [multiply], max_completion_length=256,
                           max_tool_calling_iterations=1)
    assert row["completion_ids"] == turn0 + tail + turn0 and row["tool_call_count"] == 1
    with pytest.raises(ValueError, match="row 0 has no scripted turn 2"):
        trl_tool_loop(tok, [PROMPT], [[turn0, turn0]], [multiply], max_completion_length=256)
