"""What a TRL script reads back from a `GRPOTrainer` (`grpo_jax.api.trl_api`): `trainer.args` under TRL's names too,
`trainer.model` as a view of the policy's weights, `trainer.state` and its `log_history` under TRL's metric names,
the newest logged round's completion table (`trainer._logs`), TRL's `checkpoint-N` folders. The weights are read
from Hugging Face folders; jax only for those no folder holds (the LoRA adapters a run draws, a synced reference)
and for `trainer.model.generate`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace

from grpo_jax.config import Config, trl_keys
from grpo_jax.config.model import BUFFERS

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


# TRL names of what grpo_jax does one way only, and the value that says so: rows are read in the training process
# (no loader workers)
TRL_FIXED = {"dataloader_num_workers": 0}
# accelerate's AcceleratorConfig fields, at the values that ask for nothing grpo_jax does otherwise; dispatch_batches
# (None, True or False) changes no row: every process reads the rows itself, the ones process 0 would dispatch
ACCELERATOR_DEFAULTS = {"split_batches": False, "even_batches": True, "use_seedable_sampler": True,
                        "non_blocking": False, "gradient_accumulation_kwargs": None, "use_configured_state": False}


def accelerator_config(value) -> SimpleNamespace:
    """TRL's ``accelerator_config`` (a dict, its JSON string, or accelerate's AcceleratorConfig; None: accelerate's
    defaults) as ``args.accelerator_config``: ``dispatch_batches`` as given (None, True or False) and the other
    fields at accelerate's defaults, any other value refused in one line naming the field."""
    if isinstance(value, str):
        value = json.loads(value)
    if value is not None and not isinstance(value, dict):
        value = {f: getattr(value, f) for f in ("dispatch_batches", *ACCELERATOR_DEFAULTS) if hasattr(value, f)}
    fields = dict(value or {})
    dispatch = fields.pop("dispatch_batches", None)
    if dispatch not in (None, True, False):
        raise ValueError(f"accelerator_config dispatch_batches={dispatch!r}: use true, false or null")
    for name, given in fields.items():
        if name not in ACCELERATOR_DEFAULTS or given != ACCELERATOR_DEFAULTS[name]:
            raise ValueError(f"accelerator_config {name}={given!r} is accelerate's, which grpo_jax does not run: "
                             "remove it (grpo_jax shards with its device mesh: set mesh.*)")
    return SimpleNamespace(dispatch_batches=dispatch, **ACCELERATOR_DEFAULTS)


class TRLArgs(Config):
    """The run's `Config` (`GRPOConfig(...)`, `trainer.args`) that also reads TRL's names: `args.beta` is
    `args.loss.beta` (`trl_keys.ALIASES`), `dataloader_num_workers` is 0 (`TRL_FIXED`) and `accelerator_config` its
    own (`accelerator_config`). A dataclass like `Config`, equal field for field; `dataclasses.replace` keeps the
    class (and accelerate's defaults for `accelerator_config`)."""

    @classmethod
    def of(cls, config: Config, accelerator: SimpleNamespace | None = None) -> "TRLArgs":
        """``config`` as TRLArgs; ``accelerator``: its ``accelerator_config`` (`accelerator_config`), else the one
        ``config`` has, else accelerate's defaults. Each TRLArgs has its own (TRL's trainer sets its fields)."""
        args = cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
        if accelerator is None:
            accelerator = copy.copy(config.__dict__.get("accelerator_config")) or accelerator_config(None)
        object.__setattr__(args, "accelerator_config", accelerator)  # not a Config field: `replace` drops it
        return args

    def __getattr__(self, name: str):  # only names that are not our fields: TRL's
        if name in trl_keys.ALIASES:
            value = self
            for part in trl_keys.ALIASES[name].split("."):
                value = getattr(value, part)
            return value
        if name in TRL_FIXED:
            return TRL_FIXED[name]
        if name == "accelerator_config":  # a `replace`d copy: accelerate's defaults
            return accelerator_config(None)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (neither a key of grpo_jax's Config "
                             "nor a TRL name with a counterpart here: see docs/configuration.md)")


