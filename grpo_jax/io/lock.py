"""One writer per run: an exclusive lock on `output_dir/run.lock`, held while the run's process lives.

The lock is flock(2): the kernel drops it when its process ends, however it ends (SIGKILL, a crash, a lost node
whose job is requeued), so a lock left by a dead run is stale and the next run takes it. The file names its
holder (pid, host, start time) for the error a second process gets. In a multi-host run process 0 holds it and
every process learns whether it got it, so all of them stop together. Imports no jax at module level.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path

LOCK = "run.lock"


class RunLock:
    """The held lock of an output_dir (an open file on process 0, None elsewhere); `release()` ends it."""

    def __init__(self, file=None):
        self._file = file

    def release(self) -> None:
        """Drops the lock (closing the file releases the flock); the file itself stays, naming the last holder."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _try_lock(output_dir: Path) -> tuple[RunLock | None, str | None]:
    """(the lock, None) or (None, why not) on this process."""
    path = output_dir / LOCK
    try:
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the whole run
    except OSError as e:
        return None, (f"output_dir={str(output_dir)!r} is not writable ({e.strerror}: {path}): choose an output_dir "
                      "on a writable filesystem")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        if holder.startswith(f"pid {os.getpid()} on host {socket.gethostname()},"):
            return None, (f"output_dir={str(output_dir)!r} is held by this process already: an earlier `build` "
                          "still holds its lock; call the lock it returned's `release()` first")
        return None, (f"output_dir={str(output_dir)!r} is in use by another grpo_jax run ({holder}; {path} is "
                      "locked): wait for that run to end or stop it (a scheduler's requeue must end the old job "
                      "first), or choose another output_dir")
    f.seek(0)
    f.truncate()
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {stamp}\n")
    f.flush()
    return RunLock(f), None


def acquire(output_dir: Path, *, multihost: bool = False) -> RunLock:
    """Takes `output_dir`'s lock, or raises a ValueError naming the process that holds it (or the folder that
    cannot be written). `multihost`: process 0 takes it and broadcasts the outcome (call on every process)."""
    output_dir = Path(output_dir)
    if not multihost:
        lock, problem = _try_lock(output_dir)
    else:
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        lock, problem = _try_lock(output_dir) if jax.process_index() == 0 else (RunLock(), None)
        if multihost_utils.broadcast_one_to_all(np.int32(problem is not None)) and problem is None:
            problem = f"output_dir={str(output_dir)!r} is locked or not writable (process 0 says which)"
    if problem is not None:
        if lock is not None:
            lock.release()
        raise ValueError(problem)
    return lock
