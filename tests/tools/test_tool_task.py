"""Tests for grpo_jax.tools.tool_task: rows, tokenizer, chat template against TRL's checks, response parsing, rewards."""

import re
import sys

import pytest
import transformers
from transformers.utils import get_json_schema

from grpo_jax.api import trainer
from grpo_jax.tools import tool_task

CALL_MSG = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "lookup", "arguments": {}}}]}
CONVERSATION = [
    {"role": "user", "content": "12?"},
    CALL_MSG,
    {"role": "tool", "name": "lookup", "content": "5281"},
    {"role": "assistant", "content": "5281"},
]
EXPECTED_TEXT = (
    '12?<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    "<tool_response>5281</tool_response>5281<eos>"
)


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_tok")
    return tool_task.build_tokenizer(path), path


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_make_examples_deterministic_and_consistent():
    rows = tool_task.make_examples(50, seed=3)
    assert rows == tool_task.make_examples(50, seed=3)
    assert rows != tool_task.make_examples(50, seed=4)
    for row in rows:
        assert row["prompt"] == [{"role": "user", "content": f"{row['key']}?"}]
        assert len(row["key"]) == 2 and row["answer"].isdigit() and 3 <= len(row["answer"]) <= 5
    assert {len(r["answer"]) for r in tool_task.make_examples(20, seed=0, min_len=2, max_len=2)} == {2}
    # values are drawn per row, not from a table a policy could learn: one key gets several values
    by_key = {}
    for row in tool_task.make_examples(2000, seed=0):
        by_key.setdefault(row["key"], set()).add(row["answer"])
    assert max(len(v) for v in by_key.values()) > 1


def test_tokenizer_ids_and_round_trip(saved_tokenizer):
    tok, _ = saved_tokenizer
    assert (tok.pad_token_id, tok.eos_token_id, tok.all_special_ids) == (0, 0, [0])
    assert len(tok) == 2 + len(tool_task.CHARS) + 3
    call_id, open_id, close_id = (len(tok) - 3, len(tok) - 2, len(tok) - 1)
    assert _ids(tok, tool_task.CALL) == [call_id]
    assert _ids(tok, "<tool_response>") == [open_id] and _ids(tok, "</tool_response>") == [close_id]
    assert tool_task.stop_token_ids(tok) == (0, call_id)
    assert _ids(tok, "12?") == [3, 4, 12]
    ids = _ids(tok, EXPECTED_TEXT)
    assert len(ids) == 15 and tok.decode(ids) == EXPECTED_TEXT
    # the call and the tool's result survive skip_special_tokens; only <eos> goes
    assert tok.decode(ids, skip_special_tokens=True) == EXPECTED_TEXT.removesuffix("<eos>")


def test_tokenizer_reload_keeps_templates(saved_tokenizer):
    tok, path = saved_tokenizer
    reloaded = transformers.AutoTokenizer.from_pretrained(path)
    assert reloaded.chat_template == tool_task.CHAT_TEMPLATE
    assert reloaded.response_template == tool_task.RESPONSE_TEMPLATE
    assert _ids(reloaded, EXPECTED_TEXT) == _ids(tok, EXPECTED_TEXT)
    assert tool_task.stop_token_ids(reloaded) == tool_task.stop_token_ids(tok)


def test_chat_template_renders_conversation(saved_tokenizer):
    tok, _ = saved_tokenizer
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED_TEXT
    assert tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False) == _ids(tok, EXPECTED_TEXT)
    prompt = CONVERSATION[:1]
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == "12?"
    # arguments given as a JSON string (TRL's fallback) render the same way
    flat = [{"role": "assistant", "content": "", "tool_calls": [{"name": "lookup", "arguments": "{}"}]}]
    assert tok.apply_chat_template(flat, tokenize=False) == tool_task.CALL


def test_trl_template_checks(saved_tokenizer):
    pytest.importorskip("trl")
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    tok, _ = saved_tokenizer
    assert is_chat_template_prefix_preserving(tok)
    assert supports_tool_calling(tok)


