"""Damaged runs are never trusted, through the CLI: checkpoints without checksums, no trustworthy checkpoint left, an
invalid config.yaml, a file-size limit hit while saving, and data changed under a checkpoint (its fingerprint)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_jax.api.cli import main as cli_main
from grpo_jax.data import sources, task
from grpo_jax.io import checkpoint
from tests.io.test_checkpoint import ROOT, TINY, _assert_same_state, _lines, _state, _train


def _error_lines(err: str) -> list[str]:
    """stderr without the progress lines `--no-progress` prints there."""
    return [line for line in err.splitlines() if line and not line.startswith("grpo step")]


def _tree(folder: Path) -> dict:
    """Every file under `folder` with its bytes: what a failed start must leave as it found it."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_checkpoint_without_checksums_is_not_trusted_and_none_left_is_one_line(tmp_path, capsys):
    """checksums.json of the newest step deleted (nothing can tell a damaged file from a whole one then): the step is
    moved aside and the run replays from the previous one, ending where it had ended. With no trustworthy step left:
    one line, nothing moved."""
    out = tmp_path / "run"
    args = ["--no-progress", f"output_dir={out}", *TINY, "max_steps=4", "save_steps=2"]
    _train(out, "max_steps=4", "save_steps=2")
    lines, (state, _) = _lines(out), _state(out)
    (out / "checkpoints" / "4" / checkpoint.CHECKSUMS).unlink()
    with pytest.warns(RuntimeWarning, match=r"checkpoints/4 could not be restored \(ValueError: checkpoint 4 is not "
                                            r"trusted: no checksums.json.*resuming from step 2"):
        assert cli_main(args) == 0
    assert [p.name.split("-")[0] for p in (out / checkpoint.UNREADABLE).iterdir()] == ["4"]
    assert _lines(out) == lines
    _assert_same_state(_state(out)[0], state)
    assert cli_main(["verify", str(out)]) == 0
    capsys.readouterr()

    for step in (2, 4):  # both damaged: no checksums left to trust them by
        (out / "checkpoints" / str(step) / checkpoint.CHECKSUMS).unlink()
    before = _tree(out / "checkpoints"), _tree(out / checkpoint.UNREADABLE), (out / "metrics.jsonl").read_bytes()
    assert cli_main(args) == 1
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith(f"grpo-jax: no trustworthy checkpoint in {out / 'checkpoints'} (step 4:")
    assert "step 2: ValueError: checkpoint 2 is not trusted" in err[0] and "nothing was moved or deleted" in err[0]
    assert (_tree(out / "checkpoints"), _tree(out / checkpoint.UNREADABLE), (out / "metrics.jsonl").read_bytes()) \
        == before
    assert cli_main(["verify", str(out)]) == 1
    assert capsys.readouterr().out.count("NOT TRUSTED: no checksums.json") == 2


def test_an_invalid_config_yaml_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("model: {hidden_size: 32\nseed: [\n")
    assert cli_main([f"output_dir={tmp_path}", *TINY]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"grpo-jax: {tmp_path / 'config.yaml'} is not a run's config "
                                               "(invalid YAML: "), err
    assert err[0].endswith("put the saved config.yaml back, or delete it to resume with the config held by the "
                           "newest checkpoint")
    (tmp_path / "config.yaml").write_text("- a list\n")
    assert cli_main([f"output_dir={tmp_path}", *TINY]) == 1
    assert "(a YAML list, not a mapping of keys)" in capsys.readouterr().err


# bytes: a checkpoint of the test's model (~12 MB with Adam's moments) cannot be written however orbax splits its
# files; its metrics can
LIMIT = 256 << 10


def test_a_file_size_limit_is_a_storage_error_in_one_line(tmp_path):
    """`ulimit -f` (EFBIG; Python ignores SIGXFSZ) while the first checkpoint is written: one message naming the
    limit, exit 1, no traceback, as for a full disk."""
    limited = ("import resource, runpy; resource.setrlimit(resource.RLIMIT_FSIZE, "
               f"({LIMIT}, resource.RLIM_INFINITY)); runpy.run_module('grpo_jax', run_name='__main__')")
    cmd = [sys.executable, "-c", limited, "--no-progress", f"output_dir={tmp_path / 'run'}", *TINY,
           "model.hidden_size=256", "model.intermediate_size=1024", "max_steps=2", "save_steps=1",
           "data.task_num_train=200"]  # the task's rows (data/train.jsonl) well under the limit: the checkpoint hits it
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    err = _error_lines(result.stderr)
    assert result.returncode == 1 and len(err) == 1, result.stderr
    assert err[0].startswith(f"grpo-jax: a file in {tmp_path / 'run'}") and f"({LIMIT:,} bytes, `ulimit -f`)" in err[0]
    assert "raise it (`ulimit -f unlimited`)" in err[0]


# --- the data a checkpoint indexes ------------------------------------------------------------------------


