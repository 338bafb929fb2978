"""Which run folder `resume_from_checkpoint` (TRL's name) continues.

`true` with no `output_dir` picks the newest folder under `runs/` that holds a checkpoint and whose config.yaml
this config may resume (`checkpoint.check_compatible`): the same command continues its own run although each start
without `output_dir` names a new folder. A path names the run folder, or its newest checkpoint `RUN/checkpoints/N`.
Imports no jax.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

RUNS = Path("runs")  # where runs without output_dir go (`run._output_dir`)


def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in (folder / "checkpoints").glob("*") if p.name.isdigit())


def _compatible(folder: Path, config) -> bool:
    from grpo_jax.checkpoint import check_compatible
    from grpo_jax.config import resolve_defaults, to_dict, with_defaults

    try:
        saved = with_defaults(yaml.safe_load((folder / "config.yaml").read_text()))
        check_compatible(saved, to_dict(resolve_defaults(config, saved)))  # as `run.build` compares them
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):  # another run's, or unreadable
        return False
    return True


def newest_run(config, root: Path = RUNS) -> Path | None:
    """The newest run folder under `root` with a checkpoint and a config.yaml that `config` may resume."""
    folders = [p for p in root.glob("*") if p.is_dir() and _steps(p) and (p / "config.yaml").is_file()]
    folders.sort(key=lambda p: (p / "checkpoints" / str(_steps(p)[-1])).stat().st_mtime, reverse=True)
    return next((p for p in folders if _compatible(p, config)), None)


def resolve(config):
    """`config` with `output_dir` set to the run `resume_from_checkpoint` names or finds (unchanged when it is unset
    or false); a ValueError names what is missing and the fix."""
    value = config.resume_from_checkpoint
    if value in (None, False):
        return config
    if value is True and config.output_dir is None:
        found = newest_run(config)
        if found is None:
            raise ValueError(f"resume_from_checkpoint=true: no run under {RUNS}/ has a checkpoint and this config "
                             "(the keys that must stay the same on resume): give its folder as output_dir, or drop "
                             "resume_from_checkpoint to start a new run")
        return dataclasses.replace(config, output_dir=str(found))
    folder = Path(config.output_dir if value is True else value)
    if folder.parent.name == "checkpoints" and folder.name.isdigit():  # RUN/checkpoints/N
        folder, step = folder.parent.parent, int(folder.name)
        if step not in _steps(folder) or step != _steps(folder)[-1]:
            raise ValueError(f"resume_from_checkpoint={value!r}: a run resumes from its newest checkpoint, step "
                             f"{(_steps(folder) or [None])[-1]}; name the run folder {str(folder)!r}, or export that "
                             "step (`grpo-jax export`) and start a new run from it with model.path")
    if not _steps(folder):
        raise ValueError(f"resume_from_checkpoint={value!r}: {str(folder)!r} holds no checkpoint to resume: name a "
                         "run folder that does, or drop resume_from_checkpoint to start a new run")
    if config.output_dir is not None and Path(config.output_dir).resolve() != folder.resolve():
        raise ValueError(f"resume_from_checkpoint={value!r} names the run {str(folder)!r} but output_dir="
                         f"{config.output_dir!r}: give one of them")
    return dataclasses.replace(config, output_dir=str(folder), resume=True)
