"""TRL's entry point: a script that imports `GRPOConfig` and `GRPOTrainer` from `grpo_jax` instead of `trl` keeps its
constructor calls, and `.train()` runs `grpo_jax.api.trainer.train`. What TRL takes as a Python object that grpo_jax
cannot use as it is (a transformers model, a tokenizer not saved in a folder, a PEFT option with no counterpart) is
refused in one line naming what to pass instead. Imports no jax until `.train()` (or `GRPOConfig(use_cpu=True)`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_jax.api.arguments import check_arguments
from grpo_jax.api.trl_inputs import (cached_reward_model, env_reward_classes, env_reward_func, held_out, is_stream,
                                     lora_options, model_and_adapters, model_folder, reward_func_names,
                                     tokenizer_folder, trl_tools)
from grpo_jax.api.trl_state import (PolicyView, ReferenceView, TrainerState, TRLArgs, accelerator_config,
                                    residual_means, trl_checkpoint, trl_line, trl_logs)
from grpo_jax.config import Config, for_run, make_config, trl_keys
from grpo_jax.config.sections import TASK_REWARDS

__all__ = ["GRPOConfig", "GRPOTrainer", "lora_options", "model_folder"]  # what a script reads back: `trl_state`


# TRL 1.16 GRPOConfig's defaults where ours differ (the CLI and recipes keep ours), so a script trains what it trains
# under TRL; report_to stays jsonl (this trainer's own record) and gradient_checkpointing off (memory, not numbers)
TRL_DEFAULTS = {"beta": 0.0, "loss_type": "dapo", "use_bias_correction_kl": True, "learning_rate": 1e-6,
                "lr_scheduler_type": "linear", "adam_beta2": 0.999, "per_device_train_batch_size": 8,
                "max_completion_length": 512, "num_train_epochs": 3.0, "max_steps": -1, "seed": 42,
                "logging_steps": 10, "save_total_limit": None}
# how TRL's trainer behaves where a key of ours chooses: it goes on through steps of gradient norm 0 (the CLI stops)
TRL_BEHAVIOUR = {"train.stop_on_zero_gradient": False}
# a default that another key given by the script replaces (its rows per step, its own step count)
_REPLACED_BY = {"per_device_train_batch_size": ("train_batch_size", "train.train_batch_size")}


def GRPOConfig(**kwargs: Any) -> Config:  # noqa: N802 - TRL's name for what builds the run's config
    """TRL's `GRPOConfig(...)` as a grpo_jax `Config`, with TRL 1.16's defaults (`TRL_DEFAULTS`): TRL's flat names
    (`beta=0.0`, `per_device_train_batch_size=4`), our dotted keys (`**{"sampling.top_k": 50}`) or sections
    (`train={...}`), checked as `make_config` checks them.

    ``use_cpu=True`` (TRL's: the CPU even where an accelerator exists) makes JAX's CPU its only backend, which holds
    only before JAX has started on another: then a ValueError says so."""
    if kwargs.pop("use_cpu", False):
        _use_cpu()
    accelerator = accelerator_config(kwargs.pop("accelerator_config", None))
    given = set(kwargs)
    for section, values in kwargs.items():
        if isinstance(values, Mapping):
            given |= {f"{section}.{leaf}" for leaf in values}
        elif dataclasses.is_dataclass(values):
            given |= {f"{section}.{f.name}" for f in dataclasses.fields(values)}
    defaults = {}
    for name, value in TRL_DEFAULTS.items():
        dotted = trl_keys.ALIASES.get(name, name)
        if not given & {name, dotted, *_REPLACED_BY.get(name, ())}:
            defaults[name] = value
    defaults.update({name: value for name, value in TRL_BEHAVIOUR.items() if name not in given})
    config = make_config(**defaults, **kwargs)
    # TRL evaluates by sampling as it trains: num_generations_eval (None: num_generations) at the temperature
    follow = {}
    if "eval.num_generations" not in given and kwargs.get("num_generations_eval") is None:
        follow["num_generations"] = config.train.num_generations
    if "eval.temperature" not in given:
        follow["temperature"] = config.sampling.temperature
    return TRLArgs.of(dataclasses.replace(config, eval=dataclasses.replace(config.eval, **follow)), accelerator)


def _use_cpu() -> None:
    """JAX's platforms set to the CPU alone (the one import of jax before `.train()`: TRL's use_cpu takes effect where
    it is given); a ValueError when JAX already runs on another backend, which this process cannot change."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    if jax.default_backend() != "cpu":
        raise ValueError(f"use_cpu=True but JAX already started on {jax.default_backend()}: build GRPOConfig before "
                         "anything uses JAX, or run with the environment variable JAX_PLATFORMS=cpu")


