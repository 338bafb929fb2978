"""Prompt rows from where users keep them (grpo_jax/data/sources.py): every format gives the rows a JSONL file gives,
`train(train_dataset=..., reward_funcs=...)` trains as the same data from a file does, and the prompt length fits
the data or warns."""

import json

import datasets
import numpy as np
import pandas as pd
import pytest

from grpo_jax.api import trainer
from grpo_jax.api.run import _prompt_length, build
from grpo_jax.config import load_config
from grpo_jax.data import sources, task

ROWS = [{"prompt": f"{i % 10}{(3 * i) % 10}{(7 * i) % 10}>", "answer": f"x{i}"} for i in range(24)]
QUICK = ["max_steps=2", "train.train_batch_size=16", "train.num_generations=4", "eval.num_examples=0",
         "sampling.max_completion_length=6", "model.init=random"]


def _write_all(folder):
    """ROWS as each kind of source `data.path` takes: {name: path}."""
    folder.mkdir(exist_ok=True)
    frame = pd.DataFrame(ROWS)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "rows.json").write_text(json.dumps(ROWS))
    frame.to_parquet(folder / "rows.parquet")
    frame.to_csv(folder / "rows.csv", index=False)
    (folder / "parts").mkdir(exist_ok=True)
    frame[:10].to_parquet(folder / "parts" / "a.parquet")
    frame[10:].to_parquet(folder / "parts" / "b.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(str(folder / "saved"))
    return {"jsonl": folder / "rows.jsonl", "json": folder / "rows.json", "parquet": folder / "rows.parquet",
            "csv": folder / "rows.csv", "glob": folder / "parts" / "*.parquet", "save_to_disk": folder / "saved"}


def _hub_cache(root, monkeypatch, name="me/digits"):
    """A dataset repo as `hf download --repo-type dataset` leaves it in the hub cache (no network involved)."""
    import huggingface_hub

    repo = root / "hub" / f"datasets--{name.replace('/', '--')}"
    (repo / "snapshots" / "0123abcd" / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    pd.DataFrame(ROWS).to_parquet(repo / "snapshots" / "0123abcd" / "data" / "train-00000-of-00001.parquet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "hub"))
    return name


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _write_all(tmp_path_factory.mktemp("sources"))


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "glob", "save_to_disk", "hub_cache"])
def test_every_source_gives_the_rows_of_the_jsonl_file(files, kind, tmp_path, monkeypatch):
    path = _hub_cache(tmp_path, monkeypatch) if kind == "hub_cache" else str(files[kind])
    rows, lines = sources.load_rows(path)
    assert [dict(rows[i]) for i in range(len(rows))] == ROWS
    assert lines == (list(range(1, 25)) if kind == "jsonl" else None)
    assert kind == "jsonl" or isinstance(rows, datasets.Dataset)  # memory-mapped, never a Python list


def test_a_large_jsonl_file_is_memory_mapped(files, monkeypatch):
    monkeypatch.setattr(sources, "LARGE_JSONL_BYTES", 16)
    rows, lines = sources.load_rows(str(files["jsonl"]))
    assert isinstance(rows, datasets.Dataset) and lines is None and [dict(r) for r in rows] == ROWS


def test_source_errors_name_the_key_and_the_fix(files, tmp_path, monkeypatch):
    pd.DataFrame({"question": ["a"]}).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=r"q.parquet has no 'prompt' column \(has \['question'\]\): rename"):
        sources.load_rows(str(tmp_path / "q.parquet"))
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\], not data.split='validation'"):
        sources.load_rows(str(files["save_to_disk"]), split="validation")
    with pytest.raises(ValueError, match=r"train_dataset holds no rows: it needs at least one row with a 'prompt'"):
        sources.from_python(datasets.Dataset.from_dict({"prompt": []}), "train_dataset")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl' is empty: it needs at least one line with a 'prompt'"):
        sources.load_rows(str(tmp_path / "empty.jsonl"))
    pd.DataFrame({"prompt": ["a", 3]}, dtype=object).to_json(tmp_path / "mixed.json", orient="records")
    with pytest.raises(ValueError, match=r"mixed.json.*: row 1: 'prompt' is a int"):
        sources.load_rows(str(tmp_path / "mixed.json"))
    with pytest.raises(ValueError, match=r"data.path='.*none\*.parquet' matches no file"):
        sources.load_rows(str(tmp_path / "none*.parquet"))
    _hub_cache(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"data.path='me/other' is not a file or folder, and the dataset id could "
                                         r"not be loaded from the local Hugging Face cache .*hf download "
                                         r"--repo-type dataset me/other"):
        sources.load_rows("me/other")
    with pytest.raises(ValueError, match="train_dataset is a DatasetDict of splits"):
        sources.from_python(datasets.load_from_disk(str(files["save_to_disk"])), "train_dataset")


def digit_reward(prompts, completions, answer, **kwargs):
    return [float(len(c)) / 6 + (0.5 if a.endswith("1") else 0.0) for c, a in zip(completions, answer)]


