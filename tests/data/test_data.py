"""Tests for grpo_jax.data.prompts: JSONL errors, static left-padding/truncation, seeded epochs, resume, group repeat."""

import copy
import json

import numpy as np
import pytest

from grpo_jax.data import prompts as data, task


@pytest.fixture(scope="module")
def tok():
    return task.build_tokenizer()


def _write(tmp_path, text, name="d.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _rows(n):
    return [{"prompt": f"{i}>", "answer": str(i), "idx": i} for i in range(n)]


# --- load_jsonl -------------------------------------------------------------------------------------------


def test_load_jsonl_ok_skips_blank_lines(tmp_path):
    path = _write(tmp_path, '{"prompt": "12>", "answer": "21"}\n\n{"prompt": "3>", "answer": "3"}\n')
    assert data.load_jsonl(path) == [{"prompt": "12>", "answer": "21"}, {"prompt": "3>", "answer": "3"}]


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "1"}\n{"prompt": \n', r"d.jsonl: line 2 is not valid JSON"),
    ('[1, 2]\n', r"d.jsonl: line 1 is a JSON list, not an object.*'prompt' field \(string\)"),
    ('{"prompt": "1"}\n{"question": "1"}\n', r"d.jsonl: line 2 has no 'prompt' column.*'prompt' field \(string\)"),
    ('{"prompt": []}\n', r"d.jsonl: line 1: 'prompt' is a list but not chat messages \(it is empty\)"),
    ('{"prompt": [{"role": "user"}]}\n', r"line 1: 'prompt' is a list but not chat messages \(message 0 is "),
    ('{"prompt": ["hi"]}\n', r"line 1: 'prompt' is a list but not chat messages \(message 0 is 'hi'"),
    ('{"prompt": 12}\n', r"d.jsonl: line 1: 'prompt' is a int.*'prompt' field \(string or list of chat messages\)"),
    ('\n  \n', r"d.jsonl' is empty"),
])
def test_load_jsonl_errors(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        data.load_jsonl(_write(tmp_path, text))


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope.jsonl' does not exist"):
        data.load_jsonl(tmp_path / "nope.jsonl")


def test_load_jsonl_round_trips_write_jsonl(tmp_path):
    rows = task.make_examples("add", 5, 0)
    task.write_jsonl(tmp_path / "a.jsonl", rows)
    assert data.load_jsonl(tmp_path / "a.jsonl") == rows


def test_every_prompt_is_checked_before_training_and_named_by_its_line(tmp_path, tok):
    """A row the tokenizer rejects (a lone surrogate), or one too long with truncation=error, fails before the
    first step, named by its file and line (blank lines counted), not by its index in some later batch."""
    rows = [{"prompt": "12>"}, {"prompt": "a\ud800b>"}, {"prompt": "123456789>"}]
    path = _write(tmp_path, "\n".join([json.dumps(rows[0]), "", json.dumps(rows[1]), json.dumps(rows[2])]) + "\n")
    loaded, lines = data.read_jsonl(path)
    assert loaded == rows and lines == [1, 3, 4]
    with pytest.raises(ValueError, match=r"d.jsonl: line 3: the prompt .* cannot be tokenized \(TypeError: .*\): "
                                         r"fix or remove that row"):
        data.check_prompts(path, data.prompt_column(loaded), lines, tok, 8, "left")
    tokens, offsets = data.check_prompts(path, [rows[0]["prompt"], rows[2]["prompt"]], [1, 4], tok, 8, "left")
    assert np.diff(offsets).tolist() == [3, 10]  # the second is truncated later, warned about at build
    assert tokens.tolist() == tok("12>123456789>", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=r"d.jsonl: line 4: the prompt '123456789>' has 10 tokens > "
                                         r"data.max_prompt_length=8: raise data.max_prompt_length"):
        data.check_prompts(path, [rows[0]["prompt"], rows[2]["prompt"]], [1, 4], tok, 8, "error")


# --- tokenize_prompts ------------------------------------------------------------------------------------


def test_tokenize_prompts_left_pads_to_exact_length(tok):
    ids, mask, num_truncated = data.tokenize_prompts(tok, ["12>", "4^"], 5)
    c = {ch: len(task.SPECIAL_TOKENS) + task.CHARS.index(ch) for ch in task.CHARS}
    np.testing.assert_array_equal(ids, [[0, 0, c["1"], c["2"], c[">"]], [0, 0, 0, c["4"], c["^"]]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    assert ids.dtype == np.int32 and mask.dtype == np.int32 and num_truncated == 0


def test_tokenize_prompts_left_truncation(tok):
    ids, mask, num_truncated = data.tokenize_prompts(tok, ["123456>", "1>", "12345>"], 4)
    assert num_truncated == 2
    assert [tok.decode(row[m == 1]) for row, m in zip(ids, mask)] == ["456>", "1>", "345>"]
    np.testing.assert_array_equal(mask[0], [1, 1, 1, 1])


def test_tokenize_prompts_truncation_error(tok):
    with pytest.raises(ValueError, match=r"prompt 1 \('123456>'\) has 7 tokens > data.max_prompt_length=4: raise "
                                         r"data.max_prompt_length or set data.truncation=left"):
        data.tokenize_prompts(tok, ["1>", "123456>"], 4, truncation="error")
    ids, _, n = data.tokenize_prompts(tok, ["123>"], 4, truncation="error")
    assert n == 0 and ids.shape == (1, 4)


def test_tokenize_prompts_bad_args(tok):
    with pytest.raises(ValueError, match="data.truncation='right'"):
        data.tokenize_prompts(tok, ["1"], 4, truncation="right")
    with pytest.raises(ValueError, match="data.max_prompt_length=0"):
        data.tokenize_prompts(tok, ["1"], 0)
    with pytest.raises(ValueError, match="prompt 1 .*zero tokens"):
        data.tokenize_prompts(tok, ["1", ""], 4)


# --- Dataset and DataState ------------------------------------------------------------------------------


def _dataset(rows, tokenizer=None, length=4, truncation="left"):
    tokenizer = tokenizer or task.build_tokenizer()
    tokens, offsets = data.check_prompts("rows", data.prompt_column(rows), None, tokenizer, length, truncation)
    return data.Dataset(rows, tokens, offsets, length, tokenizer.pad_token_id)


def _take_indices(dataset, p, seed, num_batches):
    position, out = data.DataState(0, 0, seed), []
    for _ in range(num_batches):
        batch, position = data.next_batch(dataset, position, p)
        out += batch.columns["idx"]
    return out


def test_batches_follow_seeded_epoch_permutations():
    n, p, seed = 7, 3, 5
    seen = _take_indices(_dataset(_rows(n)), p, seed, 7)  # 21 prompts = exactly 3 epochs
    expected = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(3)]).tolist()
    assert seen == expected
    for e in range(3):
        assert sorted(seen[e * n:(e + 1) * n]) == list(range(n))


def test_unshuffled_batches_are_trls_repeat_sampler_without_shuffle():
    """data.shuffle=false (TRL's shuffle_dataset=False): the prompts in the rows' order, epoch after epoch, as TRL
    1.16's RepeatSampler(shuffle=False) yields them (each round's chunk once, before its G and mu repeats)."""
    n, k, G, R = 12, 3, 2, 2
    rows = _rows(n)
    tokenizer = task.build_tokenizer()
    tokens, offsets = data.check_prompts("rows", data.prompt_column(rows), None, tokenizer, 4, "left")
    dataset = data.Dataset(rows, tokens, offsets, 4, tokenizer.pad_token_id, shuffle=False)
    seen = _take_indices(dataset, k, 5, 2 * n // k)  # two epochs; the seed does not matter
    assert seen == _take_indices(dataset, k, 6, 2 * n // k)
    assert seen == list(range(n)) * 2
    trl_utils = pytest.importorskip("trl.trainer.utils")
    sampler = trl_utils.RepeatSampler(list(range(n)), mini_repeat_count=G, batch_size=k, repeat_count=R,
                                      shuffle=False)
    yielded = [i for _ in range(2) for i in sampler]  # TRL's dataloader iterates the sampler once an epoch
    span = k * G * R  # one round's rows: its k prompts, each G times, the chunk R times
    assert [i for c in range(0, len(yielded), span) for i in yielded[c:c + k * G:G]] == seen


def test_batches_are_deterministic_per_seed_and_differ_across_seeds():
    dataset = _dataset(_rows(7))
    assert _take_indices(dataset, 3, 1, 5) == _take_indices(dataset, 3, 1, 5)
    assert _take_indices(dataset, 3, 1, 5) != _take_indices(dataset, 3, 2, 5)


def test_batch_contents_are_the_prompts_tokenized_alone(tok):
    dataset = _dataset(_rows(12), tok)
    batch, _ = data.next_batch(dataset, data.DataState(0, 0, 0), 5)
    assert batch.prompt_ids.shape == (5, 4) and batch.prompt_mask.shape == (5, 4)
    assert batch.prompts == [f"{i}>" for i in batch.columns["idx"]]
    assert batch.columns["answer"] == [str(i) for i in batch.columns["idx"]]
    assert batch.num_truncated == 0
    ids, mask, _ = data.tokenize_prompts(tok, batch.prompts, 4)  # the reference: each batch tokenized on its own
    np.testing.assert_array_equal(batch.prompt_ids, ids)
    np.testing.assert_array_equal(batch.prompt_mask, mask)


def test_more_prompts_than_rows_span_epochs():
    n, seed = 3, 4
    batch, position = data.next_batch(_dataset(_rows(n)), data.DataState(0, 0, seed), 8)
    expected = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(3)]).tolist()
    assert batch.columns["idx"] == expected[:8]
    assert position == data.DataState(epoch=2, index=2, seed=seed)


def test_a_saved_position_continues_identically():
    dataset = _dataset(_rows(7))
    position = data.DataState(0, 0, 9)
    for _ in range(4):
        _, position = data.next_batch(dataset, position, 3)
    assert position == data.DataState(1, 5, 9)
    saved = data.DataState(**json.loads(json.dumps(position._asdict())))  # as a checkpoint's JSON keeps it
    a = b = None
    for _ in range(6):
        a, position = data.next_batch(dataset, position, 3)
        b, saved = data.next_batch(dataset, saved, 3)
        assert a.columns["idx"] == b.columns["idx"]
    with pytest.raises(ValueError, match="out of range for 7 rows"):
        data.next_batch(dataset, data.DataState(0, 7, 9), 3)


def test_missing_columns_become_none_and_truncation_is_counted():
    rows = [{"prompt": "123456>", "answer": "1"}, {"prompt": "1>"}]
    batch, _ = data.next_batch(_dataset(rows), data.DataState(0, 0, 0), 2)
    assert batch.num_truncated == 1
    assert dict(zip(batch.prompts, batch.columns["answer"])) == {"123456>": "1", "1>": None}
    long = batch.prompt_ids[batch.prompts.index("123456>")]
    assert task.build_tokenizer().decode(long) == "456>"  # left truncation keeps the prompt's end
    with pytest.raises(ValueError, match=r"row 0: the prompt '123456>' has 7 tokens > data.max_prompt_length=4"):
        _dataset(rows, truncation="error")


# --- repeat_groups ---------------------------------------------------------------------------------------


def test_repeat_groups_is_group_major(tok):
    ids, mask, _ = data.tokenize_prompts(tok, ["1>", "22>"], 3)
    batch = data.PromptBatch(ids, mask, ["1>", "22>"], {"answer": ["1", "22"]}, 0)
    rep = data.repeat_groups(batch, 3)
    assert rep.prompts == ["1>"] * 3 + ["22>"] * 3
    assert rep.columns == {"answer": ["1"] * 3 + ["22"] * 3}
    for g in range(2):
        for j in range(3):
            np.testing.assert_array_equal(rep.prompt_ids[g * 3 + j], ids[g])
            np.testing.assert_array_equal(rep.prompt_mask[g * 3 + j], mask[g])
    assert rep.prompt_ids.shape == (6, 3)
    with pytest.raises(ValueError, match="num_generations=0"):
        data.repeat_groups(batch, 0)


# --- conversational prompts (TRL's format) -----------------------------------------------------------------

# a chat template over the character vocabulary: "^" opens a user turn, "=" an assistant turn, ">" asks for one
CHAT_TEMPLATE = ("{% for m in messages %}{{ '^' if m['role'] == 'user' else '=' }}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}>{% endif %}")
CHAT = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "21"}, {"role": "user", "content": "3"}]


