"""Tools and environments of multi-turn rollouts, as TRL 1.16's GRPOTrainer defines them (`_tool_call_loop`).

A tool is a Python function (sync or async) with type hints and a Google-style docstring: the chat template renders
its JSON schema into the prompt. An environment is a class: one instance per rollout, `reset(**row)` before the
rollout (a returned string is appended to the last user message), its public methods are that rollout's tools, and
an optional `get_reward()` is one more reward function (weight 1, named after the class). A dict of factories picks
one per row by the row's ``environment`` column.

A turn's tool calls are parsed from its tokens with the tokenizer's response parser (`parse_turn`, TRL's
`parse_response`), for a tokenizer without one with ours of its family (`tool_parsers`: no TRL needed), and run
by a `toolbox.Toolbox` (TRL's failure semantics, each call under a timeout); `suffix_ids` renders the tool
messages with the chat template exactly as TRL's `_get_tool_suffix_ids` does, tokens appended after the turn's own
end. A call the parser cannot read leaves the turn plain text, as in TRL, but is counted
(``malformed``), which TRL does not.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence

from grpo_jax.rewards.paths import resolve_reward_fn
from grpo_jax.tools import templates, tool_parsers, toolbox

RESERVED = ("reset", "get_reward")  # an environment's methods that are not tools


def resolve(spec: str | Callable) -> Callable:
    """A tool or environment factory: a callable as it is, a 'module:name' path imported."""
    if callable(spec):
        return spec
    return resolve_reward_fn(spec, what="tool or environment")


def environment_factories(spec) -> dict | None:
    """TRL's ``environment_factory`` as {name: factory} ({None: factory} for one), or None."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {name: resolve(factory) for name, factory in spec.items()}
    return {None: resolve(spec)}


def methods(environment) -> list[Callable]:
    """An environment instance's tools: its public methods but `reset` and `get_reward` (listed on the class, as TRL
    does, so properties are not evaluated)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def make_environment(name, factory):
    """One instance from an environment factory; what it raises becomes an error naming it."""
    try:
        return factory()
    except Exception as e:
        where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        raise RuntimeError(f"{where} ({getattr(factory, '__qualname__', factory)!s}) raised {type(e).__name__}: "
                           f"{e}") from e


def check_environment(name, environment) -> None:
    """An environment must define `reset` (TRL's check), named in the error."""
    if not callable(getattr(type(environment), "reset", None)):
        raise ValueError(f"environment_factory{'' if name is None else f'[{name!r}]'} made a "
                         f"{type(environment).__name__} without a reset method: TRL environments define "
                         "reset(self, **row) (returning None or a string appended to the prompt)")


def _validate_calls(calls) -> None:
    """TRL's `_validate_tool_calls`: every call names a function; missing arguments become {}."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("a tool call must be a dict")
        fn = call["function"] if "function" in call else call
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("a tool call must name its function")
        if fn.get("arguments") is None:
            fn["arguments"] = {}


def compiled_template(tokenizer):
    """The tokenizer's ``response_template`` compiled once (transformers compiles it on every `parse_response`
    call otherwise); without one, our parser of its chat template's family (`tool_parsers.detect`); None for a
    legacy ``response_schema`` or an unknown family."""
    template = getattr(tokenizer, "response_template", None)
    if template is None:
        if getattr(tokenizer, "response_schema", None) is not None:
            return None
        return tool_parsers.detect(getattr(tokenizer, "chat_template", None))
    from transformers.utils.chat_parsing.response_templates import load_response_template
    return load_response_template(template)


_SCHEMAS: dict = {}


def json_schemas(fns: Sequence[Callable]) -> list[dict]:
    """The tools' JSON schemas (transformers' `get_json_schema`), each function's once: the parser types a call's
    arguments with them."""
    from transformers.utils import get_json_schema

    out = []
    for fn in fns:
        key = getattr(fn, "__func__", fn)  # an environment's bound methods share their class's function
        if key not in _SCHEMAS:
            _SCHEMAS[key] = get_json_schema(fn)
        out.append(_SCHEMAS[key])
    return out


def parse_turn(tokenizer, ids: Sequence[int], prefix: Sequence[int] | None, tools: list,
               template=None) -> tuple[dict, bool]:
    """(the turn as an assistant message, whether it failed to parse): TRL 1.16's `parse_response` (a turn that does
    not parse is its text, special tokens skipped), and the flag TRL does not keep. Needs the tokenizer's
    ``response_template`` (``template``: it compiled, `compiled_template`), a legacy ``response_schema`` or
    ``template`` one of our `tool_parsers.Format`."""
    try:
        if isinstance(template, tool_parsers.Format):
            parsed = _parse_own(tokenizer, template, ids, prefix, tools)
        elif getattr(tokenizer, "response_template", None) is not None and prefix is not None:
            parsed = tokenizer.parse_response(list(ids), template, prefix=list(prefix), tools=tools or None)
        else:
            parsed = tokenizer.parse_response(list(ids))
        if parsed is None:
            raise ValueError("parse_response returned None")
        if isinstance(parsed.get("content"), str):
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            _validate_calls(parsed["tool_calls"])
        return parsed, False
    except (ValueError, TypeError):
        return {"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)}, True


def _parse_own(tokenizer, fmt: tool_parsers.Format, ids, prefix, tools) -> dict:
    """`tool_parsers.parse_response` of the turn's text; a reasoning block the prompt opened (a template that
    pre-writes ``<think>``) is reopened first, as transformers' parser reads the prefix."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    if fmt.reasoning is not None and prefix:
        tail = tokenizer.decode(list(prefix)[-16:], skip_special_tokens=False)
        opened, closed = tail.rfind(fmt.reasoning[0]), tail.rfind(fmt.reasoning[1])
        if opened >= 0 and opened > closed and not tail[opened + len(fmt.reasoning[0]):].strip():
            text = fmt.reasoning[0] + text
    schemas = json_schemas([t for t in tools or () if callable(t)]) + [t for t in tools or () if isinstance(t, dict)]
    return tool_parsers.parse_response(fmt, text, schemas)


