"""Tools and environments (grpo_jax/tools/calls.py, toolbox.py): calls run with TRL's failure semantics and a timeout,
environments and paths fail with errors naming them, per-turn rewards become process-supervision steps at the turns'
ends."""

import asyncio
import dataclasses
import sys
import time

import numpy as np
import pytest

from grpo_jax.config import load_config
from grpo_jax.rewards import functions as rewards
from grpo_jax.rollout.scoring import turn_ends
from grpo_jax.tools import tool_task, calls as tools
from grpo_jax.tools.toolbox import Toolbox


def double(x: int) -> int:
    """Doubles.

    Args:
        x: A number.
    """
    return 2 * x


async def later(x: int) -> int:
    """Returns x after a moment.

    Args:
        x: A number.
    """
    await asyncio.sleep(0.01)
    return x


async def stuck(x: int) -> int:
    """Never returns in time.

    Args:
        x: A number.
    """
    await asyncio.sleep(5)
    return x


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_turns_calls_run_with_trls_order_failures_and_a_timeout():
    box = Toolbox(timeout=0.3)
    fns = tools.tool_dict([double, later, stuck])
    start = time.perf_counter()
    out = box.submit([call("later", x=1), call("double", x=4), call("missing"), call("stuck", x=1),
                      {"type": "code", "name": "x"}], fns).result()
    box.close()
    assert time.perf_counter() - start < 2.0
    assert [(m["name"], m["content"]) for m in out.messages] == [
        ("double", "8"), ("missing", "{'error': 'Tool missing not found.'}"),
        ("x", "{'error': 'Unsupported tool call type: code'}"), ("later", "1"),
        ("stuck", "{'error': \"tool 'stuck' did not return within 0.3 s\"}")]
    assert (out.calls, out.failures) == (5, 3)


def quits(x: int) -> int:
    """Calls sys.exit.

    Args:
        x: A number.
    """
    sys.exit(x)


async def interrupts(x: int) -> int:
    """Raises KeyboardInterrupt.

    Args:
        x: A number.
    """
    raise KeyboardInterrupt


def test_a_tool_stopping_the_process_stops_the_turn_naming_it_and_the_toolbox_still_works():
    """Old outcome: sys.exit's message named no tool; an async tool's KeyboardInterrupt ended the event loop's thread
    (the turn never returned). New: a RuntimeError naming the tool, a KeyboardInterrupt naming it; the next turn's
    async calls still run."""
    box = Toolbox(timeout=2.0)
    fns = tools.tool_dict([double, later, quits, interrupts])
    with pytest.raises(RuntimeError, match=r"^tool 'quits' called sys.exit\(3\): raise an exception"):
        box.submit([call("double", x=1), call("quits", x=3)], fns).result(timeout=5)
    with pytest.raises(KeyboardInterrupt, match="tool 'interrupts' raised KeyboardInterrupt"):
        box.submit([call("later", x=1), call("interrupts", x=1)], fns).result(timeout=5)
    out = box.submit([call("later", x=2)], fns).result(timeout=5)
    box.close()
    assert [m["content"] for m in out.messages] == ["2"]


class NoReset:
    def act(self) -> str:
        """Acts."""
        return "x"


class Broken:
    def __init__(self):
        raise OSError("no sandbox")


class Picky(tool_task.LookupEnv):
    def reset(self, **row):
        raise KeyError("answer")


def test_environments_and_tool_paths_fail_with_errors_naming_them():
    tok = tool_task.build_tokenizer()
    build = dict(timeout=1.0, max_iterations=None, max_model_len=None)
    with pytest.raises(ValueError, match="environment_factory made a NoReset without a reset method"):
        tools.build((), NoReset, tok, **build)
    with pytest.raises(RuntimeError, match=r"environment_factory\['box'\] \(Broken\) raised OSError: no sandbox"):
        tools.build((), {"box": Broken}, tok, **build)
    with pytest.raises(ValueError, match="tools: tool or environment 'no_such_module:f': module 'no_such_module'"):
        tools.build(("no_such_module:f",), None, tok, **build)
    tooling = tools.build((), {"a": tool_task.LookupEnv}, tok, **build)
    with pytest.raises(ValueError, match=r"environment='b'`, which is not among the environments passed to "
                                         r"`environment_factory`\. Expected one of: \['a'\]"):
        tools.Environments(tooling).draw([{"environment": "b"}])
    assert [m.__name__ for m in tooling.schemas({"environment": "a"})] == ["lookup"]
    assert tools.env_rewards(tooling) == []


