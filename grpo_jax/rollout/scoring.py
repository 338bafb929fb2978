"""The host's scoring of finished rows: a sampling pass decoded and scored (`decode_and_score`: the one decode ->
score path of training rounds and evaluation alike, the reward functions called once a pass), completion texts
(`decode`), the reward functions over a piece's rows (`score`) with TRL's columns and weights, a pass's rows and
scores placed as one `rounds.Draw` (`draw`), and the round's completion and reward metrics; reward functions that
return None are warned about once a run.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable

import numpy as np

from grpo_jax.algo import rounds
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.data import prompts as data
from grpo_jax.device import sharding
from grpo_jax.rewards import functions as rewards
from grpo_jax.rollout import multiturn, stream
from grpo_jax.rollout.piece import Piece, joined

# TRL's logger: its "all reward functions returned None" line reaches a script's log filters and handlers as TRL's does
trl_logger = logging.getLogger("trl.trainer.grpo_trainer")


def decode_and_score(decoder, params, batch: data.PromptBatch, key, score: Callable[[Piece], tuple], *,
                     group_size: int, greedy: bool = False, slots: int = 0, turns: multiturn.Turns | None = None,
                     later: bool = False, log: rewards.RewardLog | None = None,
                     decoded: Callable[[Piece, list], None] | None = None) -> tuple[Trajectory, list, list]:
    """One sampling pass of ``batch``'s rows (`stream.decode` with ``decoder``), its pieces joined in row order
    (`piece.joined`) and scored on the host with ``score`` (a `score` partial) once decoding is over: each reward
    function is called once a pass, on the pass's rows in order, as TRL calls it once a generation batch. ``later``
    (`multiturn.scores_on_first`): scored on process 0, the scores (and what the functions logged to ``log``)
    handed to every process. ``decoded(last piece, earlier pieces)`` runs once every row's tokens are on the host,
    before the rows are scored (training queues its log-probs there). Returns (the rows on the devices, the pass
    as one piece in a list, its scores in a list)."""
    pieces, rows = [], None
    for piece in stream.decode(decoder, params, batch.prompt_ids, batch.prompt_mask, key, greedy=greedy,
                               group_size=group_size, slots=slots, turns=turns):
        if piece.trajectory is not None:  # decoding is over: every row's tokens are on the host
            rows = piece.trajectory
            if decoded is not None:
                decoded(piece, pieces)
        pieces.append(piece)
    pieces = [joined(pieces)]
    if not later:
        scores = [score(pieces[0])]
    elif log is None:
        scores = sharding.from_first_process(lambda: [score(pieces[0])])
    else:  # what the functions logged comes along
        scores, log.metrics, log.extra = sharding.from_first_process(lambda: (
            [score(pieces[0])], log.metrics, log.extra))
    return rows, pieces, scores


def decode(tokenizer, completion_ids: np.ndarray, completion_mask: np.ndarray) -> list[str]:
    """Completion texts without EOS and padding, as reward functions expect them."""
    rows = [ids[: int(m.sum())].tolist() for ids, m in zip(completion_ids, completion_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def columns_with_ids(columns: dict, completion_ids: np.ndarray, completion_mask: np.ndarray) -> dict:
    """Dataset columns plus `completion_ids` (EOS included, padding removed), as TRL passes them."""
    if "completion_ids" in columns:
        raise ValueError("the dataset has a 'completion_ids' column: rename it (reward functions receive the "
                         "completions' token ids under that name, as in TRL)")
    lengths = completion_mask.sum(axis=1)
    return {**columns, "completion_ids": [ids[:n].tolist() for ids, n in zip(completion_ids, lengths)]}


def completion_metrics(mask: np.ndarray, truncated: np.ndarray) -> dict:
    lengths = mask.sum(axis=1)
    terminated = lengths[~truncated] if (~truncated).any() else np.zeros(1)  # TRL's 0s when none ended
    return {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.mean(),
            "completions/mean_terminated_length": terminated.mean(),
            "completions/min_terminated_length": terminated.min(),
            "completions/max_terminated_length": terminated.max()}


def nanstd(values) -> float:
    """TRL's `nanstd`: the standard deviation of the non-NaN values with Bessel's correction; NaN for fewer than 2."""
    values = np.asarray(values, np.float64)
    return math.nan if np.sum(~np.isnan(values)) < 2 else float(np.nanstd(values, ddof=1))


def reward_metrics(rewards_NxF, r_N, std_N, names) -> dict:
    """TRL 1.16's reward metrics: `reward` and `reward_std` the mean and std of the rows' weighted reward sums
    ``r_N`` (`rounds.round_advantages`), `frac_reward_zero_std` the rows whose advantage scale ``std_N`` is 0, each
    function's mean and std over the rows it scored."""
    out = {"reward": rewards.scored(np.nanmean, r_N), "reward_std": nanstd(r_N),
           "frac_reward_zero_std": np.mean(np.isclose(std_N, 0.0))}
    for i, name in enumerate(names):
        out[f"rewards/{name.split(':')[-1]}/mean"] = rewards.scored(np.nanmean, rewards_NxF[:, i])
        out[f"rewards/{name.split(':')[-1]}/std"] = nanstd(rewards_NxF[:, i])
    return out


