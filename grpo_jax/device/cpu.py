"""XLA:CPU speed-ups, all behind one switch (the config's ``cpu_speedups``, on by default on CPU).

- A decoding call's rows in chunks, each decoded from its own host thread (`host_chunks`, driven by
  `stream.decode`): XLA:CPU runs a small model's decode steps on one core, so chunks keep the other cores busy.
- Every decode step's noise drawn before the decode loop when it is small (`decode_options`,
  `PRECOMPUTED_NOISE_BYTES`): one threefry call outside the loop instead of a small loop of its own in every step.
- Arg-max as two plain reductions (`argmax_last_axis`): XLA:CPU runs argmax's (value, index) reduction element
  by element.
- The Linear layers' weight gradient multiplies a materialised x^T (`linear_layers`): XLA:CPU hands a dot with a
  transposed operand to a slower kernel.
- A packed buffer's attention runs block by block, skipping blocks of keys that no query of a block sees
  (`packed_attention`, `models.attention.blocked_attention`): dense, its [T, T] scores and their masking cost most
  of a packed update at real lengths.
- Mixture-of-experts layers multiply each expert's rows block by block (`grouped_experts`, `blocked_ragged_dot`):
  XLA:CPU lowers ``jax.lax.ragged_dot`` to a product of every row with every expert's weights (E times the work).
- glibc keeps freed blocks (`configure_host_allocator`): XLA:CPU gives each call one large block of temporaries,
  which glibc would otherwise mmap and unmap per call, page-faulting the working set in again every time.

The tokens and sampler log-probs are those of the default path (`decoder`'s in-loop noise and ``jnp.argmax``)
bit for bit, whatever the chunks; tests check it. The Linear weight gradients are the same products summed in
another order: equal up to float rounding.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.config.sections import HOST_ALLOCATORS
# the blocked attention lives with the other attention backends (accelerators run packed layouts through it too)
from grpo_jax.models.attention import ATTENTION_BLOCK, MIN_BLOCKED_LENGTH, blocked_attention  # noqa: F401
from grpo_jax.models.layers import Attention
from grpo_jax.models.moe import Experts


def enabled(setting: bool | None) -> bool:
    """The ``cpu_speedups`` setting resolved: None means on exactly when jax's default backend is the CPU."""
    return jax.default_backend() == "cpu" if setting is None else bool(setting)


# --- host allocator -------------------------------------------------------------------------------------------

RETAIN_BYTES = 1 << 30  # blocks below 1 GiB come from (and go back to) the heap; mallopt takes a C int
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


def _glibc():
    """The process's C library when it is glibc (mallopt's parameters are glibc's), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):  # musl, or no libc to load: leave its allocator alone
        return None
    return libc


def configure_host_allocator(policy: str) -> bool:
    """Apply ``policy`` to this process's malloc; True when glibc accepted the thresholds.

    ``retain``: blocks under `RETAIN_BYTES` are never mmap'd per call nor trimmed (glibc only; elsewhere a
    no-op); the process keeps its peak heap, which a training process needs again next step anyway.
    ``system``: leave malloc as it is, e.g. for an ``LD_PRELOAD``-ed jemalloc or tcmalloc.
    """
    if policy not in HOST_ALLOCATORS:
        raise ValueError(f"host_allocator={policy!r} is not supported: use one of {', '.join(HOST_ALLOCATORS)}")
    libc = None if policy == "system" else _glibc()
    if libc is None:
        return False
    return (libc.mallopt(_M_MMAP_THRESHOLD, RETAIN_BYTES) == 1) & (libc.mallopt(_M_TRIM_THRESHOLD, RETAIN_BYTES) == 1)


# --- Linear layers --------------------------------------------------------------------------------------------

@jax.custom_vjp
def _matmul(x_NxI, w_IxO):
    return x_NxI @ w_IxO


def _matmul_fwd(x_NxI, w_IxO):
    return x_NxI @ w_IxO, (x_NxI, w_IxO)


def _matmul_bwd(residuals, g_NxO):
    x_NxI, w_IxO = residuals
    # x^T copied out first: the barrier keeps XLA from folding the transpose back into the dot
    x_IxN = jax.lax.optimization_barrier(jnp.transpose(x_NxI))
    return g_NxO @ w_IxO.T, x_IxN @ g_NxO


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general` whose plain 2-D ``x @ W`` takes `_matmul`: the weight gradient multiplies a
    materialised x^T (the same products, summed in XLA:CPU's order for that layout)."""
    plain = (lhs.ndim == rhs.ndim == 2 and tuple(map(tuple, dimension_numbers[0])) == ((1,), (0,))
             and precision is None and preferred_element_type is None and kwargs.get("out_sharding") is None
             and lhs.dtype == rhs.dtype)
    if plain:
        return _matmul(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)


