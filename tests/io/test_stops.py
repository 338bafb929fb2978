"""Every stop keeps the steps it finished: a reward function, an evaluation or a tracker that fails late, a
`sys.exit`, a KeyboardInterrupt raised by Python code, SIGHUP with the console gone, Ctrl-C while starting; and a run
started without output_dir resumes by the command its message prints, or by `resume_from_checkpoint=true`. Each rerun ends as the uninterrupted run,
bit for bit (metrics and state)."""

import importlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from grpo_jax.api import cli
from grpo_jax.data import task
from grpo_jax.io import preemption, reporting
from grpo_jax.io.preemption import RunFailed
from tests.io.test_checkpoint import ROOT, TINY, _assert_same_state, _lines, _state, _train

STOP = {"kind": None, "at": None, "calls": 0}  # what `stopping_reward` does on its `at`-th call
EVAL_STOP = {"at": None, "calls": 0}
# 3 rounds of 2 steps, held-out evaluations before and after (their lines come between the steps'), no periodic save
RUN = ["max_steps=6", "save_steps=0", "eval.num_examples=4", "reward.functions=[tests.io.test_stops:stopping_reward]",
       "eval.reward_functions=[tests.io.test_stops:eval_reward]"]
FAILING_AT_ROUND_3 = 4  # call 1 is the check before compiling (`rewards.check_reward_fns`), then one call a round


def _kind():
    """STOP's, or in a child process the GRPO_JAX_TEST_STOP environment variable's ("kind:at")."""
    if STOP["kind"] is None and os.environ.get("GRPO_JAX_TEST_STOP"):
        kind, at = os.environ["GRPO_JAX_TEST_STOP"].split(":")
        STOP.update(kind=kind, at=int(at))
    return STOP["kind"]


def stopping_reward(prompts, completions, **kwargs):
    """The embedded task's reward, failing in the way STOP["kind"] says on its STOP["at"]-th call."""
    kind = _kind()
    STOP["calls"] += 1
    if STOP["calls"] == STOP["at"]:
        n = len(completions)
        if kind == "raise":
            raise ConnectionError("the grading service went away")
        if kind == "short":
            return [0.0] * (n - 1)
        if kind == "nan":
            return [math.nan] * n
        if kind == "strings":
            return ["good"] * n
        if kind == "memory":
            raise MemoryError("the grader ran out of memory")
        if kind == "exit":
            sys.exit(3)
        if kind == "interrupt":
            raise KeyboardInterrupt
    return task.char_accuracy(prompts, completions, **kwargs)


async def async_stopping_reward(prompts, completions, **kwargs):
    """`stopping_reward` as a coroutine function (awaited on the reward loop's thread)."""
    return stopping_reward(prompts, completions, **kwargs)


def eval_reward(prompts, completions, **kwargs):
    """The embedded task's exact match, raising on its EVAL_STOP["at"]-th call."""
    EVAL_STOP["calls"] += 1
    if EVAL_STOP["calls"] == EVAL_STOP["at"]:
        raise TimeoutError("the evaluation service timed out")
    return task.exact_match(prompts, completions, **kwargs)


def _shared():
    """STOP and EVAL_STOP of the module `reward.functions` imports (`tests.io.test_stops`, not pytest's
    `test_stops`)."""
    module = importlib.import_module("tests.io.test_stops")
    return module.STOP, module.EVAL_STOP


@pytest.fixture
def stops():
    stop, eval_stop = _shared()
    stop.update(kind=None, at=None, calls=0)
    eval_stop.update(at=None, calls=0)
    yield stop, eval_stop
    stop.update(kind=None, at=None, calls=0)
    eval_stop.update(at=None, calls=0)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """metrics and final state of the run of RUN that nothing stops."""
    out = tmp_path_factory.mktemp("whole")
    _shared()[0].update(kind=None, at=None, calls=0)
    _train(out, *RUN)
    return _lines(out), _state(out)[0]


def _same_as_whole(out, whole):
    lines, state = whole
    assert _lines(out) == lines
    _assert_same_state(_state(out)[0], state)


