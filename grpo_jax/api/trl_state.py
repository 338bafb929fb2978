"""What a TRL script reads back from a `GRPOTrainer` (`grpo_jax.api.trl_api`): `trainer.model` as a view of the
policy's weights, `trainer.state` and its `log_history` under TRL's metric names, TRL's `checkpoint-N` folders. No
jax: the weights are read from Hugging Face folders.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"  # `grpo_jax.io.checkpoint.CHECKPOINTS`, named here without importing jax

_TRAINER_LOGS = ("step", "loss", "grad_norm", "learning_rate", "epoch")  # transformers' Trainer logs these itself


def residual_means(history: list[dict], last_step: int, logging_steps: int) -> dict:
    """The metrics TRL's final log line carries: each metric's mean over the steps after the last multiple of
    `logging_steps` (TRL logs and clears its metrics every `logging_steps`, and logs what remains with the run's
    summary); {} when the run ended on a multiple. The Trainer's own (loss, grad_norm, learning_rate, epoch) are
    logged at logging steps only."""
    boundary = last_step - last_step % max(logging_steps, 1)
    lines = [line for line in history if "loss" in line and boundary < line.get("step", 0) <= last_step]
    keys = dict.fromkeys(k for line in lines for k, v in line.items()
                         if k not in _TRAINER_LOGS and isinstance(v, (int, float)) and not isinstance(v, bool))
    return {k: sum(line[k] for line in lines if k in line) / sum(k in line for line in lines) for k in keys}


class PolicyView:
    """TRL's `trainer.model` as far as scripts read it: the policy's weights under their Hugging Face names, read
    from the model folder before training and from the run's `final/` after (torch tensors when torch is installed,
    else numpy arrays), and `save_pretrained`. A view: grpo_jax trains JAX arrays, not this object."""

    def __init__(self, trainer):  # the `grpo_jax.api.trl_api.GRPOTrainer` it views
        self._trainer = trainer

    @property
    def folder(self) -> Path:
        """The folder the weights are read from: the run's `final/` once trained, else the model folder."""
        out = self._trainer._output_dir
        return Path(out) / "final" if out is not None else Path(self._trainer.args.model.path)

    def named_parameters(self):
        """(name, tensor) of every weight the folder's safetensors files hold, file by file."""
        try:
            from safetensors.torch import load_file
        except ImportError:
            from safetensors.numpy import load_file
        for file in sorted(self.folder.glob("*.safetensors")):
            yield from load_file(file).items()

    def parameters(self):
        return (tensor for _, tensor in self.named_parameters())

    def get_parameter(self, name: str):
        for key, tensor in self.named_parameters():
            if key == name:
                return tensor
        raise AttributeError(f"the policy has no parameter {name!r} (its Hugging Face names are those of "
                             f"{self.folder}'s safetensors files)")

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """The folder (weights, config and tokenizer) copied to `save_directory`."""
        shutil.copytree(self.folder, save_directory, dirs_exist_ok=True)


@dataclasses.dataclass
class TrainerState:
    """TRL's `trainer.state` as far as scripts read it: the steps taken and every logged line."""

    global_step: int = 0
    max_steps: int = 0
    log_history: list = dataclasses.field(default_factory=list)


# our metric names that TRL logs under another
TRL_METRIC_NAMES = {"router_aux_loss": "aux_loss"}


def trl_line(line: dict) -> dict:
    """One metrics line as TRL's `log_history` holds it: evaluation under `eval_` (TRL's prefix), TRL's names."""
    out = {}
    for key, value in line.items():
        key = "eval_" + key[len("eval/"):] if key.startswith("eval/") else TRL_METRIC_NAMES.get(key, key)
        out[key] = value
    return out


def trl_checkpoint(value: bool | str | None) -> bool | str | None:
    """TRL's `RUN/checkpoint-N` folder (which grpo_jax never writes) as our `RUN/checkpoints/N`; anything else as
    it is."""
    if not isinstance(value, (str, os.PathLike)):
        return value
    path = Path(value)
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    if match and not path.exists() and (path.parent / CHECKPOINTS_DIR).is_dir():
        return str(path.parent / CHECKPOINTS_DIR / match.group(1))
    return os.fspath(value)
