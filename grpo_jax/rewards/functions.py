"""Reward function plumbing: score completions on the host (what a config names is resolved by
`grpo_jax.rewards.reward_specs`).

Reward functions follow TRL's GRPOTrainer convention:
    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]
where every dataset column other than "prompt" arrives as a keyword argument (one value per completion) and None
means "no opinion on this completion" (it becomes NaN and is skipped by the advantage computation). As in TRL,
`completion_ids` (the token ids of each completion, EOS included, padding removed) arrives as a keyword too, and,
as TRL 1.16 passes them, to a function that accepts them (by name or `**kwargs`): `trainer_state` (`TrainerState`,
transformers' fields: `global_step`, `max_steps`, `epoch`, ...), `log_metric(name, value)` (a scalar averaged over
the round and logged with its steps' metrics) and `log_extra(column, values)` (a column of the completions table).
Each function gets its own copy of every argument, so one that edits them in place cannot change what the next
one scores. `async def` functions are awaited concurrently, on one event loop that lives as long as the process
(as TRL's `async_loop`).

Built-in: `soft_overlong_punishment` (DAPO's length penalty, in tokens), listed in `reward.functions` as
`grpo_jax.rewards.functions:soft_overlong_punishment` and configured by `reward.soft_punish_cache`; and
`get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`, TRL's factory of the same function.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import inspect
import math
import numbers
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grpo_jax.data import prompts as data


FLOAT32_MAX = float(np.finfo(np.float32).max)  # rewards and advantages are float32


def soft_overlong_punishment(prompts=None, completions=None, *, completion_ids, max_completion_len: int,
                             soft_punish_cache: int, **kwargs) -> list[float]:
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13), one value per completion, lengths in tokens.

    With L = len(ids) (EOS included), L_max = `max_completion_len`, L_c = `soft_punish_cache`:
    R = 0 if L <= L_max - L_c;  ((L_max - L_c) - L) / L_c if L_max - L_c < L <= L_max;  -1 if L > L_max.
    The trainer binds L_max = sampling.max_completion_length and L_c = reward.soft_punish_cache.
    """
    limit = max_completion_len - soft_punish_cache
    out = []
    for ids in completion_ids:
        length = len(ids)
        if length <= limit:
            out.append(0.0)
        elif length <= max_completion_len:
            out.append((limit - length) / soft_punish_cache)
        else:
            out.append(-1.0)
    return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """TRL's `trl.rewards.get_soft_overlong_punishment`: the DAPO length penalty as a reward function."""
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache={soft_punish_cache} must be in [1, max_completion_len="
                         f"{max_completion_len}]")

    def soft_overlong_punishment_reward(completion_ids, **kwargs) -> list[float]:
        return soft_overlong_punishment(completion_ids=completion_ids, max_completion_len=max_completion_len,
                                        soft_punish_cache=soft_punish_cache)

    return soft_overlong_punishment_reward


def _to_float(name: str, i: int, value: Any) -> float:
    """One reward value -> float (None -> NaN); rejects non-numbers, non-finite floats and floats beyond float32."""
    if value is None:
        return math.nan
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    # numbers.Real covers bool (True -> 1.0, as TRL's torch.tensor would) and numpy scalars.
    if not isinstance(value, numbers.Real):
        raise ValueError(
            f"reward function '{name}' returned {type(value).__name__} {value!r} at index {i}: "
            "rewards must be numbers (or None to skip a completion)"
        )
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(
            f"reward function '{name}' returned {out} at index {i}: return None to skip a completion instead"
        )
    if abs(out) > FLOAT32_MAX:
        raise ValueError(f"reward function '{name}' returned {out} at index {i}: beyond float32's range (±3.4e38), "
                         "in which rewards are computed: scale the reward down")
    return out


class RewardLog:
    """What reward functions log through TRL's `log_metric` and `log_extra` during one round."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[str(column)].extend(values)

    def add(self, piece: RewardLog, rows, num_rows: int) -> None:
        """What functions called on ``rows`` of a round's ``num_rows`` logged: metrics appended, extra columns
        placed at their rows (a column of another length than ``rows`` ends up too long for the table)."""
        for name, values in piece.metrics.items():
            self.metrics[name].extend(values)
        for column, values in piece.extra.items():
            placed = self.extra.setdefault(column, [None] * num_rows)
            if len(values) != len(rows):
                placed.extend(values)
                continue
            for row, value in zip(rows, values):
                placed[row] = value

    def metric_means(self) -> dict[str, float]:
        """Each logged metric's mean over the round (TRL averages them over a logging step)."""
        return {name: float(np.mean(values)) for name, values in self.metrics.items() if values}


@dataclasses.dataclass
class TrainerState:
    """`transformers.TrainerState`'s fields and defaults (tests/rewards/test_rewards.py keeps them equal) without importing
    transformers' trainer stack: with torch and peft installed that import costs every run 3-4 s."""

    epoch: float = 0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, str | float | int | bool] | None = None
    stateful_callbacks: dict = dataclasses.field(default_factory=dict)


