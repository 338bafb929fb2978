"""Tool-call parsing of the chat formats we support, as data, without TRL: a turn's text -> TRL's assistant message.

A tokenizer without a response parser of its own (transformers' ``response_template``) gets one of these, picked by
markers of its chat template (`detect`), so a plain install reads tool calls: Qwen2.5/Qwen3 (``<tool_call>`` JSON
``</tool_call>``, ``<think>`` reasoning), Llama 3.1/3.2 (a JSON object with ``parameters``, optionally after
``<|python_tag|>``), Mistral (``[TOOL_CALLS]`` then a JSON list, or ``name[ARGS]{...}`` per call), Gemma 4
(``<|tool_call>call:name{...}<tool_call|>`` with unquoted keys and ``<|"|>`` strings) and GLM-4-MoE
(``<tool_call>name`` then ``<arg_key>`` / ``<arg_value>`` pairs); Qwen3.5's XML-style calls are not among them. The
output is what TRL 1.16's ``add_response_schema`` + ``parse_response`` give (`tests/tools/test_tool_parsers.py`
checks it against them): ``{"role": "assistant", "reasoning_content"?, "content"?, "tool_calls"?: [{"type":
"function", "function": {"name", "arguments"}}]}``, empty fields left out; a call that does not parse raises
ValueError, as there.
"""

from __future__ import annotations

import dataclasses
import json
import re


@dataclasses.dataclass(frozen=True)
class Format:
    """One family's response format: where the turn ends, its reasoning block, and how its tool calls are written."""

    name: str
    markers: tuple[str, ...]  # all in a chat template: this family's
    absent: tuple[str, ...]  # none in it (a later version of the family writes its calls otherwise)
    end: str  # regex: the end of the turn (what follows is dropped)
    calls_start: str  # regex: where the tool calls begin (the content is what comes before)
    calls: str  # "json" (one object per tag), "llama", "mistral" or "gemma": how `_calls` reads them
    reasoning: tuple[str, str] | None = None  # (open, close) literals of a leading reasoning block
    strip_prefix: str = ""  # regex dropped from the turn's start
    calls_need_end: bool = False  # a call in a turn cut before its end is malformed (Llama 3's template in TRL)


FORMATS = (
    Format("qwen", ("<|im_start|>", "<tool_call>"), ("<function=",), r"<\|im_end\|>", r"<tool_call>", "json",
           reasoning=("<think>", "</think>")),
    Format("llama3", ("<|start_header_id|>", '"parameters"'), (), r"<\|eot_id\|>|<\|eom_id\|>",
           r'\{\s*"name"\s*:', "llama", strip_prefix=r"\s*<\|python_tag\|>",
           calls_need_end=True),
    Format("mistral", ("[TOOL_CALLS]",), (), r"</s>", r"\[TOOL_CALLS\]", "mistral"),
    Format("gemma4", ("<|tool_call>",), (), r"<turn\|>|<\|tool_response>|<eos>", r"<\|tool_call>", "gemma",
           reasoning=("<|channel>thought\n", "<channel|>")),
    Format("glm4moe", ("<|assistant|>", "<arg_key>"), (), r"<\|user\|>|<\|observation\|>|<\|endoftext\|>",
           r"<tool_call>(?=\S)", "glm", reasoning=("<think>", "</think>")),  # a nameless one is text
)


def detect(chat_template) -> Format | None:
    """The format whose markers all appear in ``chat_template`` (a string, or a dict of named templates) and whose
    absent markers do not, or None."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(map(str, chat_template.values()))
    if not isinstance(chat_template, str):
        return None
    return next((f for f in FORMATS if all(m in chat_template for m in f.markers)
                 and not any(m in chat_template for m in f.absent)), None)


def _call(name, arguments) -> dict:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ValueError(f"a tool call needs a string name and an object of arguments, got {name!r}, {arguments!r}")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _json_objects(text: str) -> list:
    """The JSON values written one after another in ``text`` (whitespace or ';' between them)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return out
        value, i = decoder.raw_decode(text, i)  # a JSONDecodeError is a ValueError
        out.append(value)


def _gemma_json(text: str) -> str:
    """Gemma 4's argument object as JSON: ``<|"|>`` delimits strings, keys are bare words."""
    parts = text.split('<|"|>')
    if len(parts) % 2 == 0:
        raise ValueError('an unclosed <|"|> string in a Gemma tool call')
    code = [re.sub(r'([{,]\s*)([A-Za-z_][\w.-]*)(\s*):', r'\1"\2"\3:', p) for p in parts[0::2]]
    strings = [json.dumps(s) for s in parts[1::2]]
    return "".join(c + s for c, s in zip(code, strings + [""]))


