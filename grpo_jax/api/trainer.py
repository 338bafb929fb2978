"""The training loop: `train(config)` builds the run (`grpo_jax.api.run.build`), restores its newest checkpoint, repeats
rounds (`grpo_jax.rollout.round`: `prepare_round`, then `run_steps`) with periodic saves, evaluation and metrics, and
exports the policy; every exception after the first step saves the last good state first (`grpo_jax.io.preemption`).
All of a run's I/O is here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.experimental import multihost_utils
import numpy as np

from grpo_jax.algo.state import TrainState
from grpo_jax.api.arguments import check_arguments
from grpo_jax.api.run import build
from grpo_jax.config import Config, to_dict
from grpo_jax.data import prompts as data, sources
from grpo_jax.device import sharding
from grpo_jax.io import checkpoint, export, preemption, supervisor
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


class Place(NamedTuple):
    """Where the loop stands: what a checkpoint saves (the train state, the data position, the round it is inside,
    None between rounds, and the next round's index) and the decode slots of the next rounds, which it does not."""

    state: TrainState
    data_state: data.DataState
    round_batch: RoundBatch | None
    round_index: int
    step: int  # optimizer steps done: the state's, known without a device sync
    plan: stream.SlotPlan = stream.SlotPlan()  # a speed choice: the tokens do not depend on it
    tokens_seen: int = 0  # the rounds' prompt and completion tokens so far (TRL's num_tokens, in the history)


def _meta(run: Run, place: Place, history: list, eval_before: dict) -> dict:
    """The JSON part of a checkpoint: everything but the train state and the round's arrays (the data position
    is three ints)."""
    rb = place.round_batch
    scalars = None if rb is None else {k: getattr(rb, k) for k in _SCALARS}
    # a copy: the save writes in the background while the loop appends to the history
    return {"round_index": place.round_index, "data": place.data_state._asdict(), "buffer": scalars,
            "history": list(history), "eval_before": eval_before, "config": to_dict(run.config),
            "model_config": to_dict(run.config.model), "tokenizer_path": str(run.tokenizer_path),
            "data_fingerprint": run.dataset.fingerprint,
            "code_fingerprint": code_fingerprints.fingerprint(run.reward_fns, run.tooling)}


def _arrays(place: Place, sampler) -> dict:
    """A checkpoint's host arrays: the round's rows by field name, `token_counts` and `step_rows`, and the
    params versions the asynchronous sampler still needs."""
    rb = place.round_batch
    versions = {} if sampler is None else sampler.saved_versions(place.step)
    if rb is None:
        return versions
    rows = {k: v for k, v in rb.rows._asdict().items() if v is not None}
    return {**rows, "token_counts": rb.token_counts, "step_rows": rb.step_rows, **versions}


def _restore(run: Run, state: TrainState, mngr) -> tuple[Place, list, dict | None, dict]:
    """Where the run continues: the place of its newest valid checkpoint (`checkpoint.resume`, which reads older
    layouts), its metrics history, eval before and host arrays; step 0's when it has none."""
    start = Place(state, data.DataState(epoch=0, index=0, seed=run.config.seed), None, 0, int(state.step))
    if not run.resuming:
        return start, [], None, {}
    cfg = run.config
    resumed = checkpoint.resume(mngr, state, keep_ref=run.keep_ref, seed=cfg.seed, fingerprints={
        "data_fingerprint": lambda saved, step: sources.check_fingerprint(
            saved, run.dataset.fingerprint, step=step, allow_changed=cfg.data.allow_changed),
        "code_fingerprint": lambda saved, step: code_fingerprints.check(
            saved, code_fingerprints.fingerprint(run.reward_fns, run.tooling), step=step,
            allow_changed=cfg.reward.allow_changed)})
    if resumed is None:
        print(f"grpo_jax: {run.output_dir} has no checkpoint yet: starting from step 0")
        return start, [], None, {}
    round_batch = None
    if resumed.buffer is not None:
        round_batch = RoundBatch(rows=sharding.shard_global_rows(resumed.rows, run.mesh),
                                 token_counts=resumed.token_counts, step_rows=resumed.arrays["step_rows"],
                                 **resumed.buffer)
    where = "" if round_batch is None else f", inside round {round_batch.round_index} ({round_batch.position} " \
        f"of its {len(round_batch.step_rows)} steps done)"
    print(f"grpo_jax: resuming from checkpoint {mngr.directory / str(resumed.step)} at step {resumed.step}{where}")
    # TRL's num_tokens so far: the round resumed inside counts itself already (it may have run no step yet), else
    # the newest step line counts every round up to its own
    seen = next((line["num_tokens"] for line in reversed(resumed.history) if "num_tokens" in line), 0)
    if round_batch is not None:
        seen = round_batch.metrics.get("num_tokens", seen)
    place = Place(resumed.state, data.DataState(**resumed.data), round_batch, resumed.round_index, resumed.step,
                  tokens_seen=seen)
    return place, resumed.history, resumed.eval_before, resumed.arrays


def train(config: Config, *, show_progress: bool = True, loss_fn: Callable | None = None, train_dataset=None,
          eval_dataset=None, reward_funcs: list | None = None, tools: list | None = None,
          environment_factory=None, eval_reward_funcs: list | None = None, reward_processing_classes=None,
          restart: bool = False, rollout_func=None) -> dict:
    """Runs GRPO as configured and returns a summary (eval before/after, skipped steps, output_dir).

    Continues the run in `output_dir` from its newest checkpoint when there is one (`resume`), unless `restart`
    (TRL's `train()`) sets that run aside and starts again (`runs.open_folder`). Saves every
    `save_steps` steps and at the end, then exports the policy to `output_dir/final/`. On SIGTERM/SIGINT it
    finishes the step, saves, and raises `preemption.Preempted`; any other exception during training saves the
    last good state first and raises `preemption.RunFailed` saying what failed (`preemption.failed`); a
    KeyboardInterrupt raised by Python code (a reward function, a tool, a tracker) saves alike and raises
    `preemption.Interrupted`, still a KeyboardInterrupt. `loss_fn`: a custom loss with `compute_loss`'s signature,
    used instead of it; `train_dataset`, `eval_dataset`,
    `reward_funcs` (callables, paths, reward model folders or transformers objects), `reward_processing_classes`,
    `tools` and `environment_factory` as TRL's GRPOTrainer takes them, `rollout_func` ((prompts, trainer_state) -> TRL's dict:
    `grpo_jax.rollout.rollout_func`), and `eval_reward_funcs` (default: the
    training ones) for the held-out evaluation (see `build`). The run holds `output_dir`'s lock (one writer per run)
    until it returns.
    """
    check_arguments(config, loss_fn=loss_fn, reward_funcs=reward_funcs, train_dataset=train_dataset,
                    eval_dataset=eval_dataset, tools=tools, environment_factory=environment_factory,
                    eval_reward_funcs=eval_reward_funcs)
    run, state, held = build(config, loss_fn=loss_fn, train_dataset=train_dataset, eval_dataset=eval_dataset,
                             reward_funcs=reward_funcs, tools=tools, environment_factory=environment_factory,
                             eval_reward_funcs=eval_reward_funcs, reward_processing_classes=reward_processing_classes,
                             restart=restart, rollout_func=rollout_func)
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
    named = config.output_dir is not None  # else a rerun needs output_dir= added (`preemption.again`)
    preemption.Console.log_to(run.output_dir)
    supervisor.report("output_dir", run.output_dir)
    print(f"grpo_jax: output_dir={run.output_dir}  devices={len(run.mesh.devices.flat)} "
          f"({jax.devices()[0].platform})  mesh={dict(run.mesh.shape)}  decoding in {run.decode_layout}")
    mngr = checkpoint.manager(run.output_dir, save_total_limit=config.save_total_limit)
    place, history, before, arrays = _restore(run, state, mngr)
    first_step = place.step
    compile_seconds = _compile_ahead(run, place.state)
    warned: set = set()  # the keys of the warnings given once a run, not every round (`prepare_round`)
    sampler = None  # asynchronous rounds: sampled ahead by a thread (`grpo_jax.rollout.async_rounds`)
    if async_rounds.enabled(config):
        sampler = async_rounds.Sampler(run, place.state, next_round=place.round_index + (place.round_batch is not None),
                                       data_state=place.data_state, arrays=arrays, warned=warned, toolbox=toolbox)
    saved_step = place.step if history else -1
    writer = _writer(run, place.step, history, show_progress and not config.disable_tqdm, main)
    if before is None:
        before = _evaluate(run, writer, place, toolbox)

    def save(wait: bool) -> None:
        checkpoint.save(mngr, place.state, keep_ref=run.keep_ref, wait=wait, arrays=_arrays(place, sampler),
                        meta=_meta(run, place, writer.history, before))

    skipped, after, failure = 0, {}, None
    try:
        with preemption.PreemptionGuard(multihost=jax.process_count() > 1) as guard:
            while place.step < config.max_steps and not guard.requested:
                place = _next_round(run, place, sampler, warned, toolbox)
                place, lines, completions = _steps(run, place, sampler, stop=guard.stop,
                                                   max_skipped=config.train.max_nonfinite_steps - skipped)
                writer.write_steps(lines, completions=completions)
                supervisor.report("step", place.step)
                skipped = _skipped(writer.history, config.train.max_nonfinite_steps,
                                   config.train.stop_on_zero_gradient)
                if _due(config.eval.steps, place.step, config.max_steps) and not guard.requested:
                    _evaluate(run, writer, place, toolbox)
                if _due(config.save_steps, place.step, config.max_steps) and not guard.requested:
                    save(wait=False)
                    saved_step = place.step
            if not guard.requested:
                after = _evaluate_after(run, writer, place, toolbox)
            if place.step != saved_step:
                save(wait=True)
            if guard.requested:
                raise preemption.Preempted(guard.signum, place.step, mngr.directory / str(place.step),
                                           preemption.again(run.output_dir, named), processes=jax.process_count())
    except preemption.Preempted:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:  # a library's sys.exit, or Python's interrupt
        failure = error
        raise _stopped(error, run, place, sampler, writer, saved_step, save, named) from error
    finally:
        _close(run, mngr, writer, sampler, failure, main)
    counts = {"steps_trained": place.step - first_step, "train_batch_size": config.train.train_batch_size,
              "skipped_steps": skipped,
              "compile_seconds": round(compile_seconds, 2)}
    return _finish(run, place.state, writer, before, after, counts, main)


def _compile_ahead(run: Run, state: TrainState) -> float:
    """Every program of the rounds compiled before the first step, not inside one (`shapes.compile_ahead`): the
    seconds it took. The startup line names the slowest three (lowering + compile; a cache load is fast)."""
    if run.shapes is None:
        return 0.0
    workers = shapes.compile_workers(run.config.compile_threads)
    count, seconds, peaks, programs = shapes.compile_ahead(run, state, run.shapes, workers=workers)
    slowest = sorted(programs, key=lambda p: p[1] + p[2], reverse=True)[:3]
    print(f"grpo_jax: compiled {count} programs in {seconds:.1f}s before the first step on {workers} thread(s) "
          f"(slowest: {', '.join(f'{name} {lower_s + compile_s:.1f}s' for name, lower_s, compile_s in slowest)}); "
          + "; ".join(run.shapes.describe())
          + f"; peak per device: {shapes.describe_peaks(peaks, jax.local_devices()[0])}")
    return seconds


def _writer(run: Run, step: int, history: list, show_progress: bool, main: bool) -> MetricsWriter:
    config = run.config
    return MetricsWriter(run.output_dir, max_steps=config.max_steps, initial_step=step,
                         logging_steps=config.logging_steps, show_progress=show_progress, history=history,
                         write_file=main, report_to=config.report_to,
                         num_completions_to_print=config.num_completions_to_print, run_config=to_dict(config))


def _next_round(run: Run, place: Place, sampler, warned: set, toolbox) -> Place:
    """The place with the round whose steps come next: the one it is inside, else the sampler's round or a new one
    (`prepare_round`), the data position moved past its prompts."""
    if sampler is not None:  # rounds whose params version is this step's go to the sampler now
        sampler.feed(place.state, place.step)
    if place.round_batch is not None:
        return place
    if sampler is not None:
        round_batch, data_state = sampler.take(place.state, place.round_index)
    else:
        round_batch, data_state = prepare_round(run, place.state, place.data_state, place.round_index,
                                                slots=place.plan.slots, warned=warned, toolbox=toolbox)
    seen = place.tokens_seen + int(round_batch.token_counts.sum())  # its rows' prompt and completion tokens
    round_batch = round_batch._replace(metrics={**round_batch.metrics, "num_tokens": seen})
    place = place._replace(round_batch=round_batch, data_state=data_state, tokens_seen=seen)
    return place if sampler is not None else place._replace(plan=_plan(run, place.plan, round_batch))


def _steps(run: Run, place: Place, sampler, *, stop: Callable[[int], bool], max_skipped: int
           ) -> tuple[Place, list[dict], list | None]:
    """The round's next optimizer steps (`run_steps`) up to the next save, evaluation, sampler feed or max_steps:
    the place after them (between rounds once the round's last step is done), their metrics lines and the round's
    completions table."""
    config = run.config
    until = config.max_steps
    if sampler is not None and sampler.next_feed(place.step) is not None:  # its params, before the update
        until = min(until, sampler.next_feed(place.step))
    for every in (config.save_steps, config.eval.steps):
        if every:
            until = min(until, (place.step // every + 1) * every)
    state, round_batch, lines = run_steps(run, place.state, place.round_batch, until=until, stop=stop,
                                          max_skipped=max_skipped)
    if sampler is not None:
        lines = [{**line, **async_rounds.step_metrics(config.train, line["step"]),
                  "step_time/sample_wait": round_batch.seconds["sample_wait"] / len(round_batch.step_rows)}
                 for line in lines]
    place = place._replace(state=state, round_batch=round_batch, step=round_batch.first_step + round_batch.position)
    if round_batch.position == len(round_batch.step_rows):
        place = place._replace(round_batch=None, round_index=place.round_index + 1)
    return place, lines, round_batch.completions


def _due(every: int | None, step: int, max_steps: int) -> bool:
    """Whether a periodic save or evaluation falls after this step (the last step's come after the loop)."""
    return bool(every) and step % every == 0 and step < max_steps


def _skipped(history: list[dict], max_nonfinite_steps: int, zero_gradient: bool = True) -> int:
    """The run's skipped (non-finite) steps so far; a RuntimeError when they stalled it (`preemption.stalled`)."""
    stalled = preemption.stalled([h for h in history if not is_eval(h)], max_nonfinite_steps, zero_gradient)
    if stalled:
        raise RuntimeError(stalled)
    return sum(int(h.get("skipped") or 0) for h in history)


def _evaluate(run: Run, writer: MetricsWriter, place: Place, toolbox) -> dict:
    """The held-out metrics of the place's params (`evaluate`), logged."""
    metrics = evaluate(run, place.state.params, place.step, toolbox=toolbox,
                       reference_params=place.state.reference_params)
    writer.write_eval(place.step, metrics)
    return metrics


def _evaluate_after(run: Run, writer: MetricsWriter, place: Place, toolbox) -> dict:
    """The evaluation after training, logged; one logged at this step already (a resumed run that had ended)
    is reused."""
    last = writer.history[-1] if writer.history else {}
    if is_eval(last) and last["step"] == place.step:
        return {k: v for k, v in last.items() if k != "step"}
    return _evaluate(run, writer, place, toolbox)


def _stopped(error: BaseException, run: Run, place: Place, sampler, writer: MetricsWriter, saved_step: int,
             save: Callable[[bool], None], named: bool) -> BaseException:
    """What a failed loop raises (`preemption.failed`), after saving the last good state when no checkpoint has
    its steps; an interrupt raised by Python code, not a signal, is still an interrupt."""
    stopped = preemption.failed(error, run.output_dir, checkpoint.nbytes(place.state, run.keep_ref,
                                                                         _arrays(place, sampler)),
                                state=place.state, steps=sum(not is_eval(h) for h in writer.history),
                                saved_step=saved_step, save=save, named=named)
    return preemption.Interrupted(str(stopped)) if isinstance(error, KeyboardInterrupt) else stopped


def _close(run: Run, mngr, writer: MetricsWriter, sampler, failure: BaseException | None, main: bool) -> None:
    """However the loop ended: the sampler stopped, the saves finished, the metrics closed and plotted."""
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


def _finish(run: Run, state: TrainState, writer: MetricsWriter, before: dict, after: dict, counts: dict,
            main: bool) -> dict:
    """summary.json and the policy exported to `output_dir/final/`; returns the summary (``counts``: the steps
    this call trained, the skipped steps, the compile seconds, by name)."""
    summary = {"output_dir": str(run.output_dir), "steps": int(state.step), **counts,
               "eval_before": short_names(before), "eval_after": short_names(after),
               **_reward_summary(writer.history)}
    final = run.output_dir / "final"
    if main:
        (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    fmt = export.export_policy(run.graphdef, run.config.model, state.params, final, tokenizer=run.tokenizer,
                               overwrite=True)  # the run's own final/ of an earlier end, replaced whole
    if jax.process_count() > 1:  # the others wait here, not in the shutdown barrier, while process 0 writes it
        multihost_utils.sync_global_devices("grpo_jax: the policy exported")
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


def _reward_summary(history: list[dict]) -> dict:
    history = [h for h in history if not is_eval(h)]
    rewards_ = np.array([np.nan if h.get("reward") is None else h["reward"] for h in history], dtype=float)
    k = max(1, len(rewards_) // 10)
    return {"reward_first_10pct": float(scored(np.nanmean, rewards_[:k])),
            "reward_last_10pct": float(scored(np.nanmean, rewards_[-k:]))}
