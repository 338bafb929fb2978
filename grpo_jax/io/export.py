"""Export of a trained policy: Hugging Face format (native orbax format as the fallback), and `grpo-jax export`.

`export_policy` writes given params (a run's final policy); `export` reads the params of a checkpoint
(`grpo_jax.io.checkpoint`'s layout) without its optimizer state or reference, and writes them the same way. A LoRA
policy is written as a PEFT adapter folder, or with ``merge`` as the Hugging Face model with the adapters merged.
Both write into a new folder renamed into place when complete: no file of an existing folder is deleted or
overwritten unless asked to (`overwrite`), and never by a failed export.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax.algo.state import abstract_state, entropy_control, model_graphdef, optimizer_from_config
from grpo_jax.config import LossConfig, TrainConfig, from_dict, to_dict
from grpo_jax.data.prompts import load_tokenizer
from grpo_jax.io.checkpoint import CHECKPOINTS, check_checksums, nonfinite_leaves, read_only_manager
from grpo_jax.io.preemption import storage_error
from grpo_jax.models import Model, ModelConfig, init_model, lora, peft_io, save_pretrained

FORMAT_NAMES = {"hf": "Hugging Face", "peft": "PEFT adapter", "native": "native"}  # export_policy's formats

def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"{str(out)!r} already exists and is not empty: choose a new folder, or pass --overwrite "
                         "(overwrite=True) to replace it (it is replaced only once the new export is complete)")


def _check_not_a_run(out: Path, run_dir: Path) -> None:
    """Refuses an `out` that would hold or replace a run (the one read, or any other), even with --overwrite."""
    out, run_dir = out.resolve(), run_dir.resolve()
    if out == run_dir or out in run_dir.parents or run_dir in out.parents:
        where = "is" if out == run_dir else "holds" if out in run_dir.parents else "is inside"
        raise ValueError(f"--out {str(out)!r} {where} the run folder being exported ({run_dir}): an export there "
                         "would replace its files; choose a folder outside it (--overwrite does not apply)")
    if (out / "config.yaml").is_file() or (out / CHECKPOINTS).is_dir():
        raise ValueError(f"--out {str(out)!r} is a run folder (config.yaml, {CHECKPOINTS}/): an export there would "
                         "replace it; choose another folder (--overwrite does not apply)")


def _temporary(out: Path) -> Path:
    """A new folder beside `out` to write into, the same on every process of a multi-host run."""
    token = np.int64(np.random.default_rng().integers(1 << 62))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        token = multihost_utils.broadcast_one_to_all(token)
    return out.parent / f".{out.name}.partial-{int(token):x}"


def export_policy(graphdef, model_config, params, out: Path, *, tokenizer=None, merge: bool = False,
                  overwrite: bool = False) -> str:
    """Writes the policy to `out` in Hugging Face format via `grpo_jax.models.save_pretrained`.

    Falls back to the native format (`params/` orbax tree + `model_config.json` + tokenizer) when that fails for
    another reason than the disk; returns "hf", "peft" or "native". Everything is written to a new folder beside `out`
    that is renamed to `out` once complete, so a failed export leaves `out` as it was; an `out` that exists and
    is not empty is a ValueError unless `overwrite`. Params holding NaN or inf are a ValueError. Every process
    calls it (the arrays are gathered collectively); process 0 writes. With LoRA adapters: a PEFT adapter folder
    (`export_adapters`, "peft"), or with `merge` the merged model.
    """

    adapters = lora.has_adapters(params) and not merge
    if lora.has_adapters(params) and merge:
        params = lora.base_params(lora.merged_params(model_config, params))
        model_config = lora.base_config(model_config)
        graphdef = _graphdef(model_config)

    out = Path(out).absolute()
    _check_out(out, overwrite)
    bad = nonfinite_leaves(params)
    if bad:
        raise ValueError(f"not exported to {out}: params {', '.join(bad[:5])} hold NaN or inf")
    main = jax.process_index() == 0
    tmp = _temporary(out)
    try:
        try:
            if adapters:
                export_adapters(model_config, params, tmp, tokenizer=tokenizer, final=out)
                fmt = "peft"
            else:
                save_pretrained(Model(graphdef=graphdef, config=model_config), params, tmp, tokenizer=tokenizer)
                fmt = "hf"
        except Exception as e:  # never lose a trained policy to an export problem
            if storage_error(e) is not None:
                raise
            warnings.warn(f"{'PEFT' if adapters else 'Hugging Face'} export to {out} failed ({type(e).__name__}: "
                          f"{e}); writing the native format there instead", RuntimeWarning, stacklevel=2)
            if main:
                shutil.rmtree(tmp, ignore_errors=True)  # this call's own partial folder
            _save_native(model_config, params, tmp, tokenizer)
            fmt = "native"
        if main:
            _publish(tmp, out)
    finally:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
    return fmt


def _save_native(model_config, params, out: Path, tokenizer) -> None:

    out.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", params, force=True)
    checkpointer.wait_until_finished()
    (out / "model_config.json").write_text(json.dumps(to_dict(model_config), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def _publish(tmp: Path, out: Path) -> None:
    """Puts the complete folder `tmp` in place of `out` (which `_check_out` allowed to replace)."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.replaced-{tmp.name.rsplit('-', 1)[-1]}"
    os.rename(out, old)
    os.rename(tmp, out)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def _graphdef(model_config):
    return model_graphdef(model_config)