@pytest.mark.parametrize("kind, function, rerun", [
    ("raise", "stopping_reward", True), ("short", "stopping_reward", False), ("nan", "stopping_reward", False),
    ("strings", "stopping_reward", False), ("memory", "stopping_reward", False), ("exit", "stopping_reward", True),
    ("raise", "async_stopping_reward", False)])
def test_a_reward_failing_late_saves_the_finished_steps(tmp_path, stops, whole, kind, function, rerun):
    """The reward fails while round 3 is scored, 4 steps in, with no periodic checkpoint and evaluation lines in
    the history: step 4 is saved, the message names it and the function; the same command then ends as the
    uninterrupted run."""
    stops[0].update(kind=kind, at=FAILING_AT_ROUND_3)
    overrides = [o.replace("stopping_reward", function) for o in RUN]
    with pytest.raises(RunFailed) as failure:
        _train(tmp_path, *overrides)
    message = str(failure.value)
    assert re.match(r"training stopped after optimizer step 4: (RuntimeError|ValueError|TypeError): reward "
                    f"function 'tests.io.test_stops:{function}'", message), message
    assert "The state after step 4 was saved first. Run the same command again to resume from the newest " \
           f"complete checkpoint, {tmp_path / 'checkpoints' / '4'} (step 4)" in message
    if kind == "exit":
        assert "called sys.exit(3)" in message
    assert _state(tmp_path)[1] == 4
    if rerun:
        stops[0].update(kind=None, at=None)
        _train(tmp_path, *overrides)
        if function == "stopping_reward":
            _same_as_whole(tmp_path, whole)


@pytest.mark.parametrize("layout", [["sampling.max_batch_rows=4"], ["train.packing=true"]])
def test_a_reward_failing_late_saves_with_continuous_batching_and_packing(tmp_path, stops, layout):
    """The same failure with fewer decode slots than rows (rows reaching the host group by group) or packed
    updates: step 4 is saved, and the rerun ends as the run of that layout that nothing stopped. Either way the
    reward function is called once a round, as TRL calls it once a generation batch."""
    stops[0].update(kind="raise", at=None)
    _train(tmp_path / "whole", *RUN, *layout)
    assert stops[0]["calls"] == 1 + 3  # the check before compiling, then one call each of the 3 rounds
    stops[0].update(calls=0, at=1 + 2 + 1)  # the check, two rounds, then round 3's call
    with pytest.raises(RunFailed, match="training stopped after optimizer step 4: .*The state after step 4 was "
                                        "saved first"):
        _train(tmp_path / "run", *RUN, *layout)
    stops[0].update(kind=None, at=None)
    _train(tmp_path / "run", *RUN, *layout)
    _same_as_whole(tmp_path / "run", (_lines(tmp_path / "whole"), _state(tmp_path / "whole")[0]))


def test_an_evaluation_failing_after_training_saves_the_last_steps(tmp_path, stops, whole):
    """save_steps=4 of 6: the evaluation after training raises (call 1 is the check, 2 the evaluation before):
    steps 5-6 are saved, and the rerun evaluates again and ends as the uninterrupted run."""
    stops[1]["at"] = 3
    with pytest.raises(RunFailed, match=r"training stopped after optimizer step 6: RuntimeError: reward function "
                       r"'tests.io.test_stops:eval_reward' raised TimeoutError: the evaluation service timed out .*"
                       r"The state after step 6 was saved first"):
        _train(tmp_path, *RUN, "save_steps=4")
    assert _state(tmp_path)[1] == 6
    _train(tmp_path, *RUN)
    _same_as_whole(tmp_path, whole)


class _FailingTracker:
    def scalars(self, values, step):
        if step == 3:
            raise ConnectionError("the tracker's server hung up")

    def completions(self, *args):
        pass

    def close(self):
        pass


def test_a_tracker_failing_saves_every_finished_step(tmp_path, stops, whole, monkeypatch):
    """A tracker raises on step 3's line (a round's steps are written together): the state after the round's
    steps is saved with all their lines, and the rerun (without that tracker) ends as the uninterrupted run."""
    real = reporting.open_tracker
    monkeypatch.setattr(reporting, "open_tracker", lambda name, *a: _FailingTracker() if name == "tensorboard"
                        else real(name, *a))
    with pytest.raises(RunFailed, match="training stopped after optimizer step 4: ConnectionError: the tracker's "
                                        "server hung up .*The state after step 4 was saved first"):
        _train(tmp_path, *RUN, "report_to=[jsonl,tensorboard]")
    monkeypatch.setattr(reporting, "open_tracker", real)
    _train(tmp_path, *RUN)
    _same_as_whole(tmp_path, whole)