@pytest.fixture(scope="module")
def chat_tok():
    tokenizer = task.build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_load_jsonl_keeps_chat_messages(tmp_path):
    path = _write(tmp_path, json.dumps({"prompt": CHAT, "answer": "3"}) + "\n" + '{"prompt": "4>"}\n')
    assert data.load_jsonl(path) == [{"prompt": CHAT, "answer": "3"}, {"prompt": "4>"}]


def test_chat_prompts_render_like_trl(chat_tok):
    trl_data_utils = pytest.importorskip("trl.data_utils")
    rendered = data.render_prompt(chat_tok, CHAT)
    assert rendered == "^12 =21 ^3 >"
    assert rendered == trl_data_utils.maybe_apply_chat_template({"prompt": CHAT}, chat_tok)["prompt"]
    assert data.render_prompt(chat_tok, "12>") == "12>"
    ids, mask, _ = data.tokenize_prompts(chat_tok, [CHAT, "12>"], 14)
    # TRL 1.16 tokenizes conversations with apply_chat_template(add_generation_prompt=True, tokenize=True)
    expected = chat_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    np.testing.assert_array_equal(ids[0][mask[0] == 1], expected["input_ids"])
    np.testing.assert_array_equal(ids[1][mask[1] == 1], chat_tok("12>", add_special_tokens=False)["input_ids"])


