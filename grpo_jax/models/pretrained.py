"""Hugging Face model folders in and out: ``from_pretrained``, ``save_pretrained``, ``Model``, ``eos_token_ids``.

Name mapping (L layers, stacked on a leading axis): our ``layers.<m>.kernel`` [L, in, out] is
``model.layers.<i>.<m>.weight`` [out, in] transposed, for i < L; biases and norm weights keep their shape;
``embed_tokens.embedding`` is ``model.embed_tokens.weight``, ``norm.weight`` is ``model.norm.weight`` and
``lm_head.kernel`` is ``lm_head.weight`` transposed. Loading memory-maps the safetensors files and builds each
parameter with ``jax.make_array_from_callback``, so every device reads only its own slice and no full host
copy of the model exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from grpo_jax.config.model import ModelConfig
from grpo_jax.models import safetensors_io as st
from grpo_jax.models.registry import family, resolve_config, to_hf_config
from grpo_jax.models.transformer import Transformer, forward, positions_from_mask, unembed

# tensors some checkpoints carry that hold no parameters of ours
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Model:
    """The static half of a model (graphdef + config); hashable, so it can be a static jit argument."""

    graphdef: nnx.GraphDef
    config: ModelConfig

    def __call__(self, params, input_ids_BxT, attention_mask_BxT):
        """Logits [B, T, V] of a left-padded batch; positions come from the mask (``positions_from_mask``)."""
        hidden_BxTxD, _ = forward(self.graphdef, params, input_ids_BxT, positions_from_mask(attention_mask_BxT),
                                  attention_mask_BxT)
        return unembed(self.graphdef, params, hidden_BxTxD)


def abstract_model(config: ModelConfig) -> tuple[Model, nnx.State]:
    """The Model and its params as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    return Model(graphdef, config), abstract


def _flat(tree) -> dict[str, Any]:
    """"a.b.c" -> leaf of an nnx.State or a nested dict."""
    pure = nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
    leaves = jax.tree_util.tree_flatten_with_path(pure, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    return {jax.tree_util.keystr(k, simple=True, separator="."): v for k, v in leaves}


def _sharding_fn(shardings) -> Callable[[str, tuple], jax.sharding.Sharding]:
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda path, shape: device
    if callable(shardings):
        return shardings
    table = _flat(shardings)

    def lookup(path, shape):
        if path not in table:
            raise ValueError(f"shardings has no entry for parameter {path} {shape}: pass a pytree matching the "
                             "params (e.g. from abstract_model) or a function (path, shape) -> Sharding")
        return table[path]

    return lookup


def _check_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"model folder {path!r} does not exist: pass a local Hugging Face model folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {path!r} has no config.json: it must hold config.json and "
                         f"{st.SINGLE_FILE} (or {st.INDEX_FILE} + shards)")


