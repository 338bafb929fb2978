"""Checkpoints of a run: orbax saves, exact restores and the config compatibility of a resume.

A checkpoint is one orbax `CheckpointManager` step folder `output_dir/checkpoints/<step>/` with three items:
`state` (the `TrainState` pytree; `ref_params` only when `train.sync_ref_model` can move it away from the
initial weights, otherwise rebuilt from the same initialisation at restore), `meta` (JSON: round index, data
iterator position, the metrics history, eval before training, the mid-round buffer's scalars) and, when the
run stopped inside a round, `buffer` (that round's row arrays). Orbax writes a step to a temporary folder and
renames it when every item is complete, so a save cut short is never listed; a listed step that fails to
read is skipped with a warning in favour of the previous one.

Each step folder also holds `checksums.json`: the size and xxh3-128 hash of every file orbax wrote, recorded
while the step is still in its temporary folder (so a listed step always has them) and checked before a
restore; a step whose files differ, or that has no `checksums.json` (deleted, or a grpo_jax from before checksums
wrote it: nothing says its files are whole), is treated like one that fails to read. `grpo-jax verify` checks them
all.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import xxhash

from grpo_jax.algo.trajectory import Trajectory
from grpo_jax.config import flatten

CHECKPOINTS = "checkpoints"
UNREADABLE = "unreadable_checkpoints"  # where restore_latest moves steps that fail to read
CHECKSUMS = "checksums.json"  # in each step folder: {"algorithm", "files": {relative path: [size, hex digest]}}
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's temporary step folders: `<step>.orbax-checkpoint-tmp`
UNHASHED = (CHECKSUMS, "_CHECKPOINT_METADATA")  # orbax rewrites its step metadata (timestamps) at the rename
# top-level and section keys that may change between a run and its resume (dotted; "eval" covers the section)
# where the processes meet and how the devices are laid out: a rescheduled pod job, or fewer or more hosts
RESUMABLE_KEYS = ("output_dir", "distributed", "mesh", "max_steps", "logging_steps", "save_steps", "save_total_limit",
                  "resume", "resume_from_checkpoint",
                  "cpu_speedups", "host_allocator", "compilation_cache_dir", "eval", "train.max_nonfinite_steps",
                  "train.stop_on_zero_gradient",
                  "data.allow_changed", "reward.allow_changed", "num_train_epochs", "disable_tqdm",
                  "sampling.host_threads", "sampling.max_batch_rows", "sampling.tool_timeout", "report_to",
                  "log_completions", "num_completions_to_print")


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.relative_to(step_dir).as_posix() not in UNHASHED)


def write_checksums(step_dir: Path) -> None:
    """Records the size and xxh3-128 hash of every file under `step_dir` in its `checksums.json`."""
    step_dir = Path(step_dir)
    files = {p.relative_to(step_dir).as_posix(): [p.stat().st_size, _digest(p)] for p in _files(step_dir)}
    partial = step_dir / (CHECKSUMS + ".partial")
    partial.write_text(json.dumps({"algorithm": "xxh3_128", "files": files}, indent=0))
    os.replace(partial, step_dir / CHECKSUMS)


NO_CHECKSUMS = f"no {CHECKSUMS}: its files cannot be checked (deleted, or written before grpo_jax recorded them)"


def verify_step(step_dir: Path) -> list[str]:
    """What is wrong with the files of a step folder against its `checksums.json` (empty: all match); a step
    without checksums.json is not trusted (`NO_CHECKSUMS`): a damaged file would load silently."""
    step_dir = Path(step_dir)
    try:
        recorded = json.loads((step_dir / CHECKSUMS).read_text())["files"]
    except FileNotFoundError:
        return [NO_CHECKSUMS]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{CHECKSUMS} is unreadable ({type(e).__name__}: {e})"]
    problems = []
    for name, (size, digest) in recorded.items():
        path = step_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, {size} when written")
        elif _digest(path) != digest:
            problems.append(f"{name}: contents differ from when written (xxh3_128 {digest})")
    return problems


class _RecordChecksums:
    """orbax's post-finalization callback: runs on process 0 once every process's files of a step are written and
    before orbax renames its temporary folder, so the step is listed only with its checksums. With one writer per
    output_dir (the run's lock) and leftovers removed at start, the temporary folder is the step being saved."""

    def __init__(self, directory: Path):
        self.directory = directory

    def __call__(self) -> None:
        for tmp in self.directory.glob("*" + TMP_SUFFIX):
            write_checksums(tmp)


def manager(output_dir: Path, *, save_total_limit: int | None = None) -> ocp.CheckpointManager:
    """The run's CheckpointManager over `output_dir/checkpoints` (keeps `save_total_limit` steps; None: all).

    Asynchronous saves that record checksums; temporary folders of saves cut short are removed (call it only
    while holding the run's lock, `grpo_jax.io.lock`).
    """
    directory = Path(output_dir).absolute() / CHECKPOINTS
    options = ocp.CheckpointManagerOptions(
        max_to_keep=save_total_limit, create=True, cleanup_tmp_directories=True,
        async_options=ocp.AsyncOptions(post_finalization_callback=_RecordChecksums(directory)))
    return ocp.CheckpointManager(directory, options=options)


def nonfinite_leaves(tree) -> list[str]:
    """Key paths of the leaves of `tree` holding a NaN or an infinity (a reduction a leaf where it lives, one small
    fetch; `grpo_jax.algo.programs` is the only place that jits)."""
    inexact = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
               if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not inexact:
        return []
    finite = jax.device_get(jnp.stack([jnp.isfinite(x).all() for _, x in inexact]))
    return [jax.tree_util.keystr(path) for (path, _), ok in zip(inexact, finite) if not ok]


def _saved_state(state, keep_ref: bool):
    return state if keep_ref else state._replace(ref_params=None)


def nbytes(state, keep_ref: bool, arrays: dict | None = None) -> int:
    """About the bytes a checkpoint of `state` (and `arrays`) takes on disk: its arrays, uncompressed."""
    leaves = jax.tree.leaves(_saved_state(state, keep_ref)) + list((arrays or {}).values())
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in leaves))


