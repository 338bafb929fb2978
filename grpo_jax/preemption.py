"""Preemption: SIGTERM/SIGINT finish the current optimizer step, save a checkpoint, then stop the run.

`PreemptionGuard` turns the first signal into a flag the round loop polls between steps (a second one exits at
once); `Preempted` is what `train` raises after that checkpoint is written, with the exit code of the signal.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from pathlib import Path


class Preempted(Exception):
    """Raised by `train` after a SIGTERM/SIGINT: the step finished and a checkpoint was written."""

    def __init__(self, signum: int, step: int, path: Path):
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"{signal.Signals(signum).name} received: stopped after optimizer step {step} and saved "
                         f"{path}; run the same command again to resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as if the signal had ended the process (the run is not finished)."""
        return 128 + self.signum


class PreemptionGuard:
    """Context manager: the first SIGTERM/SIGINT sets `requested`; a second one exits the process at once."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"\ngrpo_jax: second {signal.Signals(signum).name}: exiting now without saving", flush=True)
            os._exit(128 + signum)
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
