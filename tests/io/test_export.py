"""Export: `grpo-jax export` of a checkpoint writes the params it holds (Hugging Face or native format)."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from grpo_jax.api import trainer
from grpo_jax.api.cli import main as cli_main
from grpo_jax.config import load_config
from grpo_jax.io import checkpoint, export
from tests.io.test_checkpoint import ROOT, TINY, _flat, _train


def test_export_round_trip(tmp_path, capsys):
    """`grpo-jax export` of a run (and of one step folder) writes the params the checkpoint holds."""
    _train(tmp_path / "run", "max_steps=2", "save_steps=1")
    for source, step in ((tmp_path / "run", 2), (tmp_path / "run" / "checkpoints" / "1", 1)):
        out = tmp_path / f"export{step}"
        assert cli_main(["export", "--checkpoint", str(source), "--out", str(out)]) == 0
        assert f"step {step}'s policy written" in capsys.readouterr().out
        mngr = ocp.CheckpointManager((tmp_path / "run" / "checkpoints").absolute())
        saved = jax.device_get(mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore())).state["params"])
        if (out / "config.json").is_file():  # Hugging Face format
            from grpo_jax.models import from_pretrained
            _, params = from_pretrained(str(out))
        else:
            _, params = export.load_native(out)
        loaded, saved = _flat(jax.device_get(params)), _flat(saved)
        for key, value in saved.items():
            np.testing.assert_array_equal(loaded.pop(key), value, err_msg=key)
        # Qwen2 in transformers always has q/k/v biases: a model without them comes back with zero biases
        assert all(key.endswith("bias/value") and not value.any() for key, value in loaded.items()), sorted(loaded)
        assert (out / "tokenizer.json").is_file()
    assert cli_main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 1
    assert "neither a run's output_dir" in capsys.readouterr().err
    # an existing folder is never deleted or overwritten unless asked, and then only by a complete export
    (out / "notes.txt").write_text("mine")
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 1
    assert "already exists and is not empty: choose a new folder, or pass --overwrite" in capsys.readouterr().err
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export1", "export2", "run"]  # no temporary folder left
    assert cli_main(["verify", str(tmp_path / "run")]) == 0
    assert "checkpoints/2: ok" in capsys.readouterr().out


def test_export_reference_writes_the_reference_a_synced_run_saved(tmp_path, run_dir, capsys):
    """`--reference` writes the checkpoint's `ref_params` (saved where train.sync_ref_model moves them): here mixed
    toward the policy at every step, so neither the policy nor the initial model. A run without it keeps no
    reference (the initial model is its reference): one line says so."""
    from grpo_jax.models import from_pretrained

    _train(tmp_path / "run", "max_steps=2", "loss.beta=0.1", "train.sync_ref_model=true",
           "train.ref_model_sync_steps=1", "train.ref_model_mixup_alpha=0.5")
    out = tmp_path / "ref"
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out), "--reference"]) == 0
    assert "step 2's reference model written" in capsys.readouterr().out
    mngr = ocp.CheckpointManager((tmp_path / "run" / "checkpoints").absolute())
    saved = jax.device_get(mngr.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state)
    loaded = _flat(jax.device_get(from_pretrained(str(out))[1]))
    ref, params = _flat(saved["ref_params"]), _flat(saved["params"])
    for key, value in ref.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    assert any(not np.array_equal(ref[k], params[k]) for k in ref)
    assert cli_main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "none"), "--reference"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no reference model: without train.sync_ref_model" in err[0], err
    assert not (tmp_path / "none").exists()


def test_a_failed_export_leaves_the_folder_as_it_was(tmp_path, tiny_model, monkeypatch):
    """The Hugging Face write fails on a full disk (injected) after writing part of the files: the user's folder
    keeps its files, nothing half-written is left, and the error is the disk's (no fallback, no exit 0)."""
    import errno

    config, graphdef, params = tiny_model
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("the user's own")

    def disk_full(model, params, path, **kwargs):
        (path / "model.safetensors").parent.mkdir(parents=True)
        (path / "model.safetensors").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "model.safetensors"))

    monkeypatch.setattr(export, "save_pretrained", disk_full)  # where export_policy looks it up
    with pytest.raises(OSError, match="No space left on device"):
        export.export_policy(graphdef, config, params, out, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [(p.name, p.read_text()) for p in out.iterdir()] == [("model.safetensors", "the user's own")]
    with pytest.raises(ValueError, match="already exists and is not empty"):
        export.export_policy(graphdef, config, params, out)
    bad = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan) if x.ndim else x, params)
    with pytest.raises(ValueError, match="hold NaN or inf"):
        export.export_policy(graphdef, config, bad, tmp_path / "new")


