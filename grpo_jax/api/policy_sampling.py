"""`trainer.model.generate` (`trl_state.PolicyView`): transformers' `generate` signature over grpo_jax's sampler
(`algo.programs.jit_decoder`, one device), on the weights the view reads: its folder, and under LoRA the base with
the viewed adapters (as `api.run` joins them)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from grpo_jax.algo import programs
from grpo_jax.api import run
from grpo_jax.algo.sampling import SamplingConfig
from grpo_jax.device import sharding
from grpo_jax.models import abstract_model, from_pretrained, peft_io, resolve_config
from grpo_jax.rollout import stream

IGNORED = ("use_cache",)  # transformers' options that change nothing here


def _model(view):
    """(graphdef, params, model config) of the weights `view` reads."""
    args = view._trainer.args
    if not view._lora:
        model, params = from_pretrained(str(view.folder), dtype=args.model.dtype)
        return model.graphdef, params, model.config
    trained = view._trainer._output_dir is not None and (view.folder / peft_io.WEIGHTS_FILE).is_file()
    adapters = str(view.folder) if trained else args.model.lora.path
    config = resolve_config(dataclasses.replace(args.model, path=str(view._base_folder),
                                                lora=dataclasses.replace(args.model.lora, path=adapters)))
    config = dataclasses.replace(config, lora=peft_io.resolve_lora(config.lora))
    return abstract_model(config)[0].graphdef, run.pretrained_params(config, args.seed), config


def _generation_config(folder):
    import transformers
    try:
        return transformers.GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: transformers' defaults
        return transformers.GenerationConfig()


def generate(view, ids: np.ndarray, mask: np.ndarray, *, draw: int, options: dict) -> np.ndarray:
    """[B, P + T] ids of `ids` / `mask` (left-padded [B, P]) and their completions; `options` as `generate` takes
    them, None where the folder's generation config decides."""
    gen = _generation_config(view._base_folder)

    def pick(name, default=None):  # the call's option, else the folder's generation config, else transformers'
        return next((v for v in (options.get(name), getattr(gen, name, None), default) if v is not None), None)

    # transformers: 20 new tokens unless the call or the folder's config sets max_new_tokens or a whole max_length
    new = pick("max_new_tokens") or (max(int(gen.max_length) - ids.shape[1], 1) if gen.max_length else 20)
    eos = pick("eos_token_id")
    eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    pad = pick("pad_token_id", eos[0] if eos else 0)
    greedy = not pick("do_sample", False)
    # transformers' defaults where nothing sets one: temperature 1, top_k 50, top_p 1, no min_p, no penalty
    config = SamplingConfig(max_completion_length=int(new), temperature=float(pick("temperature", 1.0)),
                            top_k=int(pick("top_k", 50)), top_p=float(pick("top_p", 1.0)),
                            min_p=float(pick("min_p", 0.0)), repetition_penalty=float(pick("repetition_penalty", 1.0)),
                            num_beams=int(pick("num_beams", 1)), length_penalty=float(pick("length_penalty", 1.0)),
                            early_stopping=pick("early_stopping", False))
    # the weights read once per folder and trained step, a decoder built once per sampling options: a script's
    # loop of calls compiles once
    cache = view._sampling_cache
    weights = (str(view.folder), view._trainer.state.global_step)
    if cache.get("weights") != weights:
        cache.clear()
        cache.update(weights=weights, model=_model(view))
    graphdef, params, model_config = cache["model"]
    options_key = (config, eos, int(pad))
    if options_key not in cache:
        mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        cache[options_key] = programs.jit_decoder(graphdef, mesh, model_config, config=config, eos_token_ids=eos,
                                                  pad_token_id=int(pad))
    decoder = cache[options_key]
    key = jax.random.fold_in(jax.random.key(view._trainer.args.seed), draw)
    out = stream.generate(decoder, params, ids, mask, key, greedy=greedy)
    completions = np.asarray(out.completion_ids)
    ended = np.isin(completions, eos) if eos else np.zeros(completions.shape, bool)
    # transformers stops once every row has ended: no column after the last row's EOS
    length = max((int(np.argmax(row)) + 1 if row.any() else completions.shape[1]) for row in ended)
    if config.num_beams > 1 and eos and not pad:  # transformers' beam search pads with `pad_token_id or eos[0]`
        completions = np.where(np.asarray(out.completion_mask) == 1, completions, eos[0])
    return np.concatenate([ids, completions[:, :length].astype(ids.dtype)], axis=1)
