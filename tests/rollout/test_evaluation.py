"""pass@k, maj@n and the sampled evaluation's metrics as pure host functions, against direct counts; which reward
functions score the held-out rows of a run; the held-out rows decoded and scored through the training pass's path."""

import itertools
import json
import warnings

import jax
import numpy as np
import pytest
import yaml

from grpo_jax.api import trainer
from grpo_jax.config import load_config
from grpo_jax.data import task
from grpo_jax.rollout.evaluation import majority_vote, pass_at_k, sampled_metrics


def _direct_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of the k-subsets of the n samples that hold a correct one: what pass@k estimates."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("correct", [[1, 0, 0, 1, 0, 0], [0] * 6, [1] * 6, [0, 0, 0, 0, 0, 1]])
def test_pass_at_k_is_the_direct_count_over_subsets(correct):
    n = len(correct)
    for k in range(1, n + 1):
        assert pass_at_k([sum(correct)], n, k)[0] == pytest.approx(_direct_pass_at_k(correct, k), abs=1e-12), k
    assert pass_at_k([sum(correct)], n, 1)[0] == pytest.approx(np.mean(correct))  # pass@1: the fraction correct


def test_pass_at_k_stored_case_and_bad_k():
    # n = 10, c = 3, k = 5: 1 - C(7, 5) / C(10, 5) = 1 - 21/252
    np.testing.assert_allclose(pass_at_k([3, 0, 10], 10, 5), [1 - 21 / 252, 0.0, 1.0])
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k([1], 4, 5)


def test_majority_vote():
    answers = [["7", "7", "3", None],  # 7 wins and is correct
               ["1", "2", "2", "1"],  # a tie: the first seen ("1") wins, and it is wrong
               [None, None, None, None],  # no answer: wrong
               ["5", None, "4", "4"]]  # 4 wins; its first sample (index 2) is correct
    correct = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]], bool)
    np.testing.assert_array_equal(majority_vote(answers, correct), [True, False, False, True])


def test_sampled_metrics_names_and_values():
    # 2 prompts x 3 samples, group-major; functions: correctness (first: decides pass@k), a length score
    rewards = np.array([[1, 0.5], [0, 0.25], [np.nan, 1.0], [0, 0.0], [0, 0.5], [1, np.nan]], np.float32)
    answers = ["4", "5", "4", None, "8", "9"]
    metrics = sampled_metrics(rewards, ["m:correct", "m:short"], answers, np.array([3, 4, 5, 6, 7, 8]),
                              num_generations=3, ks=(1, 3))
    # every name says how its completions were drawn: sampled (pass@k and maj@n are sampled by definition)
    assert set(metrics) == {"eval/sampled/reward", "eval/sampled/rewards/correct/mean",
                            "eval/sampled/rewards/correct/std", "eval/sampled/rewards/short/mean",
                            "eval/sampled/rewards/short/std", "eval/sampled/completions/mean_length",
                            "eval/pass@1", "eval/pass@3", "eval/maj@3"}
    assert metrics["eval/sampled/reward"] == pytest.approx(np.mean([1.5, 0.25, 1.0, 0.0, 0.5, 1.0]))
    assert metrics["eval/sampled/rewards/correct/mean"] == pytest.approx(2 / 5)  # the unscored sample is skipped
    assert metrics["eval/pass@1"] == pytest.approx((1 / 3 + 1 / 3) / 2)  # NaN counts as not correct
    assert metrics["eval/pass@3"] == 1.0
    assert metrics["eval/maj@3"] == 0.5  # prompt 0: "4" (correct); prompt 1: a tie, "8" first (wrong)
    assert metrics["eval/sampled/completions/mean_length"] == 5.5