# a template with an argument of its own, as Qwen3's `enable_thinking`: "!" after the generation prompt when set
FLAG_TEMPLATE = CHAT_TEMPLATE.replace("{% endif %}", "{% if loud %}!{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_as_trl_passes_them(chat_tok, tmp_path):
    """data.chat_template_kwargs: the prompt tokens are the tokenizer's own apply_chat_template(**kwargs) and TRL's
    rendering with the same kwargs."""
    chat_tok = copy.deepcopy(chat_tok)
    chat_tok.chat_template = FLAG_TEMPLATE
    assert data.render_prompt(chat_tok, CHAT) == "^12 =21 ^3 >"
    assert data.render_prompt(chat_tok, CHAT, template_kwargs={"loud": True}) == "^12 =21 ^3 >!"
    ids, mask, _ = data.tokenize_prompts(chat_tok, [CHAT], 16, template_kwargs={"loud": True})
    expected = chat_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            loud=True)["input_ids"]
    np.testing.assert_array_equal(ids[0][mask[0] == 1], expected)
    trl_data_utils = pytest.importorskip("trl.data_utils")
    assert data.render_prompt(chat_tok, CHAT, template_kwargs={"loud": True}) == \
        trl_data_utils.maybe_apply_chat_template({"prompt": CHAT}, chat_tok, loud=True)["prompt"]


