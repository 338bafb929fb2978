"""Device mesh, partition rules and NamedShardings for params, optimizer state, batches and the KV cache.

Mesh axes: `data` (pure data parallel: rows split, params replicated), `fsdp` (rows split AND every weight
matrix split along its hidden dimension D), `tensor` (Megatron-style: attention heads / MLP columns / vocab split),
`expert` (mixture of experts: each device holds 1/n of every layer's experts, `models.moe.expert_parallel`; the
rows are split over it too, so the rest of the model runs data parallel there).
Rules match a parameter's path (keys joined by ".", layer indices included or not) and give the spec of its
LAST dims; leading dims (the stacked layer axis L) are None. A dim that its mesh axis does not divide stays
unsplit on that axis (one warning lists them).
"""

from __future__ import annotations

import functools
import math
import pickle
import re
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor", "expert")
ROWS = ("data", "fsdp", "expert")  # batch rows are split over every data-parallel axis
FSDP, TENSOR, EXPERT = "fsdp", "tensor", "expert"

# (regex searched in the dotted path, spec of the trailing dims); the first match wins
PARTITION_RULES: tuple[tuple[str, tuple], ...] = (
    (r"embed_tokens\.embedding$", (TENSOR, FSDP)),                     # [V, D]
    # mixture of experts (models/moe.py): stacked experts split over `expert`, each like its dense kernel
    (r"experts\.(gate_proj|up_proj)$", (EXPERT, FSDP, TENSOR)),       # [.., E, D, F]
    (r"experts\.down_proj$", (EXPERT, TENSOR, FSDP)),                  # [.., E, F, D]
    # GPT-OSS (models/gpt_oss.py): gate and up interleaved, so a tensor shard of 2F columns holds whole pairs
    (r"experts\.gate_up_proj$", (EXPERT, FSDP, TENSOR)),              # [.., E, D, 2F]
    (r"experts\.gate_up_proj_bias$", (EXPERT, TENSOR)),               # [.., E, 2F]
    (r"experts\.down_proj_bias$", (EXPERT, None)),                    # [.., E, D]
    (r"mlp\.(gate|router)\.kernel$", (FSDP, None)),                    # router [.., D, E]
    (r"mlp\.router\.bias$", (None,)),                                 # [.., E]
    (r"mlp\.gate\.e_score_correction_bias$", (None,)),                # [.., E] (GLM-4-MoE)
    (r"self_attn\.sinks$", (None,)),                                  # [.., H]: tiny, replicated
    (r"lm_head\.kernel$", (FSDP, TENSOR)),                             # [D, V]
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.kernel$", (FSDP, TENSOR)),  # [.., D, out]
    (r"(o_proj|down_proj)\.kernel$", (TENSOR, FSDP)),                  # [.., in, D]
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.bias$", (TENSOR,)),   # [.., out]
    (r"(o_proj|down_proj)\.bias$", (None,)),                           # [.., D]: tiny, replicated
    (r"(norm|layernorm)\.weight$", (None,)),                           # RMSNorm scales: replicated
    # LoRA adapters (models/lora.py): A's input dim and B's output dim split like their kernel's, rank r unsplit
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.lora_a$", (FSDP, None)),   # [.., D, r]
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.lora_b$", (None, TENSOR)),  # [.., r, out]
    (r"(o_proj|down_proj)\.lora_a$", (TENSOR, None)),                        # [.., in, r]
    (r"(o_proj|down_proj)\.lora_b$", (None, FSDP)),                          # [.., r, D]
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None, expert: int = 1) -> Mesh:
    """A (data, fsdp, tensor, expert) mesh over `devices` (default: all); one size may be -1 for "the rest"."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor, expert]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes {dict(zip(AXES, sizes))}: each must be >= 1, and at most one may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh sizes {dict(zip(AXES, sizes))} do not divide the {len(devices)} devices: "
                             "choose mesh.data/fsdp/tensor/expert whose product divides the device count")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices but "
                         f"{len(devices)} are present: make mesh.data*fsdp*tensor*expert equal the device count")
    return Mesh(np.asarray(devices).reshape(sizes), AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def row_sharded(mesh: Mesh) -> NamedSharding:
    """Leading (row) axis split over the data-parallel axes, everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(ROWS))


def num_row_shards(mesh: Mesh) -> int:
    """Devices the rows are split over: mesh.data * mesh.fsdp * mesh.expert."""
    return math.prod(mesh.shape[axis] for axis in ROWS)