@pytest.mark.parametrize("function", ["stopping_reward", "async_stopping_reward"])
def test_a_keyboard_interrupt_raised_by_a_reward_saves_the_finished_steps(tmp_path, stops, whole, function):
    """Old outcome: the interrupt reached the caller and no checkpoint was written (the rerun started at step 0).
    New: step 4 is saved first, then `Interrupted` (a KeyboardInterrupt) says so; the rerun ends as the
    uninterrupted run."""
    stops[0].update(kind="interrupt", at=FAILING_AT_ROUND_3)
    overrides = [o.replace("stopping_reward", function) for o in RUN]
    with pytest.raises(KeyboardInterrupt) as stopped:
        _train(tmp_path, *overrides)
    assert isinstance(stopped.value, preemption.Interrupted)
    assert isinstance(stopped.value.__cause__, KeyboardInterrupt)
    assert str(stopped.value).startswith("training stopped after optimizer step 4: KeyboardInterrupt"), stopped.value
    assert f"The state after step 4 was saved first. Run the same command again to resume from the newest " \
           f"complete checkpoint, {tmp_path / 'checkpoints' / '4'} (step 4)" in str(stopped.value)
    assert _state(tmp_path)[1] == 4
    stops[0].update(kind=None, at=None)
    _train(tmp_path, *overrides)
    if function == "stopping_reward":
        _same_as_whole(tmp_path, whole)
    else:
        assert _state(tmp_path)[1] == 6


class _InterruptingTracker(_FailingTracker):
    def scalars(self, values, step):
        if step == 3:
            raise KeyboardInterrupt


def test_a_keyboard_interrupt_raised_by_a_tracker_saves_every_finished_step(tmp_path, stops, whole, monkeypatch):
    real = reporting.open_tracker
    monkeypatch.setattr(reporting, "open_tracker", lambda name, *a: _InterruptingTracker() if name == "tensorboard"
                        else real(name, *a))
    with pytest.raises(preemption.Interrupted, match="training stopped after optimizer step 4: KeyboardInterrupt.*"
                                                     "The state after step 4 was saved first"):
        _train(tmp_path, *RUN, "report_to=[jsonl,tensorboard]")
    monkeypatch.setattr(reporting, "open_tracker", real)
    _train(tmp_path, *RUN)
    _same_as_whole(tmp_path, whole)