def trainer_state(global_step: int, max_steps: int, epoch: float) -> TrainerState:
    """The `trainer_state` TRL passes to reward functions: a `TrainerState` of the run so far."""
    return TrainerState(global_step=int(global_step), max_steps=int(max_steps), epoch=float(epoch))


def is_async_callable(fn: Callable) -> bool:
    """Whether calling `fn` returns a coroutine: async functions, partials of them, callables with an async
    `__call__` (TRL's `is_async_callable`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _accepts(fn: Callable, keyword: str) -> bool:
    """Whether `fn` takes `keyword` as a keyword argument (by that name, or through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): pass only what every function gets
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == keyword and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               for p in parameters)


class _Loop:
    """One event loop on a daemon thread for the process: async reward functions keep their clients bound to it
    from one round to the next."""

    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    @classmethod
    def run(cls, coroutine):
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="grpo_jax-rewards", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, cls._loop).result()


def _outputs(reward_fns, arguments: list[dict]) -> list:
    """Every function's return value (or the exception it raised): the synchronous ones in order, then the
    async ones awaited together."""
    outputs: list = [None] * len(reward_fns)
    pending = []
    for f, ((name, fn), args) in enumerate(zip(reward_fns, arguments)):
        if is_async_callable(fn):
            pending.append(f)
            continue
        try:
            outputs[f] = fn(**args)
        except (Exception, SystemExit) as e:  # sys.exit in a function stops the run with its name, not silently
            raise _failure(name, e) from e
    if pending:
        async def guarded(f):
            try:
                return await reward_fns[f][1](**arguments[f])
            except BaseException as e:  # noqa: BLE001 - a SystemExit or interrupt would end the loop's thread
                return e

        async def gather():
            return await asyncio.gather(*(guarded(f) for f in pending))

        for f, out in zip(pending, _Loop.run(gather())):
            if isinstance(out, KeyboardInterrupt):  # an interrupt stays one: the run saves, then re-raises it
                raise out
            if isinstance(out, BaseException):
                raise _failure(reward_fns[f][0], out) from out
            outputs[f] = out
    return outputs


def _failure(name: str, error: BaseException) -> RuntimeError:
    if isinstance(error, SystemExit):
        return RuntimeError(f"reward function '{name}' called sys.exit({error.code!r}): raise an exception (or "
                            "return None for a completion it cannot score) instead")
    return RuntimeError(f"reward function '{name}' raised {type(error).__name__}: {error}")


def _fresh(value):
    """A deep copy (a function that edits its arguments changes neither the next function's nor the data's), with
    the lists, dicts and scalars of rows copied directly: `copy.deepcopy` is several times slower on them."""
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return copy.deepcopy(value)


def _call_all(reward_fns, prompts, completions, columns, context: dict | None = None):
    """Calls every function once; yields (name, its list of N values) after checking the list's shape.

    `context`: TRL's extra keywords (`trainer_state`, `log_metric`, `log_extra`), passed to the functions that
    accept them."""
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    arguments = []
    for name, fn in reward_fns:
        extra = {k: v for k, v in (context or {}).items() if _accepts(fn, k)}
        arguments.append({**_fresh({"prompts": prompts, "completions": completions, **columns}), **extra})
    for (name, fn), out in zip(reward_fns, _outputs(reward_fns, arguments)):
        if inspect.isawaitable(out):
            if inspect.iscoroutine(out):
                out.close()  # never awaited: no "coroutine was never awaited" warning on top of this error
            raise ValueError(f"reward function '{name}' returned a coroutine from a synchronous call: declare it "
                             "`async def` (async functions are awaited) or return the list itself")
        if isinstance(out, np.ndarray):
            out = out.tolist() if out.ndim == 1 else out
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise ValueError(
                f"reward function '{name}' returned {type(out).__name__}: it must return a list of floats "
                "(or None), one per completion"
            )
        if len(out) != n:
            raise ValueError(f"reward function '{name}' returned {len(out)} rewards for {n} completions")
        yield name, out


def score_completions(
    reward_fns: Sequence[tuple[str, Callable]],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    context: dict | None = None,
) -> np.ndarray:
    """Call every reward function on the N completions; returns rewards_NxF float32 (NaN where None).
    `context`: TRL's `trainer_state`, `log_metric` and `log_extra`, for the functions that take them."""
    rewards_NxF = np.full((len(completions), len(reward_fns)), np.nan, dtype=np.float32)
    for f, (name, out) in enumerate(_call_all(reward_fns, prompts, completions, columns, context)):
        rewards_NxF[:, f] = [_to_float(name, i, v) for i, v in enumerate(out)]
    return rewards_NxF


