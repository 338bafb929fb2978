"""The orchestrating loop: rounds of sample -> score -> advantages -> log-probs -> updates, with all I/O here.

Jitted maths lives in sampling, logprobs, advantages, losses and train_step, and `grpo_jax.run.build` sets a
run up; this module only moves data between them, calls the Python reward functions, and writes the run
directory and its checkpoints.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from grpo_jax import checkpoint, data, rewards, rounds, sharding
from grpo_jax.config import Config, to_dict
from grpo_jax.reporting import MetricsWriter, plain, plot_rewards
from grpo_jax.run import Run, build
from grpo_jax.train_step import Batch


class RoundBuffer(NamedTuple):
    """One round's training rows and step slices; the first `position` of its steps are done.

    Arrays are host NumPy or device arrays: N rows of the round, T completion tokens, B rows per step,
    K = steps_per_generation x num_iterations steps. A checkpoint taken inside a round saves it whole.
    """

    round_index: int
    first_step: int  # optimizer steps taken before the round
    position: int  # steps of the round done
    prompt_ids: Any  # [N, L]
    prompt_mask: Any  # [N, L]
    completion_ids: Any  # [N, T]
    completion_mask: Any  # [N, T] the training mask (after mask_truncated_completions)
    advantages: Any  # [N], or [N, T] for process supervision
    old_per_token_logps: Any  # [N, T] or None (one update per round)
    ref_per_token_logps: Any  # [N, T] or None (beta 0)
    sampler_per_token_logps: Any  # [N, T] masked, or None (use_sampler_logps off)
    step_rows: np.ndarray  # [K, B] row indices of each step of the round
    metrics: dict  # the round's metrics, repeated on each of its steps
    seconds: dict  # sample / score / logps seconds of the round

    ARRAYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
              "ref_per_token_logps", "sampler_per_token_logps", "step_rows")

def decode(tokenizer, completion_ids: np.ndarray, completion_mask: np.ndarray) -> list[str]:
    """Completion texts without EOS and padding, as reward functions expect them."""
    rows = [ids[: int(m.sum())].tolist() for ids, m in zip(completion_ids, completion_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def evaluate(run: Run, params) -> dict[str, float]:
    """Greedy completions of the held-out prompts, scored by `eval.reward_functions` (mean per function)."""
    if not run.eval_rows:
        return {}
    cfg = run.config
    shards = sharding.num_row_shards(run.mesh)
    n = len(run.eval_rows)
    padded = [run.eval_rows[i % n] for i in range(n + (-n) % shards)]  # rows must split over the devices
    ids, mask, _ = data.tokenize_prompts(run.tokenizer, [r["prompt"] for r in padded], cfg.data.max_prompt_length,
                                         truncation="left")
    ids, mask = sharding.host_rows((ids, mask), run.mesh)
    out = sharding.to_host(run.sample_fn(params, ids, mask, jax.random.PRNGKey(0), True))
    completions = decode(run.tokenizer, out.completion_ids, out.completion_mask)[:n]
    columns = {k: [r.get(k) for r in run.eval_rows] for k in run.eval_rows[0] if k != "prompt"}
    lengths = out.completion_mask.sum(axis=1)[:n]
    columns["completion_ids"] = [ids[:m].tolist() for ids, m in zip(out.completion_ids, lengths)]
    scores = rewards.score_completions(run.eval_reward_fns,
                                       *data.reward_inputs([r["prompt"] for r in run.eval_rows], completions), columns)
    return {name.split(":")[-1]: float(np.nanmean(scores[:, i])) for i, (name, _) in enumerate(run.eval_reward_fns)}


def _completion_metrics(mask: np.ndarray, truncated: np.ndarray) -> dict:
    lengths = mask.sum(axis=1)
    terminated = lengths[~truncated]
    return {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.mean(),
            "completions/mean_terminated_length": terminated.mean() if terminated.size else 0.0}


def _reward_metrics(rewards_NxF, r_N, std_N, names, num_generations: int) -> dict:
    group_std = std_N.reshape(-1, num_generations)[:, 0]
    out = {"reward": np.nanmean(r_N), "reward_std": np.nanmean(group_std),
           "frac_reward_zero_std": np.mean(np.isclose(np.nan_to_num(group_std), 0.0))}
    for i, name in enumerate(names):
        out[f"rewards/{name.split(':')[-1]}/mean"] = np.nanmean(rewards_NxF[:, i])
        out[f"rewards/{name.split(':')[-1]}/std"] = np.nanstd(rewards_NxF[:, i])
    return out


def _weights(config: Config) -> np.ndarray:
    return np.asarray(config.reward.weights or [1.0] * len(config.reward.functions), np.float32)


_fold_in = jax.jit(jax.random.fold_in)  # one dispatch, not fold_in's primitives one by one (~0.7 ms on CPU)


def sample_and_score(run: Run, draw_index: int, seconds: dict, on_device_rows: Callable | None = None) -> rounds.Draw:
    """One sampling pass of P prompts x G completions with the current policy, scored on the host.

    Adds its sampling and scoring time to seconds["sample"] / seconds["score"]. `on_device_rows(prompt_ids,
    prompt_mask, completion_ids, completion_mask)` gets the sampled rows (completions on the devices, prompts
    as `sharding.host_rows`) as soon as they are dispatched: work queued there (log-probs) runs on the devices
    while the host scores.
    """
    cfg, tc = run.config, run.config.train
    timer = time.perf_counter()
    batch = data.repeat_groups(run.prompts.next_batch(), tc.num_generations)
    sample_key = _fold_in(run.state.key, run.state.step)
    if draw_index:  # dynamic sampling's extra passes
        sample_key = _fold_in(sample_key, draw_index)
    prompt_ids, prompt_mask = sharding.host_rows((batch.prompt_ids, batch.prompt_mask), run.mesh)
    out = run.sample_fn(run.state.params, prompt_ids, prompt_mask, sample_key, False)
    if on_device_rows is not None:
        on_device_rows(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)
    out = sharding.to_host(out)
    seconds["sample"] = seconds.get("sample", 0.0) + time.perf_counter() - timer
    timer = time.perf_counter()
    completions = decode(run.tokenizer, out.completion_ids, out.completion_mask)
    if "completion_ids" in batch.columns:
        raise ValueError("the dataset has a 'completion_ids' column: rename it (reward functions receive the "
                         "completions' token ids under that name, as in TRL)")
    lengths = out.completion_mask.sum(axis=1)
    columns = {**batch.columns, "completion_ids": [ids[:n].tolist() for ids, n in zip(out.completion_ids, lengths)]}
    steps = {}
    if tc.advantage_estimator == "process":
        rewards_NxF, steps["step_rewards"], steps["step_end_indices"] = rewards.score_steps(
            run.reward_fns, _weights(cfg), *data.reward_inputs(batch.prompts, completions), columns, lengths)
    else:
        rewards_NxF = rewards.score_completions(run.reward_fns, *data.reward_inputs(batch.prompts, completions),
                                                columns)
    seconds["score"] = seconds.get("score", 0.0) + time.perf_counter() - timer
    return rounds.Draw(batch.prompt_ids, batch.prompt_mask, out.completion_ids, out.completion_mask,
                       np.asarray(out.is_truncated), out.sampler_per_token_logps, rewards_NxF, batch.prompts, batch.columns,
                       batch.num_truncated, **steps)


def collect_round(run: Run, seconds: dict, on_device_rows: Callable | None = None) -> tuple[rounds.Draw, dict]:
    """The round's rows: one pass, or DAPO dynamic sampling's passes until informative groups fill it.

    `on_device_rows` (see `sample_and_score`) is called for a one-pass round only: dynamic sampling merges
    passes on the host.
    """
    tc = run.config.train
    if not tc.dynamic_sampling:
        return sample_and_score(run, 0, seconds, on_device_rows), {}
    state = rounds.init()
    while not (rounds.is_full(state, tc.prompts_per_round) or len(state.draws) >= tc.max_num_gen_batches):
        draw = sample_and_score(run, len(state.draws), seconds)
        state = rounds.update(state, draw, rounds.zero_std_groups(draw, _weights(run.config), tc.num_generations))
    return rounds.finalize(state, tc.prompts_per_round, tc.num_generations)


def prepare_round(run: Run, round_index: int) -> RoundBuffer:
    """A round's rows before its updates: sample and score, advantages, old/ref log-probs, the step slices."""
    cfg, tc = run.config, run.config.train
    first_step = int(run.state.step)  # the only read of the device step counter in a round
    seconds: dict = {}
    dispatched: dict = {}
    old_forward = tc.needs_old_logps and cfg.model.dtype != "float32"

    def log_probs(*rows):
        """Reference (and old-policy) log-probs of the rows, dispatched to the devices without waiting."""
        return {"ref": None if cfg.loss.beta == 0.0 else run.ref_logps_fn(run.state.ref_params, *rows),
                "old": run.logps_fn(run.state.params, *rows) if old_forward else None}

    def on_device_rows(*rows):
        # the sampled rows never leave the devices for these passes, which overlap the host's reward scoring.
        # They attend with the sampled mask: mask_truncated_completions zeroes whole rows, whose values are
        # then masked out of every loss term and metric anyway
        dispatched.update(rows=rows, **log_probs(*rows))

    draw, sampling_metrics = collect_round(run, seconds, on_device_rows)

    timer = time.perf_counter()
    mask = rounds.mask_truncated(draw.completion_mask, draw.is_truncated) if tc.mask_truncated_completions \
        else draw.completion_mask
    advantages_N, r_N, std_N = rounds.compute_advantages(
        draw, mask, _weights(cfg), estimator=tc.advantage_estimator, scale_rewards=tc.scale_rewards,
        multi_objective_aggregation=tc.multi_objective_aggregation, num_generations=tc.num_generations)
    seconds["score"] += time.perf_counter() - timer

    timer = time.perf_counter()
    # old/ref log-probs stay on the devices (no host round trip in a round); a one-pass round's completions are
    # already there (the sampler's), a dynamic-sampling round's rows go up once
    if dispatched:
        prompt_ids, prompt_mask, completion_ids, mask_dev = dispatched["rows"]
        if tc.mask_truncated_completions:
            mask_dev = sharding.host_rows(mask, run.mesh)
    else:
        prompt_ids, prompt_mask, completion_ids, mask_dev = sharding.shard_global_rows(
            (draw.prompt_ids, draw.prompt_mask, draw.completion_ids, mask), run.mesh)
        dispatched.update(log_probs(prompt_ids, prompt_mask, completion_ids, mask_dev))
    ref, old = dispatched["ref"], dispatched["old"]
    if tc.needs_old_logps and not old_forward:
        # the sampler's log-probs are the old policy's (same params, full-vocabulary log-softmax at the
        # temperature) up to float32 rounding: reuse them instead of another forward pass
        old = draw.sampler_logps * mask
    jax.block_until_ready((ref, old))  # the phase's time, not the next one's
    # the time the round waits for its log-probs: what scoring on the host did not hide
    seconds["logps"] = time.perf_counter() - timer

    round_metrics = {**_reward_metrics(draw.rewards, r_N, std_N, cfg.reward.functions, tc.num_generations),
                     **_completion_metrics(draw.completion_mask, draw.is_truncated),
                     "prompts/num_truncated": draw.num_prompts_truncated, **sampling_metrics}
    if run.step_prompt_group_size > 1:  # one step takes the whole round: its row order changes nothing
        order = np.arange(tc.generation_batch_size)
    else:
        order = np.random.default_rng([cfg.seed, round_index]).permutation(tc.generation_batch_size)
    slices = [order[k * tc.train_batch_size:(k + 1) * tc.train_batch_size] for k in range(tc.steps_per_generation)]
    step_rows_KxB = np.stack([s for _ in range(tc.num_iterations) for s in slices])
    sampler = draw.sampler_logps * mask if tc.use_sampler_logps else None
    return RoundBuffer(round_index=round_index, first_step=first_step, position=0, prompt_ids=prompt_ids,
                       prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=mask_dev,
                       advantages=advantages_N, old_per_token_logps=old, ref_per_token_logps=ref,
                       sampler_per_token_logps=sampler, step_rows=step_rows_KxB,
                       metrics={k: plain(v) for k, v in round_metrics.items()}, seconds=seconds)