def linear_layers(graphdef: nnx.GraphDef, params: nnx.State, on: bool) -> nnx.GraphDef:
    """``graphdef`` whose ``nnx.Linear`` layers use `dot_general` when ``on`` and the model has no remat policy
    (remat's "dots" policy must see jax's plain dots), else ``graphdef`` unchanged. Apply once, where the model
    is built; ``params`` may be abstract (shapes only)."""
    model = nnx.merge(graphdef, params)
    if not on or model.config.remat != "none":  # transformer.REMAT_POLICIES: only "none" keeps no policy
        return graphdef
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Linear):
            module.dot_general = dot_general
    return nnx.split(model)[0]


# --- packed attention -----------------------------------------------------------------------------------------

# `blocked_attention`'s time in matmul FLOPs (the cost model's unit, `trajectory.layout_flops`): a score pair it
# computes costs BLOCK_PAIR_COST times a dense product's FLOP, and each of the loop's n x n steps over a key block,
# skipped or not (scan step, cond, carry), BLOCK_VISIT blocks' worth. Least squares over six packed updates (small,
# 4 x 8 rows of 16 or 64-512 + ~100 tokens, 1-4 buffers; Intel Xeon AVX-512, benchmarks/packed_update.py),
# each predicted within 6 %
BLOCK_PAIR_COST = 7.7
BLOCK_VISIT = 1.2
# a dense attention score pair's time in matmul FLOPs (masking, softmax): 6.1 and 6.0 in the shared-prompt
# layout's updates of the same rows
DENSE_PAIR_COST = 6.0