def test_a_function_that_scores_nothing_gives_nan_without_numpy_warnings():
    rewards = np.array([[1, np.nan], [0, np.nan], [1, np.nan], [0, np.nan]], np.float32)  # "none": None everywhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" / "Degrees of freedom" would raise here
        metrics = sampled_metrics(rewards, ["m:correct", "m:none"], [None] * 4, np.array([3, 4, 5, 6]),
                                  num_generations=2, ks=(1,))
    assert np.isnan(metrics["eval/sampled/rewards/none/mean"]) and np.isnan(metrics["eval/sampled/rewards/none/std"])
    assert metrics["eval/sampled/rewards/correct/mean"] == 0.5 and metrics["eval/sampled/reward"] == 0.5


ROWS = [{"prompt": f"{i % 10}{(3 * i) % 10}{(7 * i) % 10}>", "answer": f"{(7 * i) % 10}"} for i in range(16)]
QUICK = ["max_steps=2", "save_steps=2", "train.train_batch_size=8", "train.num_generations=4",
         "sampling.max_completion_length=4", "eval.num_examples=4", "model.hidden_size=32",
         "model.intermediate_size=64", "model.num_hidden_layers=1"]


def digit_count(prompts, completions, **kwargs):
    """The user's training reward: the digits a completion writes (a random policy writes some)."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def ends_with_answer(prompts, completions, answer, **kwargs):
    return [float(c.endswith(a)) for c, a in zip(completions, answer)]


def digit_steps(prompts, completions, completion_ids, **kwargs):
    """A process-supervision reward: one step, at the last token, worth the completion's digits."""
    return [[(len(ids) - 1, float(sum(ch.isdigit() for ch in c)))] for c, ids in zip(completions, completion_ids)]


def _evals(output_dir) -> list[dict]:
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if any(k.startswith("eval/") for k in line)]


def test_held_out_evaluation_scores_the_users_data_with_the_training_reward_functions(tmp_path, capsys):
    """With data.path and no eval.reward_functions the held-out rows are scored with reward.functions (not the
    embedded digit task's exact_match); a run whose config.yaml holds the old default list still resumes."""
    from grpo_jax.api.cli import main as cli_main

    tokenizer = tmp_path / "tokenizer"
    task.build_tokenizer(tokenizer)
    task.write_jsonl(tmp_path / "train.jsonl", ROWS)
    task.write_jsonl(tmp_path / "eval.jsonl", ROWS[:4])
    out = tmp_path / "run"
    args = ["--no-progress", f"output_dir={out}", *QUICK, f"data.path={tmp_path / 'train.jsonl'}",
            f"eval.path={tmp_path / 'eval.jsonl'}", f"data.tokenizer_path={tokenizer}", "model.init=random",
            "reward.functions=[tests.rollout.test_evaluation:digit_count]"]
    assert cli_main(args) == 0
    console = capsys.readouterr().out
    assert "held-out eval at step 0: greedy/digit_count=" in console and "exact_match" not in console, console
    evals = _evals(out)
    assert [set(line) for line in evals] == [{"step", "eval/greedy/digit_count"}] * 2
    assert all(0 <= line["eval/greedy/digit_count"] <= 4 for line in evals)  # digits of 4-token completions

    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["eval"]["reward_functions"] is None
    saved["eval"]["reward_functions"] = ["grpo_jax.data.task:exact_match", "grpo_jax.data.task:char_accuracy"]  # old default
    (out / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    assert cli_main([*args, "max_steps=3"]) == 0
    assert "resuming from checkpoint" in capsys.readouterr().out
    assert set(_evals(out)[-1]) == {"step", "eval/greedy/digit_count"}


def test_process_supervision_steps_are_not_taken_as_evaluation_scores(tmp_path, capsys):
    """The training functions of train.advantage_estimator=process return steps: evaluation needs its own."""
    from grpo_jax.api.cli import main as cli_main

    tokenizer = tmp_path / "tokenizer"
    task.build_tokenizer(tokenizer)
    task.write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = [f"output_dir={tmp_path / 'run'}", *QUICK, f"data.path={tmp_path / 'rows.jsonl'}",
            f"eval.path={tmp_path / 'rows.jsonl'}", f"data.tokenizer_path={tokenizer}",
            "model.init=random", "train.advantage_estimator=process",
            "reward.functions=[tests.rollout.test_evaluation:digit_steps]"]
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("grpo-jax: eval.reward_functions is null (the training reward functions) with "
                          "train.advantage_estimator=process") and err.count("\n") == 1, err


def test_train_takes_evaluation_reward_functions_as_trl_style_arguments(tmp_path):
    """train(eval_reward_funcs=...) (callables or paths) replaces the training functions for the held-out rows."""
    tokenizer = tmp_path / "tokenizer"
    task.build_tokenizer(tokenizer)
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", *QUICK, "max_steps=1", "model.init=random",
                                "eval.num_generations=2", f"data.tokenizer_path={tokenizer}"])
    summary = trainer.train(config, show_progress=False, train_dataset=ROWS, eval_dataset=ROWS[:4],
                            reward_funcs=[digit_count],
                            eval_reward_funcs=[ends_with_answer, "grpo_jax.data.task:exact_match"])
    evals = _evals(tmp_path / "run")
    assert {k for k in evals[0] if k.startswith("eval/greedy/")} == {"eval/greedy/ends_with_answer",
                                                                     "eval/greedy/exact_match"}
    # ends_with_answer decides which samples are correct: pass@1 is its sampled mean
    assert evals[0]["eval/pass@1"] == pytest.approx(evals[0]["eval/sampled/rewards/ends_with_answer/mean"])
    assert summary["eval_after"]["greedy/ends_with_answer"] == evals[1]["eval/greedy/ends_with_answer"]