def test_a_keyboard_interrupt_from_python_code_is_one_line_on_the_cli(tmp_path):
    """The CLI prints `Interrupted`'s message (what was saved, how to resume) and exits 130, no traceback."""
    env = {**os.environ, "GRPO_JAX_TEST_STOP": f"interrupt:{FAILING_AT_ROUND_3}", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={tmp_path / 'run'}",
                             *TINY, *RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo-jax: training stopped after optimizer step 4: KeyboardInterrupt"), result.stderr
    assert _state(tmp_path / "run")[1] == 4


def test_sighup_with_the_console_gone_saves_and_logs_the_message(tmp_path):
    """The terminal closes: the pipes of stdout and stderr lose their reader, then SIGHUP comes. The step
    finishes and is saved (exit 129), what could not be printed is in console.log, and the run resumes to the
    uninterrupted run's state."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={out}", *TINY, "max_steps=1000",
           "save_steps=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.stdout.close()
    proc.stderr.close()
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=300) == 128 + signal.SIGHUP
    state, stopped = _state(out)
    assert stopped == len(metrics.read_text().splitlines()) >= 2
    log = (out / "console.log").read_text()
    assert "SIGHUP received" in log and f"stopped after optimizer step {stopped} and saved" in log
    _train(out, f"max_steps={stopped + 1}", "save_steps=0")
    _train(tmp_path / "whole", f"max_steps={stopped + 1}", "save_steps=0")
    assert _lines(out) == _lines(tmp_path / "whole")
    _assert_same_state(_state(out)[0], _state(tmp_path / "whole")[0])


def test_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    def interrupted(config, no_progress, debug=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_train", interrupted)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after `cli.main` wraps them
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(preemption, "COMMAND", None)
    assert cli.main(["max_steps=1"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo-jax: interrupted outside the training steps: none was lost")


def test_a_reward_calling_sys_exit_at_once_is_named(tmp_path):
    """sys.exit in a reward function's first call (the check before compiling): one line naming it, not a silent
    exit with its code."""
    env = {**os.environ, "GRPO_JAX_TEST_STOP": "exit:1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={tmp_path / 'run'}",
                             *TINY, "reward.functions=[tests.io.test_stops:stopping_reward]"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo-jax: reward function 'tests.io.test_stops:stopping_reward' called sys.exit(3)"), \
        result.stderr


def test_without_output_dir_the_message_gives_the_command_that_resumes(tmp_path, whole):
    """No output_dir: each start makes a new runs/<task>-<time>/, so the failure's message prints the command with
    output_dir added; that command ends the run as the uninterrupted one."""
    env = {**os.environ, "GRPO_JAX_TEST_STOP": f"raise:{FAILING_AT_ROUND_3}", "PYTHONPATH": str(ROOT)}
    args = ["--no-progress", *TINY, *RUN]
    failed = subprocess.run([sys.executable, "-m", "grpo_jax", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert failed.returncode == 1
    message = failed.stderr.strip().splitlines()[-1]
    (run,) = (tmp_path / "runs").iterdir()
    command = shlex.join(["grpo-jax", *args, f"output_dir={run.relative_to(tmp_path)}"])
    assert f"Run the command with output_dir added, {command}, to resume from the newest complete checkpoint" \
        in message, message
    env.pop("GRPO_JAX_TEST_STOP")
    resumed = subprocess.run([sys.executable, "-m", "grpo_jax", *shlex.split(command)[1:]], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    _same_as_whole(run, whole)


def test_resume_from_checkpoint_true_continues_the_newest_run_of_the_same_config(tmp_path, stops, whole,
                                                                                 monkeypatch):
    """TRL's resume_from_checkpoint=true without output_dir: the newest folder under runs/ whose config this one
    may resume, past a newer run of another config; none such is one line."""
    monkeypatch.chdir(tmp_path)
    stops[0].update(kind="raise", at=FAILING_AT_ROUND_3)
    with pytest.raises(RunFailed, match="Set output_dir='runs/.*' in the config and train again to resume"):
        _train_unnamed(*RUN)
    (ours,) = (tmp_path / "runs").iterdir()
    time.sleep(1.1)  # runs/<task>-<seconds>: the other run gets a folder of its own
    stops[0].update(kind=None, at=None)
    _train_unnamed(*RUN, "seed=1", "max_steps=2")  # newer, another seed: not this run's
    assert len(list((tmp_path / "runs").iterdir())) == 2
    _train_unnamed(*RUN, "resume_from_checkpoint=true")
    _same_as_whole(ours, whole)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=true: no run under runs/ has a checkpoint and "
                                         r"this config"):
        _train_unnamed(*RUN, "seed=2", "resume_from_checkpoint=true")


def _train_unnamed(*overrides):
    from grpo_jax.api import trainer
    from grpo_jax.config import load_config

    return trainer.train(load_config(None, [*TINY, *overrides]), show_progress=False)


def test_resume_from_checkpoint_names_a_run_or_its_newest_checkpoint(tmp_path, stops):
    _train(tmp_path / "run", *RUN, "max_steps=2")
    with pytest.raises(ValueError, match=r"resume_from_checkpoint='.*/checkpoints/1': a run resumes from its newest "
                                         r"checkpoint, step 2"):
        _train(tmp_path / "run", *RUN, f"resume_from_checkpoint={tmp_path / 'run' / 'checkpoints' / '1'}")
    with pytest.raises(ValueError, match="holds no checkpoint to resume"):
        _train(tmp_path / "new", *RUN, "resume_from_checkpoint=true")
    summary = _train(tmp_path / "run", *RUN, "max_steps=3",
                     f"resume_from_checkpoint={tmp_path / 'run' / 'checkpoints' / '2'}")
    assert summary["steps"] == 3
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "eval/" not in line][-1] == 3