def suffix_ids(tokenizer, tool_messages: list[dict], chat_template: str | None = None, cache: dict | None = None,
               **template_kwargs) -> list:
    """The tokens that follow a turn's end to carry its tool messages and open the next assistant turn: TRL's
    `_get_tool_suffix_ids` (a dummy conversation rendered with and without them, the shorter cut after its last EOS,
    so the suffix starts just after the model's own end-of-turn token). ``cache`` keeps the dummy's rendering by
    tool name."""
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    render = dict(tokenize=True, chat_template=chat_template, return_dict=False, **template_kwargs)
    name = tool_messages[0]["name"]
    prefix = None if cache is None else cache.get(name)
    if prefix is None:
        prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **render)
        if cache is not None:
            cache[name] = prefix
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, **render)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[:eos[-1] + 1]
    if list(full[:len(prefix)]) != list(prefix):
        raise ValueError("the chat template is not prefix-preserving for tool messages: the conversation before them "
                         "renders differently once they follow (TRL's `get_training_chat_template` gives a training "
                         "template for the known families; set the tokenizer's chat_template to it)")
    return list(full[len(prefix):])


def tool_dict(tools: Sequence[Callable]) -> dict[str, Callable]:
    """Tools by the name the model calls them (their ``__name__``)."""
    return {fn.__name__: fn for fn in tools}


def reward_of(environment_type: type) -> Callable:
    """An environment class's `get_reward` as a TRL reward function over the rollouts' ``environments`` (None for
    rollouts of other environments), as TRL adds it."""
    if inspect.iscoroutinefunction(environment_type.get_reward):
        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is environment_type else None for e in environments]
    else:
        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is environment_type else None for e in environments]
    get_reward.__name__ = environment_type.__name__
    return get_reward



def _parser_and_template(tokenizer) -> str | None:
    """Checks the tokenizer has a response parser (its own, ours for its family, else TRL's `add_response_schema`
    set on it) and returns
    the chat template multi-turn rendering needs: None (the tokenizer's) where it is prefix-preserving, else the
    training template for it (ours, `templates`, else TRL's `get_training_chat_template`), as TRL's GRPOTrainer
    does."""
    if compiled_template(tokenizer) is None and getattr(tokenizer, "response_schema", None) is None:
        try:  # families we do not parse ourselves (GPT-OSS, ...) that TRL knows
            from trl.chat_template_utils import add_response_schema
        except ImportError:
            raise ValueError("tools need the tokenizer's response parser (its response_template) to read tool calls, "
                             "and this tokenizer has none and a chat template of none of the families grpo_jax "
                             f"parses ({', '.join(f.name for f in tool_parsers.FORMATS)}): set "
                             "tokenizer.response_template (transformers' response parsing docs) and save it with the "
                             "tokenizer, or `pip install trl` for its add_response_schema") from None
        try:
            add_response_schema(tokenizer)
        except ValueError as e:
            raise ValueError(f"tools: {e}") from e
    try:
        suffix_ids(tokenizer, [{"role": "tool", "name": "dummy", "content": "dummy"}])
        return None
    except ValueError:
        ours = templates.training_chat_template(tokenizer)
        if ours is not None:
            return ours
        try:  # families beyond ours that TRL knows
            from trl.chat_template_utils import get_training_chat_template
        except ImportError:
            raise ValueError("tools: the tokenizer's chat template is not prefix-preserving (an earlier turn renders "
                             "differently once a tool message follows) and is none of the released templates "
                             f"grpo_jax has a training template for ({', '.join(templates.NAMES)}): set a "
                             "prefix-preserving chat_template, or `pip install trl` for its training "
                             "templates") from None
        return get_training_chat_template(tokenizer)