def run_steps(run: Run, writer: MetricsWriter, buffer: RoundBuffer, *, until: int,
              stop: Callable[[], bool] | None = None) -> RoundBuffer:
    """The round's next optimizer steps, up to step `until` (counted over the run) or the round's end.

    `stop()` is checked before each step (preemption). Steps are dispatched back to back and their metrics
    fetched once at the end, then written. Returns the buffer with its new position.
    """
    last = min(len(buffer.step_rows), until - buffer.first_step)
    timer = time.perf_counter()
    # host arrays (the advantages, a restored round's rows) go to the devices once, or as they are into the
    # call of the only step left, which places them itself
    put = sharding.host_rows if last - buffer.position <= 1 else sharding.shard_global_rows
    buffer = buffer._replace(**{k: put(getattr(buffer, k), run.mesh)
                                for k in RoundBuffer.ARRAYS[:-1] if isinstance(getattr(buffer, k), np.ndarray)})
    pending, position = [], buffer.position
    round_rows = Batch(buffer.prompt_ids, buffer.prompt_mask, buffer.completion_ids, buffer.completion_mask,
                       buffer.advantages, buffer.old_per_token_logps, buffer.ref_per_token_logps,
                       buffer.sampler_per_token_logps)
    num_rows = len(buffer.completion_ids)
    while position < last and not (stop is not None and stop()):
        step_rows = buffer.step_rows[position]
        # a step of all the round's rows in order (one step per round) takes them as they are, without a gather
        in_order = len(step_rows) == num_rows and np.array_equal(step_rows, np.arange(num_rows))
        step_batch = round_rows if in_order else run.take_fn(round_rows, step_rows)
        run.state, metrics = run.step_fn(run.state, step_batch)
        pending.append(metrics)
        position += 1
    run.prompts.prefetch()  # the next round's prompts are tokenized while the devices run the steps
    pending = jax.device_get(pending)  # one host sync per call, after every step was dispatched
    t_update = (time.perf_counter() - timer) / max(len(pending), 1)

    num_steps = len(buffer.step_rows)  # the round's sampling, scoring and log-prob time is shared by its steps
    times = {f"step_time/{k}": buffer.seconds[k] / num_steps for k in ("sample", "score", "logps")}
    for i, metrics in enumerate(pending):
        step = buffer.first_step + buffer.position + i
        writer.write({"step": step + 1, **buffer.metrics, **metrics, "learning_rate": float(run.schedule(step)),
                      "step_time": sum(times.values()) + t_update, **times, "step_time/update": t_update})
    return buffer._replace(position=position)