class GRPOTrainer:
    """TRL's `GRPOTrainer`: the same arguments, `.train()` runs `grpo_jax.api.trainer.train`.

    `model`: a Hugging Face folder or a cached model id (`model.path`). `reward_funcs`: a function, a
    'module:function' path, a reward model folder, or a list of them. `args`: a `Config` (`GRPOConfig(...)`; None:
    the defaults). `train_dataset` / `eval_dataset`: a `datasets.Dataset` (or a streamed one) or a list of dicts;
    `train_dataset` is required, as in TRL, unless an environment owns the data or args name `data.path`.
    `peft_config`: a `peft.LoraConfig` or a dict of its fields (`model.lora`). `processing_class`: a tokenizer
    folder, or a tokenizer loaded from one (`data.tokenizer_path`); None: the model folder's.
    `reward_processing_classes`, `tools`, `environment_factory` and `rollout_func` (`grpo_jax.rollout.rollout_func`)
    go to `train` as TRL's. `.args` is the config the run gets; `.processing_class` its tokenizer.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: Config | None = None, train_dataset=None,
                 eval_dataset=None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list | None = None, rollout_func: Any = None,
                 environment_factory: Any = None):
        for name, value, instead in (
                ("callbacks", callbacks, "metrics reach report_to's trackers and metrics.jsonl every step"),
                ("optimizers", None if optimizers == (None, None) else optimizers,
                 "the train.* keys configure optax's AdamW and its schedule"),
                ("quantization_config", quantization_config, "train in float32 or bfloat16 (model.dtype)")):
            if value:
                raise ValueError(f"{name} is TRL's PyTorch hook, which grpo_jax has no counterpart for: {instead}")
        config = GRPOConfig() if args is None else args
        if not isinstance(config, Config):
            raise ValueError(f"args is a {type(config).__name__}: build it with grpo_jax's GRPOConfig(...), which "
                             "takes TRL's GRPOConfig keywords")
        check_arguments(config, reward_funcs=reward_funcs, train_dataset=train_dataset, tools=tools,
                        environment_factory=environment_factory)
        for name, dataset in (eval_dataset.items() if isinstance(eval_dataset, Mapping) else [(None, eval_dataset)]):
            check_arguments(config, eval_dataset=held_out(dataset, name))  # TRL: a dict of them, each by name
        path, lora_config = model_and_adapters(model, peft_config, beta=config.loss.beta)
        if config.model.path not in (None, path):
            raise ValueError(f"model={path!r} and args' model.path={config.model.path!r} differ: give the model once")
        if lora_config is not None and config.model.lora.enabled:
            raise ValueError("the adapters (peft_config or a PeftModel) and args' model.lora both set adapters: give "
                             "the LoRA options once")
        model_config = dataclasses.replace(config.model, path=path,
                                           **({} if lora_config is None else {"lora": lora_config}))
        data_config = config.data
        if processing_class is not None:
            folder = tokenizer_folder(processing_class)
            if data_config.tokenizer_path not in (None, folder):
                raise ValueError(f"processing_class={folder!r} and args' data.tokenizer_path="
                                 f"{data_config.tokenizer_path!r} differ: give the tokenizer once")
            data_config = dataclasses.replace(data_config, tokenizer_path=None if folder == path else folder)
        # checked as a whole again; TRL's names read too (`args.beta`)
        self.args = TRLArgs.of(dataclasses.replace(config, model=model_config, data=data_config),
                               copy.copy(config.accelerator_config) if isinstance(config, TRLArgs) else None)
        # None: args' reward.functions (TRL: reward_funcs may be left out when the environment scores)
        given = None if reward_funcs is None else list(
            reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        self._reward_funcs = None if given is None else [cached_reward_model(f) for f in given]
        # TRL's list: the given ones, then each environment's own reward (the run scores those itself)
        owned = [env_reward_func(cls) for cls in env_reward_classes(environment_factory)]
        self.reward_funcs = self._reward_funcs if not owned else (self._reward_funcs or []) + owned
        self.reward_func_names = reward_func_names(given, environment_factory)
        if train_dataset is None and environment_factory is None and self.args.data.path is None:  # TRL's
            raise ValueError("`train_dataset` is required unless an `environment_factory` is provided. (grpo_jax "
                             "also reads data.path in args; the embedded task trains through grpo_jax.train)")
        if train_dataset is None and isinstance(environment_factory, Mapping):  # TRL's check: nothing routes rows
            raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                             "`environment` column to route each example to its environment. Provide a dataset, or "
                             "pass a single environment factory.")
        if train_dataset is None and environment_factory is not None and self.args.data.path is None \
                and self.args.max_steps <= 0:  # TRL's check: the environment's data has no length
            raise ValueError("When training without a `train_dataset` (the environment owns the data and returns the "
                             "prompt from `reset()`), `max_steps` must be set to a positive value to define the "
                             "training length. Set it via `GRPOConfig(max_steps=...)`.")
        if train_dataset is not None and reward_funcs is None and environment_factory is None \
                and self.args.reward.functions == TASK_REWARDS:
            # the embedded task's rewards score its own rows only: TRL's check, for a script's own data
            raise ValueError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                             "environment defines a `get_reward` method.")
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        held = eval_dataset.values() if isinstance(eval_dataset, Mapping) else [eval_dataset]
        if any(is_stream(d) for d in (train_dataset, *held)):  # TRL's check: a stream is never dispatched
            if self.args.accelerator_config.dispatch_batches:
                raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                                 "`accelerator_config`. Please set it to `False`.")
            self.args.accelerator_config.dispatch_batches = False
        self._streamed = None  # a streamed train_dataset's rows, once read (`_train_rows`)
        _trl_checks(self.args, self._reward_funcs, reward_processing_classes)
        if self._reward_funcs is not None and not isinstance(reward_processing_classes, (list, tuple)):
            # TRL keeps one per reward function: None for each, or the one given in a list
            reward_processing_classes = [reward_processing_classes] * (
                len(self._reward_funcs) if reward_processing_classes is None else 1)
        self.reward_processing_classes, self._tools = reward_processing_classes, tools
        self.tools = trl_tools(tools, environment_factory)
        self.environment_factory = environment_factory
        if rollout_func is not None and not callable(rollout_func):
            raise TypeError(f"rollout_func is a {type(rollout_func).__name__}: pass a function (prompts, trainer) -> "
                            "dict of prompt_ids, completion_ids and logprobs")
        self.rollout_func = rollout_func
        self.state, self._output_dir = TrainerState(), None
        self.model = PolicyView(self)
        # TRL keeps a reference model for beta != 0 without PEFT (whose reference is the base: adapters off)
        self.ref_model = ReferenceView(self) if self.args.loss.beta != 0.0 and not self.args.model.lora.enabled \
            else None
        self.use_vllm = False  # TRL's flags scripts and tests read: grpo_jax samples with its own sampler
        self.entropy_coef = self.args.loss.entropy_coef

    @property
    def _logs(self) -> dict:
        """TRL's completion logs of the newest logged round (`trl_state.trl_logs`; empty before training or without
        `log_completions`), which TRL's tests read."""
        out = self._output_dir
        return trl_logs(None if out is None else Path(out) / "completions.jsonl",
                        self.args.train.generation_batch_size)

    @property
    def reward_weights(self):
        """TRL's: one weight per name in `reward_func_names` (`reward.weights`, else 1 each; 1 for an environment's
        `get_reward`), a torch tensor when torch is installed."""
        weights = list(self.args.reward.weights or [1.0] * len(self._reward_funcs or []))
        weights += [1.0] * (len(self.reward_func_names) - len(weights))
        try:
            import torch
        except ImportError:
            return weights
        return torch.tensor(weights, dtype=torch.float32)

    def get_high_entropy_mask(self, entropies, mask, threshold: float):
        """TRL's method on torch tensors: True where a valid token's entropy is >= the ``threshold`` quantile of the
        valid entropies (`grpo_jax.losses.masks.high_entropy_mask` with top quantile 1 - threshold)."""
        import jax.numpy as jnp
        import numpy as np
        import torch

        from grpo_jax.losses.masks import high_entropy_mask
        out = high_entropy_mask(jnp.asarray(entropies.float().numpy()), jnp.asarray(mask.float().numpy()),
                                top_quantile=1.0 - threshold)
        return torch.from_numpy(np.asarray(out) > 0)

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """TRL's static method on torch tensors: [B, 1] in ``mask``'s dtype, 1 unless A < 0 and the sequence's mean
        sampler-vs-policy log-ratio exceeds the threshold (`grpo_jax.losses.masks.off_policy_sequence_mask`)."""
        import jax.numpy as jnp
        import numpy as np
        import torch

        from grpo_jax.losses.masks import off_policy_sequence_mask
        as_jax = lambda t: jnp.asarray(t.detach().float().numpy())  # noqa: E731
        out = off_policy_sequence_mask(as_jax(advantages), as_jax(per_token_logps),
                                       as_jax(sampling_per_token_logps), as_jax(mask),
                                       threshold=off_policy_threshold)
        return torch.from_numpy(np.array(out)).to(mask.dtype)

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's: the model is a mixture of experts (its config has ``output_router_logits``) and the load-balancing
        coefficient (`loss.router_aux_loss_coef`, None: the model's own) is not 0."""
        with open(os.path.join(self.args.model.path, "config.json")) as f:
            hf = json.load(f)
        hf = hf.get("text_config", hf)
        coef = self.args.loss.router_aux_loss_coef
        coef = hf.get("router_aux_loss_coef", 0.0) if coef is None else coef
        return "output_router_logits" in hf and coef != 0.0

    def __getattr__(self, name: str):  # called only for attributes not set: `processing_class`, read on first use
        if name != "processing_class":
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        from grpo_jax.data.prompts import load_tokenizer

        folder = self.args.data.tokenizer_path or self.args.model.path
        tokenizer = None if folder is None else load_tokenizer(folder, "data.tokenizer_path" if
                                                                self.args.data.tokenizer_path else "model.path")
        if tokenizer is not None and tokenizer.pad_token_id is None:  # as the run pads: with EOS, as TRL does
            tokenizer.pad_token = tokenizer.eos_token
        self.processing_class = tokenizer  # TRL's tokenizer: the run's
        return tokenizer

    def _rollout(self, prompts: list, trainer_state) -> dict:
        """`rollout_func` called as TRL calls it, (prompts, trainer), `self.state` the run's so far (its step and
        max_steps: `trainer_state`); the run checks what it returns."""
        if trainer_state is not None:
            self.state.global_step, self.state.max_steps = trainer_state.global_step, trainer_state.max_steps
        return self.rollout_func(prompts, self)

    def _generate(self, prompts: list):
        """TRL's `_generate` with a `rollout_func` (what the run calls each training pass, `_rollout`): (prompt_ids,
        completion_ids, tool_mask (the output's `env_mask`, or None), completions (the decoded texts), logprobs,
        the output's other fields)."""
        from grpo_jax.rollout.rollout_func import checked

        if self.rollout_func is None:
            raise ValueError("_generate without a rollout_func: grpo_jax samples with its own programs inside "
                             "train(); pass rollout_func to GRPOTrainer to make the rows yourself")
        output, extra = checked(self.rollout_func(prompts, self))
        completions = self.processing_class.batch_decode(output["completion_ids"], skip_special_tokens=True)
        return (output["prompt_ids"], output["completion_ids"], extra.pop("env_mask", None), completions,
                output["logprobs"], extra)

    def _train_rows(self):
        """`train_dataset` as the run reads it: a streamed `datasets.IterableDataset` (TRL's `streaming=True`) as the
        rows its `max_steps` can reach (whole rounds of prompts on every device there could be), read once, in the
        stream's order; anything else as it is."""
        if not is_stream(self.train_dataset):
            return self.train_dataset
        if self._streamed is None:
            import jax

            if self.args.max_steps <= 0:
                raise ValueError("train_dataset is a streamed IterableDataset (it has no length): set max_steps, as "
                                 "TRL requires")
            config = for_run(self.args, row_devices=jax.device_count(), num_prompts=None)
            rounds = -(-config.max_steps // config.train.steps_per_round)
            self._streamed = list(itertools.islice(self.train_dataset, rounds * config.train.prompts_per_round))
        return self._streamed

    def train(self, resume_from_checkpoint: bool | str | None = None):
        """Trains (`grpo_jax.api.trainer.train`) and returns transformers' `TrainOutput` (global_step, training_loss,
        metrics: the run's summary, which `output["steps"]` also reads) when transformers is importable, else the
        summary; `self.state.log_history` then holds every logged line (TRL's keys, transformers' final line).
        A run already in `args.output_dir` is set aside into its `previous-run/` and training starts again, as
        TRL's does, unless `resume_from_checkpoint` (this argument or the config key, `grpo_jax.io.runs`) asks to
        continue: True (the newest checkpoint), a run folder, its newest checkpoint folder, or TRL's
        `RUN/checkpoint-N`."""
        from grpo_jax.api import trainer
        from grpo_jax.io import checkpoint, preemption  # jax and the models: only once training starts

        config = self.args
        if resume_from_checkpoint is not None:
            config = dataclasses.replace(config, resume_from_checkpoint=resume_from_checkpoint)
        config = dataclasses.replace(config, resume_from_checkpoint=trl_checkpoint(config.resume_from_checkpoint))
        started = time.perf_counter()
        if isinstance(self.eval_dataset, Mapping):
            raise ValueError(f"eval_dataset is a dict of {len(self.eval_dataset)} datasets: a run evaluates one "
                             "held-out set; give one (trainer.evaluate(eval_dataset=...) evaluates each of a dict)")
        restart = not config.resume_from_checkpoint
        preemption.RERUN = "call trainer.train(resume_from_checkpoint=True)" if restart else None
        try:
            summary = trainer.train(config, train_dataset=self._train_rows(),
                                    eval_dataset=held_out(self.eval_dataset), reward_funcs=self._reward_funcs,
                                    reward_processing_classes=self.reward_processing_classes, tools=self._tools,
                                    environment_factory=self.environment_factory, restart=restart,
                                    rollout_func=None if self.rollout_func is None else self._rollout)
        finally:
            preemption.RERUN = None
        self._output_dir = summary["output_dir"]
        meta = checkpoint.saved_meta(self._output_dir) or {}  # its history: every line, whatever report_to
        history = [trl_line(line) for line in meta.get("history", [])]
        losses = [line["loss"] for line in history if line.get("loss") is not None]
        train_loss = sum(losses) / len(losses) if losses else float("nan")
        # transformers' final line (`speed_metrics`): this call's steps, of train_batch_size completions each;
        # total_flos 0 as in TRL, whose GRPO inputs have no input_ids for the Trainer's FLOP estimate
        runtime, trained = time.perf_counter() - started, summary["steps_trained"]
        epoch = next((line["epoch"] for line in reversed(history) if "epoch" in line), 0.0)
        history.append({**residual_means(history, summary["steps"], config.logging_steps),
                        "train_runtime": round(runtime, 4),
                        "train_samples_per_second": round(trained * summary["train_batch_size"] / runtime, 3),
                        "train_steps_per_second": round(trained / runtime, 3), "total_flos": 0.0,
                        "train_loss": train_loss, "epoch": epoch, "step": summary["steps"]})
        self.state = TrainerState(global_step=summary["steps"], max_steps=summary["steps"], log_history=history)
        if config.loss.use_adaptive_entropy:  # TRL's trainer.entropy_coef: where the controller left it
            self.entropy_coef = next(line["entropy_coef"] for line in reversed(history) if "loss" in line)
        try:
            from transformers.trainer_utils import TrainOutput
        except ImportError:
            return summary

        class Output(TrainOutput):
            """TRL's `TrainOutput`; a string key reads the summary, as `train()` returned before."""
            def __getitem__(self, key):
                return self.metrics[key] if isinstance(key, str) else super().__getitem__(key)
        return Output(summary["steps"], train_loss, {**summary, "train_runtime": history[-1]["train_runtime"],
                                                     "train_loss": train_loss})

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """TRL's `evaluate()`: the held-out evaluation (`eval.*`) under TRL's names (`eval_` prefix, or
        `metric_key_prefix`). `eval_dataset` (TRL's: one dataset, or a dict of them, each under
        `<prefix>_<name>_`) evaluates the params as they are now (the model as given before `train()`, the trained
        ones after); None: the trainer's own, after `train()` the evaluation the run made at its last step.
        `ignore_keys` (model outputs TRL leaves out of its predictions) has nothing to leave out here."""
        if isinstance(eval_dataset, Mapping):
            out = {}
            for name, dataset in eval_dataset.items():
                out.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        if eval_dataset is None and self._output_dir is not None:
            evaluations = [line for line in self.state.log_history if any(k.startswith("eval_") for k in line)]
            if not evaluations:
                raise ValueError("evaluate() needs an evaluation: give eval_dataset (or eval.num_examples > 0) so the "
                                 "run evaluates its policy")
            metrics = dict(evaluations[-1])
        else:
            if eval_dataset is None and isinstance(self.eval_dataset, Mapping):
                return self.evaluate(self.eval_dataset, ignore_keys, metric_key_prefix)
            metrics = self._evaluate_now(held_out(self.eval_dataset if eval_dataset is None else eval_dataset))
        prefix = metric_key_prefix + "_"
        return {prefix + k[len("eval_"):] if k.startswith("eval_") else k: v for k, v in metrics.items()}

    def _evaluate_now(self, eval_dataset) -> dict:
        """Builds the run (its lock held meanwhile; after `train()` it resumes the trained state) and evaluates its
        params on `eval_dataset`'s rows."""
        from grpo_jax.api import trainer

        run, state, held = trainer.build(self.args, train_dataset=self._train_rows(), eval_dataset=eval_dataset,
                                         reward_funcs=self._reward_funcs, tools=self._tools,
                                         environment_factory=self.environment_factory,
                                         reward_processing_classes=self.reward_processing_classes)
        toolbox = None
        try:
            if not run.eval_rows:
                raise ValueError("evaluate() needs held-out rows: give eval_dataset (or eval.num_examples > 0)")
            if self._output_dir is not None:  # trained: its newest checkpoint, the state train() ended with
                from grpo_jax.io import checkpoint

                mngr = checkpoint.manager(run.output_dir, save_total_limit=run.config.save_total_limit)
                restored = checkpoint.restore_latest(mngr, state, keep_ref=run.keep_ref)
                state = state if restored is None else restored[1]
            toolbox = trainer.open_toolbox(run.tooling)
            step = int(state.step)
            metrics = trainer.evaluate(run, state.params, step, toolbox=toolbox,
                                       reference_params=state.reference_params)
        finally:
            if toolbox is not None:
                toolbox.close()
            held.release()
        return trl_line({**metrics, "step": step})

    def save_model(self, output_dir: str | os.PathLike | None = None) -> None:
        """TRL's `save_model`: the trained policy as a Hugging Face folder (the run's `final/`: config.json, the
        safetensors, the tokenizer, generation_config.json; PEFT's adapter files under LoRA) written into
        `output_dir` (default: `args.output_dir`, the run's own folder, as TRL writes it there), so that
        `from_pretrained(output_dir)` loads it. The run's own files (config.yaml, checkpoints/, ...) keep other names."""
        if self._output_dir is None:
            raise ValueError("save_model before train(): nothing is trained yet; call trainer.train() first, or "
                             "export a checkpoint with `grpo-jax export`")
        final = Path(self._output_dir) / "final"
        out = Path(self._output_dir if output_dir is None else output_dir)
        if out.resolve() == final.resolve():
            return
        out.mkdir(parents=True, exist_ok=True)
        for entry in final.iterdir():
            if entry.is_dir():
                shutil.copytree(entry, out / entry.name, dirs_exist_ok=True)
            else:
                shutil.copy2(entry, out / entry.name)


logger = logging.getLogger("trl.trainer.grpo_trainer")  # TRL's logger, so a script's log filters apply


def _trl_checks(config: Config, reward_funcs: list | None, processing_classes: Any) -> None:
    """TRL's GRPOTrainer `__init__` checks on the arguments together (its messages), and its warnings."""
    if reward_funcs is not None:
        weights = config.reward.weights
        if weights is not None and len(weights) != len(reward_funcs):
            raise ValueError(f"Number of reward weights ({len(weights)}) must match number of reward functions "
                             f"({len(reward_funcs)})")
        # TRL takes a single class as a list of one
        classes = processing_classes if isinstance(processing_classes, (list, tuple)) else [processing_classes]
        if processing_classes is not None and len(classes) != len(reward_funcs):
            raise ValueError(f"The number of reward processing classes ({len(classes)}) must match the "
                             f"number of reward functions ({len(reward_funcs)}).")
    loss = config.loss
    if loss.loss_type == "luspo" and loss.importance_sampling_level != "sequence":
        logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
                       "mirror the paper's setup.")
    if loss.loss_type == "vespo" and loss.importance_sampling_level != "token":
        logger.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
                       "should be set to `'token'` (the default).")
    if loss.importance_sampling_level == "sequence" and loss.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        logger.warning(f"When using `importance_sampling_level='sequence'`, the `'{loss.loss_type}'` loss sums "
                       "per-token contributions, which effectively weights each sequence by its completion length "
                       "instead of optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set "
                       "`loss_type='grpo'`.")
