"""Decoding's own layout: which group of neighbouring devices holds one copy of the policy, and why.

Training splits every weight over ``fsdp`` along the hidden size, so a decode step in that layout has every device
run every row against its slice and all-reduce the partial sums across all of them, the [rows, vocab] logits
included. Decoding runs instead over the same devices in the same order reshaped to (data = n / g, tensor = g):
each group of g consecutive devices (neighbours on a TPU slice) holds one compute-dtype copy split Megatron-style
(heads, MLP columns and vocabulary: `sharding.PARTITION_RULES` at fsdp 1, one all-reduce a block inside the group),
rows and their KV cache split over the groups, the next token drawn from the group's vocabulary shards (their
arg-maxes gathered, a few bytes a row). A mixture of experts splits its experts over the group instead (expert
parallel, attention data parallel). The policy is resharded into it once per decoding call (`programs.jit_decoder`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_jax.device import sharding
from grpo_jax.device.chips import Chip, collective_seconds
from grpo_jax.models.transformer import layer_windows

FIT_FRACTION = 0.9  # of a chip's HBM, as `grpo_jax.api.plan` judges a fit (XLA's own buffers, fragments)


class Layout(NamedTuple):
    """Decoding over groups of ``group`` devices split along ``axis`` ("tensor", or "expert" for experts);
    ``kv_cache_tokens`` the paged pool that fits in HBM beside the weights when every slot's whole row does not
    (`sampling.kv_cache_tokens`'s meaning; 0: whole rows fit)."""

    group: int
    axis: str
    reason: str
    kv_cache_tokens: int = 0


def rollout_mesh(mesh: Mesh, layout: Layout) -> Mesh:
    """``mesh``'s devices in the same order (so one program may take the training layout and give this one) as
    (data = n / group) x (``layout.axis`` = group)."""
    sizes = {"data": mesh.devices.size // layout.group, "fsdp": 1, "tensor": 1, "expert": 1, layout.axis: layout.group}
    return Mesh(np.asarray(mesh.devices).reshape(-1).reshape([sizes[a] for a in sharding.AXES]), sharding.AXES)


def bytes_per_device(abstract_tree, shardings) -> int:
    """Bytes one device holds of ``abstract_tree`` (arrays or ShapeDtypeStructs) laid out as ``shardings``."""
    sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize,
                         abstract_tree, shardings)
    return int(sum(jax.tree.leaves(sizes)))


def _splits(model, group: int, expert: bool) -> bool:
    if expert:
        return model.num_experts % group == 0
    return (model.num_attention_heads % group == 0 and model.num_key_value_heads % group == 0
            and model.intermediate_size % group == 0)


def step_seconds(chip: Chip, *, weights: float, kv: float, rows: int, hidden: int, layers: int, group: int,
                 top_k: int = 0) -> float:
    """A decode step's estimate on one chip of ``chip``: ``weights`` + ``kv`` bytes read at its HBM bandwidth (a
    ranking: `grpo-jax plan` applies its efficiency factor), plus the group's collectives of its ``rows`` (rings
    over the group: `chips.collective_seconds`). A tensor group all-reduces two bfloat16 ``rows`` x ``hidden``
    blocks a layer; an expert group (``top_k`` experts a token) gathers its rows' tokens, expert ids (int32) and
    routing weights (bfloat16) and all-reduces the experts' outputs once a routed layer (``layers``), as its
    compiled decode step does (tests/device/test_rollout_layout.py)."""
    if group == 1:
        ici = 0.0
    elif top_k:
        ici = layers * (collective_seconds(chip, "all-gather", rows * hidden * 2, group)
                        + collective_seconds(chip, "all-gather", rows * top_k * 4, group)
                        + collective_seconds(chip, "all-gather", rows * top_k * 2, group)
                        + collective_seconds(chip, "all-reduce", rows * hidden * 2, group))
    else:
        ici = 2 * layers * collective_seconds(chip, "all-reduce", rows * hidden * 2, group)
    return (weights + kv) / chip.hbm_bandwidth + ici


def row_tokens(model, prompt: int, completion: int) -> tuple[int, float, int]:
    """A row's cached tokens summed over layers, as a paged cache holds them: (its full-attention layers' tokens of
    a whole row, the mean of all layers' tokens a decode step reads over a row's life (half its completion; a
    window layer at most its window), its window layers' rings (`models.paged.Ring`))."""
    windows = layer_windows(model)
    whole, mean = prompt + completion, prompt + completion / 2
    full = sum(whole for w in windows if w is None)
    rings = sum(min(w, whole) for w in windows if w is not None)
    return full, sum(mean if w is None else min(w, mean) for w in windows), rings


def choose(setting: int, model, mesh: Mesh, *, chip: Chip | None, rows: int, prompt: int, completion: int,
           abstract_params, state_bytes: int) -> Layout | None:
    """Decoding's layout for ``mesh.rollout_tensor`` = ``setting`` (0: chosen, -1: none, n: groups of n) of
    ``model`` over ``mesh`` (the training mesh), ``rows`` a decoding call's rows in flight of ``prompt`` +
    ``completion`` tokens; None: decode in the training layout. The choice takes, of the group sizes that divide the
    devices, rows, heads (experts) and hold the weights, the window rings and one whole row a row shard beside the
    ``state_bytes`` a device keeps of the train state, the one whose decode step `step_seconds` estimates fastest on
    ``chip`` (a paged cache's reads: rows at half their completion on average, `row_tokens`). When every row's
    whole row does not fit too, the layout says the pool that does (``kv_cache_tokens``): rows then wait for pages."""
    n, expert = mesh.devices.size, bool(model.num_experts)
    axis = "expert" if expert else "tensor"
    if setting == -1 or n == 1:
        return None
    if setting > 0:
        if n % setting or rows % (n // setting):
            raise ValueError(f"mesh.rollout_tensor={setting} must divide the {n} devices into groups over which the "
                             f"{rows} rows split: choose a divisor g of {n} with {rows} a multiple of {n}/g, or 0")
        return Layout(setting, axis, f"{axis} {setting} x data {n // setting} (mesh.rollout_tensor={setting})")
    platform = mesh.devices.flat[0].platform
    if platform == "cpu" or chip is None:
        return None  # weights stream from host memory: the training layout, unless a key asks
    itemsize = jnp.dtype(model.jnp_dtype).itemsize
    experts_bytes = sum(math.prod(x.shape) for x in _leaves_named(abstract_params, "experts")) * itemsize
    weights = sum(math.prod(x.shape) for x in _leaves_named(abstract_params, "")) * itemsize
    full, mean, rings = row_tokens(model, prompt, completion)
    free = FIT_FRACTION * chip.hbm_bytes - state_bytes
    tried = []
    for group in (g for g in range(1, n + 1) if n % g == 0 and g & (g - 1) == 0):
        if rows % (n // group) or not _splits(model, group, expert):
            continue
        chip_weights = (weights - experts_bytes) + experts_bytes / group if expert else weights / group
        shards = n if expert else n // group  # row shards (experts: rows over every device)
        chip_rows = rows / shards
        layer_token = 2 * model.num_key_value_heads * model.resolved_head_dim * itemsize / (1 if expert else group)
        held = chip_weights + chip_rows * rings * layer_token  # weights and the rows' rings, always there
        left = free - held - chip_rows * full * layer_token
        pool = 0 if left >= 0 or not full else int((free - held) // (full / (prompt + completion) * layer_token))
        over = left < 0 and (not full or pool < prompt + completion)  # not even one whole row a shard
        kv = chip_rows * mean * layer_token
        # the group's rows' activations: a tensor group's rows are all its devices'; experts gather theirs
        seconds = step_seconds(chip, weights=chip_weights, kv=kv, rows=int(chip_rows * (group if expert else 1)),
                               hidden=model.hidden_size, layers=model.routed_layers if expert else
                               model.num_hidden_layers, group=group, top_k=model.num_experts_per_tok if expert else 0)
        tried.append((over, seconds, group, chip_weights, kv, pool * shards))
    if not tried:
        return None
    over, seconds, group, chip_weights, kv, pool = min(tried)
    others = ", ".join(f"{g}: {1e3 * s:.2f} ms" for _, s, g, *_ in sorted(tried, key=lambda t: t[2]) if g != group)
    reason = (f"{axis} {group} x data {n // group}: weights {chip_weights / 2**30:.2f} GiB + KV read "
              f"{kv / 2**30:.2f} GiB a chip, est. {1e3 * seconds:.2f} ms a decode step (groups of "
              f"{others or 'none other'})"
              + (f"; a KV pool of {pool} tokens (rows wait for pages beyond)" if pool else "")
              + ("; nothing fits beside the train state" if over else ""))
    return Layout(group, axis, reason, pool)


def _leaves_named(tree, part: str) -> list:
    return [x for path, x in jax.tree_util.tree_leaves_with_path(tree) if part in sharding.path_name(path)]