def test_train_dataset_and_callable_rewards_train_as_the_same_file_does(files, tmp_path):
    """TRL's constructor arguments from Python (a Dataset, a callable reward) give the metrics that data.path and
    reward.functions give for the same rows: same order, same rewards, same updates."""
    tokenizer = tmp_path / "tokenizer"
    task.build_tokenizer(tokenizer)
    common = [*QUICK, f"data.tokenizer_path={tokenizer}"]
    trainer.train(load_config(None, [f"output_dir={tmp_path / 'file'}", *common, f"data.path={files['parquet']}",
                                     "reward.functions=[tests.data.test_sources:digit_reward]"]), show_progress=False)
    trainer.train(load_config(None, [f"output_dir={tmp_path / 'python'}", *common]), show_progress=False,
                  train_dataset=datasets.Dataset.from_list(ROWS), reward_funcs=[digit_reward])

    def lines(name):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("step_time")}
                for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    from_file, from_python = lines("file"), lines("python")
    assert len(from_file) == 2 and from_file[0]["rewards/digit_reward/mean"] > 0
    assert from_python == from_file


def test_prompt_length_fits_the_data_or_warns_how_many_are_cut(files, tmp_path):
    assert _prompt_length(None, np.array([3, 17, 5])) == 32 and _prompt_length(None, np.array([16])) == 16
    with pytest.warns(RuntimeWarning, match=r"2 of 3 prompts are longer than data.max_prompt_length=4 tokens \(the "
                                            r"longest: 17\): they lose their first tokens .*set it to null"):
        assert _prompt_length(4, np.array([3, 17, 5])) == 4
    tokenizer = tmp_path / "tokenizer"
    task.build_tokenizer(tokenizer)
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", *QUICK, f"data.tokenizer_path={tokenizer}",
                                f"data.path={files['parquet']}", "data.max_prompt_length=3",
                                "reward.functions=[tests.data.test_sources:digit_reward]"])
    with pytest.warns(RuntimeWarning, match="24 of 24 prompts are longer than data.max_prompt_length=3 tokens"):
        run, _, held = build(config)
    held.release()
    run, _, held = build(load_config(None, [f"output_dir={tmp_path / 'fit'}", *QUICK, f"data.tokenizer_path={tokenizer}",
                                            f"data.path={files['jsonl']}",
                                            "reward.functions=[tests.data.test_sources:digit_reward]"]))
    held.release()
    assert run.config.data.max_prompt_length == 16  # 4-token prompts, rounded up to 16


def test_a_memory_mapped_dataset_iterates_and_resumes_as_the_list_does(files):
    """A data.Dataset over a datasets.Dataset reads rows by index: the same batches as over the list, and the same
    batches again from a saved position (what a checkpoint resumes from)."""
    from grpo_jax.data import prompts as data

    tok = task.build_tokenizer()
    rows, _ = sources.load_rows(str(files["parquet"]))

    def batches(source, n, position=data.DataState(0, 0, 3)):
        tokens, offsets = data.check_prompts("rows", data.prompt_column(source), None, tok, 8, "left")
        dataset, out = data.Dataset(source, tokens, offsets, 8, tok.pad_token_id), []
        for _ in range(n):
            batch, position = data.next_batch(dataset, position, 5)
            out.append((batch.prompt_ids.tolist(), batch.prompts, batch.columns))
        return out, position

    from_list, _ = batches(ROWS, 12)
    from_dataset, _ = batches(rows, 12)
    assert from_dataset == from_list  # 12 batches of 5 over 24 rows: across epoch boundaries
    _, position = batches(rows, 7)
    assert batches(rows, 5, position)[0] == from_list[7:]


def test_prompts_that_pass_the_models_positions_are_counted_in_a_warning_or_refused(tmp_path, capsys):
    """Prompt + completion beyond model.max_position_embeddings: one warning on stderr with the count of prompts (train
    and held-out) whose tokens and a whole completion pass it; with data.truncation=error a one-line refusal."""
    import subprocess
    import sys

    from grpo_jax.api.cli import main as cli_main
    from tests.io.test_checkpoint import ROOT, TINY

    long_prompts = ["data.task_max_len=12", "model.max_position_embeddings=16", "sampling.max_completion_length=6"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={out}", *TINY, "max_steps=1",
           "eval.num_examples=8", *long_prompts]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    prompts = [json.loads(line)["prompt"] for name in ("train", "eval")
               for line in (out / "data" / f"{name}.jsonl").read_text().splitlines()]
    over = sum(len(p) + 6 > 16 for p in prompts)  # the embedded task's tokenizer: one token a character
    assert 0 < over < len(prompts)
    warned = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1 and (f"{over} of {len(prompts)} prompts (the longest: {max(map(len, prompts))} tokens) "
                                 "plus sampling.max_completion_length=6 tokens pass model.max_position_embeddings=16"
                                 in warned[0]) and "data.max_prompt_length to 10" in warned[0], result.stderr

    assert cli_main([f"output_dir={tmp_path / 'refused'}", *TINY, *long_prompts, "data.truncation=error"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("grpo-jax: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "pass model.max_position_embeddings=16" in err
