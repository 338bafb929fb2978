"""Held-out evaluation on the mesh with the jitted samplers: greedy, and n sampled completions per prompt.

`evaluate(run, params, step)` returns metrics under `eval/` (see docs/configuration.md, "What a run writes"), each
named for how its completions were drawn:

- `eval/greedy/<fn>`: one arg-max completion per prompt, mean of each evaluation reward function.
- with `eval.num_generations` = n > 0, n completions per prompt at `eval.temperature`, TRL's names under
  `eval/sampled/` (`reward`, the unweighted sum of the functions; `rewards/<fn>/mean|std`, `completions/...`),
  `eval/pass@k` for k in `eval.pass_at_k` (the unbiased estimator of Chen et al. 2021, arXiv 2107.03374) and
  `eval/maj@n` (the most common answer `eval.answer_extractor` pulls out of the n completions is correct).

The evaluation reward functions (`reward_functions`) are `train(eval_reward_funcs=...)`, else
`eval.reward_functions`, else the training ones; the embedded tasks keep their own. A completion is correct when
the first of them gives it 1 or more (exact match, math accuracy). The sampled pass draws its key from a stream of
its own (`eval_key`): evaluating never moves the training key, the data order or any host RNG, so a run trains the
same with and without it.
Dimension letters: P prompts, n completions per prompt, N = P x n rows, F reward functions.
"""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np

from grpo_jax.data import prompts as data
from grpo_jax.device import sharding
from grpo_jax.rewards import functions as rewards
from grpo_jax.rewards.paths import resolve_reward_fn
from grpo_jax.rollout import multiturn, stream

EVAL_STREAM = 0x6576616C  # "eval", folded into the seed's key: a stream the training key never meets
TASK_REWARDS = ("grpo_jax.data.task:exact_match", "grpo_jax.data.task:char_accuracy")  # the digit tasks' own
LOOKUP_REWARDS = ("grpo_jax.tools.tool_task:answer_accuracy",)  # the multi-turn lookup task's own


def reward_functions(config, *, given_data: bool, held_out: bool = True, eval_reward_funcs=None):
    """What evaluation scores with: `eval_reward_funcs` (callables or paths, as `train` takes them), else
    `eval.reward_functions`, else the embedded task's own functions (no data given); None: the training ones,
    refused for `held_out` rows when they return process supervision's steps."""
    if eval_reward_funcs is not None:
        return list(eval_reward_funcs)
    if config.eval.reward_functions is not None:
        return list(config.eval.reward_functions)
    if given_data:
        if held_out and config.train.advantage_estimator == "process":
            raise ValueError("eval.reward_functions is null (the training reward functions) with "
                             "train.advantage_estimator=process: those return steps, evaluation scores a completion "
                             "with one number; list eval.reward_functions (from Python: eval_reward_funcs=[...])")
        return None
    return list(LOOKUP_REWARDS if config.data.task == "lookup" else TASK_REWARDS)


def pass_at_k(num_correct_P, n: int, k: int) -> np.ndarray:
    """Unbiased pass@k of each prompt from n samples, c of them correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) (Chen et al. 2021, Fig. 3), which never forms the large
    binomials; 1 when n - c < k. [P] float64.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per prompt")
    c_P = np.asarray(num_correct_P, np.int64)
    return np.array([1.0 if n - c < k else 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)) for c in c_P])


def majority_vote(answers_PxN: list[list], correct_PxN: np.ndarray) -> np.ndarray:
    """[P] bool: the most common answer (None: no answer, no vote) of each prompt's n samples is correct.

    Ties go to the answer seen first; the answer is judged by the first sample that gave it. A prompt
    none of whose samples gave an answer counts as wrong.
    """
    out_P = np.zeros(len(answers_PxN), bool)
    for p, answers in enumerate(answers_PxN):
        votes = Counter(a for a in answers if a is not None)
        if votes:
            top = votes.most_common(1)[0][0]  # Counter keeps first-seen order among equal counts
            out_P[p] = bool(correct_PxN[p][answers.index(top)])
    return out_P


def sampled_metrics(rewards_NxF: np.ndarray, names, answers_N: list, lengths_N: np.ndarray, *,
                    num_generations: int, ks) -> dict[str, float]:
    """The `eval/` metrics of N = P x n sampled completions (rows group-major: row p*n + j is prompt p)."""
    n = num_generations
    short = [name.split(":")[-1] for name in names]
    correct_PxN = (np.nan_to_num(rewards_NxF[:, 0], nan=0.0) >= 1.0).reshape(-1, n)
    total_N = np.where(np.isnan(rewards_NxF).all(axis=1), np.nan, np.nansum(rewards_NxF, axis=1))  # as TRL's
    out = {"eval/sampled/reward": rewards.scored(np.nanmean, total_N)}
    for i, name in enumerate(short):
        out[f"eval/sampled/rewards/{name}/mean"] = rewards.scored(np.nanmean, rewards_NxF[:, i])
        out[f"eval/sampled/rewards/{name}/std"] = rewards.scored(np.nanstd, rewards_NxF[:, i])
    out["eval/sampled/completions/mean_length"] = np.mean(lengths_N)
    for k in ks:
        out[f"eval/pass@{k}"] = np.mean(pass_at_k(correct_PxN.sum(axis=1), n, k))
    answers_PxN = [answers_N[p * n:(p + 1) * n] for p in range(len(correct_PxN))]
    out[f"eval/maj@{n}"] = np.mean(majority_vote(answers_PxN, correct_PxN))
    return {k: float(v) for k, v in out.items()}


def eval_key(seed: int):
    """The root key of evaluation's sampling, apart from the training key `PRNGKey(seed)`."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), EVAL_STREAM)


