"""Held-out evaluation on the mesh with the jitted samplers: greedy, and n sampled completions per prompt.

`evaluate(run, params, step)` returns metrics under `eval/` (see docs/configuration.md, "What a run writes"), each
named for how its completions were drawn:

- `eval/greedy/<fn>`: one arg-max completion per prompt, mean of each evaluation reward function.
- with `eval.num_generations` = n > 0, n completions per prompt at `eval.temperature`, TRL's names under
  `eval/sampled/` (`reward`, the unweighted sum of the functions; `rewards/<fn>/mean|std`, `completions/...`),
  `eval/pass@k` for k in `eval.pass_at_k` (the unbiased estimator of Chen et al. 2021, arXiv 2107.03374) and
  `eval/maj@n` (the most common answer `eval.answer_extractor` pulls out of the n completions is correct), and
  `eval/loss`, TRL's `eval_loss` of those rows (`eval_loss.sampled_loss`).

The evaluation reward functions (`reward_functions`) are `train(eval_reward_funcs=...)`, else
`eval.reward_functions`, else the training ones; the embedded tasks keep their own. A completion is correct when
the first of them gives it 1 or more (exact match, math accuracy). The sampled pass draws its key from a stream of
its own (`eval_key`): evaluating never moves the training key, the data order or any host RNG, so a run trains the
same with and without it.
Dimension letters: P prompts, n completions per prompt, N = P x n rows, F reward functions.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import NamedTuple

import jax
import numpy as np

from grpo_jax.data import prompts as data
from grpo_jax.device import sharding
from grpo_jax.rewards import functions as rewards
from grpo_jax.rewards.paths import resolve_reward_fn
from grpo_jax.rollout import eval_loss, multiturn, scoring
from grpo_jax.rollout.piece import Piece

EVAL_STREAM = 0x6576616C  # "eval", folded into the seed's key: a stream the training key never meets
# the digit tasks' own, exact match first: the held-out line's headline (training lists char_accuracy first,
# config.sections.TASK_REWARDS)
EVAL_TASK_REWARDS = ("grpo_jax.data.task:exact_match", "grpo_jax.data.task:char_accuracy")
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
    return list(LOOKUP_REWARDS if config.data.task == "lookup" else EVAL_TASK_REWARDS)


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
        out[f"eval/sampled/rewards/{name}/std"] = scoring.nanstd(rewards_NxF[:, i])
    out["eval/sampled/completions/mean_length"] = np.mean(lengths_N)
    for k in ks:
        out[f"eval/pass@{k}"] = np.mean(pass_at_k(correct_PxN.sum(axis=1), n, k))
    answers_PxN = [answers_N[p * n:(p + 1) * n] for p in range(len(correct_PxN))]
    out[f"eval/maj@{n}"] = np.mean(majority_vote(answers_PxN, correct_PxN))
    return {k: float(v) for k, v in out.items()}


def eval_key(seed: int):
    """The root key of evaluation's sampling, apart from the training key `PRNGKey(seed)`."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), EVAL_STREAM)


def _eval_batch(rows: list[dict], n: int, shards: int, tokenizer, tooling, max_prompt_length: int,
                template_kwargs: dict | None = None) -> data.PromptBatch:
    """The held-out ``rows`` tokenized, n rows a prompt, whole prompts repeated after them until the rows split over
    ``shards`` row shards."""
    num_prompts = padded = len(rows)
    while (padded * n) % shards:  # whole prompts, repeated until the rows split over the devices
        padded += 1
    chosen = [rows[i % num_prompts] for i in range(padded)]
    ids, mask, _ = data.tokenize_prompts(tokenizer, [r["prompt"] for r in chosen], max_prompt_length,
                                         truncation="left", tools=tooling and [tooling.schemas(r) for r in chosen],
                                         chat_template=tooling and tooling.chat_template,
                                         template_kwargs=template_kwargs)
    columns = {k: [r.get(k) for r in chosen] for k in dict.fromkeys(k for r in chosen for k in r) if k != "prompt"}
    return data.repeat_groups(data.PromptBatch(ids, mask, [r["prompt"] for r in chosen], columns, 0), n)