@dataclasses.dataclass(frozen=True, eq=False)
class Tooling:
    """A run's tools and environments, built once (`build`): the standalone tools, the environment factories with
    each one's tools (from a probe instance, as TRL renders the schemas), the tool calls' timeout and the chat
    template multi-turn rendering uses. What lives through the loop is not here: the loop that rounds opens the
    `Toolbox` that runs the calls (a thread pool) with the `Environments` its rollouts reset and use
    (`open_toolbox`), and closes it."""

    tools: tuple  # standalone tools (callables)
    factories: dict | None  # {environment name (None: the one): factory}
    env_tools: dict  # {environment name: its probe instance's methods}
    probes: dict  # {environment name: its probe instance}, the first instance `Environments` hands out
    timeout: float  # seconds a tool call may take (`toolbox.Toolbox`)
    chat_template: str | None
    max_iterations: int | None
    max_model_len: int | None
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # `data.chat_template_kwargs`

    def environment_name(self, row: dict):
        if self.factories is None or None in self.factories:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(f"Example has `environment={name!r}`, which is not among the environments passed to "
                             f"`environment_factory`. Expected one of: {list(self.factories)}. Fix the row's "
                             "'environment' column or add that environment")  # TRL's message, and the fix
        return name

    def schemas(self, row: dict) -> list:
        """The tools a row's prompt is rendered with (its environment's methods after the standalone tools)."""
        if self.factories is None:
            return list(self.tools)
        return list(self.tools) + self.env_tools[self.environment_name(row)]

    def row_schemas(self, rows, where) -> list:
        """`schemas` of every row (a list of dicts or a `datasets.Dataset`); the prompts must be conversations, as
        TRL's tool loop reads messages (a ValueError names ``where`` they come from)."""
        rows = rows if isinstance(rows, list) else rows.to_list()
        if rows and not isinstance(rows[0]["prompt"], list):
            raise ValueError(f"{where}: tools and environments need conversational prompts (lists of "
                             '{"role", "content"} messages), as TRL\'s tool loop does: the prompts are strings')
        return [self.schemas(row) for row in rows]



class Environments:
    """The environment instances of a run's rollouts, reused round after round (each reset before its rollout) and
    made when a batch needs more of one environment: the loop's, opened with its `Toolbox` (`open_toolbox`). The
    probe instances `build` made come first."""

    def __init__(self, tooling: Tooling):
        self.tooling = tooling
        self.pool = {name: [probe] for name, probe in tooling.probes.items()}  # {environment name: [instances]}

    def draw(self, rows: list) -> list:
        """One pooled instance per row, the instances of one environment in pool order."""
        out, cursor = [], {}
        for row in rows:
            name = self.tooling.environment_name(row)
            pool = self.pool.setdefault(name, [])
            index = cursor.get(name, 0)
            if index == len(pool):
                pool.append(make_environment(name, self.tooling.factories[name]))
                check_environment(name, pool[-1])
            cursor[name] = index + 1
            out.append(pool[index])
        return out


def build(tool_specs, factory_spec, tokenizer, *, timeout: float, max_iterations: int | None,
          max_model_len: int | None, template_kwargs: dict | None = None) -> Tooling | None:
    """A run's `Tooling` from TRL's ``tools`` and ``environment_factory`` (paths or objects); None without either.
    Probes one instance of each environment (a missing `reset` is an error naming it)."""
    factories = environment_factories(factory_spec)
    if not tool_specs and factories is None:
        return None
    standalone = []
    for spec in tool_specs:
        try:
            standalone.append(resolve(spec))
        except ValueError as e:
            raise ValueError(f"tools: {e}") from e
    env_tools, probes = {}, {}
    for name, factory in (factories or {}).items():
        instance = make_environment(name, factory)
        check_environment(name, instance)
        env_tools[name], probes[name] = methods(instance), instance
    return Tooling(tuple(standalone), factories, env_tools, probes, timeout, _parser_and_template(tokenizer),
                   max_iterations, max_model_len, dict(template_kwargs or {}))


def open_toolbox(tooling: Tooling | None) -> toolbox.Toolbox | None:
    """The thread pool that runs a run's tool calls with the run's `Environments` (None without tools), for the
    loop that rounds with it: that loop closes it (`Toolbox.close`) however it ends."""
    if tooling is None:
        return None
    return toolbox.Toolbox(tooling.timeout, environments=None if tooling.factories is None else Environments(tooling))


def env_rewards(tooling: Tooling | None) -> list[tuple[str, Callable]]:
    """(name, reward function) of each environment class with a `get_reward` (once a class), as TRL adds them."""
    seen, out = [], []
    for probe in (tooling.probes.values() if tooling is not None else ()):
        kind = type(probe)
        if callable(getattr(kind, "get_reward", None)) and kind not in seen:
            seen.append(kind)
            out.append((kind.__name__, reward_of(kind)))
    return out
