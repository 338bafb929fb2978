"""How a run stops early without losing its steps: preemption, and failures.

SIGTERM/SIGINT/SIGHUP finish the current optimizer step, save a checkpoint, then stop the run: `PreemptionGuard`
turns the first signal into a flag the round loop polls between steps (a second one exits at once);
`Preempted` is what `train` raises after that checkpoint is written, with the exit code of the signal. Any
other exception during training (a reward function, the data, a tracker, a device; `SystemExit` too) saves the
last good state the same way and surfaces as `RunFailed`, whose message names what failed, where, and the
checkpoint a rerun resumes from; a KeyboardInterrupt raised in Python code (not a signal) saves alike and
surfaces as `Interrupted`, still a KeyboardInterrupt; `storage_error` tells a full or read-only disk, where no
save is attempted, apart.
`Console` keeps a console whose reader is gone (a closed pipe) from stopping any of this.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
STORAGE_TEXTS = ("No space left on device", "Disk quota exceeded", "Read-only file system", "File too large")
# the terminal closing (an ssh session dropping) stops a run as a scheduler's SIGTERM does
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
COMMAND: list[str] | None = None  # the command line that started the run, when it is `grpo-jax` (`cli.main`)
RERUN: str | None = None  # how to continue, when a caller's rerun does not resume by itself (TRL's `train()`)


def again(output_dir: Path, named: bool = True) -> str:
    """How to continue the run in `output_dir`: the same command again, or, where `output_dir` was not given (a
    new `runs/<task>-<time>/` each start), that command with `output_dir=...` added; `RERUN` where set."""
    if RERUN is not None:
        return RERUN
    if named:
        return "run the same command again"
    if COMMAND is None:
        return f"set output_dir={str(output_dir)!r} in the config and train again"
    return f"run the command with output_dir added, {shlex.join([*COMMAND, f'output_dir={output_dir}'])},"


class Preempted(Exception):
    """Raised by `train` after a SIGTERM/SIGINT: the step finished and a checkpoint was written. ``processes``: how
    many processes stopped and saved together (a preemption notice on any of them)."""

    def __init__(self, signum: int, step: int, path: Path, rerun: str = "run the same command again",
                 processes: int = 1):
        self.signum, self.step, self.path = signum, step, path
        if processes == 1:
            super().__init__(f"{signal.Signals(signum).name} received: stopped after optimizer step {step} and saved "
                             f"{path}; {rerun} to resume")
        else:
            super().__init__(f"a preemption notice ({signal.Signals(signum).name}) reached the run: its {processes} "
                             f"processes stopped after optimizer step {step} and saved {path} together; {rerun} on "
                             "every host to resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as if the signal had ended the process (the run is not finished)."""
        return 128 + self.signum


