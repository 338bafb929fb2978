"""Multi-host start-up: `jax.distributed.initialize` from config or environment, before any other jax call.

One process per host (GPU node: one per node, or one per GPU with `local_device_ids`; TPU pod slice: one per
TPU VM). Every process runs the same program; each feeds its own rows (`sharding.shard_rows`), and the mesh
spans all processes' devices. Where JAX detects the cluster itself (Cloud TPU, SLURM, Open MPI, Kubernetes)
`mode="auto"` needs nothing else; elsewhere give the coordinator `host:port`, the process count and this
process's id, in the config or as JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""

from __future__ import annotations

import os

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


def initialize(config: DistributedConfig) -> bool:
    """Joins the multi-process run as configured (call first, before any jax computation); True if it did.

    Afterwards `jax.devices()` lists every process's devices and `jax.process_index()` is this process's id.
    """
    import jax  # here, not at import: the config (and `grpo-jax --help`) must not pull in jax

    if config.mode == "never":
        return False
    args = resolved_arguments(config)
    if config.mode == "auto" and not _auto_wanted(args):
        return False
    if config.cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    given = {k: v for k, v in args.items() if v is not None}
    if given.get("coordinator_address") and ("num_processes" not in given or "process_id" not in given) \
            and not _auto_wanted({"coordinator_address": None}):
        raise ValueError("distributed: a coordinator_address without num_processes and process_id (and no cluster "
                         "JAX can detect): set distributed.num_processes and distributed.process_id, or "
                         "JAX_NUM_PROCESSES and JAX_PROCESS_ID")
    jax.distributed.initialize(**given)
    return True