def blocked_pairs(prompt_tokens_R, branch_tokens_RxG, length: int, buffers: int = 0) -> int | None:
    """What `blocked_attention` costs for a packed layout's buffers, in (query, key) pairs at a dense product's
    pace (host counts: each group's shared prompt tokens, then its branches' tokens; groups one after another in
    ``buffers`` buffers, 0: one a group), None when the dense path runs: the blocks that some buffer needs (any
    query of one sees any key of the other; mirrors its ``needed``) times the block's area and the buffers, at
    `BLOCK_PAIR_COST`, plus `BLOCK_VISIT` blocks for each of the n x n steps of its loop."""
    b = math.gcd(length, ATTENTION_BLOCK)
    if length < MIN_BLOCKED_LENGTH or b < 64:
        return None
    n = length // b
    prompts_R, branches_RxG = np.asarray(prompt_tokens_R), np.asarray(branch_tokens_RxG)
    K = buffers or len(prompts_R)
    needed_nxn = np.zeros((n, n), bool)
    lower_nxn = np.tril(np.ones((n, n), bool))

    def span(lo, hi):  # the blocks slots lo .. hi - 1 fall in
        out = np.zeros(n, bool)
        out[lo // b:(hi - 1) // b + 1] = True
        return out

    for group in range(len(prompts_R)):
        if group % (len(prompts_R) // K) == 0:
            offset = 0  # a new buffer
        prompt, branches = int(prompts_R[group]), branches_RxG[group]
        starts = offset + prompt + np.concatenate([[0], np.cumsum(branches)[:-1]])
        prompt_span = span(offset, offset + prompt) if prompt else np.zeros(n, bool)
        needed_nxn |= prompt_span[:, None] & prompt_span[None, :] & lower_nxn  # causal inside the prompt
        for start, size in zip(starts, branches):
            if size:
                branch = span(start, start + size)
                needed_nxn |= branch[:, None] & (branch[None, :] & lower_nxn | prompt_span[None, :])  # and its prompt
        offset += prompt + int(np.sum(branches))
    return int(BLOCK_PAIR_COST * needed_nxn.sum() * b * b * K + BLOCK_VISIT * n * n * b * b)


def packed_attention(graphdef: nnx.GraphDef, params: nnx.State, on: bool) -> nnx.GraphDef:
    """``graphdef`` whose attention layers run packed buffers' whole masks through `blocked_attention` when ``on``,
    else ``graphdef`` unchanged. Apply once, where the model is built; ``params`` may be abstract."""

    return _with_hook(graphdef, params, on, Attention, "attend_whole_mask", blocked_attention)


def _with_hook(graphdef: nnx.GraphDef, params: nnx.State, on: bool, kind: type, name: str, fn) -> nnx.GraphDef:
    """``graphdef`` with attribute ``name`` of every ``kind`` module set to ``fn`` when ``on`` (else unchanged)."""
    if not on:
        return graphdef
    model = nnx.merge(graphdef, params)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, kind):
            setattr(module, name, fn)
    return nnx.split(model)[0]


EXPERT_BLOCK = 32  # rows per block of `blocked_ragged_dot`: each group pads to whole blocks


def blocked_ragged_dot(x_MxD, w_ExDxF, group_sizes_E, preferred_element_type=None):
    """``jax.lax.ragged_dot`` (rows sorted by group; rows past the groups give 0) the CPU's way: each group's rows
    padded to whole blocks of `EXPERT_BLOCK`, one [block, D] x [D, F] product per block in a scan. The same
    products, (M + E * block) * D * F work instead of E * M * D * F."""
    M, D = x_MxD.shape
    E, _, F = w_ExDxF.shape
    b = EXPERT_BLOCK
    num_blocks = -(-(M + E * (b - 1)) // b)  # every group padded: at most this many blocks
    end_E = jnp.cumsum(group_sizes_E)
    padded_E = -(-group_sizes_E // b) * b
    padded_end_E = jnp.cumsum(padded_E)
    m_M = jnp.arange(M)
    group_M = jnp.searchsorted(end_E, m_M, side="right")  # E: past every group
    safe_M = jnp.minimum(group_M, E - 1)
    at_M = jnp.where(group_M < E, padded_end_E[safe_M] - padded_E[safe_M] + m_M - (end_E - group_sizes_E)[safe_M],
                     num_blocks * b)  # past every block: dropped
    x_NxD = jnp.zeros((num_blocks * b, D), x_MxD.dtype).at[at_M].set(x_MxD, mode="drop")
    block_group = jnp.minimum(jnp.searchsorted(padded_end_E, jnp.arange(num_blocks) * b, side="right"), E - 1)

    # rematerialised: the backward slices w[e] again instead of the scan saving every block's [D, F] slice (blocks x
    # D x F: 2.6 GB a projection at 12k assignments of a 2048 x 768 expert, the step's peak)
    @jax.checkpoint
    def block(_, xs):
        x_bxD, e = xs
        return None, jnp.dot(x_bxD, w_ExDxF[e], preferred_element_type=preferred_element_type)

    _, y_NbxbxF = jax.lax.scan(block, None, (x_NxD.reshape(num_blocks, b, D), block_group))
    y_NxF = y_NbxbxF.reshape(num_blocks * b, F)
    return jnp.where((group_M < E)[:, None], y_NxF[jnp.minimum(at_M, num_blocks * b - 1)], 0)


def grouped_experts(graphdef: nnx.GraphDef, params: nnx.State, on: bool) -> nnx.GraphDef:
    """``graphdef`` whose mixture-of-experts layers multiply through `blocked_ragged_dot` when ``on``, else
    ``graphdef`` unchanged. Apply once, where the model is built; ``params`` may be abstract."""

    return _with_hook(graphdef, params, on, Experts, "ragged_dot", blocked_ragged_dot)


# --- sampling -------------------------------------------------------------------------------------------------

# below this many bytes of [B, T, V] float32 noise, every step's noise is drawn in `decoder.start`
PRECOMPUTED_NOISE_BYTES = 32 << 20


def argmax_last_axis(x_BxV):
    """``jnp.argmax(x, axis=-1)`` (first maximum; a NaN counts as the maximum) as two plain reductions."""
    V = x_BxV.shape[-1]
    max_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    hit_BxV = (x_BxV == max_Bx1) | jnp.isnan(x_BxV)
    return jnp.min(jnp.where(hit_BxV, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def decode_options(options, num_rows: int, vocab: int):
    """A decoding call's `decoder.DecodeOptions` the CPU's way, the same tokens: `argmax_last_axis`, and every
    step's noise drawn in one go before the loop when it is small (`PRECOMPUTED_NOISE_BYTES`)."""
    T = options.sampling.max_completion_length
    return dataclasses.replace(options, argmax=argmax_last_axis,
                               noise_ahead=num_rows * T * vocab * 4 <= PRECOMPUTED_NOISE_BYTES)


def host_threads(setting: int, mesh) -> int:
    """``sampling.host_threads`` resolved: 0 means the CPU cores this process may use on a one-device CPU mesh,
    else 1."""
    if setting:
        return setting
    one_cpu = mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"
    return len(os.sched_getaffinity(0)) if one_cpu and hasattr(os, "sched_getaffinity") else 1


def host_chunks(setting: int, mesh, num_rows: int, group_size: int) -> int:
    """Row chunks for one sampling call: `host_threads`, lowered until the chunks split into whole groups of
    ``group_size`` rows."""
    groups = num_rows // group_size
    return max(k for k in range(1, min(host_threads(setting, mesh), groups) + 1) if groups % k == 0)
