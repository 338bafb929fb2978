"""A run's folder: made or found (`open_folder`, locked), its saved config (`saved_config`), and which run
`resume_from_checkpoint` (TRL's name) continues (`resolve`).

`true` with no `output_dir` picks the newest folder under `runs/` that holds a checkpoint and whose config.yaml
this config may resume (`checkpoint.check_compatible`): the same command continues its own run although each start
without `output_dir` names a new folder. A path names the run folder, or its newest checkpoint `RUN/checkpoints/N`.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
from pathlib import Path

import yaml

from grpo_jax.config import resolve_defaults, to_dict, with_defaults
from grpo_jax.io import checkpoint, lock
from grpo_jax.models.registry import resolve_config

RUNS = Path("runs")  # where runs without output_dir go


def open_folder(config, *, multihost: bool, restart: bool = False) -> tuple[Path, bool, lock.RunLock]:
    """The run directory, whether it already holds this run (config.yaml or checkpoints) to resume, and its lock
    (held: one writer per run, `grpo_jax.io.lock`). `restart` (TRL's `train()` without `resume_from_checkpoint`):
    a run already there is moved to `PREVIOUS/` inside the folder (`set_aside`) and a new one starts."""
    if config.output_dir is not None:
        path = Path(config.output_dir)
        if path.is_dir() and not restart and any(p.name != lock.LOCK for p in path.iterdir()):
            if not config.resume:
                raise ValueError(f"output_dir={str(path)!r} is not empty and resume=false: choose a new output_dir, "
                                 "delete it, or set resume=true to continue the run saved there")
            if not (path / "config.yaml").is_file() and not (path / checkpoint.CHECKPOINTS).is_dir():
                raise ValueError(f"output_dir={str(path)!r} is not empty and holds no grpo_jax run (no config.yaml): "
                                 "choose a new output_dir or delete it")
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = "jsonl" if config.data.path else config.data.task
        path = RUNS / f"{name}-{stamp}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"output_dir={str(path)!r} cannot be created ({e.strerror}): choose an output_dir on a "
                         "writable filesystem") from e
    held = lock.acquire(path, multihost=multihost)
    resuming = holds_run(path)
    if restart and resuming:
        if not multihost:
            set_aside(path)
        else:
            import jax
            from jax.experimental import multihost_utils

            if jax.process_index() == 0:
                set_aside(path)
            multihost_utils.sync_global_devices("grpo_jax: the previous run set aside")
        resuming = False
    return path, resuming, held


PREVIOUS = "previous-run"  # where a restarted folder's earlier run goes (`set_aside`)


def holds_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() or (path / checkpoint.CHECKPOINTS).is_dir()


def set_aside(path: Path) -> None:
    """Moves everything in the run folder `path` but its lock into `path/PREVIOUS/` (an older one there is deleted:
    one earlier run is kept), so that a new run starts in `path` as TRL's `train()` does, and says so in one line."""
    previous = path / PREVIOUS
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir()
    for entry in path.iterdir():
        if entry.name not in (lock.LOCK, PREVIOUS):
            entry.rename(previous / entry.name)
    print(f"grpo_jax: training from the start as TRL does; the earlier run in {path} is now in {previous} "
          "(train(resume_from_checkpoint=True) continues a run instead)")


def saved_config(output_dir: Path, config) -> tuple[dict, dict]:
    """(saved, given) configs of a resumed run as `checkpoint.check_compatible` compares them: config.yaml and
    `config`; when config.yaml was deleted, the config of the newest checkpoint (whose model section is resolved)
    and `config` resolved the same way (`model.path`'s architecture, the vocabulary size the run found). Either
    way `config`'s null learning rate is the saved one (`config.resolve_defaults`), as the resumed run takes it."""
    path = output_dir / "config.yaml"
    if path.is_file():
        try:
            saved = yaml.safe_load(path.read_text())
            why = None if isinstance(saved, dict) else f"a YAML {type(saved).__name__}, not a mapping of keys"
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            why = "invalid YAML: " + " ".join(str(e).split())[:200]  # one line
        if why is not None:
            raise ValueError(f"{path} is not a run's config ({why}): put the saved config.yaml back, or delete it to "
                             "resume with the config held by the newest checkpoint")
        return with_defaults(saved), to_dict(resolve_defaults(config, saved))
    saved = checkpoint.saved_config(output_dir)
    if saved is None:
        raise ValueError(f"output_dir={str(output_dir)!r} has checkpoints but neither its config.yaml nor any "
                         "checkpoint's config could be read: put config.yaml back, or choose a new output_dir "
                         f"(keep {output_dir / checkpoint.CHECKPOINTS} until you no longer need it)")
    model = resolve_config(config.model)
    if model.vocab_size is None:
        model = dataclasses.replace(model, vocab_size=saved.get("model", {}).get("vocab_size"))
    data_config = config.data
    if data_config.max_prompt_length is None:  # fitted to the data: the saved run's value
        data_config = dataclasses.replace(data_config,
                                          max_prompt_length=saved.get("data", {}).get("max_prompt_length"))
    config = resolve_defaults(dataclasses.replace(config, model=model, data=data_config), saved)
    return with_defaults(saved), to_dict(config)


SETUP_FILES = ("data", "tokenizer")  # what `run._build` writes into a new output_dir before config.yaml


def remove_setup_files(output_dir: Path) -> None:
    """A build that failed on a new output_dir leaves it as it found it (config.yaml is written last, so none
    is there): the same command, corrected, starts cleanly instead of meeting a half-made run."""
    for name in SETUP_FILES:
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in (folder / checkpoint.CHECKPOINTS).glob("*") if p.name.isdigit())


def _compatible(folder: Path, config) -> bool:
    try:
        checkpoint.check_compatible(*saved_config(folder, config))  # as `run.build` compares them
    except (OSError, ValueError, TypeError, AttributeError):  # another run's, or unreadable
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
