"""Checkpoints of a run: orbax saves, exact restores and the config compatibility of a resume.

A checkpoint is one orbax `CheckpointManager` step folder `output_dir/checkpoints/<step>/` with three items:
`state` (the `TrainState` pytree; `ref_params` only when `train.sync_ref_model` can move it away from the
initial weights, otherwise rebuilt from the same initialisation at restore), `meta` (JSON: round index, data
iterator position, the metrics history, eval before training, the mid-round buffer's scalars) and, when the
run stopped inside a round, `buffer` (that round's row arrays). Orbax writes a step to a temporary folder and
renames it when every item is complete, so a save cut short is never listed; a listed step that fails to
read is skipped with a warning in favour of the previous one.
"""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINTS = "checkpoints"
UNREADABLE = "unreadable_checkpoints"  # where restore_latest moves steps that fail to read
# top-level and section keys that may change between a run and its resume (dotted; "eval" covers the section)
RESUMABLE_KEYS = ("output_dir", "max_steps", "logging_steps", "save_steps", "save_total_limit", "resume",
                  "cpu_speedups", "host_allocator", "compilation_cache_dir", "eval", "train.max_nonfinite_steps",
                  "sampling.host_threads", "report_to", "log_completions", "num_completions_to_print")


def manager(output_dir: Path, *, save_total_limit: int | None = None,
            async_saving: bool = True) -> ocp.CheckpointManager:
    """The run's CheckpointManager over `output_dir/checkpoints` (keeps `save_total_limit` steps; None: all)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=save_total_limit, enable_async_checkpointing=async_saving,
                                           create=True)
    return ocp.CheckpointManager(Path(output_dir).absolute() / CHECKPOINTS, options=options)


def _saved_state(state, keep_ref: bool):
    return state if keep_ref else state._replace(ref_params=None)


def save(mngr: ocp.CheckpointManager, state, *, keep_ref: bool, meta: dict, arrays: dict | None = None,
         wait: bool = False) -> None:
    """Saves `state` (at its own step), the JSON `meta` and optional host `arrays`, collectively on all hosts.

    The call returns once the arrays are copied off the devices (the state may then be donated); the write
    finishes in the background unless `wait`.
    """
    step = int(state.step)
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


def restore_step(mngr: ocp.CheckpointManager, step: int, fresh_state, *, keep_ref: bool):
    """(state, meta, arrays) of one step, restored into the shardings of `fresh_state` (a freshly built state)."""
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
    """The newest checkpoint that reads back, as (step, state, meta, arrays), or None when there is none.

    A listed step that fails to read (corrupted, partly deleted) is skipped with a warning and moved to
    `unreadable_checkpoints/` next to the checkpoints folder (the resumed run saves that step again); when
    every listed step fails, a RuntimeError names them and what to do.
    """
    steps = sorted(mngr.all_steps(), reverse=True)
    errors, unreadable = [], []
    for step in steps:
        try:
            restored = (step, *restore_step(mngr, step, fresh_state, keep_ref=keep_ref))
        except Exception as e:  # noqa: BLE001 - any read failure means "not a usable checkpoint"
            errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
            unreadable.append(step)
            warnings.warn(f"checkpoint {mngr.directory / str(step)} could not be restored ({errors[-1]}); "
                          f"trying the previous one and moving this one to {UNREADABLE}/", RuntimeWarning,
                          stacklevel=2)
            continue
        if unreadable and jax.process_index() == 0:
            aside = Path(mngr.directory).parent / UNREADABLE
            aside.mkdir(exist_ok=True)
            for bad in unreadable:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                shutil.move(str(Path(mngr.directory) / str(bad)), str(aside / f"{bad}-{stamp}"))
        if unreadable:
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils
                multihost_utils.sync_global_devices("grpo_jax: unreadable checkpoints moved")
            mngr.reload()
        return restored
    if errors:
        raise RuntimeError(f"no valid checkpoint in {mngr.directory}: " + "; ".join(errors)
                           + f". Delete {mngr.directory} to start again from step 0, or use a new output_dir.")
    return None


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def check_compatible(saved: dict, new: dict) -> None:
    """Raises a ValueError listing every dotted key (with both values) that differs and may not change on resume."""
    saved_flat, new_flat = _flatten(saved), _flatten(new)
    missing = object()
    diffs = [f"{k}: saved {saved_flat.get(k, missing)!r}, now {new_flat.get(k, missing)!r}"
             .replace(repr(missing), "(absent)")
             for k in sorted(set(saved_flat) | set(new_flat))
             if not _resumable(k) and saved_flat.get(k, missing) != new_flat.get(k, missing)]
    if diffs:
        raise ValueError("cannot resume: the config differs from the saved run's config.yaml in keys that must "
                         "stay the same:\n  " + "\n  ".join(diffs) + "\nUse the saved values, or a new output_dir "
                         f"for a new run (keys that may change on resume: {', '.join(RESUMABLE_KEYS)}).")