def _generate(decoder, params, batch: data.PromptBatch, key, *, n: int, num_rows: int, greedy: bool, tokenizer,
              reward_fns: list, tooling, toolbox) -> tuple[list, np.ndarray, np.ndarray, Rows]:
    """The first ``num_rows`` rows of ``batch`` (`_eval_batch`), decoded and scored as a training pass is
    (`scoring.decode_and_score`) with ``reward_fns`` (no log, no trainer state): (texts, rewards_NxF,
    completion_mask, the `Rows` a loss reads), N = ``num_rows``. With ``tooling`` the rows run their turns as in
    training (no journal: evaluation may call a tool again) and a text is the last assistant message."""
    N, F = num_rows, len(reward_fns)
    batch, turns, environments = multiturn.setup(tooling, tokenizer, batch, None, n, toolbox=toolbox)
    score = functools.partial(scoring.score, batch, context={}, log=None, tokenizer=tokenizer, reward_fns=reward_fns,
                              environments=environments)

    def score_held_out(piece: Piece) -> tuple:
        piece = _held_out(piece, N)
        return score(piece) if len(piece.rows) else (np.zeros((0, F), np.float32), None)

    _, pieces, scores = scoring.decode_and_score(decoder, params, batch, key, score_held_out, group_size=n,
                                                 greedy=greedy, turns=turns, later=multiturn.scores_on_first(tooling))
    completion_mask = np.zeros((N, pieces[0].completion_ids.shape[1]), np.int32)
    completion_ids, loss_mask, is_truncated = np.zeros_like(completion_mask), np.zeros_like(completion_mask), \
        np.zeros(N, bool)
    rewards_NxF = np.full((N, F), np.nan, np.float32)
    texts = [None] * N
    for piece, (r_NxF, _) in zip(pieces, scores):
        piece = _held_out(piece, N)  # the rows past N repeat prompts so that the rows split over the devices
        completion_mask[piece.rows], rewards_NxF[piece.rows] = piece.completion_mask, r_NxF
        completion_ids[piece.rows], is_truncated[piece.rows] = piece.completion_ids, piece.is_truncated
        loss_mask[piece.rows] = piece.completion_mask if piece.loss_mask is None else piece.loss_mask
        done = [data.completion_text(c) for c in piece.completions] if turns is not None else scoring.decode(
            tokenizer, piece.completion_ids, piece.completion_mask)
        for row, text in zip(piece.rows, done):
            texts[row] = text
    rows = Rows(batch.prompt_ids[:N], batch.prompt_mask[:N], completion_ids, completion_mask, loss_mask,
                is_truncated)
    return texts, rewards_NxF, completion_mask, rows


class Rows(NamedTuple):
    """A pass's held-out rows as a loss reads them (`eval_loss.sampled_loss`): [N, P], [N, T] and [N]."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray  # what attention sees
    loss_mask: np.ndarray  # what trains: the completion less tool results
    is_truncated: np.ndarray


def _held_out(piece: Piece, num_rows: int) -> Piece:
    """A piece's rows among the first ``num_rows``, the held-out ones (the others repeat prompts to pad the call)."""
    keep = piece.rows < num_rows
    if keep.all():
        return piece
    kept = [c for c, k in zip(piece.completions, keep) if k] if piece.completions is not None else None
    return piece._replace(rows=piece.rows[keep], completion_ids=piece.completion_ids[keep],
                          completion_mask=piece.completion_mask[keep], is_truncated=piece.is_truncated[keep],
                          loss_mask=None if piece.loss_mask is None else piece.loss_mask[keep], completions=kept,
                          tool_counts=None if piece.tool_counts is None else piece.tool_counts[keep])


def evaluate(run, params, step: int, *, toolbox=None, reference_params=None) -> dict[str, float]:
    """The held-out metrics of `params` after `step` optimizer steps (see the module docstring); {} without
    held-out rows. Decodes with `run.programs.decoder` (greedy) and `run.programs.eval_decoder` (sampled);
    ``toolbox``: the loop's, for a run with tools (`tools.calls.open_toolbox`); ``reference_params``: the state's,
    for the sampled rows' loss (`eval_loss.sampled_loss`)."""
    if not run.eval_rows:
        return {}
    cfg = run.config.eval
    names = [name.split(":")[-1] for name, _ in run.eval_reward_fns]

    def generate(decoder, n: int, key, greedy: bool, reward_fns):
        batch = _eval_batch(run.eval_rows, n, sharding.num_row_shards(run.mesh), run.tokenizer, run.tooling,
                            run.config.data.max_prompt_length, run.config.data.template_kwargs)
        return _generate(decoder, params, batch, key, n=n, num_rows=len(run.eval_rows) * n, greedy=greedy,
                         tokenizer=run.tokenizer, reward_fns=reward_fns, tooling=run.tooling, toolbox=toolbox)

    _, scores, _, _ = generate(run.programs.decoder, 1, jax.random.PRNGKey(0), True, run.eval_reward_fns)
    metrics = {f"eval/greedy/{name}": float(rewards.scored(np.nanmean, scores[:, i])) for i, name in enumerate(names)}
    if cfg.num_generations:
        key = run.programs.sample_key(eval_key(run.config.seed), step, 0)
        # the training functions too (those evaluation does not score), for the rows' loss
        extra = [fn for fn in run.reward_fns if fn not in run.eval_reward_fns]
        texts, scores, mask, rows = generate(run.programs.eval_decoder, cfg.num_generations, key, False,
                                             list(run.eval_reward_fns) + extra)
        columns = list(run.eval_reward_fns) + extra
        training = scores[:, [columns.index(fn) for fn in run.reward_fns]]
        scores = scores[:, :len(run.eval_reward_fns)]
        extract = resolve_reward_fn(cfg.answer_extractor)
        metrics.update(sampled_metrics(scores, names, [extract(t) for t in texts], mask.sum(axis=1),
                                       num_generations=cfg.num_generations, ks=cfg.ks))
        loss = eval_loss.sampled_loss(run, params, reference_params, rows, training, cfg.num_generations)
        if loss is not None:
            metrics["eval/loss"] = loss
    return metrics


def short_names(metrics: dict) -> dict:
    """Metrics as summary.json and the console name them: `eval/` dropped, `greedy/` and `sampled/` kept."""
    return {k.removeprefix("eval/"): v for k, v in metrics.items()}
