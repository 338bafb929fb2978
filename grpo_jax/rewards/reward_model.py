"""Reward models: a Hugging Face `*ForSequenceClassification` folder (Qwen2, Qwen3, Llama, Mistral) as an entry of
`reward.functions`, or the transformers object itself in `train(reward_funcs=...)` (as TRL takes it, converted to
JAX through the folder route), scored in JAX as TRL 1.16 scores one.

TRL's `_calculate_rewards` for a model: each prompt + completion as text (conversations through the reward model's
own chat template, `messages = prompt + completion`), tokenized without special tokens and right-padded, and the
reward is `logits[:, 0]` of the head `score` (a bias-free Linear, hidden -> num_labels) at the last token that is
not the pad token (transformers' pooling; TRL sets the model's pad id to its tokenizer's, EOS when it has none).
The decoder is ours (`grpo_jax.models`), its weights placed over the run's mesh; rows are padded to a multiple of
`LENGTH_BUCKET` tokens and to a power-of-two number of rows (a sampling pass, dynamic sampling's included, has any
number), so only a few shapes compile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import numpy as np

LENGTH_BUCKET = 64


def is_reward_model(path) -> bool:
    """Whether `path` is a folder whose config.json names a `*ForSequenceClassification` architecture; a model
    folder with another head is a ValueError saying what it is."""
    config = Path(os.fspath(path)) / "config.json"
    if not config.is_file():
        return False
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"{os.fspath(path)!r} is a model folder but not a reward model (architectures "
                         f"{architectures}): list a *ForSequenceClassification folder, saved with transformers' "
                         "AutoModelForSequenceClassification, or a 'module:function'")
    return True


def is_model_object(obj) -> bool:
    """Whether `obj` is a transformers model object (a PyTorch module with a config), not a reward function."""
    return hasattr(obj, "config") and hasattr(obj, "state_dict") and hasattr(obj, "save_pretrained")


def _tokenizer_of(name: str):
    """The tokenizer saved beside a model object's weights (its `name_or_path`, a folder or a cached hub id), or
    None."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True) if name else None
    except (OSError, ValueError, TypeError):  # transformers' many ways of saying "no tokenizer here"
        return None


class RewardModel:
    """A reward function `fn(prompts, completions, **kwargs) -> list[float]` backed by a sequence classifier."""

    def __init__(self, path, mesh=None, tokenizer=None):
        from transformers import AutoTokenizer

        from grpo_jax.algo import programs
        from grpo_jax.config.model import ModelConfig
        from grpo_jax.device import sharding
        from grpo_jax.models import abstract_model, from_pretrained, resolve_config, safetensors_io

        self.path = os.fspath(path)
        self.__name__ = Path(self.path).name  # TRL names a model reward after the model
        shardings = None
        if mesh is not None:
            trunk = dataclasses.replace(resolve_config(ModelConfig(path=self.path)), tie_word_embeddings=True)
            shardings = sharding.param_shardings(mesh, abstract_model(trunk)[1])
        self.model, self.params = from_pretrained(self.path, shardings=shardings, extra_tensors=("score.weight",),
                                                  trunk_only=True)
        refs = safetensors_io.open_folder(self.path)
        if "score.weight" not in refs:
            raise ValueError(f"reward model {self.path!r} has no score.weight tensor: save it with transformers' "
                             "AutoModelForSequenceClassification")
        self.score_weight = np.array(safetensors_io.view(refs["score.weight"], {}), np.float32)  # [labels, D]
        self.tokenizer = AutoTokenizer.from_pretrained(self.path) if tokenizer is None else tokenizer
        if self.tokenizer.pad_token is None:  # TRL: pad with EOS, and the model pools by that id
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.template_kwargs: dict = {}  # `data.chat_template_kwargs` (`reward_specs.resolve_all`)
        self._scores = programs.jit_reward_scores(self.model.graphdef)

    @classmethod
    def from_object(cls, model, mesh=None, tokenizer=None) -> RewardModel:
        """A transformers `*ForSequenceClassification` object (TRL's `reward_funcs=[model]`) in JAX: its config and
        weights saved to a temporary folder and read as a folder is (the same weight mapping, the same scores).
        `tokenizer`: TRL's reward processing class; None: the one saved at the model's `name_or_path`."""
        kind, name = type(model).__name__, str(getattr(model.config, "_name_or_path", "") or "")
        if not kind.endswith("ForSequenceClassification"):
            raise ValueError(f"reward_funcs: a {kind} object is not a reward model: pass a *ForSequenceClassification "
                             "model (or its folder, saved with save_pretrained), or a reward function")
        tokenizer = _tokenizer_of(name) if tokenizer is None else tokenizer
        if tokenizer is None:
            raise ValueError(f"reward_funcs: the {kind} object{f' ({name})' if name else ''} comes without a "
                             "tokenizer: pass reward_processing_classes=[its tokenizer], or save model and tokenizer "
                             "with save_pretrained and list the folder in reward.functions")
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        with tempfile.TemporaryDirectory(prefix="grpo_jax-reward-model-") as folder:
            try:
                hf_logging.disable_progress_bar()  # "Writing model shards": a save of ours, not the user's
                try:
                    model.save_pretrained(folder)
                finally:
                    if bars:
                        hf_logging.enable_progress_bar()
                out = cls(folder, mesh, tokenizer=tokenizer)
            except (ValueError, OSError, RuntimeError) as e:  # an architecture or weights the folder route refuses
                raise ValueError(f"reward_funcs: the {kind} object cannot be converted to JAX "
                                 f"({str(e).replace(folder, '<its saved folder>')})") from e
        out.path, out.__name__ = name or kind, Path(name).name or kind  # TRL names it after the model
        return out

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What TRL feeds the reward model: prompt + completion, conversations through the chat template."""
        if prompts and isinstance(prompts[0], list):
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.template_kwargs)
                    for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        encoded = self.tokenizer(self.texts(prompts, completions), padding=True, padding_side="right",
                                 add_special_tokens=False, return_tensors="np")
        ids, mask = encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)
        width = -(-ids.shape[1] // LENGTH_BUCKET) * LENGTH_BUCKET
        ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=self.pad_token_id)
        mask = np.pad(mask, ((0, 0), (0, width - mask.shape[1])))
        n = len(ids)
        rows = 1 << max(n - 1, 0).bit_length()  # filled with copies of the first row, whose scores are dropped
        ids, mask = (np.concatenate([x, np.repeat(x[:1], rows - n, axis=0)]) for x in (ids, mask))
        scores = self._scores(self.params, self.score_weight, ids, mask, self.pad_token_id)
        return np.asarray(scores, np.float64)[:n].tolist()