def test_the_fingerprint_follows_the_rows_not_the_file_times(tmp_path, monkeypatch):
    """Same rows, same fingerprint (a touched file too); reordered or edited rows, another. A file over the
    whole-file limit is hashed by blocks and its size: an edit inside a block or a changed size shows."""
    rows = [{"prompt": f"{i}>", "answer": str(i)} for i in range(50)]
    path = tmp_path / "d.jsonl"
    task.write_jsonl(path, rows)
    first = sources.fingerprint(rows, str(path), path=str(path))
    assert first["rows"] == 50 and first["bytes"] == path.stat().st_size and first["of"] == "the files' bytes"
    path.touch()
    assert sources.fingerprint(rows, str(path), path=str(path)) == first
    task.write_jsonl(path, rows[::-1])
    assert sources.fingerprint(rows[::-1], str(path), path=str(path))["hash"] != first["hash"]
    assert sources.fingerprint(rows, "x")["hash"] != sources.fingerprint(rows[::-1], "x")["hash"]
    assert sources.fingerprint(rows, "x") == sources.fingerprint([dict(r) for r in rows], "x")
    import datasets  # a Dataset made the same way each run: the same fingerprint although .map takes a new lambda

    def made(rows):
        return datasets.Dataset.from_list(rows).map(lambda r: {"solution": r["answer"]}).select(range(10, 40))

    assert sources.fingerprint(made(rows), "x") == sources.fingerprint(made(rows), "x")
    assert sources.fingerprint(made(rows), "x")["rows"] == 30
    assert sources.fingerprint(made(rows[::-1]), "x")["hash"] != sources.fingerprint(made(rows), "x")["hash"]

    monkeypatch.setattr(sources, "WHOLE_FILE_BYTES", 100)
    monkeypatch.setattr(sources, "SAMPLE_BYTES", 8)
    blob = bytearray(range(256)) * 40
    path.write_bytes(bytes(blob))
    sampled = sources.fingerprint(rows, str(path), path=str(path))
    assert sampled["of"].startswith(f"{sources.SAMPLES} blocks")
    blob[0] ^= 1  # the first block is always sampled
    path.write_bytes(bytes(blob))
    assert sources.fingerprint(rows, str(path), path=str(path))["hash"] != sampled["hash"]
    path.write_bytes(bytes(blob) + b"\n")
    assert sources.fingerprint(rows, str(path), path=str(path))["bytes"] == len(blob) + 1


@pytest.fixture
def jsonl_run(tmp_path):
    """(output_dir, data file, CLI args) of a 2-step run on a JSONL file with the embedded task's rows."""
    task.build_tokenizer(tmp_path / "tok")
    data = tmp_path / "train.jsonl"
    rows = task.make_examples("reverse", 64, 0, 3, 4)
    task.write_jsonl(data, rows)
    out = tmp_path / "run"
    args = [f"output_dir={out}", *TINY, f"data.path={data}", f"data.tokenizer_path={tmp_path / 'tok'}", "save_steps=2",
            "model.init=random"]
    _train(out, *args[1:], "max_steps=2")
    return out, data, rows, args


def test_a_resume_over_changed_data_is_refused_with_both_fingerprints(jsonl_run, capsys):
    """The rows reordered under the same data.path: refused in one line naming both fingerprints; with
    data.allow_changed=true the run continues (warned); a checkpoint from before fingerprints resumes as before."""
    out, data, rows, args = jsonl_run
    saved = json.loads((out / "checkpoints" / "2" / "meta" / "metadata").read_text())["data_fingerprint"]
    assert saved["rows"] == 64 and saved["bytes"] == data.stat().st_size
    task.write_jsonl(data, rows[::-1])
    assert cli_main(["--no-progress", *args, "max_steps=3"]) == 1
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(f"grpo-jax: cannot resume: the training data ({data}) differ from "
                                               "those checkpoint 2 indexes (now: 64 rows, "), err
    now = sources.fingerprint(rows[::-1], str(data), path=str(data))
    assert f"xxh3 {now['hash']} of" in err[0] and f"then: {data}, 64 rows, {saved['bytes']:,} bytes, xxh3 " \
        f"{saved['hash']} of" in err[0] and now["hash"] != saved["hash"]
    assert "set data.allow_changed=true" in err[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2"]  # nothing trained, nothing saved

    with pytest.warns(RuntimeWarning, match="differ from those checkpoint 2 indexes .*data.allow_changed=true"):
        assert cli_main(["--no-progress", *args, "max_steps=3", "data.allow_changed=true"]) == 0
    assert [line["step"] for line in _lines(out)] == [1, 2, 3]

    # a checkpoint written before fingerprints: its meta without one (checksums recorded again), as such a run saved
    meta = out / "checkpoints" / "3" / "meta" / "metadata"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "data_fingerprint"}))
    checkpoint.write_checksums(out / "checkpoints" / "3")
    task.write_jsonl(data, rows)
    assert cli_main(["--no-progress", *args, "max_steps=4"]) == 0
    assert [line["step"] for line in _lines(out)] == [1, 2, 3, 4]