def traced_in(mesh: Mesh, fn, always: bool = False):
    """``fn`` traced under ``mesh`` (as the abstract mesh) when the mesh splits experts, so the mixture-of-experts
    blocks see the ``expert`` axis and split their work over it (`models.moe.Experts`), or is made of TPUs, whose
    splash attention kernel runs in a ``shard_map`` over it (`models.attention.splash`: Mosaic kernels are not
    partitioned automatically), or ``always`` (a paged KV cache, whose pools split over the mesh's row shards,
    `models.paged.split`); otherwise ``fn``."""
    if not always and mesh.shape[EXPERT] == 1 and mesh.devices.flat[0].platform != "tpu":
        return fn

    @functools.wraps(fn)
    def in_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)
    return in_mesh


def path_name(path) -> str:
    """A pytree key path as dotted text: `layers.0.self_attn.q_proj.kernel` (Variable `.value` dropped)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey) and key.name not in ("value", "raw_value"):
            parts.append(key.name)
    return ".".join(parts)


def _rule_spec(name: str) -> tuple | None:
    for pattern, spec in PARTITION_RULES:
        if re.search(pattern, name):
            return spec
    return None


def partition_spec(name: str, shape: tuple[int, ...], mesh: Mesh, fallbacks: list | None = None,
                   *, strict: bool = True) -> PartitionSpec:
    """The PartitionSpec of one parameter from PARTITION_RULES; an axis that does not divide its dim is dropped.

    `strict`: a parameter no rule names is an error (params); otherwise it is replicated (optimizer scalars).
    """
    rule = _rule_spec(name)
    if rule is None or len(shape) < len(rule):
        if strict and len(shape) > 0:
            raise ValueError(f"no partition rule for parameter {name!r} of shape {shape}: add a (regex, spec) "
                             "entry to grpo_jax.device.sharding.PARTITION_RULES")
        return PartitionSpec()
    spec = [None] * (len(shape) - len(rule)) + list(rule)
    for i, axis in enumerate(spec):
        if axis is not None and shape[i] % mesh.shape[axis]:
            if fallbacks is not None:
                fallbacks.append(f"{name} dim {i} ({shape[i]}) over {axis}={mesh.shape[axis]}")
            spec[i] = None
    return PartitionSpec(*spec)


def _warn(fallbacks: list) -> None:
    if fallbacks:
        warnings.warn("these parameter dims do not divide their mesh axis and stay replicated on it: "
                      + "; ".join(fallbacks), stacklevel=3)


def param_shardings(mesh: Mesh, abstract_params, *, memory_kind: str | None = None):
    """NamedShardings (same tree as `abstract_params`: arrays or ShapeDtypeStructs) from PARTITION_RULES."""
    fallbacks: list = []

    def one(path, x):
        spec = partition_spec(path_name(path), tuple(x.shape), mesh, fallbacks)
        return NamedSharding(mesh, spec, memory_kind=memory_kind)

    out = jax.tree_util.tree_map_with_path(one, abstract_params)
    _warn(fallbacks)
    return out


def optimizer_shardings(mesh: Mesh, abstract_opt_state):
    """Optimizer state: a leaf whose path ends like a parameter's (Adam moments) shares its sharding; scalars
    (step counts) and anything else are replicated."""

    def one(path, x):
        return NamedSharding(mesh, partition_spec(path_name(path), tuple(x.shape), mesh, strict=False))

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def host_memory_kind(mesh: Mesh) -> str:
    """"pinned_host" when the mesh's devices can address it (GPU, TPU, CPU); a clear error otherwise."""
    kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(f"train.offload_ref_params=true needs 'pinned_host' memory, but "
                         f"{mesh.devices.flat[0].platform} devices only have {sorted(kinds)}: set it to false")
    return "pinned_host"


def state_shardings(mesh: Mesh, abstract_state, *, offload_ref: bool = False):
    """Shardings of a TrainState: params and reference by the rules (reference optionally in host memory),
    optimizer moments like their params, step and key replicated."""
    ref_kind = host_memory_kind(mesh) if offload_ref and abstract_state.ref_params is not None else None
    return type(abstract_state)(
        params=param_shardings(mesh, abstract_state.params),
        opt_state=optimizer_shardings(mesh, abstract_state.opt_state),
        ref_params=(None if abstract_state.ref_params is None
                    else param_shardings(mesh, abstract_state.ref_params, memory_kind=ref_kind)),
        step=replicated(mesh), key=replicated(mesh),
        entropy_control=None if abstract_state.entropy_control is None else replicated(mesh))


def cache_sharding(mesh: Mesh, num_kv_heads: int) -> NamedSharding:
    """Each layer's KV cache buffer [B, K, S, Dh]: rows over (data, fsdp), kv heads over tensor when it divides
    them."""
    heads = TENSOR if num_kv_heads % mesh.shape[TENSOR] == 0 else None
    return NamedSharding(mesh, PartitionSpec(ROWS, heads, None, None))


