"""grpo_jax.tools.tool_parsers: our tool-call parsers against hand-written messages, and against TRL 1.16's response
templates (transformers' `parse_response`) where TRL is installed; tools.build reads Qwen calls without TRL."""

import sys

import pytest

from grpo_jax.data import task
from grpo_jax.tools import tool_parsers, calls as tools

FMT = {f.name: f for f in tool_parsers.FORMATS}
GLM_CALLS = ("\n<think>hmm</think>\nSure.\n<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>3</arg_value>\n"
             "<arg_key>b</arg_key>\n<arg_value>4</arg_value>\n</tool_call>\n<tool_call>f\n</tool_call><|observation|>")
QWEN_CALLS = ('<think>\nhmm\n</think>\n\nSure.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n'
              '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>')


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


@pytest.mark.parametrize("family, text, expected", [
    ("qwen", QWEN_CALLS, {"role": "assistant", "reasoning_content": "hmm", "content": "Sure.",
                          "tool_calls": [call("multiply", a=3, b=4), call("f")]}),
    ("qwen", "  just text \n<|im_end|>\n", {"role": "assistant", "content": "just text"}),
    ("llama3", '{"name": "multiply", "parameters": {"a": 3, "b": 4}}<|eot_id|>',
     {"role": "assistant", "tool_calls": [call("multiply", a=3, b=4)]}),
    ("llama3", '<|python_tag|>{"name": "multiply", "parameters": {"a": 3}}<|eom_id|>',
     {"role": "assistant", "tool_calls": [call("multiply", a=3)]}),
    ("mistral", 'Let me see. [TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 3, "b": 4}}, '
                '{"name": "f", "arguments": {}}]</s>',
     {"role": "assistant", "content": "Let me see.", "tool_calls": [call("multiply", a=3, b=4), call("f")]}),
    ("mistral", '[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 4}[TOOL_CALLS]f[ARGS]{}</s>',
     {"role": "assistant", "tool_calls": [call("multiply", a=3, b=4), call("f")]}),
    ("glm4moe", GLM_CALLS, {"role": "assistant", "reasoning_content": "hmm", "content": "Sure.",
                            "tool_calls": [call("multiply", a="3", b="4"), call("f")]}),  # text, cast by a schema
    ("gemma4", '<|channel>thought\nhm<channel|>ok<|tool_call>call:f{a:{b:[1,2]},c:<|"|>p, q: r<|"|>}<tool_call|>'
               '<turn|>',
     {"role": "assistant", "reasoning_content": "hm", "content": "ok", "tool_calls": [call("f", a={"b": [1, 2]},
                                                                                          c="p, q: r")]}),
])
def test_each_family_reads_to_trls_message(family, text, expected):
    assert tool_parsers.parse_response(FMT[family], text) == expected


@pytest.mark.parametrize("family, text", [
    ("qwen", '<tool_call>\n{"name": bad}\n</tool_call><|im_end|>'),
    ("qwen", "<tool_call>\n[1, 2]\n</tool_call>"),
    ("llama3", '{"name": "multiply", "parameters": {"a": 3}}'),  # cut before <|eot_id|>
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": }]</s>'),
    ("gemma4", '<|tool_call>call:f{a:<|"|>open}<tool_call|>'),
])
def test_a_malformed_call_raises(family, text):
    with pytest.raises(ValueError):
        tool_parsers.parse_response(FMT[family], text)


def test_string_arguments_take_their_parameters_type():
    text = '<tool_call>\n{"name": "multiply", "arguments": {"a": "7", "b": "x"}}\n</tool_call>'
    got = tool_parsers.parse_response(FMT["qwen"], text, tools.json_schemas([multiply]))
    assert got["tool_calls"] == [call("multiply", a=7, b="x")]  # "x" is no integer: kept as written


def test_detect_reads_the_chat_templates_markers():
    assert tool_parsers.detect("{{'<|im_start|>'}} ... <tool_call> ...").name == "qwen"
    assert tool_parsers.detect("<|im_start|> <tool_call>\n<function=name>") is None  # Qwen3.5's XML calls
    assert tool_parsers.detect({"default": "x", "tool_use": "[TOOL_CALLS]"}).name == "mistral"
    assert tool_parsers.detect("<start_of_turn>model") is None and tool_parsers.detect(None) is None