PEFT_PREFIX = "base_model.model."  # a PeftModel's names: the wrapped model's under it


class PolicyView:
    """TRL's `trainer.model` as far as scripts read it: the policy's weights under their Hugging Face names, read
    from the model folder before training and from the run's `final/` after (torch tensors when torch is installed,
    else numpy arrays), and `save_pretrained`. With LoRA adapters, a `peft.PeftModel`'s names, as TRL's model is
    one then: `base_model.model.<name>`, an adapted module's weights under `base_layer`, its adapters as
    `lora_A.default.weight` / `lora_B.default.weight` (the initial ones before training: `model.lora.path`'s, or
    those the run draws from its seed). A view: grpo_jax trains JAX arrays, not this object."""

    def __init__(self, trainer):  # the `grpo_jax.api.trl_api.GRPOTrainer` it views
        self._trainer = trainer
        self._initial_adapters = None  # drawn once, on the first read before training
        self._draws = 0  # `generate`'s sampled calls so far: each draws from its own key
        self._sampling_cache = {}  # `generate`'s weights and decoders (`api.policy_sampling`)

    @property
    def folder(self) -> Path:
        """The folder the weights are read from: the run's `final/` once trained, else the model folder."""
        out = self._trainer._output_dir
        return Path(out) / "final" if out is not None else Path(self._trainer.args.model.path)

    @property
    def _lora(self) -> bool:
        return self._trainer.args.model.lora.enabled

    @property
    def _base_folder(self) -> Path:
        """The folder of the base weights: the model folder under LoRA adapters (frozen: `final/` holds only the
        adapters, or a random-init base in `final/base_model`), else `folder`."""
        if not self._lora:
            return self.folder
        path = self._trainer.args.model.path
        return Path(path) if path is not None else self.folder / "base_model"

    @property
    def device(self):
        """Where the view's tensors are: the CPU (read from files), as a `torch.device` when torch is installed."""
        try:
            import torch
        except ImportError:
            return "cpu"
        return torch.device("cpu")

    def named_parameters(self):
        """(name, tensor) of every weight: the base folder's safetensors files, file by file, then under LoRA the
        adapters; buffers (`named_buffers`) apart, as PyTorch keeps them."""
        if not self._lora:
            yield from (item for item in _load_all(self.folder) if not _is_buffer(item[0]))
            return
        adapters = self._adapters()
        modules = _adapted_modules(adapters)
        for name, tensor in _load_all(self._base_folder):
            if not _is_buffer(name):
                yield _peft_name(name, modules), tensor
        for name, tensor in adapters.items():
            yield _adapter_name(name), tensor

    def named_buffers(self):
        """(name, tensor) of the saved buffers no optimizer moves (GLM-4-MoE's ``e_score_correction_bias``)."""
        folder = self._base_folder if self._lora else self.folder
        yield from (item for item in _load_all(folder) if _is_buffer(item[0]))

    def parameters(self):
        return (tensor for _, tensor in self.named_parameters())

    def _adapters(self) -> dict:
        """The LoRA adapters under PEFT's saved names: the run's `final/` once trained, else `model.lora.path`'s,
        else the ones the run draws for its seed."""
        trained, given = self.folder / ADAPTER_FILE, self._trainer.args.model.lora.path
        if self._trainer._output_dir is not None and trained.is_file():
            return _load(trained)
        if given is not None:
            return _load(Path(given) / ADAPTER_FILE)
        if self._initial_adapters is None:
            self._initial_adapters = _drawn_adapters(self._trainer.args)
        return self._initial_adapters

    def _names(self) -> list[str]:
        from safetensors import safe_open  # the keys only: no tensor is read
        names = []
        for file in sorted(self._base_folder.glob("*.safetensors")):
            with safe_open(file, "numpy") as f:
                names += list(f.keys())
        if not self._lora:
            return names
        adapters = self._adapters()
        modules = _adapted_modules(adapters)
        return [_peft_name(n, modules) for n in names] + [_adapter_name(n) for n in adapters]

    def _tied(self, name: str) -> str:
        """``name`` as stored: a tied `lm_head.weight` (config.json's `tie_word_embeddings`) is the embedding's."""
        config = self._base_folder / "config.json"
        if name.endswith("lm_head.weight") and config.is_file() and name not in self._names():
            hf = json.loads(config.read_text())
            if hf.get("tie_word_embeddings", hf.get("text_config", {}).get("tie_word_embeddings", False)):
                return name[:-len("lm_head.weight")] + "model.embed_tokens.weight"
        return name

    def get_parameter(self, name: str):
        stored = self._tied(name)
        for key, tensor in self.named_parameters():
            if key == stored:
                return tensor
        raise AttributeError(f"the policy has no parameter {name!r} (its Hugging Face names are those of "
                             f"{self._base_folder}'s safetensors files{', under PEFT' if self._lora else ''})")

    def __getattr__(self, name: str):
        """A submodule by its Hugging Face path (`trainer.model.lm_head.weight`), as PyTorch's modules nest."""
        if name.startswith("_"):
            raise AttributeError(name)
        return _ModuleView(self, name).check()

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """The folder (weights, config and tokenizer; under LoRA once trained, the adapters) copied to
        `save_directory`."""
        shutil.copytree(self.folder, save_directory, dirs_exist_ok=True)

    def generate(self, input_ids=None, attention_mask=None, *, max_new_tokens: int | None = None,
                 do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
                 eos_token_id=None, pad_token_id: int | None = None, num_beams: int | None = None,
                 length_penalty: float | None = None, early_stopping: bool | str | None = None, **kwargs):
        """transformers' `generate` on the viewed weights, through grpo_jax's sampler: left-padded [B, P] prompts
        (torch or numpy) to [B, P + T] ids, rows past their EOS padded and T cut where the last row ends, as
        transformers returns them. Options not given come from the folder's generation_config.json (transformers'
        defaults: greedy, 20 new tokens). Sampled calls draw from the run's seed and a call counter (never
        transformers' torch draws). Under LoRA it runs the base with the adapters as viewed."""
        import numpy as np

        from grpo_jax.api import policy_sampling  # jax: only a script that samples loads it

        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in policy_sampling.IGNORED)
        if unknown:
            raise ValueError(f"trainer.model.generate: {', '.join(unknown)} not supported (grpo_jax's sampler takes "
                             "max_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, "
                             "num_beams, length_penalty, early_stopping, eos_token_id, pad_token_id)")
        as_torch = type(input_ids).__module__.startswith("torch")
        ids = np.asarray(input_ids.cpu() if as_torch else input_ids, np.int32)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(
            attention_mask.cpu() if as_torch else attention_mask, np.int32)
        self._draws += 1
        out = policy_sampling.generate(self, ids, mask, draw=self._draws, options=dict(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repetition_penalty=repetition_penalty, num_beams=num_beams, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos_token_id, pad_token_id=pad_token_id))
        if not as_torch:
            return out.astype(np.asarray(input_ids).dtype)
        import torch
        return torch.from_numpy(out).to(device=input_ids.device, dtype=input_ids.dtype)