def shard_rows(tree, mesh: Mesh):
    """Places host arrays (leading axis = rows) onto the mesh, rows split over the data axes.

    With several processes each passes ITS rows (the global batch is the processes' rows in process order),
    assembled with `jax.make_array_from_process_local_data`; with one process this is a device_put.
    """
    sharding = row_sharded(mesh)
    if jax.process_count() == 1:  # one batched transfer for the whole tree (None leaves stay None)
        return jax.device_put(tree, sharding)

    def put(x):
        x = np.asarray(x)
        global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(put, tree)


def process_rows(num_rows: int) -> slice:
    """This process's contiguous slice of `num_rows` global rows (rows split evenly over processes)."""
    if num_rows % jax.process_count():
        raise ValueError(f"{num_rows} rows do not split over {jax.process_count()} processes: make the batch a "
                         "multiple of the process count")
    per = num_rows // jax.process_count()
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def host_rows(tree, mesh: Mesh):
    """Global host rows (every process holds the same) as ONE call of a row-sharded program takes them: with one
    process the host arrays themselves, which the call's ``in_shardings`` place (a separate `device_put` is a
    slower Python round trip), with several the global arrays of `shard_global_rows`. Rows used by several calls
    go up once with `shard_global_rows` instead."""
    return tree if jax.process_count() == 1 else shard_global_rows(tree, mesh)


def shard_global_rows(tree, mesh: Mesh):
    """Every process holds the same global host rows (same seed, same data): each places only its slice."""
    if jax.process_count() == 1:
        return shard_rows(tree, mesh)
    return shard_rows(jax.tree.map(lambda x: np.asarray(x)[process_rows(np.shape(x)[0])], tree), mesh)


def to_host(tree):
    """Device arrays -> numpy on every process (all rows: an all-gather across processes when there are several)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)


def from_first_process(compute):
    """``compute()`` run on process 0 alone, its value given to every process (an exception it raises is raised on
    every process): host work with side effects (tools, environments) done once, every process going on with the
    same Python value. One process: ``compute()``. A collective: every process calls it at the same point of its
    program, and no other thread of it issues collectives meanwhile (their order must be the same everywhere)."""
    if jax.process_count() == 1:
        return compute()
    first, error = jax.process_index() == 0, None
    payload = b""
    if first:
        try:
            outcome = ("value", compute())
        except Exception as e:  # noqa: BLE001 - the others raise it too, rather than wait for a value forever
            error, outcome = e, ("error", e)
        try:
            payload = pickle.dumps(outcome)
        except Exception:  # noqa: BLE001 - an exception that does not pickle goes as its text
            payload = pickle.dumps(("error", RuntimeError(f"{type(error).__name__}: {error}")))
    kind, value = pickle.loads(_broadcast_bytes(payload))
    if kind == "error":
        raise error if first else value
    return value


HEAD_WORDS = 256  # a broadcast's fixed width in int32 words: most of what `from_first_process` shares fits in it


def _broadcast_bytes(payload: bytes) -> bytes:
    """Process 0's bytes on every process: one broadcast of a fixed width (their length, then their start), and one
    more of the rest padded to a power of two (few compiled shapes) when they do not fit."""
    from jax.experimental import multihost_utils
    head = np.zeros(HEAD_WORDS, np.int32)  # the others' zeros: the broadcast's sum is process 0's words
    head[0] = len(payload)
    head[1:] = np.frombuffer(payload[:4 * (HEAD_WORDS - 1)].ljust(4 * (HEAD_WORDS - 1), b"\0"), np.int32)
    head = np.asarray(multihost_utils.broadcast_one_to_all(head))
    n, start = int(head[0]), head[1:].tobytes()
    if n <= len(start):
        return start[:n]
    width = max(1024, 1 << (n - len(start) - 1).bit_length())
    rest = np.frombuffer(payload[len(start):].ljust(width, b"\0"), np.int32)
    return start + np.asarray(multihost_utils.broadcast_one_to_all(rest)).tobytes()[:n - len(start)]


def check_rows(num_rows: int, mesh: Mesh, what: str) -> None:
    """Rows must split evenly over the data-parallel devices."""
    shards = num_row_shards(mesh)
    if num_rows % shards:
        raise ValueError(f"{what}={num_rows} rows do not split over the {shards} data-parallel devices "
                         f"(mesh.data*mesh.fsdp*mesh.expert): make it a multiple of {shards}")


def tree_shardings(tree):
    """The sharding of every array in `tree` (e.g. a state `init_state` placed), as a pytree."""
    return jax.tree.map(lambda x: x.sharding, tree)