class _IdsTokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in rows]


def test_evaluation_decodes_and_scores_through_the_training_path_each_held_out_row_once(tiny_model):
    """`_generate` (`scoring.decode_and_score`, as a training pass) over 5 prompts x 3 rows of which the first 3
    prompts are held out and the rest pad the call: each held-out row's reward, mask and text are those of the rows
    decoded alone (`decode_rows`), and no padding row reaches a reward function."""
    from grpo_jax.data import prompts as data
    from grpo_jax.rollout import evaluation
    from tests.algo.test_decoder import EOS, G, IDS, MASK, decode_rows, make_decoder

    want = decode_rows(tiny_model)
    seen = []

    def length(prompts, completions, completion_ids, **kwargs):
        seen.extend(prompts)
        return [float(len(ids)) for ids in completion_ids]

    dec = make_decoder(tiny_model, eos=EOS, group=G, max_completion_length=9, temperature=0.9, top_k=12,
                       max_batch_rows=4)  # groups end at different segments: several pieces, some padding
    N = 3 * G
    batch = data.PromptBatch(IDS, MASK, [f"p{i // G}" for i in range(len(IDS))], {}, 0)
    texts, rewards_NxF, mask, rows = evaluation._generate(dec, tiny_model[2], batch, jax.random.key(3), n=G, num_rows=N,
                                                    greedy=False, tokenizer=_IdsTokenizer(),
                                                    reward_fns=[("length", length)], tooling=None, toolbox=None)
    assert sorted(seen) == [f"p{i // G}" for i in range(N)]  # each held-out row once, no padding row
    np.testing.assert_array_equal(mask, want.completion_mask[:N])
    np.testing.assert_array_equal(rows.completion_ids * mask, want.completion_ids[:N] * mask)  # the loss's rows
    np.testing.assert_array_equal(rows.loss_mask, mask)
    np.testing.assert_array_equal(rows.prompt_ids, IDS[:N])
    np.testing.assert_array_equal(rewards_NxF[:, 0], want.completion_mask[:N].sum(axis=1))
    assert texts == _IdsTokenizer().batch_decode(
        [ids[:n].tolist() for ids, n in zip(want.completion_ids[:N], want.completion_mask[:N].sum(axis=1))])