def save(mngr: ocp.CheckpointManager, state, *, keep_ref: bool, meta: dict, arrays: dict | None = None,
         wait: bool = False) -> None:
    """Saves `state` (at its own step), the JSON `meta` and optional host `arrays`, collectively on all hosts.

    The call returns once the arrays are copied off the devices (the state may then be donated); the write
    finishes in the background unless `wait`. Params holding a NaN or an infinity are refused (ValueError).
    """
    step = int(state.step)
    bad = nonfinite_leaves(state.params)
    if bad:
        raise ValueError(f"checkpoint {step} not written: params {', '.join(bad[:5])} hold NaN or inf (every "
                         "update that would make a parameter non-finite is skipped, so the initial weights "
                         "(model.path) already held them)")
    items = {"state": ocp.args.StandardSave(_saved_state(state, keep_ref)),
             "meta": ocp.args.JsonSave({**meta, "step": step, "ref_params_saved": keep_ref,
                                        "arrays": {k: [list(np.shape(v)), str(np.dtype(v.dtype))]
                                                   for k, v in (arrays or {}).items()}})}
    if arrays:
        items["buffer"] = ocp.args.StandardSave(dict(arrays))
    mngr.save(step, args=ocp.args.Composite(**items), force=True)
    if wait:
        mngr.wait_until_finished()