def test_a_run_tokenizes_its_rows_with_the_chat_template_kwargs(chat_tok, tmp_path):
    """The config key reaches the run: its rows' prompt tokens are rendered with data.chat_template_kwargs."""
    from grpo_jax.api import trainer
    from grpo_jax.config import load_config

    chat_tok = copy.deepcopy(chat_tok)
    chat_tok.chat_template = FLAG_TEMPLATE
    chat_tok.save_pretrained(tmp_path / "tok")
    path = _write(tmp_path, "".join(json.dumps({"prompt": CHAT, "answer": "3"}) + "\n" for _ in range(8)))
    tokens = {}
    for i, flag in enumerate((None, "{loud: true}")):
        config = load_config(None, [f"output_dir={tmp_path / f'run{i}'}", f"data.path={path}",
                                    f"data.tokenizer_path={tmp_path / 'tok'}", "max_steps=1",
                                    "train.train_batch_size=8", "train.num_generations=4", "eval.num_examples=0",
                                    "model.init=random", "reward.functions=[grpo_jax.data.task:char_accuracy]"]
                             + ([] if flag is None else [f"data.chat_template_kwargs={flag}"]))
        run, _, held = trainer.build(config)
        held.release()
        tokens[flag] = run.dataset.token_ids[run.dataset.offsets[0]:run.dataset.offsets[1]].tolist()
    def rendered(**kwargs):
        return chat_tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True, **kwargs)["input_ids"]

    assert tokens[None] == rendered() and tokens["{loud: true}"] == rendered(loud=True)
    assert tokens["{loud: true}"][:-1] == tokens[None]  # the flag's "!" after the generation prompt