def run_round(run: Run, writer: MetricsWriter, round_index: int) -> RoundBuffer:
    """One generation round: sample and score, advantages, old/ref log-probs, then its optimizer steps."""
    return run_steps(run, writer, prepare_round(run, round_index), until=run.config.max_steps)


def _meta(run: Run, round_index: int, buffer: RoundBuffer | None, history: list, eval_before: dict) -> dict:
    """The JSON part of a checkpoint: everything but the state and the round's arrays."""
    scalars = None if buffer is None else {k: getattr(buffer, k) for k in RoundBuffer._fields
                                           if k not in RoundBuffer.ARRAYS}
    # a copy: the save writes in the background while the loop appends to the history
    return {"round_index": round_index, "data": run.prompts.state(), "buffer": scalars, "history": list(history),
            "eval_before": eval_before, "config": to_dict(run.config), "model_config": to_dict(run.config.model),
            "tokenizer_path": str(run.tokenizer_path)}


def _buffer_arrays(buffer: RoundBuffer | None) -> dict:
    if buffer is None:
        return {}
    return {k: getattr(buffer, k) for k in RoundBuffer.ARRAYS if getattr(buffer, k) is not None}


def _restore(run: Run, mngr) -> tuple[RoundBuffer | None, int, list, dict | None]:
    """Continues a run from its newest valid checkpoint: (buffer, round index, metrics history, eval before)."""
    restored = checkpoint.restore_latest(mngr, run.state, keep_ref=run.keep_ref)
    if restored is None:
        print(f"grpo_jax: {run.output_dir} has no checkpoint yet: starting from step 0")
        return None, 0, [], None
    step, run.state, meta, arrays = restored
    run.prompts.restore(meta["data"])
    buffer = None
    if meta["buffer"] is not None:
        buffer = RoundBuffer(**meta["buffer"], **{k: arrays.get(k) for k in RoundBuffer.ARRAYS})
    where = "" if buffer is None else f", inside round {buffer.round_index} ({buffer.position} of its " \
        f"{len(buffer.step_rows)} steps done)"
    print(f"grpo_jax: resuming from checkpoint {mngr.directory / str(step)} at step {step}{where}")
    return buffer, meta["round_index"], meta["history"], meta["eval_before"]


