"""The mixture-of-experts grouped matrix product (`models.moe`'s ``ragged_dot`` hook), by backend, behind one switch.

``jax.lax.ragged_dot`` everywhere but the TPU: XLA:TPU 0.10.2 runs its weight gradient (a ragged contraction) as a
dense product over every group, E times the work (4.13e11 against 1.29e10 FLOPs at 4,096 assignments, D 2048,
F 768, 32 experts). On TPU, megablox's ``gmm`` (``jax.experimental.pallas.ops.tpu.megablox``), whose custom VJP
runs that gradient as a grouped product too (``tgmm``). A Pallas kernel cannot be partitioned by XLA: `moe` runs
it inside a ``shard_map`` with every mesh axis manual (`needs_manual`). XLA's cost analysis takes the kernel's own
estimate, 2 m k n over every row it is given (another device's assignments too): `grpo_jax.api.plan_programs`
corrects it by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

BACKENDS = ("ragged_dot", "megablox", "megablox_interpret")  # megablox_interpret: the kernel on any backend (tests)
TILE = (512, 1024, 1024)  # megablox's (rows, contraction, output) tile at most (maxtext's defaults)
LANES = 128  # a TPU tile's last two dims are multiples of (8, 128) or the whole dimension


def resolve() -> str:
    """The grouped product's backend: megablox on TPU, else ragged_dot; the platform is the abstract mesh's devices'
    when one is set (a program traced for a TPU mesh from a CPU host, `sharding.traced_in`), else jax's default."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return "megablox" if platform == "tpu" else "ragged_dot"


def _tile(size: int, most: int) -> int:
    """A tile of a ``size`` dimension: all of it up to ``most``, else the largest multiple of `LANES` up to ``most``
    that divides it (or ``most``: megablox masks a last partial tile of the contraction and output dims)."""
    if size <= most:
        return size
    return next((t for t in range(most, LANES - 1, -LANES) if size % t == 0), most)


def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox's (tm, tk, tn) for [m, k] x [E, k, n]: rows in tiles of up to 512 (m is padded to whole tiles),
    the other dims `_tile`'s."""
    tm = min(TILE[0], -(-m // 8) * 8)
    return tm, _tile(k, TILE[1]), _tile(n, TILE[2])


def megablox_dot(x_MxK, w_ExKxN, group_sizes_E, preferred_element_type=None, *, interpret: bool = False):
    """``jax.lax.ragged_dot`` (rows sorted by group; rows past the groups give 0) through megablox's ``gmm``:
    the rows padded to whole tiles (past every group), gradients through its custom VJP (``tgmm`` for w's)."""
    M, K = x_MxK.shape
    tm, tk, tn = tiling(M, K, w_ExKxN.shape[-1])
    pad = -M % tm
    dtype = preferred_element_type or jnp.result_type(x_MxK.dtype, w_ExKxN.dtype)
    # gmm leaves rows past the groups unwritten, in its output and in x's gradient (NaN in interpret mode): zeroed
    # on the way in (so their gradient is) and out
    in_groups_M = jnp.arange(M + pad) < jnp.sum(group_sizes_E)
    x_MxK = jnp.where(in_groups_M[:, None], jnp.pad(x_MxK, ((0, pad), (0, 0))), 0)
    out_MxN = megablox.gmm(x_MxK, w_ExKxN, group_sizes_E.astype(jnp.int32), dtype, (tm, tk, tn), None, None, False,
                           interpret)
    return jnp.where(in_groups_M[:, None], out_MxN, 0)[:M]


def grouped_dot(x_MxK, w_ExKxN, group_sizes_E, preferred_element_type=None):
    """The grouped product of the backend `resolve` picks (`Experts.ragged_dot`'s default): [M, N]."""
    if resolve() == "megablox":
        return megablox_dot(x_MxK, w_ExKxN, group_sizes_E, preferred_element_type)
    return jax.lax.ragged_dot(x_MxK, w_ExKxN, group_sizes_E, preferred_element_type=preferred_element_type)


def interpreted_dot(x_MxK, w_ExKxN, group_sizes_E, preferred_element_type=None):
    """`megablox_dot` in Pallas interpret mode: the TPU kernel on any backend (slow: tests)."""
    return megablox_dot(x_MxK, w_ExKxN, group_sizes_E, preferred_element_type, interpret=True)


def needs_manual(ragged_dot) -> bool:
    """Whether a ``ragged_dot`` hook runs a Pallas kernel here (megablox on TPU, or interpreted), which XLA cannot
    partition: `moe` then runs it in a ``shard_map`` over every mesh axis."""
    return ragged_dot is interpreted_dot or (ragged_dot is grouped_dot and resolve() == "megablox")
