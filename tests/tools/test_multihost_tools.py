"""Tools and environments on two processes (jax.distributed on localhost, gloo) == one process, bit for bit.

Each run is this file run as a script: one process with 2 CPU devices, or two processes with one each (the same
data=2 mesh; an all-reduce of two partial sums is the same sum in either order, so the params match bitwise). The
multi-turn lookup task (`grpo_jax.tools.tool_task`) trains a few steps with a standalone tool or an environment whose tool
appends a line to a file at each call: process 0 alone calls it, once per call, and a run stopped by a failing
reward after its tools ran resumes on two processes from the journal without calling them again.
"""

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_jax.tools import tool_task

CALLS_FILE = "GRPO_JAX_TEST_CALLS"  # where the tools append a line per call
RAISE_AT = "GRPO_JAX_TEST_RAISE_AT_STEP"  # the reward fails while this step's round is scored (once a process)
RUN = ["data.task=lookup", "data.task_num_train=64", "sampling.max_completion_length=12",
       "sampling.max_tool_calling_iterations=1", "train.train_batch_size=8", "train.num_generations=4",
       "reward.functions=[tests.tools.test_multihost_tools:flaky_accuracy]", "eval.num_examples=2",
       "eval.reward_functions=[grpo_jax.tools.tool_task:answer_accuracy]", "model.hidden_size=32",
       "model.intermediate_size=64", "model.num_hidden_layers=1", "train.learning_rate=3e-3", "max_steps=3",
       "save_steps=0", "log_completions=true"]


def _count_call() -> None:
    import jax
    with open(os.environ[CALLS_FILE], "a") as f:
        f.write(f"{jax.process_index()}\n")


def lookup() -> str:
    """Look up the value stored under the key in the question (a standalone tool with a side effect: it counts).

    Returns:
        The value, a string of digits.
    """
    _count_call()
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
        _count_call()
        self.called += 1
        return super().lookup()

    def get_reward(self) -> float:
        return 0.1 * min(self.called, 1)


_RAISED = []


def flaky_accuracy(prompts, completions, answer, trainer_state, **kwargs):
    """answer_accuracy that raises once while the round after step $GRPO_JAX_TEST_RAISE_AT_STEP is scored."""
    if os.environ.get(RAISE_AT) == str(trainer_state.global_step) and not _RAISED:
        _RAISED.append(True)
        raise ConnectionError("the grader went away")
    return tool_task.answer_accuracy(prompts, completions, answer)


def worker(process_id: int, num_processes: int, port: int, output_dir: str, *overrides: str) -> None:
    """One process of a run: joins the others (two processes), trains, and says how it ended."""
    if num_processes > 1:
        from grpo_jax.device.distributed import DistributedConfig, initialize
        initialize(DistributedConfig(mode="always", coordinator_address=f"127.0.0.1:{port}",
                                     num_processes=num_processes, process_id=process_id, cpu_collectives="gloo"))
    from grpo_jax.api import trainer
    from grpo_jax.config import load_config
    from grpo_jax.io.preemption import RunFailed
    try:
        trainer.train(load_config(None, [f"output_dir={output_dir}", *RUN, *overrides]), show_progress=False)
        print("RUN: finished")
    except RunFailed as e:
        print(f"RUN: failed: {str(e).splitlines()[0]}")