def test_a_reset_that_raises_names_the_environment():
    from grpo_jax.data import prompts as data
    from grpo_jax.rollout import multiturn

    tok = tool_task.build_tokenizer()
    tooling = tools.build((), Picky, tok, timeout=1.0, max_iterations=None, max_model_len=None)
    rows = tool_task.make_examples(2, seed=0)
    batch = data.PromptBatch(np.zeros((2, 4), np.int32), np.ones((2, 4), np.int32), [r["prompt"] for r in rows],
                             {"answer": [r["answer"] for r in rows]}, 0)
    box = tools.open_toolbox(tooling)
    try:
        with pytest.raises(RuntimeError, match=r"Picky.reset raised KeyError: 'answer' \(on a row with columns"):
            multiturn.setup(tooling, tok, batch, None, 1, toolbox=box)
    finally:
        box.close()


def test_the_tooling_is_a_value_and_the_toolbox_belongs_to_whoever_opens_it():
    import threading

    from grpo_jax.data import prompts as data
    from grpo_jax.rollout import multiturn

    tok = tool_task.build_tokenizer()
    before = {t.ident for t in threading.enumerate()}
    tooling = tools.build((double,), None, tok, timeout=1.0, max_iterations=None, max_model_len=None)
    assert {t.ident for t in threading.enumerate()} <= before  # building the run's tools starts no thread
    assert tools.open_toolbox(None) is None
    rows = tool_task.make_examples(2, seed=0)
    batch = data.PromptBatch(np.zeros((2, 4), np.int32), np.ones((2, 4), np.int32), [r["prompt"] for r in rows],
                             {"answer": [r["answer"] for r in rows]}, 0)
    with pytest.raises(ValueError, match=r"pass toolbox=grpo_jax.tools.calls.open_toolbox\(run.tooling\)"):
        multiturn.setup(tooling, tok, batch, None, 1)
    box = tools.open_toolbox(tooling)
    try:
        assert box.timeout == 1.0 and box.submit([], {}).result(timeout=5).outcomes == []
        _, turns, _ = multiturn.setup(tooling, tok, batch, None, 1, toolbox=box)
        assert turns.toolbox is box
    finally:
        box.close()