def abstract(tree):
    """ShapeDtypeStructs with the shardings of `tree`: restore targets that land in the same layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def check_checksums(directory: Path, step: int) -> None:
    """Raises a ValueError naming the files of checkpoint `step` that differ from its checksums; process 0 reads
    the files and every process of a multi-host run gets its answer."""
    problems = verify_step(Path(directory) / str(step)) if jax.process_index() == 0 else []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        count = int(multihost_utils.broadcast_one_to_all(np.int32(len(problems))))
        problems = problems or [f"{count} file(s), named in process 0's warning"] * (count > 0)
    if problems == [NO_CHECKSUMS]:
        raise ValueError(f"checkpoint {step} is not trusted: {NO_CHECKSUMS}")
    if problems:
        raise ValueError(f"checkpoint {step} does not match its {CHECKSUMS}: " + "; ".join(problems[:5])
                         + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))


def restore_step(mngr: ocp.CheckpointManager, step: int, fresh_state, *, keep_ref: bool):
    """(state, meta, arrays) of one step, restored into the shardings of `fresh_state` (a freshly built state),
    after its files are checked against their checksums (`check_checksums`)."""
    check_checksums(mngr.directory, step)
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    if meta.get("ref_params_saved") != keep_ref:
        raise ValueError(f"checkpoint {step} was saved with ref_params_saved={meta.get('ref_params_saved')}, "
                         f"this run needs {keep_ref}")
    items = {"state": ocp.args.StandardRestore(abstract(_saved_state(fresh_state, keep_ref)))}
    if meta["arrays"]:
        items["buffer"] = ocp.args.StandardRestore(
            {k: np.zeros(shape, dtype) for k, (shape, dtype) in meta["arrays"].items()})
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    state = restored.state if keep_ref else restored.state._replace(ref_params=fresh_state.ref_params)
    if int(state.step) != step or meta["step"] != step:
        raise ValueError(f"checkpoint {step} holds step {int(state.step)} (meta: {meta['step']})")
    return state, meta, dict(restored.buffer) if meta["arrays"] else {}


def restore_latest(mngr: ocp.CheckpointManager, fresh_state, *, keep_ref: bool):
    """The newest checkpoint that reads back and matches its checksums, as (step, state, meta, arrays), or None
    when there is none.

    Newer steps that fail (torn, damaged, no checksums.json) are moved to `unreadable_checkpoints/` next to the
    checkpoints folder with a warning each (the resumed run saves those steps again; a user can move them back).
    When every listed step fails, nothing is moved and a one-line ValueError names them and what to do.
    """
    directory = Path(mngr.directory)
    errors = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            restored = (step, *restore_step(mngr, step, fresh_state, keep_ref=keep_ref))
        except Exception as e:  # noqa: BLE001 - any read failure means "not a usable checkpoint"
            errors.append((step, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"))  # one line
            continue
        if errors:
            _move_aside(mngr, errors, used=step)
        return restored
    if errors:
        raise ValueError(f"no trustworthy checkpoint in {directory} (" + "; ".join(f"step {s}: {e}" for s, e in errors)
                         + f"): nothing was moved or deleted; `grpo-jax verify {directory.parent}` lists what "
                         "differs. Start again from step 0 with a new output_dir (or move this one away)")
    return None


class Resumed(NamedTuple):
    """A run's newest checkpoint as the loop continues from it (`resume`), older layouts read as today's."""

    step: int
    state: object  # the `TrainState`
    data: dict  # the data position's fields (`data.DataState`)
    round_index: int
    history: list  # the metrics lines so far
    eval_before: dict | None
    buffer: dict | None  # the scalars of the round the run stopped inside (None: between rounds)
    rows: Trajectory | None  # that round's rows on the host (`saved_rows`)
    token_counts: np.ndarray | None  # [N, 2] their real prompt and completion tokens
    arrays: dict  # every host array saved (asynchronous rounds' params versions too)


def resume(mngr: ocp.CheckpointManager, fresh_state, *, keep_ref: bool, seed: int,
           fingerprints: dict[str, Callable]) -> Resumed | None:
    """The newest valid checkpoint (`restore_latest`) as a `Resumed`, None when there is none. ``fingerprints``: a
    check of each fingerprint the meta holds by its key, ``check(saved or None, step=)`` -> None, or the warning of a
    change allowed (it raises for one refused): the data's and the reward/tool code's. A checkpoint from before a
    fingerprint (None), the data seed or trajectories (`saved_rows`) is read as the run that wrote it trained."""
    restored = restore_latest(mngr, fresh_state, keep_ref=keep_ref)
    if restored is None:
        return None
    step, state, meta, arrays = restored
    for key, check in fingerprints.items():
        changed = check(meta.get(key), step=step)
        if changed:
            warnings.warn(changed, RuntimeWarning, stacklevel=3)
    rows, counts = saved_rows(arrays) if meta["buffer"] is not None else (None, None)
    return Resumed(step, state, {"seed": seed, **meta["data"]}, meta["round_index"], meta["history"],
                   meta["eval_before"], meta["buffer"], rows, counts, arrays)  # older runs saved no data seed


def saved_rows(arrays: dict) -> tuple[Trajectory, np.ndarray]:
    """A checkpoint's round rows (host arrays by field name) and their [N, 2] real prompt / completion tokens. A
    round saved before trajectories (no ``loss_mask``) trained and attended its ``completion_mask`` alike: it
    becomes both masks, one turn a row."""
    if "loss_mask" not in arrays:
        mask = arrays["completion_mask"]
        arrays = {"sampler_per_token_logps": np.zeros(mask.shape, np.float32), **arrays, "loss_mask": mask,
                  "turns": np.where(mask == 1, 0, -1).astype(np.int32), "is_truncated": np.zeros(len(mask), bool)}
    counts = arrays.get("token_counts")
    if counts is None:
        counts = np.stack([np.sum(arrays["prompt_mask"], 1), np.sum(arrays["completion_mask"], 1)], 1).astype(np.int32)
    return Trajectory(**{k: arrays.get(k) for k in Trajectory._fields}), counts


def _move_aside(mngr: ocp.CheckpointManager, errors: list[tuple[int, str]], *, used: int) -> None:
    """Moves the failed steps of `errors` ((step, why) pairs) to `unreadable_checkpoints/<step>-<time>` (process 0),
    with a warning each."""
    directory = Path(mngr.directory)
    aside = directory.parent / UNREADABLE
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for step, error in errors:
        warnings.warn(f"checkpoint {directory / str(step)} could not be restored ({error}): resuming from step "
                      f"{used}; the step is moved to {aside / f'{step}-{stamp}'}", RuntimeWarning, stacklevel=3)
    if jax.process_index() == 0:
        aside.mkdir(exist_ok=True)
        for step, _ in errors:
            shutil.move(str(directory / str(step)), str(aside / f"{step}-{stamp}"))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("grpo_jax: unreadable checkpoints moved")
    mngr.reload()


def verify_run(path: str | os.PathLike) -> tuple[bool, list[str]]:
    """`grpo-jax verify`: every checkpoint of an output_dir (or one step folder) against its checksums.json.

    Returns (every checkpoint matches its checksums, one line per step folder). Steps without checksums.json are
    listed as not trusted; temporary folders of saves cut short as never loaded.
    """
    path = Path(path).absolute()
    if (path / CHECKPOINTS).is_dir():
        folders = sorted((p for p in (path / CHECKPOINTS).iterdir() if p.is_dir()),
                         key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    elif path.is_dir() and path.name.isdigit() and path.parent.name == CHECKPOINTS:
        folders = [path]
    else:
        raise ValueError(f"{str(path)!r} is neither a run's output_dir (with a {CHECKPOINTS}/ folder) nor a "
                         f"checkpoint step folder ({CHECKPOINTS}/<step>)")
    ok, lines = True, []
    for folder in folders:
        name = f"{CHECKPOINTS}/{folder.name}"
        if TMP_SUFFIX in folder.name:
            lines.append(f"{name}: a save cut short: never loaded, removed when the run starts again")
            continue
        problems = verify_step(folder)
        skipped = f"(a resumed run skips this step and moves it to {UNREADABLE}/)"
        if problems == [NO_CHECKSUMS]:
            ok = False
            lines.append(f"{name}: NOT TRUSTED: {NO_CHECKSUMS} {skipped}")
        elif problems:
            ok = False
            lines.append(f"{name}: CORRUPTED: {len(problems)} file(s) differ from when written {skipped}")
            lines += [f"  {p}" for p in problems]
        else:
            files = _files(folder)
            lines.append(f"{name}: ok ({len(files)} files, {sum(f.stat().st_size for f in files):,} bytes)")
    if not folders:
        lines.append(f"no checkpoint in {path / CHECKPOINTS}")
    return ok, lines


class _ReadOnlyNotes(logging.Filter):
    """orbax's notes that a read-only CheckpointManager will not save (three absl WARNING lines each time a run is
    opened read-only on purpose); every other absl record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("CheckpointManagerOptions.read_only=True")
                    or message.startswith("Given directory is read only"))