def train(config: Config, *, show_progress: bool = True, loss_fn: Callable | None = None) -> dict:
    """Runs GRPO as configured and returns a summary (eval before/after, skipped steps, output_dir).

    Continues the run in `output_dir` from its newest checkpoint when there is one (`resume`). Saves every
    `save_steps` steps and at the end, then exports the policy to `output_dir/final/`. On SIGTERM/SIGINT it
    finishes the step, saves, and raises `checkpoint.Preempted`. `loss_fn`: a custom loss with
    `compute_loss`'s signature, used instead of it (see `build`).
    """
    run = build(config, loss_fn=loss_fn)
    main = jax.process_index() == 0
    print(f"grpo_jax: output_dir={run.output_dir}  devices={len(run.mesh.devices.flat)} "
          f"({jax.devices()[0].platform})  mesh={dict(run.mesh.shape)}")
    mngr = checkpoint.manager(run.output_dir, save_total_limit=config.save_total_limit)
    buffer, round_index, history, before = _restore(run, mngr) if run.resuming else (None, 0, [], None)
    saved_step = int(run.state.step) if history else -1
    if before is None:
        before = evaluate(run, run.state.params)
    if before:
        print("held-out greedy before training: " + "  ".join(f"{k}={v:.3f}" for k, v in before.items()))
    writer = MetricsWriter(run.output_dir, max_steps=config.max_steps, initial_step=int(run.state.step),
                           logging_steps=config.logging_steps, show_progress=show_progress, history=history,
                           write_file=main)

    def save(wait: bool) -> None:
        checkpoint.save(mngr, run.state, keep_ref=run.keep_ref, wait=wait, arrays=_buffer_arrays(buffer),
                        meta=_meta(run, round_index, buffer, writer.history, before))

    skipped, step = 0, int(run.state.step)
    try:
        with checkpoint.PreemptionGuard() as guard:
            while step < config.max_steps and not guard.requested:
                if buffer is None:
                    buffer = prepare_round(run, round_index)
                until = config.max_steps
                if config.save_steps:
                    until = min(until, (step // config.save_steps + 1) * config.save_steps)
                buffer = run_steps(run, writer, buffer, until=until, stop=lambda: guard.requested)
                step = buffer.first_step + buffer.position
                if buffer.position == len(buffer.step_rows):
                    buffer, round_index = None, round_index + 1
                skipped = sum(int(h.get("skipped") or 0) for h in writer.history)
                if skipped > config.train.max_nonfinite_steps:
                    raise RuntimeError(
                        f"{skipped} optimizer steps had a non-finite loss or gradient (train.max_nonfinite_steps="
                        f"{config.train.max_nonfinite_steps}); their updates were skipped. Lower "
                        "train.learning_rate, check the reward functions, or raise train.max_nonfinite_steps.")
                if config.save_steps and step % config.save_steps == 0 and step < config.max_steps \
                        and not guard.requested:
                    save(wait=False)
                    saved_step = step
            if step != saved_step:
                save(wait=True)
            if guard.requested:
                raise checkpoint.Preempted(guard.signum, step, mngr.directory / str(step))
    finally:
        mngr.wait_until_finished()
        mngr.close()
        writer.close()
        if writer.history and main:
            plot_rewards(writer.history, run.output_dir / "reward.png")
    after = evaluate(run, run.state.params)
    if after:
        print("held-out greedy after training:  " + "  ".join(f"{k}={v:.3f}" for k, v in after.items()))
    summary = {"output_dir": str(run.output_dir), "steps": int(run.state.step), "skipped_steps": skipped,
               "eval_before": before, "eval_after": after, **_reward_summary(writer.history)}
    final = run.output_dir / "final"
    if main:
        (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        shutil.rmtree(final, ignore_errors=True)
    fmt = checkpoint.export_policy(run.graphdef, run.config.model, run.state.params, final, tokenizer=run.tokenizer)
    if main:
        print(f"reward first 10% of steps={summary['reward_first_10pct']:.3f}  "
              f"last 10%={summary['reward_last_10pct']:.3f}  plot: {run.output_dir / 'reward.png'}  "
              f"policy ({'Hugging Face' if fmt == 'hf' else 'native'} format): {final}")
    return summary


def _reward_summary(history: list[dict]) -> dict:
    rewards_ = np.array([np.nan if h.get("reward") is None else h["reward"] for h in history], dtype=float)
    k = max(1, len(rewards_) // 10)
    return {"reward_first_10pct": float(np.nanmean(rewards_[:k])), "reward_last_10pct": float(np.nanmean(rewards_[-k:]))}