def score_steps(reward_fns: Sequence[tuple[str, Callable]], weights_F: Sequence[float], prompts: list[str],
                completions: list[str], columns: dict[str, list], lengths_N: Sequence[int],
                context: dict | None = None, turn_ends: list | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Process supervision: every function returns, per completion, a list of (end_token_index, reward) steps.

    The index is the 0-based completion-token position of the step's last token, in [0, len(completion_ids)).
    Multi-turn rows (``turn_ends``: each row's turns' last-token indices) may instead get one reward per turn, a
    list of numbers as long as the row's turns: turn k is the step ending at ``turn_ends[i][k]``.
    None (for a completion, or as a step's reward) means unscored. Steps of several functions are merged,
    each reward times its function's weight. Returns (rewards_NxF: each function's step-reward sum per
    completion (NaN if it scored none), for the metrics; step_rewards_NxS (NaN = padding) and
    step_end_indices_NxS (-1 = padding), S = max(1, most steps of any completion)), the format of
    `grpo_jax.algo.advantages.process_advantages`.
    """
    n = len(completions)
    rewards_NxF = np.full((n, len(reward_fns)), np.nan, dtype=np.float32)
    steps: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for f, (name, out) in enumerate(_call_all(reward_fns, prompts, completions, columns, context)):
        for i, row in enumerate(out):
            if row is None:
                continue
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
                raise ValueError(f"reward function '{name}' returned {type(row).__name__} at index {i}: process "
                                 "supervision needs a list of (end_token_index, reward) steps per completion")
            total = []
            if turn_ends is not None and row and all(v is None or isinstance(v, (int, float, np.number)) for v in row):
                if len(row) != len(turn_ends[i]):
                    raise ValueError(f"reward function '{name}' returned {len(row)} turn rewards at index {i} for a "
                                     f"rollout of {len(turn_ends[i])} turns: give one per turn (or (index, reward) "
                                     "steps)")
                row = list(zip(turn_ends[i], row))
            for step in row:
                if not (isinstance(step, Sequence) and len(step) == 2):
                    raise ValueError(f"reward function '{name}' returned step {step!r} at index {i}: each step "
                                     "is an (end_token_index, reward) pair")
                index, value = step
                if not isinstance(index, int | np.integer) or not 0 <= int(index) < int(lengths_N[i]):
                    raise ValueError(f"reward function '{name}' returned step index {index!r} at index {i}: it "
                                     f"must be an int in [0, {int(lengths_N[i])}), a token of that completion")
                value = _to_float(name, i, value)
                if not math.isnan(value):
                    steps[i].append((int(index), float(weights_F[f]) * value))
                    total.append(value)
            if total:
                rewards_NxF[i, f] = sum(total)
    num_steps = max([1] + [len(s) for s in steps])
    step_rewards_NxS = np.full((n, num_steps), np.nan, np.float32)
    step_end_indices_NxS = np.full((n, num_steps), -1, np.int32)
    for i, row_steps in enumerate(steps):
        for j, (index, value) in enumerate(row_steps):
            step_end_indices_NxS[i, j], step_rewards_NxS[i, j] = index, value
    return rewards_NxF, step_rewards_NxS, step_end_indices_NxS


def scored(stat: Callable, values) -> float:
    """`stat` (np.nanmean, np.nanstd) of the scored values (NaN: None); NaN when none was scored, without numpy's
    "Mean of empty slice" warning (`unscored` names the functions instead)."""
    values = np.asarray(values)
    return math.nan if np.isnan(values).all() else stat(values)


def unscored(rewards_NxF: np.ndarray, names: Sequence[str]) -> tuple[tuple[str, ...], int]:
    """(the functions that returned None for every one of the N completions, the number of completions every
    function returned None for: they train on nothing)."""
    none_NxF = np.isnan(rewards_NxF)
    return tuple(name for name, none_N in zip(names, none_NxF.T) if none_N.all()), int(none_NxF.all(axis=1).sum())


def check_reward_fns(reward_fns: Sequence[tuple[str, Callable]], rows: list[dict], eos_token_id: int, *,
                     where: str, process: bool = False) -> None:
    """Calls every reward function once on `rows` (dataset rows) with empty completions (EOS first: a model can
    produce them), as the trainer will call it, so a function that fails or returns the wrong thing stops the
    run before anything compiles. Raises a ValueError naming the function, what it did, and `where` the rows
    come from. What the functions log here is dropped."""

    if not reward_fns or not rows:
        return
    prompts, completions = data.reward_inputs([row["prompt"] for row in rows], [""] * len(rows))
    columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
    columns["completion_ids"] = [[eos_token_id] for _ in rows]
    log = RewardLog()
    context = {"trainer_state": trainer_state(0, 0, 0.0), "log_metric": log.log_metric, "log_extra": log.log_extra}
    try:
        if process:
            score_steps(reward_fns, [1.0] * len(reward_fns), prompts, completions, columns, [1] * len(rows), context)
        else:
            score_completions(reward_fns, prompts, completions, columns, context)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{e} (checked before compiling, on the first {len(rows)} rows of {where} with empty "
                         "completions)") from e