class PreemptionGuard:
    """Context manager: the first SIGTERM/SIGINT/SIGHUP sets `requested`; a second one exits the process at once.

    `multihost` (several processes): SIGTERM stays with JAX's preemption notifier, which tells every process, and
    SIGINT/SIGHUP are passed on to it as a SIGTERM; `stop(step)`, asked at every step boundary by every process,
    becomes true on all of them at the same step (`multihost_utils.reached_preemption_sync_point`), so that all
    save that step together. One process: `stop` reads the flag and costs nothing.
    """

    def __init__(self, signals: Iterable[int] = SIGNALS, *, multihost: bool = False):
        self.multihost = multihost
        self.signals = tuple(s for s in signals if not (multihost and s == signal.SIGTERM))
        self.signum: int | None = None
        self.received: int | None = None  # the signal this process got itself (multihost)
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop(self, step: int) -> bool:
        """Whether to stop before optimizer step ``step`` + 1 (after ``step`` steps) and save."""
        if self.signum is None and self.multihost:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = self.received or signal.SIGTERM
                print(f"\ngrpo_jax: a preemption notice reached the run: every process stops after optimizer step "
                      f"{step} and saves it", flush=True)
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None or self.received is not None:
            print(f"\ngrpo_jax: second {signal.Signals(signum).name}: exiting now without saving", flush=True)
            os._exit(128 + signum)
        if self.multihost:  # JAX's notifier tells the other processes; `stop` then agrees on the step
            self.received = signum
            print(f"\ngrpo_jax: {signal.Signals(signum).name} received: every process finishes the optimizer step "
                  "that all of them reach, then saves a checkpoint (send it again to exit at once)", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.signum = signum
        print(f"\ngrpo_jax: {signal.Signals(signum).name} received: finishing the current optimizer step, then "
              "saving a checkpoint (send it again to exit at once)", flush=True)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class Interrupted(KeyboardInterrupt):
    """Raised by `train` when a KeyboardInterrupt came from Python code inside the run (a reward function, a tool,
    an environment, a tracker) rather than as a signal: the finished steps were saved as for `RunFailed`, and it is
    still a KeyboardInterrupt for the caller. The interrupt is its `__cause__`."""

    exit_code = 130  # 128 + SIGINT, as the signal would have ended the process


class RunFailed(RuntimeError):
    """Raised by `train` when an exception stopped training, after the last good state was saved where it could
    be; the message says what failed, where, and which checkpoint a rerun of the same command resumes from.
    The exception that stopped the run is its `__cause__`."""


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def storage_error(error: BaseException) -> BaseException | None:
    """The exception of `error`'s chain that says the disk is full or read-only (an OSError, or an error from
    the checkpoint library quoting one), or None."""
    for e in _chain(error):
        if (isinstance(e, OSError) and e.errno in STORAGE_ERRNOS) or any(t in str(e) for t in STORAGE_TEXTS):
            return e
    return None


class _StorageNoise(logging.Filter):
    """Drops log records about a full or read-only disk (with their tracebacks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (any(t in record.getMessage() for t in STORAGE_TEXTS)
                    or (error is not None and storage_error(error) is not None))


def quiet_storage_logs() -> None:
    """Keeps the checkpoint library's and asyncio's logs of a full or read-only disk (dozens of tracebacks from
    their background threads) off the console: the command prints `RunFailed`'s one message instead. Also drops
    the "Event loop is closed" errors of writes that finish after the checkpoint library closed its event loop."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_StorageNoise())
    default = sys.unraisablehook

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            default(unraisable)

    sys.unraisablehook = hook


def describe(error: BaseException) -> str:
    """`error` in one line, with the function, file and line where its innermost cause was raised."""
    root = list(_chain(error))[-1]
    frames = traceback.extract_tb(root.__traceback__) if root.__traceback__ is not None else []
    where = f" (raised in {frames[-1].name}, {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = f"{type(error).__name__}: {error}"
    if root is not error and str(root) not in str(error):
        text += f" <- {type(root).__name__}: {root}"
    return text + where


def storage_message(error: BaseException, output_dir: Path, checkpoint_bytes: int) -> str:
    """One message for a full or read-only disk, or a file-size limit: the folder, the bytes, and what to do."""
    filename = getattr(error, "filename", None)
    folder = Path(filename).parent if isinstance(filename, str) else Path(output_dir)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if (isinstance(error, OSError) and error.errno == errno.EROFS) or STORAGE_TEXTS[2] in str(error):
        return (f"{folder} is on a read-only filesystem: make it writable or move output_dir to a writable disk "
                f"({type(error).__name__}: {str(error)[:200]})")
    if (isinstance(error, OSError) and error.errno == errno.EFBIG) or STORAGE_TEXTS[3] in str(error):
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]  # `ulimit -f`, in bytes here
        return (f"a file in {folder} reached the file-size limit ({'unlimited' if limit < 0 else f'{limit:,} bytes'}"
                f", `ulimit -f`), and a checkpoint of this run needs about {checkpoint_bytes:,} bytes: raise it "
                "(`ulimit -f unlimited`) or move output_dir to a filesystem that takes larger files")
    free = shutil.disk_usage(existing).free
    return (f"no space left on the device of {folder}: {free:,} bytes free, and a checkpoint of this run needs about "
            f"{checkpoint_bytes:,} bytes: free at least that much or move output_dir to a larger disk")


