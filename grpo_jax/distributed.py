"""Multi-host start-up: `jax.distributed.initialize` from config or environment, before any other jax call.

One process per host (GPU node: one per node, or one per GPU with `local_device_ids`; TPU pod slice: one per
TPU VM). Every process runs the same program; each feeds its own rows (`sharding.shard_rows`), and the mesh
spans all processes' devices. Where JAX detects the cluster itself (Cloud TPU, SLURM, Open MPI, Kubernetes)
`mode="auto"` needs nothing else; elsewhere give the coordinator `host:port`, the process count and this
process's id, in the config or as JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""

from __future__ import annotations

import dataclasses
import os

MODES = ("never", "auto", "always")  # not off/on: YAML would read those as booleans


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (JAX's `jax.distributed.initialize` arguments)."""

    mode: str = "never"  # never: one process; auto: initialise when the env/cluster says so; always: initialise
    coordinator_address: str | None = None  # host:port of process 0; None: JAX_COORDINATOR_ADDRESS or detection
    num_processes: int | None = None  # None: JAX_NUM_PROCESSES or detection
    process_id: int | None = None  # None: JAX_PROCESS_ID or detection
    cpu_collectives: str | None = None  # CPU-only runs across processes: "gloo" (or "mpi")

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"distributed.mode={self.mode!r}: use never, auto or always")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes={self.num_processes} must be >= 1 (or null)")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"distributed.process_id={self.process_id} must be >= 0 (or null)")
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} must be < distributed.num_processes="
                             f"{self.num_processes}")
        if self.cpu_collectives not in (None, "gloo", "mpi"):
            raise ValueError(f"distributed.cpu_collectives={self.cpu_collectives!r}: use gloo, mpi or null")


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