def _plan(abstract_flat, refs, config: ModelConfig, folder: str,
          extra_tensors: tuple[str, ...] = ()) -> dict[str, tuple[list[st.TensorRef], bool, bool]]:
    """Our path -> (tensor refs, stacked, transposed), after checking every name and shape; nothing is read."""
    index = os.path.join(folder, st.INDEX_FILE)
    source = index if os.path.isfile(index) else os.path.join(folder, st.SINGLE_FILE)
    plan, used = {}, set()
    for path, leaf in abstract_flat.items():
        names, stacked, transposed = family(config.model_type).hf_names(path, config)
        shape = tuple(leaf.shape[stacked:])
        want = shape[::-1] if transposed else shape
        for name in names:
            if name not in refs:
                raise ValueError(f"{source}: tensor {name} (for {path}) is missing: the weights do not match "
                                 f"config.json (model_type={config.model_type!r})")
            if refs[name].shape != want:
                raise ValueError(f"{refs[name].file}: tensor {name} has shape {list(refs[name].shape)}, expected "
                                 f"{list(want)} from config.json")
        used.update(names)
        plan[path] = ([refs[n] for n in names], stacked, transposed)
    extra = sorted(n for n in refs if n not in used and not n.endswith(_IGNORED_SUFFIXES) and n not in extra_tensors
                   and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if extra:
        raise ValueError(f"{source}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} (in "
                         f"{refs[extra[0]].file}): config.json (model_type={config.model_type!r}) has no place for "
                         "them, so the checkpoint and its config disagree")
    return plan


def _read(refs, stacked: int, transposed: bool, dtype, maps, shape) -> Callable:
    """make_array_from_callback's callback: the requested slice, read from the memory maps and cast. ``refs`` are
    the tensors of the ``stacked`` leading axes of ``shape``, row-major (layers, or layers x experts)."""
    grid = np.empty(len(refs), dtype=object)
    grid[:] = refs
    grid = grid.reshape(shape[:stacked])

    def piece(ref, index):
        array = st.view(ref, maps)
        if transposed:
            return array[index[1], index[0]].T
        return array[index]

    def callback(index):
        if stacked:
            chosen = grid[index[:stacked]]
            out = np.empty((*chosen.shape, *piece(refs[0], index[stacked:]).shape), dtype)
            for k in np.ndindex(chosen.shape):  # one tensor at a time: no second host copy of the stack
                out[k] = piece(chosen[k], index[stacked:])
            return out
        return np.asarray(piece(refs[0], index)).astype(dtype, copy=False)

    return callback


def from_pretrained(path, dtype: str | None = None, *, shardings=None, config: ModelConfig | None = None,
                    extra_tensors: tuple[str, ...] = (), trunk_only: bool = False) -> tuple[Model, nnx.State]:
    """Load a Hugging Face folder (a `families` model_type): (Model, params) with params in ``dtype``.

    ``dtype`` (e.g. "bfloat16") sets both the storage and the compute dtype; None keeps ``config``'s
    (default float32). ``config`` carries non-architecture settings (remat, dtypes); its architecture must
    agree with config.json. ``shardings``: None (default device), a pytree of Shardings matching the params,
    or ``fn(path_str, shape) -> Sharding``. Errors name the file and tensor; nothing is half-loaded.
    ``extra_tensors``: tensors of the folder that are not the decoder's (a reward model's ``score.weight``), left
    for the caller to read. ``trunk_only``: the folder has no LM head (``*ForSequenceClassification``): the
    unembedding is tied to the embedding, never to be used for tokens.
    """
    path = os.fspath(path)
    _check_folder(path)
    base = config if config is not None else ModelConfig()
    if dtype is not None:
        base = dataclasses.replace(base, dtype=dtype, param_dtype=dtype)
    model_cfg = resolve_config(dataclasses.replace(base, path=path))
    if trunk_only:
        model_cfg = dataclasses.replace(model_cfg, tie_word_embeddings=True)
    model, abstract = abstract_model(model_cfg)
    abstract_flat = _flat(abstract)
    plan = _plan(abstract_flat, st.open_folder(path), model_cfg, path, extra_tensors)
    sharding_of = _sharding_fn(shardings)
    maps: dict = {}
    arrays = {}
    for name, leaf in abstract_flat.items():
        refs, stacked, transposed = plan[name]
        sharding = sharding_of(name, tuple(leaf.shape))
        arrays[name] = jax.make_array_from_callback(
            tuple(leaf.shape), sharding, _read(refs, stacked, transposed, np.dtype(leaf.dtype), maps,
                                                       tuple(leaf.shape)))
    maps.clear()
    nested: dict = {}
    for name, array in arrays.items():
        *parents, leaf_name = name.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf_name] = array
    nnx.replace_by_pure_dict(abstract, nested)
    return model, abstract


def _to_host(array: jax.Array, transposed: bool) -> np.ndarray:
    if not array.is_fully_addressable:
        from jax.experimental import multihost_utils
        array = multihost_utils.process_allgather(array, tiled=True)
    host = np.asarray(jax.device_get(array))
    return host.T if transposed else host


