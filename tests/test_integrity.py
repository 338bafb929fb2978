"""Damaged runs are never trusted, through the CLI: checkpoints without checksums, no trustworthy checkpoint left."""

from pathlib import Path

import pytest

from grpo_jax import checkpoint
from grpo_jax.cli import main as cli_main
from tests.test_checkpoint import TINY, _assert_same_state, _lines, _state, _train


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
