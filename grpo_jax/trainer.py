"""The orchestrating loop: rounds of sample -> score -> advantages -> log-probs -> updates, with all I/O here.

Jitted maths lives in sampling, logprobs, advantages, losses and train_step; this module only moves data
between them, calls the Python reward functions, and writes the run directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import yaml
from transformers import AutoTokenizer

from grpo_jax import data, rewards, rounds, sharding, task
from grpo_jax.config import Config, to_dict
from grpo_jax.reporting import MetricsWriter, plot_rewards
from grpo_jax.sampling import SampleOutput, generate
from grpo_jax.state import init_state, learning_rate_schedule, make_optimizer
from grpo_jax.train_step import Batch, StepOptions, jit_logps, jit_train_step


@dataclasses.dataclass
class Run:
    """Everything `train` builds once before the loop: data, rewards, jitted functions, state."""

    config: Config
    output_dir: Path
    tokenizer: object
    prompts: data.PromptIterator
    eval_rows: list[dict]
    reward_fns: list
    eval_reward_fns: list
    mesh: object
    graphdef: object
    state: object
    schedule: object
    sample_fn: object
    logps_fn: object
    step_fn: object


def _output_dir(config: Config) -> Path:
    if config.output_dir is not None:
        path = Path(config.output_dir)
        if path.exists() and any(path.iterdir()):
            raise ValueError(f"output_dir={str(path)!r} is not empty: choose a new output_dir or delete it")
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = "jsonl" if config.data.path else config.data.task
        path = Path("runs") / f"{name}-{stamp}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_data(config: Config, output_dir: Path):
    """The tokenizer, training rows and held-out rows: from files, or the embedded task written to files."""
    if config.data.path is None:
        tokenizer_dir = output_dir / "tokenizer"
        if config.data.tokenizer_path is None:
            task.build_tokenizer(tokenizer_dir)
        else:
            tokenizer_dir = Path(config.data.tokenizer_path)
        d = config.data
        train_rows = task.make_examples(d.task, d.task_num_train, config.seed, d.task_min_len, d.task_max_len)
        eval_rows = task.make_examples(d.task, config.eval.num_examples, config.seed + 1_000_003,
                                       d.task_min_len, d.task_max_len)
        seen = {r["prompt"] for r in train_rows}
        eval_rows = [r for r in eval_rows if r["prompt"] not in seen] or eval_rows  # held out where possible
        (output_dir / "data").mkdir(exist_ok=True)
        task.write_jsonl(output_dir / "data" / "train.jsonl", train_rows)
        train_path, eval_path = output_dir / "data" / "train.jsonl", None
        if eval_rows:
            eval_path = output_dir / "data" / "eval.jsonl"
            task.write_jsonl(eval_path, eval_rows)
    else:
        tokenizer_dir, train_path = Path(config.data.tokenizer_path), Path(config.data.path)
        eval_path = Path(config.eval.path) if config.eval.path else None
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(f"tokenizer in {str(tokenizer_dir)!r} needs an eos_token and a pad_token")
    if config.model.vocab_size is not None and len(tokenizer) > config.model.vocab_size:
        raise ValueError(f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
                         f"{len(tokenizer)} tokens ({tokenizer_dir}): raise model.vocab_size or leave it unset")
    train_rows = data.load_jsonl(train_path)
    eval_rows = data.load_jsonl(eval_path)[: config.eval.num_examples] if eval_path else []
    return tokenizer, train_rows, eval_rows


def _resolve_rewards(config: Config, paths) -> list:
    """(path, callable) per reward function; the built-in soft overlong punishment gets its lengths bound."""
    out = []
    for path in paths:
        fn = rewards.resolve_reward_fn(path)
        if path == rewards.SOFT_OVERLONG:
            fn = functools.partial(fn, max_completion_len=config.sampling.max_completion_length,
                                   soft_punish_cache=config.reward.soft_punish_cache)
        out.append((path, fn))
    return out


def build(config: Config, *, loss_fn: Callable | None = None) -> Run:
    """Resolves data, rewards, mesh, optimizer and state; jits the three device programs.

    `loss_fn` replaces `grpo_jax.losses.compute_loss` in the train step (same signature; see
    `grpo_jax.train_step`): the hook for a custom loss variant. It is not part of `config.yaml`.
    """
    output_dir = _output_dir(config)
    (output_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    tokenizer, train_rows, eval_rows = _load_data(config, output_dir)
    if config.model.vocab_size is None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=len(tokenizer)))
    reward_fns = _resolve_rewards(config, config.reward.functions)
    eval_reward_fns = _resolve_rewards(config, config.eval.reward_functions)
    tc = config.train
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    sharding.check_rows(tc.train_batch_size // tc.gradient_accumulation_steps, mesh,
                        "train.train_batch_size / train.gradient_accumulation_steps")
    prompts = data.PromptIterator(train_rows, tokenizer, prompts_per_round=tc.prompts_per_round,
                                  max_prompt_length=config.data.max_prompt_length, seed=config.seed,
                                  truncation=config.data.truncation)
    schedule = learning_rate_schedule(learning_rate=tc.learning_rate, scheduler=tc.lr_scheduler_type,
                                      warmup_steps=tc.warmup_steps, max_steps=config.max_steps)
    optimizer = make_optimizer(schedule, weight_decay=tc.weight_decay, b1=tc.adam_beta1, b2=tc.adam_beta2,
                               eps=tc.adam_epsilon, max_grad_norm=tc.max_grad_norm)
    graphdef, state = init_state(config.model, optimizer, seed=config.seed,
                                 with_reference=config.loss.beta != 0.0, mesh=mesh)
    loss_config = dataclasses.replace(config.loss, max_completion_length=config.sampling.max_completion_length)
    options = StepOptions(loss=loss_config, temperature=config.sampling.temperature,
                          gradient_accumulation_steps=tc.gradient_accumulation_steps,
                          logps_chunk_size=tc.logps_chunk_size, ref_sync=tc.ref_sync, loss_fn=loss_fn)
    rows, replicated = sharding.row_sharded(mesh), sharding.replicated(mesh)
    sample_fn = jax.jit(
        lambda params, ids, mask, key, greedy: generate(
            graphdef, params, ids, mask, key, config=config.sampling, eos_token_ids=(tokenizer.eos_token_id,),
            pad_token_id=tokenizer.pad_token_id, greedy=greedy),
        static_argnums=4, in_shardings=(replicated, rows, rows, replicated),
        out_shardings=SampleOutput(rows, rows, rows, rows, num_decode_steps=replicated))
    return Run(config=config, output_dir=output_dir, tokenizer=tokenizer, prompts=prompts, eval_rows=eval_rows,
               reward_fns=reward_fns, eval_reward_fns=eval_reward_fns, mesh=mesh, graphdef=graphdef, state=state,
               schedule=schedule, sample_fn=sample_fn,
               logps_fn=jit_logps(graphdef, mesh, temperature=config.sampling.temperature,
                                  chunk_size=tc.logps_chunk_size),
               step_fn=jit_train_step(graphdef, optimizer, options, mesh))


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
    out = jax.device_get(run.sample_fn(params, ids, mask, jax.random.PRNGKey(0), True))
    completions = decode(run.tokenizer, out.completion_ids, out.completion_mask)[:n]
    columns = {k: [r.get(k) for r in run.eval_rows] for k in run.eval_rows[0] if k != "prompt"}
    lengths = out.completion_mask.sum(axis=1)[:n]
    columns["completion_ids"] = [ids[:m].tolist() for ids, m in zip(out.completion_ids, lengths)]
    scores = rewards.score_completions(run.eval_reward_fns, [r["prompt"] for r in run.eval_rows], completions,
                                       columns)
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


def sample_and_score(run: Run, draw_index: int, seconds: dict) -> rounds.Draw:
    """One sampling pass of P prompts x G completions with the current policy, scored on the host.

    Adds its sampling and scoring time to seconds["sample"] / seconds["score"].
    """
    cfg, tc = run.config, run.config.train
    timer = time.perf_counter()
    batch = data.repeat_groups(run.prompts.next_batch(), tc.num_generations)
    sample_key = jax.random.fold_in(run.state.key, run.state.step)
    if draw_index:  # dynamic sampling's extra passes
        sample_key = jax.random.fold_in(sample_key, draw_index)
    out = jax.device_get(run.sample_fn(run.state.params, batch.prompt_ids, batch.prompt_mask, sample_key, False))
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
            run.reward_fns, _weights(cfg), batch.prompts, completions, columns, lengths)
    else:
        rewards_NxF = rewards.score_completions(run.reward_fns, batch.prompts, completions, columns)
    seconds["score"] = seconds.get("score", 0.0) + time.perf_counter() - timer
    return rounds.Draw(batch.prompt_ids, batch.prompt_mask, out.completion_ids, out.completion_mask,
                       np.asarray(out.is_truncated), out.sampler_logps, rewards_NxF, batch.prompts, batch.columns,
                       batch.num_truncated, **steps)


def collect_round(run: Run, seconds: dict) -> tuple[rounds.Draw, dict]:
    """The round's rows: one pass, or DAPO dynamic sampling's passes until informative groups fill it."""
    tc = run.config.train
    if not tc.dynamic_sampling:
        return sample_and_score(run, 0, seconds), {}
    state = rounds.init()
    while not (rounds.is_full(state, tc.prompts_per_round) or len(state.draws) >= tc.max_num_gen_batches):
        draw = sample_and_score(run, len(state.draws), seconds)
        state = rounds.update(state, draw, rounds.zero_std_groups(draw, _weights(run.config), tc.num_generations))
    return rounds.finalize(state, tc.prompts_per_round, tc.num_generations)


def run_round(run: Run, writer: MetricsWriter, round_index: int) -> None:
    """One generation round: sample and score, advantages, old/ref log-probs, then its optimizer steps."""
    cfg, tc = run.config, run.config.train
    seconds: dict = {}
    draw, sampling_metrics = collect_round(run, seconds)

    timer = time.perf_counter()
    mask = rounds.mask_truncated(draw.completion_mask, draw.is_truncated) if tc.mask_truncated_completions \
        else draw.completion_mask
    advantages_N, r_N, std_N = rounds.compute_advantages(
        draw, mask, _weights(cfg), estimator=tc.advantage_estimator, scale_rewards=tc.scale_rewards,
        multi_objective_aggregation=tc.multi_objective_aggregation, num_generations=tc.num_generations)
    t_sample, t_score = seconds["sample"], seconds["score"] + time.perf_counter() - timer

    timer = time.perf_counter()
    arrays = (draw.prompt_ids, draw.prompt_mask, draw.completion_ids, mask)
    old = jax.device_get(run.logps_fn(run.state.params, *arrays)) if tc.needs_old_logps else None
    ref = jax.device_get(run.logps_fn(run.state.ref_params, *arrays)) if cfg.loss.beta != 0.0 else None
    t_logps = time.perf_counter() - timer

    round_metrics = {**_reward_metrics(draw.rewards, r_N, std_N, cfg.reward.functions, tc.num_generations),
                     **_completion_metrics(draw.completion_mask, draw.is_truncated),
                     "prompts/num_truncated": draw.num_prompts_truncated, **sampling_metrics}
    order = np.random.default_rng([cfg.seed, round_index]).permutation(tc.generation_batch_size)
    slices = [order[k * tc.train_batch_size:(k + 1) * tc.train_batch_size] for k in range(tc.steps_per_generation)]
    first_step = int(run.state.step)  # the only read of the device step counter in a round
    steps = [s for _ in range(tc.num_iterations) for s in slices][: cfg.max_steps - first_step]

    timer = time.perf_counter()
    pending = []
    for rows in steps:
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        sampler = draw.sampler_logps[rows] * mask[rows] if tc.use_sampler_logps else None
        step_batch = Batch(draw.prompt_ids[rows], draw.prompt_mask[rows], draw.completion_ids[rows], mask[rows],
                           advantages_N[rows], pick(old), pick(ref), sampler)
        run.state, metrics = run.step_fn(run.state, step_batch)
        pending.append(metrics)
    pending = jax.device_get(pending)  # one host sync per round, after every step was dispatched
    t_update = (time.perf_counter() - timer) / max(len(steps), 1)

    shared = (t_sample + t_score + t_logps) / max(len(steps), 1)
    for i, metrics in enumerate(pending):
        lr = float(run.schedule(first_step + i))
        times = {"step_time/sample": t_sample / len(steps), "step_time/score": t_score / len(steps),
                 "step_time/logps": t_logps / len(steps), "step_time/update": t_update}
        writer.write({"step": first_step + i + 1, **round_metrics, **metrics, "learning_rate": lr,
                      "step_time": shared + t_update, **times})


def train(config: Config, *, show_progress: bool = True, loss_fn: Callable | None = None) -> dict:
    """Runs GRPO as configured and returns a summary (eval before/after, skipped steps, output_dir).

    `loss_fn`: a custom loss with `compute_loss`'s signature, used instead of it (see `build`).
    """
    run = build(config, loss_fn=loss_fn)
    print(f"grpo_jax: output_dir={run.output_dir}  devices={len(run.mesh.devices.flat)} "
          f"({jax.devices()[0].platform})  mesh={dict(run.mesh.shape)}")
    before = evaluate(run, run.state.params)
    if before:
        print("held-out greedy before training: " + "  ".join(f"{k}={v:.3f}" for k, v in before.items()))
    writer = MetricsWriter(run.output_dir, max_steps=config.max_steps, logging_steps=config.logging_steps,
                           show_progress=show_progress)
    skipped, round_index = 0, 0
    try:
        while int(run.state.step) < config.max_steps:
            run_round(run, writer, round_index)
            round_index += 1
            skipped = sum(int(h.get("skipped", 0)) for h in writer.history)
            if skipped > config.train.max_nonfinite_steps:
                raise RuntimeError(
                    f"{skipped} optimizer steps had a non-finite loss or gradient (train.max_nonfinite_steps="
                    f"{config.train.max_nonfinite_steps}); their updates were skipped. Lower train.learning_rate, "
                    "check the reward functions, or raise train.max_nonfinite_steps.")
    finally:
        writer.close()
        if writer.history:
            plot_rewards(writer.history, run.output_dir / "reward.png")
    after = evaluate(run, run.state.params)
    if after:
        print("held-out greedy after training:  " + "  ".join(f"{k}={v:.3f}" for k, v in after.items()))
    summary = {"output_dir": str(run.output_dir), "steps": int(run.state.step), "skipped_steps": skipped,
               "eval_before": before, "eval_after": after, **_reward_summary(writer.history)}
    (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"reward first 10% of steps={summary['reward_first_10pct']:.3f}  "
          f"last 10%={summary['reward_last_10pct']:.3f}  plot: {run.output_dir / 'reward.png'}")
    return summary


def _reward_summary(history: list[dict]) -> dict:
    rewards_ = np.array([np.nan if h.get("reward") is None else h["reward"] for h in history], dtype=float)
    k = max(1, len(rewards_) // 10)
    return {"reward_first_10pct": float(np.nanmean(rewards_[:k])), "reward_last_10pct": float(np.nanmean(rewards_[-k:]))}
