"""The training loop: `train(config)` builds the run (`grpo_jax.api.run.build`), restores its newest checkpoint, repeats
rounds (`grpo_jax.rollout.round`: `prepare_round`, then `run_steps`) with periodic saves, evaluation and metrics, and
exports the policy; every exception after the first step saves the last good state first (`grpo_jax.io.preemption`).
All of a run's I/O is here.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable

import jax
import numpy as np

from grpo_jax.algo.state import TrainState
from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.api.arguments import check_arguments
from grpo_jax.api.run import build
from grpo_jax.config import Config, to_dict
from grpo_jax.data import prompts as data, sources
from grpo_jax.device import sharding
from grpo_jax.io import checkpoint, export, preemption
from grpo_jax.io.reporting import MetricsWriter, is_eval, plot_run
from grpo_jax.rewards import code_fingerprints
from grpo_jax.rewards.functions import scored
from grpo_jax.rollout import async_rounds, shapes, stream
from grpo_jax.rollout.context import Run
from grpo_jax.rollout.evaluation import evaluate, short_names
from grpo_jax.rollout.round import RoundBatch, prepare_round, run_round, run_steps
from grpo_jax.tools.calls import open_toolbox

__all__ = ["RoundBatch", "build", "prepare_round", "run_round", "run_steps", "train"]

_SCALARS = ("round_index", "first_step", "position", "metrics", "seconds", "completions")  # its JSON part


def _meta(run: Run, data_state: data.DataState, round_index: int, round_batch: RoundBatch | None, history: list,
          eval_before: dict) -> dict:
    """The JSON part of a checkpoint: everything but the train state and the round's arrays (the data position
    is three ints)."""
    scalars = None if round_batch is None else {k: getattr(round_batch, k) for k in _SCALARS}
    # a copy: the save writes in the background while the loop appends to the history
    return {"round_index": round_index, "data": data_state._asdict(), "buffer": scalars, "history": list(history),
            "eval_before": eval_before, "config": to_dict(run.config), "model_config": to_dict(run.config.model),
            "tokenizer_path": str(run.tokenizer_path), "data_fingerprint": run.dataset.fingerprint,
            "code_fingerprint": code_fingerprints.fingerprint(run.reward_fns, run.tooling)}


def _arrays(round_batch: RoundBatch | None) -> dict:
    """A RoundBatch's arrays as a checkpoint saves them: its rows by field name, `token_counts` and `step_rows`."""
    if round_batch is None:
        return {}
    rows = {k: v for k, v in round_batch.rows._asdict().items() if v is not None}
    return {**rows, "token_counts": round_batch.token_counts, "step_rows": round_batch.step_rows}


def saved_rows(arrays: dict) -> tuple[Trajectory, np.ndarray]:
    """A checkpoint's round rows (host arrays by field name) and their [N, 2] real prompt / completion tokens. A
    round saved before trajectories (no ``loss_mask``) trained and attended its ``completion_mask`` alike: it
    becomes both masks, one turn a row."""
    if "loss_mask" not in arrays:
        mask = arrays["completion_mask"]
        arrays = {"sampler_per_token_logps": np.zeros(mask.shape, np.float32), **arrays, "loss_mask": mask,
                  "turns": np.where(mask == 1, 0, -1).astype(np.int32), "is_truncated": np.zeros(len(mask), bool)}
    counts = arrays.get("token_counts")
    if counts is None:
        counts = np.stack([np.sum(arrays["prompt_mask"], 1), np.sum(arrays["completion_mask"], 1)], 1).astype(np.int32)
    return Trajectory(**{k: arrays.get(k) for k in Trajectory._fields}), counts


