"""Device mesh and shardings: rows of every batch split over (data, fsdp); parameters replicated for now."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")
ROWS = ("data", "fsdp")  # batch rows are split over every data-parallel axis


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all); one size may be -1 for "the rest"."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh sizes {dict(zip(AXES, sizes))} do not divide the {len(devices)} devices: "
                             "choose mesh.data/fsdp/tensor whose product divides the device count")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices but "
                         f"{len(devices)} are present: make mesh.data*fsdp*tensor equal the device count")
    return Mesh(np.asarray(devices).reshape(sizes), AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def row_sharded(mesh: Mesh) -> NamedSharding:
    """Leading (row) axis split over the data-parallel axes, everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(ROWS))


def num_row_shards(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def shard_rows(tree, mesh: Mesh):
    """Places host arrays (leading axis = rows) onto the mesh, rows split over the data axes."""
    sharding = row_sharded(mesh)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def check_rows(num_rows: int, mesh: Mesh, what: str) -> None:
    """Rows must split evenly over the data-parallel devices."""
    shards = num_row_shards(mesh)
    if num_rows % shards:
        raise ValueError(f"{what}={num_rows} rows do not split over the {shards} data-parallel devices "
                         f"(mesh.data*mesh.fsdp): make it a multiple of {shards}")