def _generate(run, decoder, params, n: int, key, greedy: bool, toolbox):
    """n completions of every held-out prompt: (texts, rewards_NxF, completion_mask), N = P x n group-major. With
    tools the rows run their turns as in training (no journal: evaluation may call a tool again) and a text is
    the last assistant message."""
    cfg, rows = run.config, run.eval_rows
    num_prompts, shards = len(rows), sharding.num_row_shards(run.mesh)
    padded = num_prompts
    while (padded * n) % shards:  # whole prompts, repeated until the rows split over the devices
        padded += 1
    chosen = [rows[i % num_prompts] for i in range(padded)]
    tooling = run.tooling
    ids, mask, _ = data.tokenize_prompts(run.tokenizer, [r["prompt"] for r in chosen], cfg.data.max_prompt_length,
                                         truncation="left", tools=tooling and [tooling.schemas(r) for r in chosen],
                                         chat_template=tooling and tooling.chat_template)
    columns = {k: [r.get(k) for r in chosen] for k in dict.fromkeys(k for r in chosen for k in r) if k != "prompt"}
    batch = data.repeat_groups(data.PromptBatch(ids, mask, [r["prompt"] for r in chosen], columns, 0), n)
    batch, turns, environments = multiturn.setup(tooling, run.tokenizer, batch, None, n, toolbox=toolbox)
    completion_ids = np.zeros((len(batch.prompt_ids), cfg.sampling.max_completion_length), np.int32)
    completion_mask = np.zeros_like(completion_ids)
    messages = [None] * len(completion_ids)
    for piece in stream.decode(decoder, params, batch.prompt_ids, batch.prompt_mask, key, greedy=greedy,
                               group_size=n, turns=turns):
        completion_ids[piece.rows], completion_mask[piece.rows] = piece.completion_ids, piece.completion_mask
        for row, completion in zip(piece.rows, piece.completions or ()):
            messages[row] = completion
    N = num_prompts * n
    completion_ids, completion_mask, messages = completion_ids[:N], completion_mask[:N], messages[:N]
    # as the training rounds hand them to reward functions: EOS kept in the ids, padding removed
    token_ids = [row[:length] for row, length in zip(completion_ids.tolist(), completion_mask.sum(axis=1))]
    columns = {k: v[:N] for k, v in batch.columns.items()}
    columns["completion_ids"] = token_ids
    prompts = batch.prompts[:N]
    context = {} if environments is None else {"environments": environments[:N]}
    if turns is None:
        texts = run.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
        inputs = data.reward_inputs(prompts, texts)
    else:
        texts = [data.completion_text(c) for c in messages]
        inputs = prompts, messages
    def score():
        return rewards.score_completions(run.eval_reward_fns, *inputs, columns, context)

    scores = sharding.from_first_process(score) if multiturn.scores_on_first(tooling) else score()
    return texts, scores, completion_mask


def evaluate(run, params, step: int, *, toolbox=None) -> dict[str, float]:
    """The held-out metrics of `params` after `step` optimizer steps (see the module docstring); {} without
    held-out rows. Decodes with `run.programs.decoder` (greedy) and `run.programs.eval_decoder` (sampled);
    ``toolbox``: the loop's, for a run with tools (`tools.calls.open_toolbox`)."""
    if not run.eval_rows:
        return {}
    cfg = run.config.eval
    names = [name.split(":")[-1] for name, _ in run.eval_reward_fns]
    _, scores, _ = _generate(run, run.programs.decoder, params, 1, jax.random.PRNGKey(0), True, toolbox)
    metrics = {f"eval/greedy/{name}": float(rewards.scored(np.nanmean, scores[:, i])) for i, name in enumerate(names)}
    if cfg.num_generations:
        key = run.programs.sample_key(eval_key(run.config.seed), step, 0)
        texts, scores, mask = _generate(run, run.programs.eval_decoder, params, cfg.num_generations, key, False, toolbox)
        extract = resolve_reward_fn(cfg.answer_extractor)
        metrics.update(sampled_metrics(scores, names, [extract(t) for t in texts], mask.sum(axis=1),
                                       num_generations=cfg.num_generations, ks=cfg.ks))
    return metrics


def short_names(metrics: dict) -> dict:
    """Metrics as summary.json and the console name them: `eval/` dropped, `greedy/` and `sampled/` kept."""
    return {k.removeprefix("eval/"): v for k, v in metrics.items()}