def export_adapters(model_config, params, out: Path, *, tokenizer=None, final: Path | None = None) -> None:
    """A LoRA policy's adapters as a PEFT folder (`models.peft_io.save_adapters`) that names `model.path` as its
    base; a random-init base (no `model.path`) is written beside them, to `out/base_model/`, and named instead
    (by its path once `out` is renamed to `final`)."""

    out = Path(out).absolute()
    base_path = model_config.path and str(Path(model_config.path).absolute())
    if base_path is None:
        base_path, base_config = str(Path(final or out).absolute() / "base_model"), lora.base_config(model_config)
        save_pretrained(Model(graphdef=_graphdef(base_config), config=base_config), lora.base_params(params),
                        out / "base_model", tokenizer=tokenizer)
    peft_io.save_adapters(model_config, params, out, base_model_name_or_path=base_path)
    if tokenizer is not None and jax.process_index() == 0:
        tokenizer.save_pretrained(str(out))


def load_native(path: Path):
    """(graphdef, params) of a native-format export (see `export_policy`), on the default device."""

    path = Path(path).absolute()
    model_config = from_dict(ModelConfig, json.loads((path / "model_config.json").read_text()), "model.")
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


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, merge: bool = False,
           overwrite: bool = False, reference: bool = False) -> tuple[int, str]:
    """`grpo-jax export`: the policy of a checkpoint (newest valid one of an output_dir) to `out`; (step, format).
    `reference`: the reference model instead, which a checkpoint holds only where `train.sync_ref_model` moves it
    (otherwise it is the run's initial model, `model.path`: a ValueError says so).

    A checkpoint whose files differ from its checksums is skipped like an unreadable one; an existing non-empty
    `out` is an error unless `overwrite` (see `export_policy`), and an `out` that is, holds or lies inside the run
    folder read, or is any run folder, always is. `merge`: a LoRA policy as the Hugging Face model
    with its adapters merged, not a PEFT adapter folder.
    """

    directory, step = _step_folder(Path(checkpoint))
    _check_not_a_run(Path(out), directory.parent)
    _check_out(Path(out).absolute(), overwrite)
    mngr = read_only_manager(directory)
    steps = [step] if step is not None else sorted(mngr.all_steps(), reverse=True)
    if not steps:
        raise ValueError(f"no checkpoint in {directory}")
    errors = []
    for step in steps:
        try:
            check_checksums(directory, step)
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            model_config = from_dict(ModelConfig, meta["model_config"], "model.")
            if reference and not meta["ref_params_saved"]:
                raise ValueError(f"checkpoint {directory / str(step)} holds no reference model: without "
                                 "train.sync_ref_model it stays the run's initial model (model.path), export that")
            # the optimizer only shapes the tree of the saved state: its values are not read
            _, optimizer = optimizer_from_config(from_dict(TrainConfig, meta["config"]["train"], "train."),
                                                 meta["config"]["max_steps"])
            shapes = abstract_state(model_config, optimizer, with_reference=meta["ref_params_saved"])
            control = entropy_control(from_dict(LossConfig, meta["config"].get("loss", {}), "loss."))
            shapes = shapes._replace(entropy_control=None if control is None else jax.eval_shape(lambda: control))
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)
            skip = lambda tree: jax.tree.map(lambda _: ocp.PLACEHOLDER, tree)  # noqa: E731 - not read at all
            kept, skipped = ("ref_params", "params") if reference else ("params", "ref_params")
            target = target._replace(opt_state=skip(target.opt_state), **{skipped: skip(getattr(target, skipped))})
            restore_args = jax.tree.map(lambda x: x if x is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(
                sharding=x.sharding), target, is_leaf=lambda x: x is ocp.PLACEHOLDER)
            state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args))).state
            break
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001
            errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
            warnings.warn(f"checkpoint {directory / str(step)} could not be restored ({errors[-1]})",
                          RuntimeWarning, stacklevel=2)
    else:
        raise RuntimeError(f"no valid checkpoint in {directory}: " + "; ".join(errors))
    tokenizer = load_tokenizer(meta["tokenizer_path"], "the run's tokenizer") if meta.get("tokenizer_path") else None
    fmt = export_policy(model_graphdef(model_config), model_config, getattr(state, kept), Path(out),
                        tokenizer=tokenizer, merge=merge, overwrite=overwrite)
    return step, fmt