def _run(tmp_path: Path, name: str, processes: int, *overrides: str, raise_at: int | None = None) -> tuple:
    """A run in ``tmp_path / name`` on ``processes`` processes (2 devices in all): (its folder, how every process
    ended: "finished" or "failed: ...")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={2 // processes}",
           "JAX_PLATFORMS": "cpu", CALLS_FILE: str(tmp_path / f"{name}.calls"), RAISE_AT: str(raise_at),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(processes), str(port), str(tmp_path / name),
                               *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(processes)]
    try:
        outputs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and "RUN: " in out, out[-4000:]
    ended = {out.split("RUN: ")[-1].splitlines()[0] for out in outputs}
    assert len(ended) == 1, ended  # every process ends alike
    return tmp_path / name, ended.pop()


def _calls(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _journal(output_dir: Path) -> list[dict]:
    """Every journalled turn (row, round, calls, outcomes) of the run, in a fixed order (they arrive in any)."""
    entries = [json.loads(line) for f in sorted((output_dir / "tool_calls").iterdir())
               for line in f.read_text().splitlines()]
    return sorted(entries, key=json.dumps)


def _params(output_dir: Path) -> dict:
    from safetensors.numpy import load_file
    return {f"{f.name}/{k}": v for f in sorted((output_dir / "final").glob("*.safetensors"))
            for k, v in load_file(f).items()}


def _assert_same_run(got: Path, expected: Path) -> None:
    from tests.io.test_checkpoint import _lines
    assert _lines(got) == _lines(expected)  # every metric of every step and evaluation
    assert (got / "completions.jsonl").read_text() == (expected / "completions.jsonl").read_text()
    a, b = _params(got), _params(expected)
    assert sorted(a) == sorted(b) and a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("source", ["tools=[tests.tools.test_multihost_tools:lookup]",
                                    "environment_factory=tests.tools.test_multihost_tools:CountingEnv"],
                         ids=["tool", "environment"])
def test_tools_on_two_processes_run_once_and_equal_one_process(tmp_path, source):
    args = (source,)  # the embedded task's tokenizer: process 0 writes it, the other reads it
    one, ended = _run(tmp_path, "one", 1, *args)
    assert ended == "finished"
    journal, calls = _journal(one), _calls(tmp_path / "one.calls")  # evaluation's calls too (it keeps no journal)
    assert journal and calls
    if source.startswith("environment"):
        two, ended = _run(tmp_path, "two", 2, *args)
        assert ended == "finished"
        _assert_same_run(two, one)
        assert any("tools/call_frequency" in line for line in (two / "metrics.jsonl").read_text().splitlines())
        # process 0 alone calls the tools, each call once: as often as the one process, with the same journal
        assert _journal(two) == journal
        assert set(_calls(tmp_path / "two.calls")) == {"0"} and len(_calls(tmp_path / "two.calls")) == len(calls)
        return
    # the standalone tool on two processes, stopped while round 1 is scored, after its tools ran: the state after
    # step 1 is saved, the rerun samples round 1 again, takes its tools' results from process 0's journal and ends
    # as the one-process run that never stopped (the environment's case above runs two processes uninterrupted)
    split, ended = _run(tmp_path, "split", 2, *args, raise_at=1)
    assert ended.startswith("failed") and "the grader went away" in ended
    assert sorted(p.name for p in (split / "tool_calls").iterdir())[-1] == "round-1-pass-0.jsonl"
    before = len(_calls(tmp_path / "split.calls"))
    _, ended = _run(tmp_path, "split", 2, *args)
    assert ended == "finished"
    _assert_same_run(split, one)
    assert any("tools/call_frequency" in line for line in (split / "metrics.jsonl").read_text().splitlines())
    assert _journal(split) == journal
    # process 0 alone calls the tool, and no journalled call ran again: both halves' calls are the uninterrupted
    # run's (evaluation's included)
    assert set(_calls(tmp_path / "split.calls")) == {"0"} and before < len(calls)
    assert len(_calls(tmp_path / "split.calls")) == len(calls)


def sharing_worker(process_id: int, port: int) -> None:
    """One of two processes calling `sharding.from_first_process`: values and errors of process 0 only."""
    from grpo_jax.device.distributed import DistributedConfig, initialize
    initialize(DistributedConfig(mode="always", coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                 process_id=process_id, cpu_collectives="gloo"))
    from grpo_jax.device import sharding
    ran = []

    def compute(value):
        ran.append(value)
        return value

    big = {"text": "é" * 5000, "floats": np.random.default_rng(0).normal(size=999), "none": None}
    values = [[], "x", big] + ["a" * n for n in range(960, 1005)]  # around the first broadcast's width too
    for value in values:
        got = sharding.from_first_process(lambda v=value: compute(v))
        assert pickle.dumps(got) == pickle.dumps(value)

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("not this one")

    for error, expected in ((ValueError("from process 0"), ValueError), (Unpicklable("local"), RuntimeError)):
        def fail(e=error):
            ran.append(e)
            raise e
        try:
            sharding.from_first_process(fail)
            raise AssertionError("no error")
        except Exception as e:  # noqa: BLE001
            # process 0 raises its own exception, the other its copy, or its text when it does not pickle
            assert e is error if process_id == 0 else (type(e) is expected and str(error) in str(e)), repr(e)
    assert len(ran) == (len(values) + 2 if process_id == 0 else 0)  # process 0 alone ran the functions
    print("SHARED: ok")


def test_from_first_process_gives_process_0s_values_and_errors_to_both(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, "share", str(i), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and "SHARED: ok" in out, out[-4000:]


if __name__ == "__main__":
    if sys.argv[1] == "share":
        sharing_worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