def test_the_environments_live_in_the_toolbox_reused_round_after_round():
    """The frozen Tooling holds one probe instance an environment; the instances rollouts reset and use are the
    toolbox's (`open_toolbox`): the probe first, more made when a batch needs them, the same again next round."""
    made = []

    class Counted(tool_task.LookupEnv):
        def __init__(self):
            super().__init__()
            made.append(self)

    tok = tool_task.build_tokenizer()
    tooling = tools.build((), Counted, tok, timeout=1.0, max_iterations=None, max_model_len=None)
    assert len(made) == 1 and tooling.probes == {None: made[0]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        tooling.probes = {}
    box = tools.open_toolbox(tooling)
    try:
        first = box.environments.draw([{}] * 3)
        assert first[0] is made[0] and len(made) == 3 and len({id(e) for e in first}) == 3
        assert box.environments.draw([{}] * 2) == first[:2] and len(made) == 3  # reused, none made
    finally:
        box.close()
    box = tools.open_toolbox(tools.build((double,), None, tok, timeout=1.0, max_iterations=None, max_model_len=None))
    assert box.environments is None  # tools alone: no environments
    box.close()


def test_a_tokenizer_without_a_response_parser_needs_one(monkeypatch):
    tok = tool_task.build_tokenizer()
    tok.response_template = None
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # as if trl were not installed
    with pytest.raises(ValueError, match="tools need the tokenizer's response parser"):
        tools.build((double,), None, tok, timeout=1.0, max_iterations=None, max_model_len=None)


def test_config_keys_check_their_shape():
    config = load_config(None, ["tools=[m:f]", "environment_factory={a: m:A}", "max_tool_calling_iterations=2"])
    assert (config.tools, config.environment_factory, config.sampling.max_tool_calling_iterations) == (
        ("m:f",), {"a": "m:A"}, 2)
    with pytest.raises(ValueError, match="list each tool as 'module:function'"):
        load_config(None, ["tools=[f]"])
    with pytest.raises(ValueError, match="environment_factory="):
        load_config(None, ["environment_factory=Env"])
    with pytest.raises(ValueError, match="sampling.tool_timeout=0.0 must be > 0"):
        load_config(None, ["sampling.tool_timeout=0"])


def test_one_reward_per_turn_is_a_process_step_at_each_turns_end():
    """Turn k of a rollout ends at its k-th run of trained tokens; a function's [r_1, .., r_K] become the steps
    (end_k, r_k); a list of the wrong length is an error naming the function."""
    loss_mask = np.array([[1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    ends = [turn_ends(m) for m in loss_mask]
    assert ends == [[1, 6], [2]]

    def per_turn(prompts, completions, **kwargs):
        return [[0.5, 1.0], [0.25]]

    _, step_rewards, step_ends = rewards.score_steps([("per_turn", per_turn)], [2.0], ["p"] * 2, [[], []], {},
                                                     [8, 3], turn_ends=ends)
    np.testing.assert_array_equal(step_ends, [[1, 6], [2, -1]])
    np.testing.assert_allclose(step_rewards, [[1.0, 2.0], [0.5, np.nan]])
    with pytest.raises(ValueError, match="'short' returned 1 turn rewards at index 0 for a rollout of 2 turns"):
        rewards.score_steps([("short", lambda prompts, completions, **kw: [[1.0], [1.0]])], [1.0], ["p"] * 2,
                            [[], []], {}, [8, 3], turn_ends=ends)


def test_a_tool_that_never_returns_holds_neither_the_run_nor_the_process_exit():
    import subprocess

    script = ("import time\nfrom grpo_jax.tools.toolbox import Toolbox\n"
              "def hang(x: int) -> int:\n    time.sleep(600)\n"
              "box = Toolbox(timeout=0.2)\n"
              "out = box.submit([{'type': 'function', 'function': {'name': 'hang', 'arguments': {'x': 1}}}], "
              "{'hang': hang}).result()\n"
              "box.close()\nprint(out.messages[0]['content'])\n")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "did not return within 0.2 s" in result.stdout
    assert time.perf_counter() - start < 20


class Scored(tool_task.LookupEnv):
    """An environment that owns its reward."""

    def get_reward(self) -> float:
        return float(len(self._answer))


class AsyncScored(tool_task.LookupEnv):
    async def get_reward(self) -> float:
        return 2.0


def test_an_environments_get_reward_is_one_more_reward_named_after_its_class():
    """As TRL adds it: once per class, scoring only rollouts of exactly that class (None for the others), async ones
    awaited; `rewards.score_completions` passes it the rollouts' environments."""
    tok = tool_task.build_tokenizer()
    tooling = tools.build((), {"a": Scored, "b": tool_task.LookupEnv, "c": Scored, "d": AsyncScored}, tok,
                          timeout=1.0, max_iterations=None, max_model_len=None)
    funcs = tools.env_rewards(tooling)
    assert [name for name, _ in funcs] == ["Scored", "AsyncScored"]
    envs = tools.Environments(tooling).draw([{"environment": n} for n in "abd"])
    for env, answer in zip(envs, ["123", "45", "6"]):
        env.reset(answer=answer)
    got = rewards.score_completions(funcs, ["p"] * 3, ["c"] * 3, {}, {"environments": envs})
    np.testing.assert_array_equal(got, [[3.0, np.nan], [np.nan, np.nan], [np.nan, 2.0]])