def warn_unscored(warned: set, rewards_NxF: np.ndarray, names: list[str], round_index: int, step: int) -> None:
    """Once a run (its keys kept in ``warned``, the set the training loop owns): a warning naming the reward functions that returned None for every completion of a
    round, or counting the completions no function scored; either trains on less than the user meant."""
    silent, none_rows = rewards.unscored(rewards_NxF, names)
    where, listed = f"round {round_index} (step {step + 1})", ", ".join(f"'{name}'" for name in silent)
    if none_rows == len(rewards_NxF):
        key, text = "all", (f"every reward function ({listed}) returned None for every completion of {where}: the "
                            "round trains on nothing; return a number for each completion a function can score")
    elif silent:
        key, text = silent, (f"reward function{'s' * (len(silent) > 1)} {listed} returned None for every completion "
                             f"of {where}: the round trains on the other functions only; if it should score these "
                             "rows, check what it reads")
    elif none_rows:
        key, text = "rows", (f"{none_rows} of {len(rewards_NxF)} completions of {where} got None from every reward "
                             "function: they train on nothing")
    else:
        return
    if key not in warned:
        warned.add(key)
        warnings.warn(text + " (warned once a run)", RuntimeWarning, stacklevel=3)


def log_unscored_row(warned: set, draw: rounds.Draw, tokenizer) -> None:
    """TRL's warning when every reward function returned None for a row, with that (first) row's reward keywords,
    on TRL's logger; once a run (TRL logs it every batch), beside `warn_unscored`'s count."""
    none_N = np.isnan(draw.rewards).all(axis=1)
    if not none_N.any() or "trl_none_row" in warned:
        return
    warned.add("trl_none_row")
    i = int(np.flatnonzero(none_N)[0])
    row = {key: values[i] for key, values in draw.columns.items()}
    row["completion_ids"] = draw.completion_ids[i][draw.completion_mask[i] == 1].tolist()
    row["prompt"] = draw.prompts[i]
    row["completion"] = decode(tokenizer, draw.completion_ids[i:i + 1], draw.completion_mask[i:i + 1])[0]
    trl_logger.warning(f"All reward functions returned None for the following kwargs:\n{row}\n"
                       "Please ensure that at least one reward function returns a valid reward.")


def reward_weights(weights: list[float] | None, num_functions: int) -> np.ndarray:
    """TRL's reward_weights (`reward.weights`, None: 1 each), and 1 for each environment's `get_reward` after them
    (as TRL adds it): [F] for ``num_functions`` F."""
    weights = list(weights or [])
    return np.asarray(weights + [1.0] * (num_functions - len(weights)), np.float32)


