"""TRL's ``rollout_func``: a user's function makes a sampling pass's rows instead of the sampler (a generation server,
an agent harness, an environment that owns the conversation). It is called once a pass with the pass's prompts (each
prompt ``num_generations`` times, in row order, as TRL's sampler hands them) and the trainer, and returns a dict of
one list per row: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (the sampler's log-prob of each completion token,
the run's ``sampler_per_token_logps``), optionally ``env_mask`` (1 on the tokens the policy sampled, 0 on ones an
environment appended: TRL's tool mask, our ``loss_mask``); every other key goes to the reward functions as a column,
as TRL forwards them. The rows are padded to the run's shapes: the prompt left to ``data.max_prompt_length``, the
completion right to ``sampling.max_completion_length``, attention stops after the first EOS (TRL's completion mask),
and a row whose last token is neither EOS nor padding is truncated (TRL's ``is_truncated``).

With several processes process 0 calls the function and hands every process its output, so they all train on the
same rows (TRL calls it in each process on that process's prompts; the rows are the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.data import prompts as data
from grpo_jax.device import sharding
from grpo_jax.rollout.piece import Piece

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")  # TRL's required keys, in its order


@dataclasses.dataclass(frozen=True)
class RolloutFunc:
    """The user's function bound to its trainer (``call(prompts, trainer_state) -> dict``: the trainer's `state` is
    the run's so far when it runs) and the stop ids its rows end at."""

    call: Callable[[list, object], dict]
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def checked(output) -> tuple[dict, dict]:
    """A rollout function's output as (the required lists, the other fields); TRL's error when keys are missing."""
    if not isinstance(output, dict):
        raise ValueError(f"rollout_func returned a {type(output).__name__}: return a dict with keys {list(REQUIRED)}")
    missing = sorted(set(REQUIRED) - output.keys())
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    return {k: output[k] for k in REQUIRED}, {k: v for k, v in output.items() if k not in REQUIRED}


def _rows(name: str, values, n: int, limit: int | None = None, fix: str = "") -> list[list]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"rollout_func's {name} holds {got} rows for the {n} prompts it was given: return one row "
                         "per prompt, in their order (each prompt comes num_generations times)")
    rows = [list(np.asarray(v).reshape(-1).tolist()) for v in values]
    for i, row in enumerate(rows):
        if limit is not None and len(row) > limit:
            raise ValueError(f"rollout_func's {name}[{i}] has {len(row)} tokens, over the run's {limit}: {fix}")
    return rows


def rows(fn: RolloutFunc, batch: data.PromptBatch, prompt_length: int, completion_length: int, mesh,
         trainer_state=None) -> tuple[data.PromptBatch, Piece]:
    """One pass's rows from ``fn`` called at ``trainer_state`` (`rewards.trainer_state`): (``batch`` with the
    function's prompt tokens, as wide as the batch's or its longest prompt, at most ``prompt_length``, and its extra
    fields as columns; the pass as one finished `Piece` whose trajectory is on ``mesh``, rows split over its data
    axes)."""
    output, extra = checked(sharding.from_first_process(lambda: fn.call(list(batch.prompts), trainer_state)))
    B = batch.prompt_ids.shape[0]
    T = completion_length
    prompts = _rows("prompt_ids", output["prompt_ids"], B, prompt_length, "raise data.max_prompt_length")
    P = max(batch.prompt_ids.shape[1], *map(len, prompts))
    completions = _rows("completion_ids", output["completion_ids"], B, T, "raise sampling.max_completion_length")
    logprobs = _rows("logprobs", output["logprobs"], B)
    env_mask = extra.pop("env_mask", None)
    env_mask = None if env_mask is None else _rows("env_mask", env_mask, B)
    prompt_ids, prompt_mask = np.full((B, P), fn.pad_token_id, np.int32), np.zeros((B, P), np.int32)
    completion_ids, completion_mask = np.full((B, T), fn.pad_token_id, np.int32), np.zeros((B, T), np.int32)
    logps, loss_mask = np.zeros((B, T), np.float32), np.zeros((B, T), np.int32)
    truncated = np.zeros(B, bool)
    stops = set(fn.eos_token_ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        for name, per_token in (("logprobs", logprobs), ("env_mask", env_mask)):
            if per_token is not None and len(per_token[i]) != len(completion):
                raise ValueError(f"rollout_func's {name}[{i}] has {len(per_token[i])} entries for the "
                                 f"{len(completion)} tokens of completion_ids[{i}]: give one per completion token")
        if prompt:
            prompt_ids[i, P - len(prompt):], prompt_mask[i, P - len(prompt):] = prompt, 1
        ends = [t for t, token in enumerate(completion) if token in stops]
        n = ends[0] + 1 if ends else len(completion)  # attention and the loss stop after the first EOS, as TRL's
        completion_ids[i, :len(completion)] = completion
        completion_mask[i, :n] = 1
        logps[i, :n] = logprobs[i][:n]
        loss_mask[i, :n] = 1 if env_mask is None else np.asarray(env_mask[i][:n]) != 0
        truncated[i] = bool(completion) and completion[-1] not in stops | {fn.pad_token_id}
    completion_ids = np.where(completion_mask == 1, completion_ids, fn.pad_token_id).astype(np.int32)
    turns = np.where(completion_mask == 1, 0, -1).astype(np.int32)
    host = Trajectory(prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask, logps, turns, truncated)
    trajectory = sharding.shard_global_rows(host, mesh)
    columns = dict(batch.columns)
    for name, values in extra.items():  # TRL: a list is one value a row, anything else every row's
        if name in columns or name in ("prompt", "completion_ids"):
            raise ValueError(f"rollout_func returned {name!r}, which the dataset (or TRL) names already: rename it")
        columns[name] = list(values) if isinstance(values, list) else [values] * B
    batch = batch._replace(prompt_ids=prompt_ids, prompt_mask=prompt_mask, columns=columns)
    piece = Piece(np.arange(B), completion_ids, completion_mask, truncated, trajectory,
                  loss_mask=None if env_mask is None else loss_mask)
    return batch, piece