def test_chat_prompt_without_template_is_an_error(tok):
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        data.tokenize_prompts(tok, [CHAT], 16)


def test_batches_keep_raw_messages_for_rewards(chat_tok):
    rows = [{"prompt": CHAT, "answer": "3"}, {"prompt": "12>", "answer": "21"}]
    batch = data.repeat_groups(data.next_batch(_dataset(rows, chat_tok, 16), data.DataState(0, 0, 0), 2)[0], 2)
    assert sorted(map(str, batch.prompts)) == sorted(map(str, [CHAT, CHAT, "12>", "12>"]))
    prompts, completions = data.reward_inputs(batch.prompts, [f"c{i}" for i in range(4)])
    assert prompts == batch.prompts
    for prompt, completion, i in zip(prompts, completions, range(4)):
        assert completion == ([{"role": "assistant", "content": f"c{i}"}] if prompt == CHAT else f"c{i}")
    with pytest.raises(ValueError):
        data.reward_inputs(batch.prompts, ["too few"])


# --- through the CLI: what a user's files can get wrong ----------------------------------------------------


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path, capsys):
    from grpo_jax.api.cli import main as cli_main

    task.build_tokenizer(tmp_path / "tok")
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "12>", "answer": "21"}\n{"prompt": "caf\xe9>", "answer": "x"}\n')  # Latin-1 e-acute
    args = [f"output_dir={tmp_path / 'run'}", f"data.path={path}", f"data.tokenizer_path={tmp_path / 'tok'}",
            "model.init=random"]
    assert cli_main(args) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"grpo-jax: {path}: line 2 is not UTF-8 text (byte 0xe9, the line's byte 16): save the file as UTF-8, which "
        "JSON Lines requires"]


def test_a_model_folder_without_tokenizer_files_says_so(tmp_path, capsys):
    """config.json alone (no tokenizer.json, ...): transformers would build an empty tokenizer from the model type,
    and every prompt would tokenize to nothing; the folder and the files expected are named instead."""
    from grpo_jax.api.cli import main as cli_main
    from tests.hf_fixtures import hf_config

    hf_config("qwen2", tied=True).save_pretrained(tmp_path / "model")
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "12>", "answer": "21"}\n')
    assert cli_main([f"output_dir={tmp_path / 'run'}", f"data.path={path}", f"model.path={tmp_path / 'model'}"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"grpo-jax: model.path='{tmp_path / 'model'}' holds no tokenizer files "
                                               "(tokenizer.json, or tokenizer.model"), err
    assert not (tmp_path / "run" / "config.yaml").exists()