TRL_CASES = {  # family: (TRL's response template name, the generation prompt it anchors on, texts)
    "qwen": ("qwen3_template", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", [
        QWEN_CALLS, "plain text<|im_end|>", "cut short", "  spaced  \n<|im_end|>\n",
        '<tool_call>\n{"name": bad}\n</tool_call><|im_end|>', "<think>\n\n</think>\n\nhi<|im_end|>",
        'a\n<tool_call>\n{"name": "f"}\n</tool_call>', '<tool_call>\n{"name": "f", "arguments": {}}',
        "<think>never closed", '<tool_call>\n{"name": "multiply", "arguments": {"a": "7", "b": 4}}\n</tool_call>']),
    "llama3": ("llama3_template", "<|start_header_id|>assistant<|end_header_id|>\n\n", [
        '{"name": "multiply", "parameters": {"a": 3, "b": 4}}<|eot_id|>', "hello<|eot_id|>", " hello \n<|eot_id|>",
        '{"name": "multiply", "parameters": {"a": 3, "b": 4}}', '{"name": "f", "parameters": {bad}}<|eot_id|>']),
    "gemma4": ("gemma4_template", "<|turn>model\n", [
        '<|tool_call>call:multiply{a:3,b:<|"|>x<|"|>}<tool_call|>', "hi<turn|>", " text <turn|>",
        "<|channel>thought\nhm<channel|>ok<|tool_call>call:f{}<tool_call|><|tool_call>call:g{x:1.5}<tool_call|>",
        '<|tool_call>call:f{a:{b:[1,2]},c:<|"|>p, q: r<|"|>}<tool_call|><turn|>']),
    # (a turn that goes on after its calls is left out: TRL's template then reads what follows them, its end token
    # included, as the content, in place of the text before them, which ours keeps)
    "glm4moe": ("glm4moe_template", "<|assistant|>", [
        GLM_CALLS.removesuffix("<|observation|>"), "\n<think></think>\nplain text<|user|>", "cut short",
        "\n<think>hm</think>\n<tool_call>f\n</tool_call>", "<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>7",
        "<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>7</arg_value>\n<arg_key>b</arg_key>\n"
        "<arg_value>x</arg_value>\n</tool_call>", "<tool_call>\n</tool_call>", "\n<think>never closed",
        "<tool_call>g\n<arg_key>x</arg_key>\n<arg_value>{\"y\": [1, 2]}</arg_value>\n<arg_key>s</arg_key>\n"
        "<arg_value>two words</arg_value>\n</tool_call>"]),
}


@pytest.mark.parametrize("family", sorted(TRL_CASES))
def test_the_same_messages_and_failures_as_trls_parser(family):
    utils = pytest.importorskip("trl.chat_template_utils")
    name, prefix, texts = TRL_CASES[family]
    tok = task.build_tokenizer()

    def outcome(parse):
        try:
            return parse()
        except ValueError:
            return "malformed"

    for text in texts:
        ours = outcome(lambda: tool_parsers.parse_response(FMT[family], text, tools.json_schemas([multiply])))
        theirs = outcome(lambda: tok.parse_response(text, schema=getattr(utils, name), prefix=prefix,
                                                    tools=[multiply]))
        assert ours == theirs, text


def test_trls_chat_templates_map_to_the_families_trl_parses_alike():
    utils = pytest.importorskip("trl.chat_template_utils")
    expected = {"qwen2_5_chat_template": "qwen", "qwen3_chat_template": "qwen",
                "qwen3_instruct_2507_chat_template": "qwen", "llama3_1_chat_template": "llama3",
                "llama3_2_chat_template": "llama3", "gemma4_chat_template": "gemma4",
                "glm4moe_chat_template": "glm4moe",
                "qwen3_5_think_chat_template": None, "gptoss_chat_template": None, "llama3_chat_template": None}
    got = {name: getattr(tool_parsers.detect(getattr(utils, name)), "name", None) for name in expected}
    assert got == expected


def test_tools_build_and_parse_a_qwen_turn_without_trl(monkeypatch):
    pytest.importorskip("trl")  # only to build the Qwen2.5 tokenizer: TRL holds the template's text
    from tests.trl_tools import qwen_tokenizer

    tok = qwen_tokenizer()
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # as if trl were not installed
    tooling = tools.build((multiply,), None, tok, timeout=1.0, max_iterations=None, max_model_len=None)
    assert tooling.chat_template is None and tok.response_template is None  # Qwen2.5's template is prefix-preserving
    ids = tok.encode('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": "4"}}\n</tool_call><|im_end|>')
    prefix = tok.apply_chat_template([{"role": "user", "content": "What is 3 times 4?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    message, malformed = tools.parse_turn(tok, ids, prefix, [multiply], tools.compiled_template(tok))
    assert not malformed and message == {"role": "assistant", "content": "", "tool_calls": [call("multiply", a=3, b=4)]}


def test_tools_build_and_parse_a_glm_turn_without_trl(monkeypatch):
    """GLM-4-MoE's released template is prefix-preserving (TRL's check agrees) and its calls are ours to read: tools on
    a GLM tokenizer need no trl."""
    utils = pytest.importorskip("trl.chat_template_utils")  # only for the template's text
    from tests.trl_tools import qwen_tokenizer

    tok = qwen_tokenizer(chat_template=utils.glm4moe_chat_template)
    assert utils.is_chat_template_prefix_preserving(tok)
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # as if trl were not installed
    tooling = tools.build((multiply,), None, tok, timeout=1.0, max_iterations=None, max_model_len=None)
    assert tooling.chat_template is None and tok.response_template is None
    ids = tok.encode("\n<think></think>\n<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>3</arg_value>\n"
                     "<arg_key>b</arg_key>\n<arg_value>4</arg_value>\n</tool_call>")
    prefix = tok.apply_chat_template([{"role": "user", "content": "What is 3 times 4?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    message, malformed = tools.parse_turn(tok, ids, prefix, [multiply], tools.compiled_template(tok))
    assert not malformed and message["tool_calls"] == [call("multiply", a=3, b=4)]