def score(batch: data.PromptBatch, piece: Piece, context: dict, log: rewards.RewardLog | None, *, tokenizer,
          reward_fns: list, step_weights: np.ndarray | None = None, environments: list | None = None) -> tuple:
    """The reward functions ``reward_fns`` ((name, fn) pairs) on the host over one piece's rows: (rewards_NxF, process
    supervision's (step rewards, step end indices) or None); ``step_weights`` [F] (`reward_weights`): process
    supervision, its steps merged with these weights (None: one reward a completion). ``context``: TRL's
    `trainer_state` (`_reward_context`); what the functions log goes to ``log`` at the piece's rows (None:
    evaluation's, which gives them no `log_metric` / `log_extra`). Multi-turn rows give their message lists as
    completions (TRL's) and the rows' ``environments``; a function may then score each turn
    (`rewards.score_steps`)."""
    rows = piece.rows
    columns = {k: [v[i] for i in rows] for k, v in batch.columns.items()}
    piece_log = rewards.RewardLog()
    if log is not None:
        context = {**context, "log_metric": piece_log.log_metric, "log_extra": piece_log.log_extra}
    if environments is not None:
        context["environments"] = [environments[i] for i in rows]
    columns = columns_with_ids(columns, piece.completion_ids, piece.completion_mask)
    if piece.completions is not None:
        inputs = [batch.prompts[i] for i in rows], piece.completions
    else:
        inputs = data.reward_inputs([batch.prompts[i] for i in rows],
                                    decode(tokenizer, piece.completion_ids, piece.completion_mask))
    steps = None
    if step_weights is not None:
        lengths = piece.completion_mask.sum(axis=1)
        ends = None if piece.loss_mask is None else [turn_ends(m) for m in piece.loss_mask]
        rewards_NxF, *steps = rewards.score_steps(reward_fns, step_weights, *inputs, columns, lengths, context,
                                                  turn_ends=ends)
    else:
        rewards_NxF = rewards.score_completions(reward_fns, *inputs, columns, context)
    if log is not None:
        log.add(piece_log, rows, len(batch.prompts))
    return rewards_NxF, steps


def turn_ends(loss_mask_T: np.ndarray) -> list[int]:
    """The completion index of each policy turn's last token: where a run of trained tokens ends."""
    m = np.asarray(loss_mask_T).astype(bool)
    return np.flatnonzero(m & ~np.append(m[1:], False)).tolist()


def draw(batch: data.PromptBatch, pieces: list, scores: list) -> rounds.Draw:
    """A pass's `rounds.Draw`: its pieces' rows and their scores (rewards_NxF, steps) placed at their rows."""
    N, T = len(batch.prompts), pieces[0].completion_ids.shape[1]
    ids, mask = np.zeros((N, T), np.int32), np.zeros((N, T), np.int32)
    truncated = np.zeros(N, bool)
    rewards_NxF = np.full((N, scores[0][0].shape[1]), np.nan, np.float32)
    multi, tooled = pieces[0].loss_mask is not None, pieces[0].tool_counts is not None  # a rollout_func: no tools
    loss_mask = np.zeros((N, T), np.int32) if multi else None
    tool_counts = np.zeros((N, 4), np.int32) if tooled else None
    for piece, (r_NxF, _) in zip(pieces, scores):
        ids[piece.rows], mask[piece.rows], truncated[piece.rows] = (piece.completion_ids, piece.completion_mask,
                                                                      piece.is_truncated)
        rewards_NxF[piece.rows] = r_NxF
        if multi:
            loss_mask[piece.rows] = piece.loss_mask
        if tooled:
            tool_counts[piece.rows] = piece.tool_counts
    steps = {}
    if scores[0][1] is not None:  # process supervision: each piece's steps padded to the most of any row
        S = max(step_rewards.shape[1] for _, (step_rewards, _) in scores)
        steps = {"step_rewards": np.full((N, S), np.nan, np.float32), "step_end_indices": np.full((N, S), -1, np.int32)}
        for piece, (_, (step_rewards, ends)) in zip(pieces, scores):
            steps["step_rewards"][piece.rows, :step_rewards.shape[1]] = step_rewards
            steps["step_end_indices"][piece.rows, :ends.shape[1]] = ends
    return rounds.Draw(batch.prompts, batch.columns, ids, mask, truncated, rewards_NxF, batch.num_truncated, **steps,
                       loss_mask=loss_mask, tool_counts=tool_counts)
