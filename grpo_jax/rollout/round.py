"""One round of GRPO, in the order it runs:

    next_batch -> decode (jit; each group scored on the host as soon as it ends, while the others decode) ->
    reference / old log-probs queued on the decoded rows -> the last groups scored (host) -> advantages (host) ->
    RoundBatch -> optimizer steps -> metrics

A round's rows are one `Trajectory` on the devices, from the decoder to the loss; the host holds what the reward
functions saw (`rounds.Draw`). Completions reach the host once (`stream.decode`'s pieces), the advantages go up once.
`prepare_round(run, state, data_state, i) -> (RoundBatch, data_state)` and `run_steps(run, state, round_batch) ->
(state, round_batch, metrics)` take the states explicitly and return them; a round can be sampled with other params
than the state's (``params``). `grpo_jax.api.run.build` makes the immutable `Run` (data, rewards, mesh,
`grpo_jax.algo.programs`), the maths lives in pure functions behind those programs, and `grpo_jax.api.trainer` repeats rounds
with checkpoints, evaluation and outputs around them. What lives through the loop is the loop's and passed in: the
tool calls' `Toolbox` (``toolbox``) and the keys of the warnings given once a run (``warned``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from grpo_jax.algo import rounds, trajectory
from grpo_jax.algo.program_types import Programs
from grpo_jax.algo.state import TrainState
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.config import Config
from grpo_jax.data import prompts as data
from grpo_jax.device import cpu, sharding
from grpo_jax.io.reporting import completion_rows, plain
from grpo_jax.rewards import functions as rewards
from grpo_jax.rollout import multiturn, rollout_func, scoring
from grpo_jax.rollout.context import Run


class RoundBatch(NamedTuple):
    """One round, built once by `prepare_round`: its rows (TRL's names, on the devices), which rows each of its
    steps takes, and how far its steps got. A checkpoint taken inside a round saves it as it is.

    N rows of the round, B rows per step, K = steps_per_generation x num_iterations steps.
    """

    rows: Trajectory  # the round's N rows on the devices, with advantages and old/ref log-probs
    token_counts: np.ndarray  # [N, 2] each row's real prompt and completion tokens (its steps' packed lengths)
    step_rows: np.ndarray  # [K, B] row indices of each step of the round
    round_index: int
    first_step: int  # optimizer steps taken before the round
    position: int  # steps of the round done
    metrics: dict  # the round's metrics (rewards, lengths), repeated on each of its steps
    seconds: dict  # sample / score / logps seconds of the round, and its decode steps and slots
    completions: list | None = None  # with log_completions: the round's table (`reporting.completion_rows`)
    token_versions: np.ndarray | None = None  # [N, T] interruptible rollouts: the params version of each token


def _weights(config: Config, reward_fns: list) -> np.ndarray:
    return scoring.reward_weights(config.reward.weights, len(reward_fns))


def _counts(prompt_mask: np.ndarray, completion_mask: np.ndarray) -> np.ndarray:
    """[N, 2] each row's real prompt and completion tokens."""
    return np.stack([np.sum(prompt_mask, axis=1), np.sum(completion_mask, axis=1)], axis=1).astype(np.int32)


def _packing(cfg: Config, shards: int, counts_Nx2: np.ndarray, group_size: int, micro_batches: int = 1,
             listed=None) -> tuple[int, int]:
    """(packed buffer length, buffers a micro-batch) of these rows' forwards over ``shards`` row shards, (0, 0) for
    the static layout: `train.packing`, or when it is null whichever layout costs fewer FLOPs
    (`trajectory.choose_packing`), among the ``listed`` shapes (`Run.shapes`' round or step packings, compiled
    ahead; None: any). ``micro_batches`` M: the rows are split as `train_step` splits them (micro-batch m takes rows
    m, m + M, ...)."""
    M = micro_batches
    counts_Nx2 = np.concatenate([counts_Nx2[m::M] for m in range(M)])  # micro-batch order
    on_cpu = cpu.enabled(cfg.cpu_speedups)
    return trajectory.choose_packing(
        counts_Nx2[:, 0], counts_Nx2[:, 1], group_size, cfg.data.max_prompt_length, cfg.sampling.max_completion_length,
        trajectory.forward_flops(cfg.model), packing=cfg.train.packing, micro_batches=M, shards=shards,
        dense_pair_cost=cpu.DENSE_PAIR_COST if on_cpu else 1.0, blocked_pairs=cpu.blocked_pairs if on_cpu else None,
        shapes=listed)


def logps_args(run: Run, rows: Trajectory, counts_Nx2: np.ndarray) -> tuple:
    """A round's rows as the log-prob programs take them: the four row arrays, the experts the sampler chose (routing
    replay; None otherwise) and their packing (`_packing`)."""
    return (rows.prompt_ids, rows.prompt_mask, rows.completion_ids, rows.completion_mask, rows.routed_experts,
            *_packing(run.config, sharding.num_row_shards(run.mesh), counts_Nx2, run.round_prompt_group_size,
                      listed=None if run.shapes is None else run.shapes.round_packings))


def dispatch_logps(programs: Programs, args: tuple, reference_params, params, *, old: bool,
                   sampler_logps=None) -> tuple:
    """(reference, old-policy) log-probs of rows laid out as ``args`` (`logps_args`), queued on the devices without
    waiting; None where the run has no reference or ``old`` is false. ``sampler_logps``: the rows' sampler
    log-probs, given in float32, where they are the old policy's (same ``params``, full-vocabulary log-softmax at
    the temperature) up to rounding: no forward pass for them."""
    ref = None if programs.ref_logps is None else programs.ref_logps(reference_params, *args)
    if not old:
        return ref, None
    return ref, sampler_logps if sampler_logps is not None else programs.logps(params, *args)


def _queue_logps(run: Run, state: TrainState, params, rows: Trajectory, counts_Nx2: np.ndarray, old: bool) -> tuple:
    """`dispatch_logps` of a round's rows under ``params``, the state's reference."""
    in_float32 = run.config.model.dtype == "float32"
    return dispatch_logps(run.programs, logps_args(run, rows, counts_Nx2), state.reference_params, params, old=old,
                          sampler_logps=rows.sampler_per_token_logps if in_float32 else None)


def _reward_context(dataset: data.Dataset, max_steps: int, step: int, data_state: data.DataState) -> dict:
    """The keywords TRL 1.16 passes every reward function beside the dataset's columns (`scoring.score` adds
    `log_metric` and `log_extra`)."""
    epoch = data.epochs_read(dataset, data_state)
    return {"trainer_state": rewards.trainer_state(step, max_steps, epoch)}


def _journal(output_dir: Path, round_index: int, pass_index: int) -> Path:
    """Where a sampling pass's tool results are kept as they arrive (`multiturn.Journal`)."""
    return output_dir / "tool_calls" / f"round-{round_index}-pass-{pass_index}.jsonl"


def _sample_and_score(run: Run, state: TrainState, params, batch: data.PromptBatch, key, seconds: dict,
                      context: dict, log: rewards.RewardLog, *, logps: bool, old: bool = False, slots: int = 0,
                      turns: multiturn.Turns | None = None, environments: list | None = None):
    """One sampling pass, scored on the host once its rows are decoded (each reward function called once, on the
    pass's rows in order, as TRL calls it once a generation batch). With ``logps`` the reference / old (``old``)
    log-probs are queued on the devices as soon as the last rows are decoded, before the host scores them.
    ``slots``: the decoding call's (`stream.plan_slots`); ``turns`` and ``environments``: multi-turn rows'
    (`multiturn.setup`). Adds the pass's `sample` time (until its last rows
    reach the host), `score` time (host scoring after that) and `decode_steps` to ``seconds``.
    Returns (the rows on the devices, `rounds.Draw`, (ref, old) or None)."""
    timer = time.perf_counter()
    queued = None
    process = run.config.train.advantage_estimator == "process"
    weights = _weights(run.config, run.reward_fns) if process else None
    score = functools.partial(scoring.score, context=context, log=log, tokenizer=run.tokenizer,
                              reward_fns=run.reward_fns, step_weights=weights,
                              environments=environments)

    def decoded(piece, pieces: list) -> None:  # every row's tokens on the host: the log-probs queued first
        nonlocal queued, timer
        seconds["decode_steps"] = seconds.get("decode_steps", 0) + piece.decode_steps
        if logps:
            completion_mask = np.zeros_like(batch.prompt_ids, shape=piece.trajectory.completion_ids.shape)
            for done in (*pieces, piece):
                completion_mask[done.rows] = done.completion_mask
            queued = _queue_logps(run, state, params, piece.trajectory, _counts(batch.prompt_mask, completion_mask),
                                  old)
        seconds["sample"] = seconds.get("sample", 0.0) + time.perf_counter() - timer
        timer = time.perf_counter()

    if run.rollout_func is not None:  # the user's function makes the rows (TRL's rollout_func), on every process
        batch, piece = rollout_func.rows(run.rollout_func, batch, run.config.data.max_prompt_length,
                                         run.config.sampling.max_completion_length, run.mesh, context["trainer_state"])
        decoded(piece, [])
        rows, pieces, scores = piece.trajectory, [piece], [score(batch, piece)]
    else:  # process 0 scores rows with environments once decoding is over: the decoding thread's collectives are done
        rows, pieces, scores = scoring.decode_and_score(
            run.programs.decoder, params, batch, key, lambda piece: score(batch, piece),
            group_size=run.config.train.num_generations, slots=slots, turns=turns,
            later=multiturn.scores_on_first(run.tooling), log=log, decoded=decoded)
    draw = scoring.draw(batch, pieces, scores)
    seconds["score"] = seconds.get("score", 0.0) + time.perf_counter() - timer
    if turns is not None:  # the time a decoding chunk had nothing to decode until a tool returned, chunks' mean
        chunks = run.programs.decoder.chunks(len(batch.prompt_ids), run.config.train.num_generations)
        seconds["tool_wait"] = seconds.get("tool_wait", 0.0) + sum(turns.waits) / chunks
    return rows, draw, queued


def _sample_pass(run: Run, state: TrainState, params, data_state: data.DataState, round_index: int, pass_index: int,
                 seconds: dict, context: dict, log: rewards.RewardLog, toolbox, *, logps: bool, old: bool = False,
                 slots: int = 0):
    """The pipeline's head, one sampling pass of a round: the next prompts, G rows each, made ready for their tools
    (`multiturn.setup`, the pass's journal), decoded with the pass's key and scored (`_sample_and_score`). Returns
    (the rows on the devices, `rounds.Draw`, (ref, old) log-probs queued or None, the prompt mask, data position)."""
    tc = run.config.train
    batch, data_state = data.next_batch(run.dataset, data_state, tc.prompts_per_round)
    batch = data.repeat_groups(batch, tc.num_generations)
    journal = _journal(run.output_dir, round_index, pass_index)
    batch, turns, environments = multiturn.setup(run.tooling, run.tokenizer, batch, journal, tc.num_generations,
                                                 toolbox=toolbox)
    key = run.programs.sample_key(state.key, round_index, pass_index)
    rows, draw, queued = _sample_and_score(run, state, params, batch, key, seconds, context, log, logps=logps,
                                           old=old, slots=slots, turns=turns, environments=environments)
    return rows, draw, queued, batch.prompt_mask, data_state


def _dynamic_sampling_passes(run: Run, state: TrainState, params, data_state: data.DataState, round_index: int,
                             seconds: dict, context: dict, log: rewards.RewardLog, toolbox):
    """DAPO dynamic sampling: passes (`_sample_pass`) until informative groups fill the round
    (`rounds.init/update/finalize`); the chosen rows are gathered on the devices. Returns (rows, draw, their token
    counts, metrics, data position)."""
    tc = run.config.train
    passes, trajectories, prompt_masks = rounds.init(), [], []
    weights = _weights(run.config, run.reward_fns)
    seconds.update(sample=0.0, score=0.0)
    while not (rounds.is_full(passes, tc.prompts_per_round) or len(passes.draws) >= tc.max_num_gen_batches):
        rows, draw, _, prompt_mask, data_state = _sample_pass(run, state, params, data_state, round_index,
                                                              len(passes.draws), seconds, context, log, toolbox,
                                                              logps=False)
        trajectories.append(rows)
        prompt_masks.append(prompt_mask)
        timer = time.perf_counter()
        passes = rounds.update(passes, draw, rounds.zero_std_groups(draw, weights, tc.num_generations))
        seconds["score"] += time.perf_counter() - timer
    draw, chosen, metrics = rounds.finalize(passes, tc.prompts_per_round, tc.num_generations)
    every = trajectories[0] if len(trajectories) == 1 else run.programs.decoder.concat(trajectories)
    counts = _counts(np.concatenate(prompt_masks)[chosen], draw.completion_mask)
    return run.programs.take(every, chosen), draw, counts, metrics, data_state


def _step_rows(cfg: Config, step_prompt_group_size: int, round_index: int) -> np.ndarray:
    """[K, B] rows of each step: `steps_per_generation` disjoint shuffled slices, repeated `num_iterations` times."""
    tc = cfg.train
    if step_prompt_group_size > 1:  # one step takes the whole round: its row order changes nothing
        order = np.arange(tc.generation_batch_size)
    else:
        order = np.random.default_rng([cfg.seed, round_index]).permutation(tc.generation_batch_size)
    slices = [order[k * tc.train_batch_size:(k + 1) * tc.train_batch_size] for k in range(tc.steps_per_generation)]
    return np.stack([s for _ in range(tc.num_iterations) for s in slices])


def prepare_round(run: Run, state: TrainState, data_state: data.DataState, round_index: int, *, params=None,
                  slots: int = 0, old: bool | None = None, warned: set | None = None, toolbox=None
                  ) -> tuple[RoundBatch, data.DataState]:
    """A round before its updates: decode (jit) -> ref/old log-probs queued -> rows to the host -> score (host) ->
    advantages (host) -> RoundBatch, and the data position after its prompts. ``params`` samples the round (and
    gives its old log-probs; None: the state's); the state gives the key, the step and the reference. ``slots``:
    the decode slots (`stream.plan_slots`; 0: `sampling.max_batch_rows`), kept in its `seconds` with the decode
    steps. With DAPO dynamic sampling the passes are merged first. ``old``: whether the rows get old-policy
    log-probs (under ``params``; None: `train.needs_old_logps`). ``warned``: the keys of the warnings given once
    a run, which the loop owns and this adds to (None: this round's own, so it warns again next round). ``toolbox``: the
    loop's `tools.calls.open_toolbox`, for a run with tools (the loop closes it)."""
    cfg, tc = run.config, run.config.train
    params = state.params if params is None else params
    old = tc.needs_old_logps if old is None else old
    seconds: dict = {"decode_slots": slots}
    log = rewards.RewardLog()
    context = _reward_context(run.dataset, cfg.max_steps, int(state.step), data_state)
    if tc.dynamic_sampling:
        rows, draw, counts, sampling_metrics, data_state = _dynamic_sampling_passes(
            run, state, params, data_state, round_index, seconds, context, log, toolbox)
        ref, old = _queue_logps(run, state, params, rows, counts, old)
    else:
        rows, draw, (ref, old), prompt_mask, data_state = _sample_pass(
            run, state, params, data_state, round_index, 0, seconds, context, log, toolbox, logps=True, old=old,
            slots=slots)
        counts, sampling_metrics = _counts(prompt_mask, draw.completion_mask), {}

    timer = time.perf_counter()
    mask = rounds.mask_truncated(draw.trained_mask, draw.is_truncated) if tc.mask_truncated_completions \
        else draw.trained_mask
    advantages, r_N, std_N = run.programs.advantages(draw.rewards, _weights(run.config, run.reward_fns), mask,
                                                     *rounds.pad_steps(draw, mask.shape[1]))
    rows = run.programs.rows(rows, advantages, old, ref)
    seconds["score"] += time.perf_counter() - timer

    timer = time.perf_counter()
    jax.block_until_ready(rows)  # the phase's time, not the next one's
    # the time the round waits for its log-probs: what scoring on the host did not hide
    seconds["logps"] = time.perf_counter() - timer

    names = [name for name, _ in run.reward_fns]
    warned = set() if warned is None else warned
    scoring.warn_unscored(warned, draw.rewards, names, round_index, int(state.step))
    scoring.log_unscored_row(warned, draw, run.tokenizer)
    metrics = {**scoring.reward_metrics(draw.rewards, r_N, std_N, names),
               **scoring.completion_metrics(draw.trained_mask, draw.is_truncated),
               **(multiturn.metrics(draw.tool_counts) if draw.tool_counts is not None else {}),
               "prompts/num_truncated": draw.num_prompts_truncated, **sampling_metrics, **log.metric_means()}
    completions = None
    if cfg.log_completions:
        completions = completion_rows(draw.prompts, scoring.decode(run.tokenizer, draw.completion_ids, draw.completion_mask),
                                      draw.rewards, names, r_N, advantages, mask, extra=log.extra)
    step_rows = _step_rows(cfg, run.step_prompt_group_size, round_index)
    return RoundBatch(rows=rows, token_counts=counts, step_rows=step_rows, round_index=round_index,
                      first_step=int(state.step), position=0,
                      metrics={k: plain(v) for k, v in metrics.items()}, seconds=seconds,
                      completions=completions), data_state


def run_steps(run: Run, state: TrainState, round_batch: RoundBatch, *, until: int,
              stop: Callable[[int], bool] | None = None,
              max_skipped: int | None = None) -> tuple[TrainState, RoundBatch, list[dict]]:
    """The round's next optimizer steps, up to step `until` (counted over the run) or the round's end.

    `stop(steps done)` is asked before each step (preemption). Steps are dispatched back to back and their metrics
    fetched once at the end; with `max_skipped` the call also ends right after the step that makes more than
    that many skipped (non-finite) steps, whose flags it fetches only once that many more steps could exceed it.
    Returns the state, the round with its new position, and one metrics line per step.
    """
    rb = round_batch
    last = min(len(rb.step_rows), until - rb.first_step)
    timer = time.perf_counter()
    pending, position = [], rb.position
    num_rows = len(rb.rows.completion_ids)
    unchecked = 0  # steps dispatched since the skipped flags were last fetched
    while position < last and not (stop is not None and stop(rb.first_step + position)) and \
            (max_skipped is None or max_skipped >= 0):
        step_rows = rb.step_rows[position]
        # a step of all the round's rows in order (one step per round) takes them as they are, without a gather
        in_order = len(step_rows) == num_rows and np.array_equal(step_rows, np.arange(num_rows))
        length, buffers = _packing(run.config, sharding.num_row_shards(run.mesh), rb.token_counts[step_rows],
                                   run.step_prompt_group_size,
                                   run.config.train.gradient_accumulation_steps,
                                   None if run.shapes is None else run.shapes.step_packings)
        rows = rb.rows if in_order else run.programs.take(rb.rows, step_rows)
        state, metrics = run.programs.step(state, rows, length, buffers)
        pending.append({**metrics, "packed_length": length})
        position += 1
        unchecked += 1
        if max_skipped is not None and unchecked > max_skipped:  # these steps alone could pass the limit
            max_skipped -= int(sum(jax.device_get([m["skipped"] for m in pending[-unchecked:]])))
            unchecked = 0
    pending = jax.device_get(pending)  # one host sync per call, after every step was dispatched
    t_update = (time.perf_counter() - timer) / max(len(pending), 1)

    num_steps = len(rb.step_rows)  # the round's sampling, scoring and log-prob time is shared by its steps
    times = {f"step_time/{k}": rb.seconds[k] / num_steps for k in ("sample", "score", "logps")}
    tc = run.config.train  # TRL's epoch: the dataset's prompts read by this step, at a round's prompts a step
    prompts_a_step = tc.prompts_per_round / tc.steps_per_round / max(len(run.dataset), 1)
    lines = []
    for i, metrics in enumerate(pending):
        step = rb.first_step + rb.position + i
        lines.append({"step": step + 1, **rb.metrics, **metrics, "learning_rate": float(run.schedule(step)),
                      "epoch": (step + 1) * prompts_a_step,
                      "step_time": sum(times.values()) + t_update, **times, "step_time/update": t_update})
    return state, rb._replace(position=position), lines


def run_round(run: Run, state: TrainState, data_state: data.DataState, round_index: int, *,
              warned: set | None = None) -> tuple[TrainState, data.DataState, RoundBatch, list[dict]]:
    """One generation round: `prepare_round`, then all its optimizer steps (`run_steps`)."""
    round_batch, data_state = prepare_round(run, state, data_state, round_index, warned=warned)
    state, round_batch, lines = run_steps(run, state, round_batch, until=run.config.max_steps)
    return state, data_state, round_batch, lines