def test_export_prints_no_read_only_notes(tmp_path, caplog):
    """`grpo-jax export` opens the run read-only on purpose: orbax's three absl notes saying so are dropped, and
    only they (another absl warning still shows)."""
    _train(tmp_path / "run", "max_steps=1")
    result = subprocess.run([sys.executable, "-m", "grpo_jax", "export", "--checkpoint", str(tmp_path / "run"),
                             "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout == f"grpo-jax export: step 1's policy written to {tmp_path / 'out'} in Hugging Face format\n"
    with caplog.at_level(logging.WARNING, logger="absl"), checkpoint.quiet_read_only_notes():
        logging.getLogger("absl").warning("Given directory is read only=%s", tmp_path)
        logging.getLogger("absl").warning("CheckpointManagerOptions.read_only=True, setting create=False.")
        logging.getLogger("absl").warning("Given directory is not writable")
    assert [r.getMessage() for r in caplog.records] == ["Given directory is not writable"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A 2-step run on the embedded task, checkpoints at 1 and 2, its policy in final/."""
    out = tmp_path_factory.mktemp("exported") / "run"
    _train(out, "max_steps=2", "save_steps=1")
    return out


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_never_writes_over_a_run_folder(run_dir, tmp_path, capsys):
    """--out the run itself, a folder inside it or holding it, or any other run folder: refused in one line, even
    with --overwrite, and the run keeps every file."""
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("seed: 0\n")
    before, others = _tree(run_dir), _tree(other)
    cases = {run_dir: "is the run folder being exported", run_dir / "checkpoints": "is inside the run folder",
             run_dir / "checkpoints" / "2": "is inside the run folder", run_dir / "final": "is inside the run folder",
             run_dir.parent: "holds the run folder being exported", other: "is a run folder (config.yaml"}
    for source in (run_dir, run_dir / "checkpoints" / "1"):
        for out, why in cases.items():
            assert cli_main(["export", "--checkpoint", str(source), "--out", str(out), "--overwrite"]) == 1, out
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"grpo-jax export: --out {str(out.resolve())!r} {why}"), err
            assert "--overwrite does not apply" in err[0]
    assert _tree(run_dir) == before and _tree(other) == others
    assert cli_main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf")]) == 0


def test_a_runs_export_trains_on_as_model_path(run_dir, tmp_path):
    """final/ (written through export.export_policy) loads back as model.path: the tokenizer it saved reads back
    with the run's tokens and ids (transformers would swap in Qwen2Tokenizer, one token more), and 2 more steps
    train from it in a new output_dir."""
    from grpo_jax.data import prompts as data, task

    run_tok, final_tok = data.load_tokenizer(run_dir / "tokenizer"), data.load_tokenizer(run_dir / "final")
    assert final_tok.get_vocab() == run_tok.get_vocab() == task.build_tokenizer().get_vocab()
    prompts = [json.loads(line)["prompt"] for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    assert final_tok(prompts[:50] + ["12 3>"])["input_ids"] == run_tok(prompts[:50] + ["12 3>"])["input_ids"]
    config = load_config(None, [f"output_dir={tmp_path / 'next'}", f"model.path={run_dir / 'final'}", "max_steps=2",
                                *(o for o in TINY if not o.startswith("model."))])
    summary = trainer.train(config, show_progress=False)
    assert summary["steps"] == 2 and (tmp_path / "next" / "final" / "model.safetensors").is_file()