class ReferenceView(PolicyView):
    """TRL's `trainer.ref_model` (beta != 0, no LoRA): the reference's weights, the initial model's until a `train()`
    with `train.sync_ref_model`, which moves them; then the newest checkpoint's (`grpo_jax.io.export`, written once
    a step to a temporary folder). A view, as `PolicyView` is."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self._exported = None  # (step, tempfile.TemporaryDirectory) of the reference last read

    @property
    def folder(self) -> Path:
        out, args = self._trainer._output_dir, self._trainer.args
        if out is None or not args.train.sync_ref_model:
            return Path(args.model.path)
        step = self._trainer.state.global_step
        if self._exported is None or self._exported[0] != step:
            from grpo_jax.io import export

            folder = tempfile.TemporaryDirectory(prefix="grpo_jax-reference-")
            export.export(out, Path(folder.name) / "model", reference=True)
            self._exported = (step, folder)
        return Path(self._exported[1].name) / "model"


ADAPTER_FILE = "adapter_model.safetensors"  # `grpo_jax.models.peft_io.WEIGHTS_FILE`, named here without jax


def _load(file: Path) -> dict:
    try:
        from safetensors.torch import load_file
    except ImportError:
        from safetensors.numpy import load_file
    return load_file(file)


def _is_buffer(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in BUFFERS


def _load_all(folder: Path):
    for file in sorted(folder.glob("*.safetensors")):
        yield from _load(file).items()


def _adapted_modules(adapters: dict) -> set[str]:
    """The modules (Hugging Face paths) that PEFT's saved adapter names `base_model.model.<module>.lora_A.weight`
    adapt."""
    return {name[len(PEFT_PREFIX):].rsplit(".", 2)[0] for name in adapters}


def _peft_name(name: str, modules: set[str]) -> str:
    """A base weight's name inside a PeftModel: under `base_model.model.`, and `<module>.base_layer.<leaf>` where
    `module` is adapted."""
    module, leaf = name.rsplit(".", 1)
    return f"{PEFT_PREFIX}{module}.base_layer.{leaf}" if module in modules else PEFT_PREFIX + name


def _adapter_name(saved: str) -> str:
    """An adapter's name inside a PeftModel: its saved name with PEFT's adapter name ("default") before `weight`."""
    return saved[:-len(".weight")] + ".default.weight"


def _drawn_adapters(config: Config) -> dict:
    """The LoRA adapters a run of `config` starts from (`algo.programs.init_adapters` for its seed) under PEFT's
    saved names, [r, in] and [out, r] as PEFT holds them."""
    from grpo_jax.algo import programs
    from grpo_jax.models import peft_io, resolve_config

    model_config = resolve_config(config.model)
    out = peft_io.host_adapters(model_config, programs.init_adapters(model_config, config.seed, None))
    try:
        import torch
    except ImportError:
        return out
    return {name: torch.from_numpy(tensor) for name, tensor in out.items()}


class _ModuleView:
    """One submodule of a `PolicyView` (its path `prefix`): an attribute is a deeper submodule or, at a leaf, the
    parameter itself."""

    def __init__(self, policy: PolicyView, prefix: str):
        self._policy, self._prefix = policy, prefix

    def check(self) -> "_ModuleView":
        prefix = self._policy._tied(self._prefix + ".weight").rsplit(".", 1)[0]
        if not any(n.startswith(prefix + ".") for n in self._policy._names()):
            raise AttributeError(f"the policy has no module {self._prefix!r} (its Hugging Face names are those of "
                                 f"{self._policy.folder}'s safetensors files)")
        return self

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        path = f"{self._prefix}.{name}"
        if self._policy._tied(path) in self._policy._names():
            return self._policy.get_parameter(path)
        return _ModuleView(self._policy, path).check()


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


def trl_logs(completions_file: Path | None, batch_size: int) -> dict:
    """TRL's `trainer._logs` (the newest generation batch's rows, which its completion table prints) read from the
    run's completions.jsonl (`log_completions`): prompt, completion, advantages, each reward function's column under
    `rewards` and the `log_extra` columns under `extra`, each at most `batch_size` long as TRL's deques are. A line's
    columns are in `io.reporting.completion_rows`' order: step, prompt, completion, the reward functions', reward,
    advantage, then the extra ones."""
    new = lambda: deque(maxlen=batch_size)  # noqa: E731
    logs = {"images": new(), "prompt": new(), "completion": new(), "rewards": defaultdict(new),
            "advantages": new(), "extra": defaultdict(new)}
    lines = [json.loads(line) for line in completions_file.read_text().splitlines()] \
        if completions_file is not None and completions_file.is_file() else []
    for row in [line for line in lines if line["step"] == lines[-1]["step"]]:
        logs["prompt"].append(row["prompt"])
        logs["completion"].append(row["completion"])
        logs["advantages"].append(row["advantage"])
        columns = list(row)
        rewards = columns[columns.index("completion") + 1:columns.index("reward")]
        extra = columns[columns.index("advantage") + 1:]
        for kind, names in (("rewards", rewards), ("extra", extra)):
            for name in names:
                logs[kind][name].append(row[name])
    return logs
