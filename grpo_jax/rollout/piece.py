"""`Piece`: finished rows of a decoding call, on the host: what `stream.decode` (its one host driver,
`stream.chunk`, single- and multi-turn alike) hands the round, whole groups at a time.
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