@contextlib.contextmanager
def quiet_read_only_notes():
    """Within it, `_ReadOnlyNotes` drops orbax's read-only notes from the absl logger."""
    notes, logger = _ReadOnlyNotes(), logging.getLogger("absl")
    logger.addFilter(notes)
    try:
        yield
    finally:
        logger.removeFilter(notes)


def read_only_manager(directory: Path) -> ocp.CheckpointManager:
    """A run's checkpoints folder opened to read only, without orbax's notes saying so."""
    with quiet_read_only_notes():
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))


def saved_meta(output_dir: Path) -> dict | None:
    """The JSON meta (config, metrics history, fingerprints) of the newest checkpoint of `output_dir` that reads, or
    None."""
    directory = Path(output_dir).absolute() / CHECKPOINTS
    mngr = read_only_manager(directory)
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001 - an unreadable step: try the previous one
            warnings.warn(f"checkpoint {directory / str(step)}: its meta could not be read ({e})", RuntimeWarning,
                          stacklevel=2)
    return None


def saved_config(output_dir: Path) -> dict | None:
    """The config (a dict) held by the newest checkpoint of `output_dir` that reads, or None."""
    meta = saved_meta(output_dir)
    return None if meta is None else meta["config"]


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def _gone(value) -> list[str]:
    """The "grpo_jax.module:attribute" strings in `value` (a string or a list) whose module grpo_jax no longer has."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, str) and v.startswith("grpo_jax.") and ":" in v
            and importlib.util.find_spec(v.partition(":")[0]) is None]


def check_compatible(saved: dict, new: dict) -> None:
    """Raises a ValueError listing every dotted key (with both values) that differs and may not change on resume;
    one line when the saved config.yaml names a grpo_jax module path that is gone (the flat layout's, from before
    the subpackages: `grpo_jax.task:char_accuracy`)."""
    saved_flat, new_flat = flatten(saved), flatten(new)
    gone = [(k, path) for k, v in saved_flat.items() for path in _gone(v)]
    if gone:
        key, path = gone[0]
        raise ValueError(f"cannot resume: the saved run's config.yaml names {path!r} ({key}), a grpo_jax module path "
                         "from before its subpackage layout that no longer exists; start a new output_dir, or write "
                         "the function's path as it is now in that config.yaml")
    missing = object()
    diffs = [f"{k}: saved {saved_flat.get(k, missing)!r}, now {new_flat.get(k, missing)!r}"
             .replace(repr(missing), "(absent)")
             for k in sorted(set(saved_flat) | set(new_flat))
             if not _resumable(k) and saved_flat.get(k, missing) != new_flat.get(k, missing)]
    if diffs:
        raise ValueError("cannot resume: the config differs from the saved run's config.yaml in keys that must "
                         "stay the same:\n  " + "\n  ".join(diffs) + "\nUse the saved values, or a new output_dir "
                         f"for a new run (keys that may change on resume: {', '.join(RESUMABLE_KEYS)}).")