def _restore(run: Run, state: TrainState, data_state: data.DataState, mngr):
    """Continues a run from its newest valid checkpoint: (state, data position, round batch, round index, history,
    eval before, its host arrays)."""
    restored = checkpoint.restore_latest(mngr, state, keep_ref=run.keep_ref)
    if restored is None:
        print(f"grpo_jax: {run.output_dir} has no checkpoint yet: starting from step 0")
        return state, data_state, None, 0, [], None, {}
    step, state, meta, arrays = restored
    changed = sources.check_fingerprint(meta.get("data_fingerprint"), run.dataset.fingerprint, step=step,
                                        allow_changed=run.config.data.allow_changed)  # older checkpoints: none
    if changed:
        warnings.warn(changed, RuntimeWarning, stacklevel=2)
    changed = code_fingerprints.check(meta.get("code_fingerprint"), code_fingerprints.fingerprint(
        run.reward_fns, run.tooling), step=step, allow_changed=run.config.reward.allow_changed)
    if changed:
        warnings.warn(changed, RuntimeWarning, stacklevel=2)
    data_state = data.DataState(**{"seed": run.config.seed, **meta["data"]})  # older runs saved no seed
    round_batch = None
    if meta["buffer"] is not None:
        rows, counts = saved_rows(arrays)
        round_batch = RoundBatch(rows=sharding.shard_global_rows(rows, run.mesh), token_counts=counts,
                                 step_rows=arrays["step_rows"], **meta["buffer"])
    where = "" if round_batch is None else f", inside round {round_batch.round_index} ({round_batch.position} " \
        f"of its {len(round_batch.step_rows)} steps done)"
    print(f"grpo_jax: resuming from checkpoint {mngr.directory / str(step)} at step {step}{where}")
    return state, data_state, round_batch, meta["round_index"], meta["history"], meta["eval_before"], arrays


def train(config: Config, *, show_progress: bool = True, loss_fn: Callable | None = None, train_dataset=None,
          eval_dataset=None, reward_funcs: list | None = None, tools: list | None = None,
          environment_factory=None, eval_reward_funcs: list | None = None, reward_processing_classes=None) -> dict:
    """Runs GRPO as configured and returns a summary (eval before/after, skipped steps, output_dir).

    Continues the run in `output_dir` from its newest checkpoint when there is one (`resume`). Saves every
    `save_steps` steps and at the end, then exports the policy to `output_dir/final/`. On SIGTERM/SIGINT it
    finishes the step, saves, and raises `preemption.Preempted`; any other exception during training saves the
    last good state first and raises `preemption.RunFailed` saying what failed (`preemption.failed`); a
    KeyboardInterrupt raised by Python code (a reward function, a tool, a tracker) saves alike and raises
    `preemption.Interrupted`, still a KeyboardInterrupt. `loss_fn`: a custom loss with `compute_loss`'s signature,
    used instead of it; `train_dataset`, `eval_dataset`,
    `reward_funcs` (callables, paths, reward model folders or transformers objects), `reward_processing_classes`,
    `tools` and `environment_factory` as TRL's GRPOTrainer takes them, and `eval_reward_funcs` (default: the
    training ones) for the held-out evaluation (see `build`). The run holds `output_dir`'s lock (one writer per run)
    until it returns.
    """
    check_arguments(config, loss_fn=loss_fn, reward_funcs=reward_funcs, train_dataset=train_dataset,
                    eval_dataset=eval_dataset, tools=tools, environment_factory=environment_factory,
                    eval_reward_funcs=eval_reward_funcs)
    run, state, held = build(config, loss_fn=loss_fn, train_dataset=train_dataset, eval_dataset=eval_dataset,
                             reward_funcs=reward_funcs, tools=tools, environment_factory=environment_factory,
                             eval_reward_funcs=eval_reward_funcs, reward_processing_classes=reward_processing_classes)
    toolbox = None  # the thread pool of the tool calls: this loop's, closed below however the run ends
    try:
        toolbox = open_toolbox(run.tooling)
        return _train(run.config, run, state, show_progress, toolbox)  # its defaults resolved (learning rate)
    except (preemption.Preempted, preemption.RunFailed, preemption.Interrupted):
        raise
    except Exception as error:
        if preemption.storage_error(error) is None:
            raise
        # outside the loop (evaluation, summary, final export): a full or read-only disk gets the same one message
        raise preemption.failed(error, run.output_dir, checkpoint.nbytes(state, run.keep_ref),
                                named=run.config.output_dir is not None) from error
    finally:
        if toolbox is not None:
            toolbox.close()
        held.release()