def _get_tool_suffix_ids(tokenizer, tool_messages):
    """TRL 1.16's GRPOTrainer._get_tool_suffix_ids for a text tokenizer with no chat-template overrides."""
    dummy_tool_calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy_messages = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": dummy_tool_calls},
    ]
    prefix_ids = tokenizer.apply_chat_template(dummy_messages, add_generation_prompt=False, tokenize=True,
                                               return_dict=False)
    full_ids = tokenizer.apply_chat_template(dummy_messages + tool_messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    eos_positions = [i for i, tok_id in enumerate(prefix_ids) if tok_id == tokenizer.eos_token_id]
    if eos_positions:
        prefix_ids = prefix_ids[: eos_positions[-1] + 1]
    if full_ids[: len(prefix_ids)] != prefix_ids:
        raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
    return full_ids[len(prefix_ids):]


def test_tool_suffix_ids(saved_tokenizer):
    tok, _ = saved_tokenizer
    # the CALL-ended dummy turn has no <eos>, so nothing is trimmed and the suffix starts right after CALL
    prefix = tok.apply_chat_template(CONVERSATION[:2], tokenize=True, return_dict=False)
    assert tok.eos_token_id not in prefix and prefix[-1] == tool_task.stop_token_ids(tok)[1]
    suffix = _get_tool_suffix_ids(tok, [{"role": "tool", "name": "lookup", "content": "5281"}])
    assert suffix == _ids(tok, "<tool_response>5281</tool_response>")


@pytest.mark.parametrize("parse", ["tokenizer", "trl"])
def test_parse_response(saved_tokenizer, parse):
    tok, _ = saved_tokenizer
    if parse == "trl":
        pytest.importorskip("trl")
        from trl.chat_template_utils import parse_response

        def parsed(ids, prefix):
            return parse_response(tok, ids, prefix=prefix, tools=[tool_task.LookupEnv().lookup])
    else:
        def parsed(ids, prefix):
            return tok.parse_response(ids, prefix=prefix)

    call_id = tool_task.stop_token_ids(tok)[1]
    prompt = _ids(tok, "12?")
    after_tool = prompt + [call_id] + _ids(tok, "<tool_response>5281</tool_response>")
    for prefix in ([], prompt):
        message = parsed([call_id], prefix)
        assert message.get("content", "") == "" and message["role"] == "assistant"
        assert message["tool_calls"] == CALL_MSG["tool_calls"]
    for prefix in ([], prompt, after_tool):
        assert parsed(_ids(tok, "5281<eos>"), prefix) == {"role": "assistant", "content": "5281"}
    assert parsed(_ids(tok, "52"), after_tool) == {"role": "assistant", "content": "52"}  # truncated, no <eos>


def test_lookup_env():
    env = tool_task.LookupEnv()
    row = tool_task.make_examples(1, seed=0)[0]
    assert env.reset(**row) is None
    assert env.lookup() == row["answer"]
    public = [name for name in dir(tool_task.LookupEnv) if not name.startswith("_")]
    assert public == ["lookup", "reset"]
    schema = get_json_schema(env.lookup)
    assert schema["function"]["name"] == "lookup"
    assert schema["function"]["parameters"] == {"type": "object", "properties": {}}


def test_answer_accuracy_hand_computed():
    tool_msg = {"role": "tool", "name": "lookup", "content": "5281"}
    completions = [
        [CALL_MSG, tool_msg, {"role": "assistant", "content": "5281"}],  # 4/4
        [CALL_MSG, tool_msg, {"role": "assistant", "content": "5231"}],  # 3/4
        [CALL_MSG, tool_msg, {"role": "assistant", "content": "528"}],  # 3/max(4, 3)
        [CALL_MSG, tool_msg],  # truncated after the tool: "" -> 0/4
        [{"role": "assistant", "content": "52811"}],  # 4/5
        "5200",  # plain string: 2/4
        [CALL_MSG],  # content "" of the only assistant message
    ]
    rewards = tool_task.answer_accuracy([None] * 7, completions, ["5281"] * 7)
    assert rewards == [1.0, 0.75, 0.75, 0.0, 0.8, 0.5, 0.0]


def test_tool_use_hand_computed():
    ok = {"role": "tool", "name": "lookup", "content": "5281"}
    error = {"role": "tool", "name": "lookup", "content": str({"error": "Tool lookup not found."})}
    answer = {"role": "assistant", "content": "5281"}
    completions = [[CALL_MSG, ok, answer], [CALL_MSG, error, answer], [answer], "5281",
                   [CALL_MSG, error, CALL_MSG, ok, answer],
                   [CALL_MSG, ok],  # called, never answered
                   [CALL_MSG, ok, CALL_MSG],  # called again instead of answering
                   [CALL_MSG, ok, {"role": "assistant", "content": ""}]]
    assert tool_task.tool_use(completions) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


# --- training on the task: resumed mid-round, no tool is called twice --------------------------------------------

CALLS = {"lookup": 0, "raise_at_step": None, "stop_at_call": None, "stop": None}


def _maybe_stop():
    """The lookup call numbered CALLS["stop_at_call"] raises CALLS["stop"]: KeyboardInterrupt, or calls sys.exit."""
    if CALLS["stop_at_call"] is not None and CALLS["lookup"] == CALLS["stop_at_call"]:
        CALLS["stop_at_call"] = None
        if CALLS["stop"] == "exit":
            sys.exit(4)
        raise KeyboardInterrupt


def lookup() -> str:
    """Look up the value stored under the key in the question (a standalone tool with a side effect: it counts).

    Returns:
        The value, a string of digits.
    """
    CALLS["lookup"] += 1
    _maybe_stop()
    return "123"


class CountingEnv(tool_task.LookupEnv):
    """LookupEnv whose tool counts its calls, and which scores its own rollouts from its state."""

    def reset(self, **row):
        self.called = 0
        return super().reset(**row)

    def lookup(self) -> str:
        """Look up the value stored under the key in the question.

        Returns:
            The value, a string of digits.
        """
        CALLS["lookup"] += 1
        _maybe_stop()
        self.called += 1
        return super().lookup()

    def get_reward(self) -> float:
        return 0.1 * min(self.called, 1)


def flaky_accuracy(prompts, completions, answer, trainer_state, **kwargs):
    """answer_accuracy that raises once while the round after step CALLS["raise_at_step"] is scored: a run that
    stops after that round's tools ran."""
    if CALLS["raise_at_step"] is not None and trainer_state.global_step == CALLS["raise_at_step"]:
        CALLS["raise_at_step"] = None
        raise ConnectionError("the grader went away")
    return tool_task.answer_accuracy(prompts, completions, answer)


TOOL_RUN = ["data.task=lookup", "data.task_num_train=64", "reward.functions=[tests.tools.test_tool_task:flaky_accuracy]",
            "sampling.max_completion_length=12",
            "sampling.max_tool_calling_iterations=1", "train.train_batch_size=8", "train.num_generations=4",
            "eval.num_examples=4", "eval.reward_functions=[grpo_jax.tools.tool_task:answer_accuracy]",
            "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
            "train.learning_rate=3e-3", "max_steps=4", "save_steps=0"]


@pytest.mark.parametrize("source", ["tools=[tests.tools.test_tool_task:lookup]",
                                    "environment_factory=tests.tools.test_tool_task:CountingEnv"],
                         ids=["tool", "environment"])
def test_a_run_stopped_after_a_rounds_tools_resumes_bitwise_without_calling_them_again(tmp_path, source):
    """The reward fails while round 3 is scored, after its tools ran: the state after step 2 is saved; the rerun
    samples round 3 again and ends as the run that never stopped, bit for bit. A standalone tool's results come
    from the journal (it is not called twice); an environment's methods run again on the reset instance, whose
    state (here its get_reward) they rebuild."""
    import importlib

    from grpo_jax.config import load_config
    from grpo_jax.io.preemption import RunFailed
    from tests.io.test_checkpoint import _assert_same_state, _lines, _state

    calls = importlib.import_module("tests.tools.test_tool_task").CALLS  # the module the config imports
    run = lambda out: trainer.train(load_config(None, [f"output_dir={out}", *TOOL_RUN, source]),  # noqa: E731
                                    show_progress=False)

    calls.update(lookup=0, raise_at_step=None)
    summary = run(tmp_path / "whole")
    assert "greedy/answer_accuracy" in summary["eval_after"]  # held-out rows run their turns too
    whole_calls = calls["lookup"]
    assert whole_calls > 0

    calls.update(lookup=0, raise_at_step=2)
    with pytest.raises(RunFailed, match="the grader went away"):
        run(tmp_path / "split")
    assert sorted(p.name for p in (tmp_path / "split" / "tool_calls").iterdir())[-1] == "round-2-pass-0.jsonl"
    run(tmp_path / "split")
    if source.startswith("tools"):
        assert calls["lookup"] == whole_calls
    else:
        assert calls["lookup"] > whole_calls
    assert _lines(tmp_path / "split") == _lines(tmp_path / "whole")
    _assert_same_state(_state(tmp_path / "split")[0], _state(tmp_path / "whole")[0])
    line = [line for line in _lines(tmp_path / "whole") if "loss" in line][-1]  # the last step's, not an eval's
    assert {"tools/call_frequency", "tools/failure_frequency", "tools/turns_per_rollout"} <= set(line)
    assert ("rewards/CountingEnv/mean" in line) == source.startswith("environment")


def test_a_tampered_journal_warns_calls_those_turns_again_and_resumes_bitwise(tmp_path):
    """After the stop, three foreign lines (JSON without the keys, a JSON list, binary junk) are appended to round
    3's journal and one recorded outcome is changed ('123' -> '923'). Old outcome: "KeyError: 'row'" on every
    rerun, or the changed outcome trained on silently. New: one warning naming the journal and its bad lines, the
    changed turn's tool called again (once), and the run ends as the uninterrupted one, bit for bit."""
    import importlib

    from grpo_jax.config import load_config
    from grpo_jax.io.preemption import RunFailed
    from tests.io.test_checkpoint import _assert_same_state, _lines, _state

    calls = importlib.import_module("tests.tools.test_tool_task").CALLS
    run = lambda out: trainer.train(load_config(None, [f"output_dir={out}", *TOOL_RUN,  # noqa: E731
                                                       "tools=[tests.tools.test_tool_task:lookup]"]), show_progress=False)
    calls.update(lookup=0, raise_at_step=None)
    run(tmp_path / "whole")
    whole_calls = calls["lookup"]
    calls.update(lookup=0, raise_at_step=2)
    with pytest.raises(RunFailed, match="the grader went away"):
        run(tmp_path / "split")
    journal = tmp_path / "split" / "tool_calls" / "round-2-pass-0.jsonl"
    lines = journal.read_bytes().splitlines()
    changed = next(i for i, line in enumerate(lines) if b'"123"' in line)
    lines[changed] = lines[changed].replace(b'"123"', b'"923"', 1)
    journal.write_bytes(b"\n".join(lines) + b'\n{"note": "hello"}\n[1, 2, 3]\n\xff\xfe\x00junk')
    n = len(lines)
    with pytest.warns(RuntimeWarning, match=rf"tool journal {journal}: lines {changed + 1}, {n + 1}, {n + 2}, "
                                            rf"{n + 3} did not parse as an entry or failed its checksum"):
        run(tmp_path / "split")
    assert calls["lookup"] == whole_calls + 1
    assert _lines(tmp_path / "split") == _lines(tmp_path / "whole")
    _assert_same_state(_state(tmp_path / "split")[0], _state(tmp_path / "whole")[0])


@pytest.mark.parametrize("source, stop", [("tools=[tests.tools.test_tool_task:lookup]", "interrupt"),
                                          ("environment_factory=tests.tools.test_tool_task:CountingEnv", "interrupt"),
                                          ("tools=[tests.tools.test_tool_task:lookup]", "exit")],
                         ids=["tool", "environment", "tool_exit"])
def test_a_tool_raising_keyboard_interrupt_or_calling_sys_exit_saves_and_names_it(tmp_path, source, stop):
    """A tool (standalone, or an environment's method) raises KeyboardInterrupt or calls sys.exit halfway through
    the run's calls. Old outcome: the interrupt reached the caller with no checkpoint; sys.exit's message did not
    name the tool. New: the finished steps are saved, then `Interrupted` (a KeyboardInterrupt) or `RunFailed`
    naming the tool; the rerun ends as the uninterrupted run, bit for bit."""
    import importlib

    from grpo_jax.config import load_config
    from grpo_jax.io.preemption import Interrupted, RunFailed
    from tests.io.test_checkpoint import _assert_same_state, _lines, _state

    calls = importlib.import_module("tests.tools.test_tool_task").CALLS
    run = lambda out: trainer.train(load_config(None, [f"output_dir={out}", *TOOL_RUN, source]),  # noqa: E731
                                    show_progress=False)
    calls.update(lookup=0, raise_at_step=None, stop_at_call=None, stop=None)
    run(tmp_path / "whole")
    calls.update(lookup=0, stop_at_call=calls["lookup"] // 2 + 1, stop=stop)
    expected = Interrupted if stop == "interrupt" else RunFailed
    with pytest.raises(expected) as stopped:
        run(tmp_path / "split")
    message = str(stopped.value)
    assert "\n" not in message
    named = "tool 'lookup' raised KeyboardInterrupt" if stop == "interrupt" else "tool 'lookup' called sys.exit(4)"
    assert named in message, message
    step = int(re.match(r"training stopped after optimizer step (\d+)", message).group(1))
    assert 0 < step < 4 and _state(tmp_path / "split")[1] == step
    assert f"The state after step {step} was saved first" in message or f"(step {step})" in message
    run(tmp_path / "split")
    assert _lines(tmp_path / "split") == _lines(tmp_path / "whole")
    _assert_same_state(_state(tmp_path / "split")[0], _state(tmp_path / "whole")[0])
