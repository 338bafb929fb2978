"""Checkpoints of a run: orbax saves and exact restores, preemption signals, config compatibility, export.

A checkpoint is one orbax `CheckpointManager` step folder `output_dir/checkpoints/<step>/` with three items:
`state` (the `TrainState` pytree; `ref_params` only when `train.sync_ref_model` can move it away from the
initial weights, otherwise rebuilt from the same initialisation at restore), `meta` (JSON: round index, data
iterator position, the metrics history, eval before training, the mid-round buffer's scalars) and, when the
run stopped inside a round, `buffer` (that round's row arrays). Orbax writes a step to a temporary folder and
renames it when every item is complete, so a save cut short is never listed; a listed step that fails to
read is skipped with a warning in favour of the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINTS = "checkpoints"
UNREADABLE = "unreadable_checkpoints"  # where restore_latest moves steps that fail to read
# top-level and section keys that may change between a run and its resume (dotted; "eval" covers the section)
RESUMABLE_KEYS = ("output_dir", "max_steps", "logging_steps", "save_steps", "save_total_limit", "resume",
                  "cpu_speedups", "host_allocator", "eval", "train.max_nonfinite_steps", "sampling.host_threads")


class Preempted(Exception):
    """Raised by `train` after a SIGTERM/SIGINT: the step finished and a checkpoint was written."""

    def __init__(self, signum: int, step: int, path: Path):
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"{signal.Signals(signum).name} received: stopped after optimizer step {step} and saved "
                         f"{path}; run the same command again to resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as if the signal had ended the process (the run is not finished)."""
        return 128 + self.signum


class PreemptionGuard:
    """Context manager: the first SIGTERM/SIGINT sets `requested`; a second one exits the process at once."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"\ngrpo_jax: second {signal.Signals(signum).name}: exiting now without saving", flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"\ngrpo_jax: {signal.Signals(signum).name} received: finishing the current optimizer step, then "
              "saving a checkpoint (send it again to exit at once)", flush=True)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


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


# --- export -------------------------------------------------------------------------------------------------

def export_policy(graphdef, model_config, params, out: Path, *, tokenizer=None) -> str:
    """Writes the policy to `out` in Hugging Face format via `grpo_jax.models.save_pretrained`, when it exists.

    Falls back to the native format (`params/` orbax tree + `model_config.json` + tokenizer) otherwise; returns
    "hf" or "native". Every process calls it (the arrays are gathered collectively); process 0 writes.
    """
    out = Path(out).absolute()
    try:
        from grpo_jax.models import Model, save_pretrained
    except ImportError:
        Model = save_pretrained = None
    if save_pretrained is not None:
        try:
            save_pretrained(Model(graphdef=graphdef, config=model_config), params, out, tokenizer=tokenizer)
            return "hf"
        except Exception as e:  # noqa: BLE001 - never lose a trained policy to an export problem
            warnings.warn(f"Hugging Face export to {out} failed ({type(e).__name__}: {e}); writing the native "
                          "format there instead", RuntimeWarning, stacklevel=2)
            shutil.rmtree(out, ignore_errors=True)
    from grpo_jax.config import to_dict

    out.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", params, force=True)
    checkpointer.wait_until_finished()
    (out / "model_config.json").write_text(json.dumps(to_dict(model_config), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return "native"


def load_native(path: Path):
    """(graphdef, params) of a native-format export (see `export_policy`), on the default device."""
    from grpo_jax.config import _build
    from grpo_jax.models import ModelConfig, init_model
    from grpo_jax.state import model_graphdef

    path = Path(path).absolute()
    model_config = _build(ModelConfig, json.loads((path / "model_config.json").read_text()), "model.")
    target = jax.eval_shape(lambda: init_model(model_config, 0)[1])
    params = ocp.StandardCheckpointer().restore(path / "params", target)
    return model_graphdef(model_config), params


def _step_folder(path: Path) -> tuple[Path, int | None]:
    """(checkpoints folder, step or None for the newest) from an output_dir or one step folder."""
    path = Path(path).absolute()
    if (path / CHECKPOINTS).is_dir():
        return path / CHECKPOINTS, None
    if path.name.isdigit() and (path / "meta").is_dir():
        return path.parent, int(path.name)
    raise ValueError(f"--checkpoint {str(path)!r} is neither a run's output_dir (with a {CHECKPOINTS}/ folder) "
                     f"nor a checkpoint step folder ({CHECKPOINTS}/<step>)")


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> tuple[int, str]:
    """`grpo-jax export`: the policy of a checkpoint (newest valid one of an output_dir) to `out`; (step, format)."""
    from transformers import AutoTokenizer

    from grpo_jax.config import _build
    from grpo_jax.models import ModelConfig, init_model
    from grpo_jax.state import TrainState, learning_rate_schedule, make_optimizer, model_graphdef

    directory, step = _step_folder(Path(checkpoint))
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    steps = [step] if step is not None else sorted(mngr.all_steps(), reverse=True)
    if not steps:
        raise ValueError(f"no checkpoint in {directory}")
    errors = []
    for step in steps:
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            model_config = _build(ModelConfig, meta["model_config"], "model.")
            tc = meta["config"]["train"]
            schedule = learning_rate_schedule(learning_rate=tc["learning_rate"], scheduler=tc["lr_scheduler_type"],
                                              warmup_steps=tc["warmup_steps"], max_steps=meta["config"]["max_steps"])
            optimizer = make_optimizer(schedule, weight_decay=tc["weight_decay"], b1=tc["adam_beta1"],
                                       b2=tc["adam_beta2"], eps=tc["adam_epsilon"], max_grad_norm=tc["max_grad_norm"])
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

            def init():
                params = init_model(model_config, 0)[1]
                ref = params if meta["ref_params_saved"] else None
                return TrainState(params, optimizer.init(params), ref, jax.numpy.zeros((), jax.numpy.int32),
                                  jax.random.PRNGKey(0))

            shapes = jax.eval_shape(init)
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)
            skip = lambda tree: jax.tree.map(lambda _: ocp.PLACEHOLDER, tree)  # noqa: E731 - not read at all
            target = target._replace(opt_state=skip(target.opt_state), ref_params=skip(target.ref_params))
            restore_args = jax.tree.map(lambda x: x if x is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(
                sharding=x.sharding), target, is_leaf=lambda x: x is ocp.PLACEHOLDER)
            state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args))).state
            break
        except Exception as e:  # noqa: BLE001
            errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
            warnings.warn(f"checkpoint {directory / str(step)} could not be restored ({errors[-1]})",
                          RuntimeWarning, stacklevel=2)
    else:
        raise RuntimeError(f"no valid checkpoint in {directory}: " + "; ".join(errors))
    tokenizer = AutoTokenizer.from_pretrained(meta["tokenizer_path"]) if meta.get("tokenizer_path") else None
    fmt = export_policy(model_graphdef(model_config), model_config, state.params, Path(out), tokenizer=tokenizer)
    return step, fmt
