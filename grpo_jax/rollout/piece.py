"""`Piece`: finished rows of a decoding call, on the host: what `stream.decode` (its one host driver,
`stream.chunk`, single- and multi-turn alike) hands the round, whole groups at a time; `joined` makes a call's
pieces one, in row order, for the reward functions' one call a pass.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grpo_jax.algo.trajectory import Trajectory


class Piece(NamedTuple):
    """Finished rows of a decoding call (whole groups), on the host."""

    rows: np.ndarray  # [n] the rows' indices in the call
    completion_ids: np.ndarray  # [n, T]
    completion_mask: np.ndarray  # [n, T]
    is_truncated: np.ndarray  # [n] bool
    trajectory: Trajectory | None = None  # the call's rows on the devices, with the piece that finishes the call
    decode_steps: int = 0  # with the piece that finishes the call: its decode steps (the longest chunk's)
    loss_mask: np.ndarray | None = None  # [n, T] multi-turn: the tokens the policy sampled (None: completion_mask)
    completions: list | None = None  # multi-turn: each row's messages after its prompt, as TRL's `completions`
    tool_counts: np.ndarray | None = None  # [n, 4] multi-turn: calls, failures, malformed turns, turns


def joined(pieces: list[Piece]) -> Piece:
    """A call's pieces as one, its rows in the call's order (as TRL hands its reward functions a generation batch),
    the call's trajectory and decode steps with it."""
    if len(pieces) == 1:
        return pieces[0]
    rows = np.concatenate([p.rows for p in pieces])
    order = np.argsort(rows, kind="stable")

    def cat(name):
        parts = [getattr(p, name) for p in pieces]
        return None if parts[0] is None else np.concatenate(parts)[order]
    completions = None
    if pieces[0].completions is not None:
        every = [c for p in pieces for c in p.completions]
        completions = [every[i] for i in order]
    trajectory = next((p.trajectory for p in pieces if p.trajectory is not None), None)
    return Piece(rows[order], cat("completion_ids"), cat("completion_mask"), cat("is_truncated"), trajectory,
                 sum(p.decode_steps for p in pieces), cat("loss_mask"), completions, cat("tool_counts"))