def _calls(fmt: Format, text: str) -> list[dict]:
    """The tool calls written in ``text`` (which starts where `Format.calls_start` matched)."""
    if fmt.calls == "json":
        # the object is the function as written (TRL's transform); a last call cut before its close tag still counts
        chunks = text.split("<tool_call>")[1:]
        objects = [json.loads(re.sub(r"</tool_call>\s*$", "", chunk).strip()) for chunk in chunks]
        if not all(isinstance(o, dict) for o in objects):
            raise ValueError("a <tool_call> that does not hold a JSON object")
        return [{"type": "function", "function": o} for o in objects]
    if fmt.calls == "llama":
        return [_call(o.get("name"), o.get("parameters", o.get("arguments", {}))) if isinstance(o, dict)
                else _call(None, o) for o in _json_objects(text)]
    if fmt.calls == "mistral":
        out = []
        for chunk in re.split(r"\[TOOL_CALLS\]", text)[1:]:
            if "[ARGS]" in chunk:  # v11+ tokenizers: name[ARGS]{arguments}
                name, args = chunk.split("[ARGS]", 1)
                out.append(_call(name.strip(), json.loads(args)))
                continue
            for value in _json_objects(chunk):
                for o in value if isinstance(value, list) else [value]:
                    out.append(_call(o.get("name"), o.get("arguments", {})) if isinstance(o, dict)
                               else _call(None, o))
        return out
    if fmt.calls == "gemma":
        found = re.findall(r"<\|tool_call>call:(\w+)(.*?)<tool_call\|>", text, re.S)
        if not found:
            raise ValueError("a <|tool_call> without its <tool_call|>")
        return [_call(name, json.loads(_gemma_json(body)) if body.strip() else {}) for name, body in found]
    if fmt.calls == "glm":  # <tool_call>name, then <arg_key>k</arg_key>\n<arg_value>v</arg_value> per argument
        # values stay text, cast by the tool's schema (`_cast`), and a last call cut before its close tag counts: as
        # TRL's response template reads them
        found = re.findall(r"<tool_call>(\S+)\n?(.*?)(?:</tool_call>|$)", text, re.S)
        return [_call(name, dict(re.findall(r"<arg_key>([^<]+)</arg_key>\s*\n<arg_value>(.*?)</arg_value>", body,
                                            re.S))) for name, body in found]
    raise ValueError(f"unknown tool-call syntax {fmt.calls!r}")


_CASTS = {"integer": int, "number": float, "boolean": lambda s: {"true": True, "false": False}[s.lower()]}


def _cast(calls: list[dict], tools: list | None) -> None:
    """String arguments cast to their parameter's JSON-schema type (integer, number, boolean), as transformers'
    `parse_response(tools=...)` does; ``tools`` are JSON schemas (transformers' `get_json_schema`)."""
    params = {s.get("function", s).get("name"): s.get("function", s).get("parameters", {}).get("properties", {})
              for s in tools or ()}
    for call in calls:
        properties = params.get(call["function"]["name"], {})
        arguments = call["function"].get("arguments")
        for key, value in (arguments.items() if isinstance(arguments, dict) else ()):
            kind = properties.get(key, {}).get("type")
            if isinstance(value, str) and kind in _CASTS:
                try:
                    arguments[key] = _CASTS[kind](value)
                except (ValueError, KeyError):
                    pass  # a value that is not of its type stays the model's text


def parse_response(fmt: Format, text: str, tools: list | None = None) -> dict:
    """A turn's decoded text (special tokens kept) as TRL's assistant message; ValueError where a call is malformed."""
    text = re.sub("^" + fmt.strip_prefix, "", text) if fmt.strip_prefix else text
    end = re.search(fmt.end, text)
    text = text[:end.start()] if end else text
    message = {"role": "assistant"}
    if fmt.reasoning is not None and text.lstrip().startswith(fmt.reasoning[0]):
        body = text.lstrip()[len(fmt.reasoning[0]):]
        reasoning, closed, text = body.partition(fmt.reasoning[1])
        if not closed:
            reasoning, text = body, ""
        if reasoning.strip():
            message["reasoning_content"] = reasoning.strip()
    start = re.search(fmt.calls_start, text)
    if start and fmt.calls_need_end and not end:
        raise ValueError(f"a {fmt.name} tool call cut before the end of its turn")
    content = text[:start.start()] if start else text
    if content.strip():
        message["content"] = content.strip()
    if start:
        calls = _calls(fmt, text[start.start():])
        _cast(calls, tools)
        if calls:
            message["tool_calls"] = calls
    return message