def _entries(model: Model, params) -> list[st.Entry]:
    """Tensors to write in Hugging Face order (embeddings, layer 0..L-1, norm, head), fetched lazily."""
    config = model.config
    entries = []
    for path, array in _flat(params).items():
        names, stacked, transposed = family(config.model_type).hf_names(path, config)
        shape = tuple(array.shape[stacked:])
        for i, name in zip(np.ndindex(array.shape[:stacked]), names):
            fetch = lambda a=array, i=i, t=transposed: _to_host(a[i] if i else a, t)  # noqa: E731
            entries.append(st.Entry(name, shape[::-1] if transposed else shape, np.dtype(array.dtype), fetch))
    zeros = family(config.model_type).export_zeros
    dtype = entries[0].dtype
    for name, shape in zeros(config) if zeros is not None else ():
        entries.append(st.Entry(name, shape, dtype, lambda shape=shape: np.zeros(shape, dtype)))

    def order(e: st.Entry):
        parts = e.name.split(".")
        layer = int(parts[2]) if parts[1:2] == ["layers"] else (-1 if "embed_tokens" in e.name else 1 << 30)
        return layer, e.name

    return sorted(entries, key=order)


def _token_ids(source: str | None, tokenizer) -> dict:
    ids = {}
    if source is not None and os.path.isfile(os.path.join(source, "config.json")):
        with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if ids.get(key) is None and getattr(tokenizer, key, None) is not None:
                ids[key] = getattr(tokenizer, key)
    return ids


def save_pretrained(model: Model, params, path, *, tokenizer=None, max_shard_size: int | str = "5GB") -> None:
    """Write a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads with the same logits.

    config.json (with ``architectures``), safetensors in the params' dtype (sharded + index above
    ``max_shard_size``), generation_config.json (copied from ``model.config.path`` when it has one) and the
    tokenizer when given. Arrays are gathered one tensor at a time; with several processes all take part in
    the gathers and process 0 writes.
    """
    import transformers

    path = os.fspath(path)
    config = model.config
    source = os.fspath(config.path) if config.path is not None else None
    if source is not None and os.path.abspath(source) == os.path.abspath(path):
        raise ValueError(f"save_pretrained: {path!r} is the folder the model was loaded from: write elsewhere")
    entries = _entries(model, params)
    dtype = entries[0].dtype
    hf = to_hf_config(config, **_token_ids(source, tokenizer))
    hf.dtype = "bfloat16" if dtype == np.dtype("bfloat16") else str(dtype)
    write = jax.process_index() == 0
    if write:
        os.makedirs(path, exist_ok=True)
    st.write_folder(path, entries, max_shard_size, write=write)
    if not write:
        return
    hf.save_pretrained(path)
    generation = os.path.join(source, "generation_config.json") if source else None
    if generation and os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(path, "generation_config.json"))
    else:
        transformers.GenerationConfig.from_model_config(hf).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def eos_token_ids(path, tokenizer) -> tuple[int, ...]:
    """EOS ids from ``path``/generation_config.json (an int or a list), else the tokenizer's eos_token_id."""
    file = os.path.join(os.fspath(path), "generation_config.json") if path is not None else None
    if file and os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            ids = (eos,) if isinstance(eos, int) else tuple(eos)
            if ids and all(isinstance(i, int) for i in ids):
                return ids
            raise ValueError(f"{file}: eos_token_id={eos!r} must be an int or a non-empty list of ints")
    if tokenizer is None or tokenizer.eos_token_id is None:
        raise ValueError(f"no EOS token: {file or 'no model folder'} gives no eos_token_id and the tokenizer has "
                         "no eos_token: set tokenizer.eos_token or add generation_config.json")
    return (int(tokenizer.eos_token_id),)