def _train(config: Config, run: Run, state: TrainState, show_progress: bool, toolbox) -> dict:
    """`train` once `build` is done: restore, the round loop with its saves, evaluation and the final export."""
    main = jax.process_index() == 0
    named = run.config.output_dir is not None  # else a rerun needs output_dir= added (`preemption.again`)
    preemption.Console.log_to(run.output_dir)
    print(f"grpo_jax: output_dir={run.output_dir}  devices={len(run.mesh.devices.flat)} "
          f"({jax.devices()[0].platform})  mesh={dict(run.mesh.shape)}")
    mngr = checkpoint.manager(run.output_dir, save_total_limit=config.save_total_limit)
    data_state = data.DataState(epoch=0, index=0, seed=config.seed)
    plan = stream.SlotPlan()  # a speed choice: the tokens do not depend on it, so it is not saved
    warned: set = set()  # the keys of the warnings given once a run, not every round (`prepare_round`)
    round_batch, round_index, history, before, arrays = None, 0, [], None, {}
    if run.resuming:
        state, data_state, round_batch, round_index, history, before, arrays = _restore(run, state, data_state, mngr)
    compile_seconds = 0.0
    if run.shapes is not None:  # every program of the rounds compiled now, not inside a step
        count, compile_seconds, peaks = shapes.compile_ahead(run, state, run.shapes)
        print(f"grpo_jax: compiled {count} programs in {compile_seconds:.1f}s before the first step; "
              + "; ".join(run.shapes.describe())
              + f"; peak per device: {shapes.describe_peaks(peaks, jax.local_devices()[0])}")
    sampler = None  # asynchronous rounds: sampled ahead by a thread (`grpo_jax.rollout.async_rounds`)
    if async_rounds.enabled(config):
        sampler = async_rounds.Sampler(run, state, next_round=round_index + (round_batch is not None),
                                       data_state=data_state, arrays=arrays, warned=warned,
                                       toolbox=toolbox)
    saved_step = int(state.step) if history else -1
    writer = MetricsWriter(run.output_dir, max_steps=config.max_steps, initial_step=int(state.step),
                           logging_steps=config.logging_steps, show_progress=show_progress and not config.disable_tqdm,
                           history=history,
                           write_file=main, report_to=config.report_to,
                           num_completions_to_print=config.num_completions_to_print, run_config=to_dict(config))
    if before is None:
        before = evaluate(run, state.params, int(state.step), toolbox=toolbox)
        writer.write_eval(int(state.step), before)
    after = {}

    def saved_arrays() -> dict:
        return {**_arrays(round_batch), **(sampler.saved_versions(step) if sampler is not None else {})}

    def save(wait: bool) -> None:
        checkpoint.save(mngr, state, keep_ref=run.keep_ref, wait=wait, arrays=saved_arrays(),
                        meta=_meta(run, data_state, round_index, round_batch, writer.history, before))

    skipped, step = 0, int(state.step)
    failure = None  # what stopped the loop
    try:
        with preemption.PreemptionGuard() as guard:
            while step < config.max_steps and not guard.requested:
                if sampler is not None:  # rounds whose params version is this step's go to the sampler now
                    sampler.feed(state, step)
                if round_batch is None and sampler is not None:
                    round_batch, data_state = sampler.take(state, round_index)
                elif round_batch is None:  # the data position moves only once the round is prepared
                    round_batch, data_state = prepare_round(run, state, data_state, round_index, slots=plan.slots,
                                                             warned=warned, toolbox=toolbox)
                    plan = _plan(run, plan, round_batch)
                until = config.max_steps
                if sampler is not None and sampler.next_feed(step) is not None:  # its params, before the update
                    until = min(until, sampler.next_feed(step))
                if config.save_steps:
                    until = min(until, (step // config.save_steps + 1) * config.save_steps)
                if config.eval.steps:
                    until = min(until, (step // config.eval.steps + 1) * config.eval.steps)
                state, round_batch, lines = run_steps(run, state, round_batch, until=until,
                                                      stop=lambda: guard.requested,
                                                      max_skipped=config.train.max_nonfinite_steps - skipped)
                if sampler is not None:
                    lines = [{**line, **async_rounds.step_metrics(config.train, line["step"]),
                              "step_time/sample_wait": round_batch.seconds["sample_wait"] / len(round_batch.step_rows)}
                             for line in lines]
                writer.write_steps(lines, completions=round_batch.completions)
                step = round_batch.first_step + round_batch.position
                if round_batch.position == len(round_batch.step_rows):
                    round_batch, round_index = None, round_index + 1
                skipped = sum(int(h.get("skipped") or 0) for h in writer.history)
                stalled = preemption.stalled([h for h in writer.history if not is_eval(h)],
                                             config.train.max_nonfinite_steps)
                if stalled:
                    raise RuntimeError(stalled)
                if config.eval.steps and step % config.eval.steps == 0 and step < config.max_steps \
                        and not guard.requested:
                    writer.write_eval(step, evaluate(run, state.params, step, toolbox=toolbox))
                if config.save_steps and step % config.save_steps == 0 and step < config.max_steps \
                        and not guard.requested:
                    save(wait=False)
                    saved_step = step
            if not guard.requested:
                after = _evaluate_after(run, state, writer, step, toolbox)
            if step != saved_step:
                save(wait=True)
            if guard.requested:
                raise preemption.Preempted(guard.signum, step, mngr.directory / str(step),
                                           preemption.again(run.output_dir, named))
    except preemption.Preempted:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:  # a library's sys.exit, or Python's interrupt
        failure = error
        stopped = preemption.failed(error, run.output_dir, checkpoint.nbytes(state, run.keep_ref, saved_arrays()),
                                    state=state, steps=sum(not is_eval(h) for h in writer.history),
                                    saved_step=saved_step, save=save, named=named)
        if isinstance(error, KeyboardInterrupt):  # raised by Python code, not a signal: still an interrupt
            raise preemption.Interrupted(str(stopped)) from error
        raise stopped from error
    finally:
        if sampler is not None:
            sampler.close()
        try:
            mngr.wait_until_finished()
            mngr.close()
        except Exception:  # a save that failed with the error in flight: that error says it
            if failure is None:
                raise
        writer.close()
        if writer.history and main and (failure is None or preemption.storage_error(failure) is None):
            plot_run(writer.history, run.output_dir)
    summary = {"output_dir": str(run.output_dir), "steps": int(state.step), "skipped_steps": skipped,
               "compile_seconds": round(compile_seconds, 2),
               "eval_before": short_names(before), "eval_after": short_names(after),
               **_reward_summary(writer.history)}
    final = run.output_dir / "final"
    if main:
        (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    fmt = export.export_policy(run.graphdef, run.config.model, state.params, final, tokenizer=run.tokenizer,
                               overwrite=True)  # the run's own final/ of an earlier end, replaced whole
    if main:
        print(f"reward first 10% of steps={summary['reward_first_10pct']:.3f}  "
              f"last 10%={summary['reward_last_10pct']:.3f}  plot: {run.output_dir / 'reward.png'}  "
              f"policy ({export.FORMAT_NAMES[fmt]} format): {final}")
    return summary


def _plan(run: Run, plan: stream.SlotPlan, round_batch: RoundBatch) -> stream.SlotPlan:
    """The next round's decode slots (`stream.plan_slots`) when `sampling.max_batch_rows` is null."""
    tc = run.config.train
    if run.config.sampling.max_batch_rows is not None or tc.dynamic_sampling:  # set, or rows from several calls
        return plan
    if run.shapes is not None and len(run.shapes.decode_slots) == 1:  # one slot count compiled (the CPU switch's)
        return plan
    seconds = round_batch.seconds
    # from measured times: process 0's choice is every process's, as they run the same programs
    return sharding.from_first_process(lambda: stream.plan_slots(
        plan, round_batch.token_counts[:, 1], slots=seconds["decode_slots"], steps=seconds["decode_steps"],
        seconds=seconds["sample"], chunks=run.programs.decoder.chunks(tc.generation_batch_size, tc.num_generations)))


def _evaluate_after(run: Run, state: TrainState, writer: MetricsWriter, step: int, toolbox) -> dict:
    """The evaluation after training, logged; one logged at this step already (a resumed run that had ended)
    is reused."""
    last = writer.history[-1] if writer.history else {}
    if is_eval(last) and last["step"] == step:
        return {k: v for k, v in last.items() if k != "step"}
    metrics = evaluate(run, state.params, step, toolbox=toolbox)
    writer.write_eval(step, metrics)
    return metrics


def _reward_summary(history: list[dict]) -> dict:
    history = [h for h in history if not is_eval(h)]
    rewards_ = np.array([np.nan if h.get("reward") is None else h["reward"] for h in history], dtype=float)
    k = max(1, len(rewards_) // 10)
    return {"reward_first_10pct": float(scored(np.nanmean, rewards_[:k])),
            "reward_last_10pct": float(scored(np.nanmean, rewards_[-k:]))}
