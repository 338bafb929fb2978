"""A multi-process run's last word when another host goes away.

JAX's coordination service stops every process of a run once one of them stops sending heartbeats
(`distributed.heartbeat_timeout`) or the coordinator (process 0) is gone: it ends the process with a C++ check
failure (SIGABRT), after which no Python runs. So with several processes `grpo-jax train` runs the training in a
child process (`supervise`) that tells it, over a pipe, the run's folder and each finished optimizer step
(`report`), copies its output through, and when the child was stopped that way or killed prints one line instead:
which process was lost, after which step, and the checkpoint a rerun of the same command on every host resumes from.
Orbax writes a checkpoint into a temporary folder renamed once every process has written its part, so a save cut off
by a lost host is never taken for a checkpoint (the next start removes it). One process: no child, nothing to pay.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from grpo_jax.io import preemption

CHANNEL = "GRPO_JAX_SUPERVISOR_FD"  # the child's end of the pipe, an inherited file descriptor
TAIL = 1 << 16  # bytes of the child's stderr kept to read the coordination service's error from
TRACE = b"*** Check failure stack trace: ***"  # what follows is the C++ stack of the abort: not copied through
LOST_TEXTS = ("detected fatal errors", "stopped sending heartbeats", "PollForError")


def report(kind: str, value) -> None:
    """Tells the supervising `grpo-jax train` (if any) the run's ``output_dir`` or its last finished ``step``."""
    fd = os.environ.get(CHANNEL)
    if fd:
        try:
            os.write(int(fd), f"{kind} {value}\n".encode())
        except OSError:  # the supervisor is gone: nothing to tell
            pass


def lost_processes(stderr: str, config) -> str:
    """Who the coordination service's error (the child's last stderr) says was lost, in words (``config``: the
    run's `DistributedConfig`)."""
    if "RegisterTask" in stderr:  # joining: not every process came
        return (f"the processes did not all join the run within distributed.initialization_timeout="
                f"{config.initialization_timeout} s: start every process with the same "
                "distributed.coordinator_address and num_processes, all within that time")
    match = re.search(r"stopped sending heartbeats\)?:?\s*((?:\s*(?:/job:\S*task:)?\d+[,\s]*)+)", stderr)
    if match:
        ids = sorted({int(i) for i in re.findall(r"(?:task:)?(\d+)", match.group(1))})
        return (f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))} stopped sending heartbeats "
                "(its host lost, killed, or out of memory)")
    if "PollForError" in stderr or "Socket closed" in stderr or "UNAVAILABLE" in stderr:
        return "the coordinator, process 0, could not be reached (its host lost, killed, or out of memory)"
    return "another process failed (the JAX distributed service stopped this one)"


class _Child:
    """The training process, its stderr copied through (and its tail kept), its reports read."""

    def __init__(self, argv: list[str]):
        read, write = os.pipe()
        env = {**os.environ, CHANNEL: str(write)}
        self.proc = subprocess.Popen([sys.executable, "-m", "grpo_jax", *argv], env=env, pass_fds=(write,),
                                     stderr=subprocess.PIPE)
        os.close(write)
        self.output_dir, self.step, self.tail = None, None, b""
        self._threads = [threading.Thread(target=self._reports, args=(read,), daemon=True),
                         threading.Thread(target=self._stderr, daemon=True)]
        for t in self._threads:
            t.start()

    def _reports(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for line in f:
                kind, _, value = line.decode(errors="replace").strip().partition(" ")
                if kind == "output_dir":
                    self.output_dir = Path(value)
                elif kind == "step":
                    self.step = int(value)

    def _stderr(self) -> None:
        out = getattr(sys.stderr, "buffer", None)
        tracing = False
        while chunk := os.read(self.proc.stderr.fileno(), 1 << 14):
            self.tail = (self.tail + chunk)[-TAIL:]
            if tracing or TRACE in self.tail[-len(chunk) - len(TRACE):]:
                chunk, tracing = chunk.split(TRACE)[0] if not tracing else b"", True
            try:  # as written (a progress bar's carriage returns too)
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    sys.stderr.write(chunk.decode(errors="replace"))
            except (OSError, ValueError):  # the console went away: the child writes console.log itself
                pass

    def wait(self) -> int:
        code = self.proc.wait()
        for t in self._threads:
            t.join(timeout=10)
        return code


def supervise(argv: list[str], config, num_processes: int | None, named: bool = True) -> int:
    """Runs `grpo-jax train argv` in a child process and returns its exit code; one line when it was lost
    (``config``: the run's `DistributedConfig`, ``num_processes`` as resolved; `named`: whether the config names
    output_dir, for the command that resumes)."""
    child = _Child(argv)
    # SIGTERM (a scheduler's, sent to this process alone) goes on to the child, whose notifier tells every process;
    # SIGINT and SIGHUP come from the terminal to both, so the child has them already
    previous = {s: signal.signal(s, h) for s, h in (
        (signal.SIGTERM, lambda signum, frame: child.proc.send_signal(signum)),
        (signal.SIGINT, signal.SIG_IGN), (signal.SIGHUP, signal.SIG_IGN))}
    try:
        code = child.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    stderr = child.tail.decode(errors="replace")
    lost = code == -signal.SIGABRT and any(t in stderr for t in LOST_TEXTS)
    if not lost and code >= 0:
        return code
    after = "before its first optimizer step" if child.step is None else f"after optimizer step {child.step}"
    of = f" of {num_processes}" if num_processes else ""
    if lost:
        what = (f"grpo-jax: the run stopped {after}: {lost_processes(stderr, config)}; the JAX distributed service "
                f"stopped this process{of} (distributed.heartbeat_timeout={config.heartbeat_timeout} s)")
    else:
        what = f"grpo-jax: this process{of} was killed by {signal.Signals(-code).name} {after}"
    where = "" if child.output_dir is None else ". " + preemption.resume_note(child.output_dir, named).replace(
        "the same command again", "the same command again on every host")
    print(what + where, file=sys.stderr, flush=True)
    return 1 if lost else 128 - code
