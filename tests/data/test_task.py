"""Tests for grpo_jax.data.task: tokenizer round trips, task answers vs naive references, hand-computed rewards."""

import json

import pytest
import transformers

from grpo_jax.data import task


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    return task.build_tokenizer(path), path


def test_tokenizer_special_ids_and_vocab(saved_tokenizer):
    tok, _ = saved_tokenizer
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 0)
    assert tok.padding_side == "left"
    assert len(tok) == 2 + len(task.CHARS)
    assert 16 <= len(tok) <= 24
    # only EOS is special: nothing but EOS/padding may vanish from a decoded completion
    assert tok.all_special_ids == [0]
    assert tok.decode([1], skip_special_tokens=True) == "<unk>"


def test_tokenizer_one_id_per_char_and_round_trip(saved_tokenizer):
    tok, _ = saved_tokenizer
    text = "12+3= 4821>^"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == [2 + task.CHARS.index(c) for c in text]
    assert tok.decode(ids) == text
    assert tok.decode(ids + [0, 0, 0], skip_special_tokens=True) == text


def test_tokenizer_reload_identical(saved_tokenizer):
    tok, path = saved_tokenizer
    reloaded = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["4821>", "12+345=", "0 9^", "x1"]
    for text in texts:
        assert reloaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
        ids = reloaded.encode(text, add_special_tokens=False)
        assert reloaded.decode(ids) == tok.decode(ids)
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 0)
    assert reloaded.padding_side == "left"
    assert reloaded.encode("x", add_special_tokens=False) == [1]


def test_build_tokenizer_without_path():
    tok = task.build_tokenizer()
    assert tok.decode(tok.encode("55+5=", add_special_tokens=False)) == "55+5="


@pytest.mark.parametrize("seed", range(20))
def test_task_answers_match_naive(seed):
    for row in task.make_examples("reverse", 10, seed, 3, 5):
        digits = row["prompt"][:-1]
        assert row["prompt"][-1] == ">" and digits.isdigit() and 3 <= len(digits) <= 5
        assert row["answer"] == "".join(reversed(list(digits)))
    for row in task.make_examples("sort", 10, seed, 2, 6):
        digits = row["prompt"][:-1]
        assert row["prompt"][-1] == "^" and digits.isdigit() and 2 <= len(digits) <= 6
        assert row["answer"] == "".join(sorted(digits))
    for row in task.make_examples("add", 10, seed, 1, 3):
        a, b = row["prompt"][:-1].split("+")
        assert row["prompt"].endswith("=") and 1 <= len(a) <= 3 and 1 <= len(b) <= len(a)
        assert row["answer"] == str(int(a) + int(b))


def test_make_examples_deterministic_and_seed_dependent():
    assert task.make_examples("add", 30, 7) == task.make_examples("add", 30, 7)
    assert task.make_examples("add", 30, 7) != task.make_examples("add", 30, 8)
    assert all(set(r["prompt"] + r["answer"]) <= set(task.CHARS)
               for t in task.TASKS for r in task.make_examples(t, 50, 0))


def test_make_examples_errors():
    with pytest.raises(ValueError, match="task='mul'.*reverse, sort, add"):
        task.make_examples("mul", 3, 0)
    with pytest.raises(ValueError, match="min_len=4, max_len=2"):
        task.make_examples("sort", 3, 0, 4, 2)


def test_write_jsonl(tmp_path):
    rows = task.make_examples("reverse", 4, 0)
    task.write_jsonl(tmp_path / "d.jsonl", rows)
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows


def test_char_accuracy_hand_computed():
    completions = ["123", "12", "1234", "321", "", "9"]
    answers = ["123"] * 5 + [""]
    got = task.char_accuracy(["p"] * 6, completions, answer=answers, extra=[0] * 6)
    assert got == pytest.approx([1.0, 2 / 3, 3 / 4, 1 / 3, 0.0, 0.0])
    assert task.char_accuracy([""], [""], answer=[""]) == [1.0]


def test_exact_match():
    assert task.exact_match(["p"] * 3, ["123", "12", "1234"], answer=["123"] * 3) == [1.0, 0.0, 0.0]


def test_reward_length_mismatch():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        task.char_accuracy(["a", "b"], ["1", "2"], answer=["1"])


@pytest.mark.parametrize("lengths, unseen", [((4, 4), True), ((1, 1), False)])
def test_run_holds_out_eval_num_examples_prompts_unseen_in_training(tmp_path, lengths, unseen):
    """The default run's held-out rows: eval.num_examples of them, none among the training prompts where the task
    has prompts left (4 digits: 10,000 strings, ~87 % drawn by 20,000 rows), else the seen ones (1 digit: 10)."""
    from grpo_jax.api import run
    from grpo_jax.config import load_config

    config = load_config(None, [f"data.task_min_len={lengths[0]}", f"data.task_max_len={lengths[1]}"])
    _, _, dataset, eval_rows, _ = run._load_data(config, tmp_path)
    train = {json.loads(line)["prompt"] for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()}
    written = [json.loads(line) for line in (tmp_path / "data" / "eval.jsonl").read_text().splitlines()]
    assert written == eval_rows and len(eval_rows) == config.eval.num_examples == 200
    assert len(train) < config.data.task_num_train  # the training rows repeat prompts
    held_out = [r["prompt"] not in train for r in eval_rows]
    assert all(held_out) if unseen else not any(held_out)
    for r in eval_rows:  # each a row of the task: its answer the reversed digits
        assert r["answer"] == r["prompt"][:-1][::-1]
