"""Multi-host start-up: `jax.distributed.initialize` from config or environment, before any other jax call.

One process per host (GPU node: one per node, or one per GPU with `local_device_ids`; TPU pod slice: one per
TPU VM). Every process runs the same program; each feeds its own rows (`sharding.shard_rows`), and the mesh
spans all processes' devices. Where JAX detects the cluster itself (Cloud TPU, SLURM, Open MPI, Kubernetes)
`mode="auto"` needs nothing else; elsewhere give the coordinator `host:port`, the process count and this
process's id, in the config or as JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.

JAX's coordination service watches the processes: one whose heartbeats stop for `heartbeat_timeout` seconds (a host
lost) stops all the others (`grpo_jax.io.supervisor` says which in one line). `check_same` refuses processes started
differently (config, code, data) before anything compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from grpo_jax.config import flatten
from grpo_jax.config.sections import DistributedConfig


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from e


def resolved_arguments(config: DistributedConfig) -> dict:
    """`jax.distributed.initialize` keyword arguments: the config's values, else the JAX_* environment."""
    return {"coordinator_address": config.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None,
            "num_processes": config.num_processes if config.num_processes is not None
            else _env_int("JAX_NUM_PROCESSES"),
            "process_id": config.process_id if config.process_id is not None else _env_int("JAX_PROCESS_ID")}


def _auto_wanted(args: dict) -> bool:
    """`auto` initialises when a coordinator is named or a cluster JAX can detect is visible."""
    cluster_vars = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")
    return args["coordinator_address"] is not None or any(os.environ.get(v) for v in cluster_vars)


def wanted(config: DistributedConfig) -> bool:
    """Whether `initialize` joins a multi-process run (without importing jax)."""
    return config.mode == "always" or (config.mode == "auto" and _auto_wanted(resolved_arguments(config)))


def initialize(config: DistributedConfig) -> bool:
    """Joins the multi-process run as configured (call first, before any jax computation); True if it did.

    Afterwards `jax.devices()` lists every process's devices and `jax.process_index()` is this process's id.
    """
    import jax  # here, not at import: the config (and `grpo-jax --help`) must not pull in jax

    if not wanted(config):
        return False
    args = resolved_arguments(config)
    if config.cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    given = {k: v for k, v in args.items() if v is not None}
    if given.get("coordinator_address") and ("num_processes" not in given or "process_id" not in given) \
            and not _auto_wanted({"coordinator_address": None}):
        raise ValueError("distributed: a coordinator_address without num_processes and process_id (and no cluster "
                         "JAX can detect): set distributed.num_processes and distributed.process_id, or "
                         "JAX_NUM_PROCESSES and JAX_PROCESS_ID")
    try:
        jax.distributed.initialize(**given, initialization_timeout=config.initialization_timeout,
                                   heartbeat_timeout_seconds=config.heartbeat_timeout,
                                   shutdown_timeout_seconds=config.shutdown_timeout)
    except Exception as e:  # the coordination service's multi-line status: what to check, in one line
        status = " ".join(str(e).split())[:300]
        raise ValueError(f"distributed: this process (process_id {args['process_id']}) could not join the run at "
                         f"{args['coordinator_address']} ({status}): start every process with the same "
                         "distributed.coordinator_address and num_processes") from e
    return True


def code_fingerprint() -> str:
    """A digest of grpo_jax's own source files and the jax version: processes running other code differ in it."""
    import jax

    digest = hashlib.sha256(jax.__version__.encode())
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def digest(value) -> str:
    """A short digest of a JSON-able value (rows of data)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_same(parts: dict, what: str) -> None:
    """Every process's ``parts`` (JSON-able, nested dicts flattened to dotted keys) compared once through a
    collective, on every process alike: a ValueError naming the keys that differ between processes and their values,
    the same on all of them (so they stop together). ``what``: which start-up check this is, for the message. Call on
    every process, in the same order, with several processes."""
    import numpy as np
    from jax.experimental import multihost_utils

    mine = json.dumps(flatten(parts), sort_keys=True, default=str).encode()
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(mine))))
    width = 1 << max(int(sizes.max()) - 1, 1).bit_length()  # a power of two: few compiled shapes
    padded = np.frombuffer(mine.ljust(width, b" "), np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    tables = [json.loads(bytes(row[:size]).decode()) for row, size in zip(gathered, sizes)]
    keys = sorted({k for t in tables for k in t if len({json.dumps(u.get(k), default=str) for u in tables}) > 1})
    if keys:
        shown = "; ".join(f"{k}: " + ", ".join(f"process {i} {t.get(k, '(absent)')!r}" for i, t in enumerate(tables))
                          for k in keys[:4]) + (f"; and {len(keys) - 4} more" if len(keys) > 4 else "")
        raise ValueError(f"distributed: the {len(tables)} processes were started with different {what} ({shown}): "
                         "start every process with the same command, code and data")