def stalled(history: list[dict], limit: int, zero_gradient: bool = True) -> str | None:
    """Why the run must stop, or None: more than `limit` (train.max_nonfinite_steps) steps skipped for non-finite
    values, or (`zero_gradient`: train.stop_on_zero_gradient) a gradient norm of exactly 0 on the last `limit` steps
    (a model that no longer trains)."""
    skipped = sum(int(h.get("skipped") or 0) for h in history)
    if skipped > limit:
        return (f"{skipped} optimizer steps had a non-finite loss or gradient, or an update that would make a "
                f"parameter non-finite (train.max_nonfinite_steps={limit}); their updates were skipped. Lower "
                "train.learning_rate, check the reward functions, or raise train.max_nonfinite_steps")
    if zero_gradient and len(history) >= limit and all(h.get("grad_norm") == 0.0 for h in history[-limit:]):
        return (f"the gradient norm was exactly 0 on the last {limit} optimizer steps (train.max_nonfinite_steps): "
                "the model is not training. Either every group's rewards were equal with loss.beta=0 "
                "(frac_reward_zero_std 1: give the rewards more resolution) or the weights saturated (lower "
                "train.learning_rate); raise train.max_nonfinite_steps, or set train.stop_on_zero_gradient=false, to go on "
                "regardless")
    return None


def resume_note(output_dir: Path, named: bool = True) -> str:
    """Where a rerun resumes: the newest complete checkpoint on disk (`named`: whether output_dir was given)."""
    checkpoints = Path(output_dir) / "checkpoints"  # grpo_jax.io.checkpoint.CHECKPOINTS (not imported: no jax here)
    steps = [int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()]
    if not steps:
        return "No checkpoint was written yet: running the same command again starts from step 0"
    newest = max(steps)
    rerun = again(output_dir, named)
    return f"{rerun[0].upper()}{rerun[1:]} to resume from the newest complete checkpoint, " \
           f"{checkpoints / str(newest)} (step {newest})"


def failed(error: BaseException, output_dir: Path, checkpoint_bytes: int, *, state=None, steps: int | None = None,
           saved_step: int = -1, save: Callable[[bool], None] | None = None, named: bool = True) -> RunFailed:
    """The `RunFailed` for `error`, after saving the last good `state` with `save(wait)` when it holds steps that
    no checkpoint has (as a SIGTERM would): not when the disk is what failed, when the state was lost with a
    failed device computation, or when `steps` (the optimizer steps the metrics history holds) does not match it.
    `named`: whether output_dir was given (else the message shows the command that resumes)."""
    storage = storage_error(error)
    if storage is not None:
        return RunFailed(f"{storage_message(storage, output_dir, checkpoint_bytes)}. "
                         f"{resume_note(output_dir, named)}")
    import jax

    note = ""
    if state is not None and any(x.is_deleted() for x in jax.tree.leaves(state)):
        note = "The state after the last steps could not be saved: a step that did not finish holds its buffers. "
    elif save is not None and steps is not None and max(saved_step, 0) < int(state.step) == steps:
        try:
            save(True)
            note = f"The state after step {steps} was saved first. "
        except Exception as e:  # noqa: BLE001 - say so; the previous checkpoint stands
            note = f"Saving step {steps} failed too ({describe(e)[:300]}). "
    after = "" if steps is None else f" after optimizer step {steps}"
    return RunFailed(f"training stopped{after}: {describe(error)}. {note}{resume_note(output_dir, named)}")


class Console(io.TextIOBase):
    """`sys.stdout`/`sys.stderr` for the command line: a write its reader can no longer take (a pipe to a `tee`
    that Ctrl-C ended, a closed terminal) never raises; it goes to `output_dir/console.log` once `log_to` named
    the run, so the stop checkpoint and its message survive a console that went away."""

    log: Path | None = None

    def __init__(self, stream):
        self.stream, self.broken = stream, False

    @classmethod
    def install(cls) -> None:
        sys.stdout, sys.stderr = cls(sys.stdout), cls(sys.stderr)

    @classmethod
    def log_to(cls, output_dir: Path) -> None:
        cls.log = Path(output_dir) / "console.log"

    def write(self, text: str) -> int:
        if not self.broken:
            try:  # flushed at once: a pipe's EPIPE comes at the flush, and then the text is still at hand to log
                self.stream.write(text)
                self.stream.flush()
                return len(text)
            except (OSError, ValueError):  # EPIPE, EIO, or the stream closed
                self._break()
        if Console.log is not None and text:
            try:
                with open(Console.log, "a", encoding="utf-8") as f:
                    f.write(text)
            except OSError:
                pass
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._break()

    def _break(self) -> None:
        self.broken = True
        try:  # the interpreter's last flush of the real stream then finds a sink, not another EPIPE
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass

    def isatty(self) -> bool:
        return not self.broken and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")
