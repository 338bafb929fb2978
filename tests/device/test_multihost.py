"""Two processes on localhost (jax.distributed, gloo CPU collectives) == one process, over two GRPO steps.

The test process writes the batches and runs the data=2 x fsdp=2 mesh over 4 of its own devices; two worker
processes (this file run as a script, 2 CPU devices each, the same mesh over the 4 global devices) each feed their
half of every batch with `sharding.shard_rows` and write the final params, gathered, for comparison; they then
write a checkpoint together, check it against its checksums, and both learn of a bit flipped in it. (Sharded ==
one device is tests/device/test_sharding.py's.)
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

STEPS, GRAD_ACCUM = 2, 2


def _config():
    from grpo_jax.models import ModelConfig
    return ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def _build(mesh):
    import optax

    from grpo_jax.algo.programs import init_state, jit_train_step
    from grpo_jax.algo.train_step import StepOptions
    from grpo_jax.device import sharding
    from grpo_jax.losses import LossConfig
    optimizer = optax.sgd(1.0)
    graphdef, state = init_state(_config(), optimizer, seed=0, with_reference=True, mesh=mesh)
    step = jit_train_step(graphdef, optimizer, StepOptions(LossConfig(beta=0.04), 1.0, GRAD_ACCUM), mesh,
                          sharding.tree_shardings(state))
    return graphdef, state, step


def _flat(params) -> dict:
    import jax

    from grpo_jax.device import sharding
    return {sharding.path_name(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def worker(process_id: int, port: int, folder: Path) -> None:
    """One of the two processes: joins the run, feeds its rows, writes the gathered params (process 0)."""
    from grpo_jax.device.distributed import DistributedConfig, initialize
    initialize(DistributedConfig(mode="always", coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                 process_id=process_id, cpu_collectives="gloo"))
    import jax

    from grpo_jax.algo.trajectory import Trajectory
    from grpo_jax.device import sharding
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    mesh = sharding.make_mesh(2, 2, 1)
    _, state, step = _build(mesh)
    for i in range(STEPS):
        saved = np.load(folder / f"batch{i}.npz")
        if i == 0:  # this process's own rows only
            mine = sharding.process_rows(saved["prompt_ids"].shape[0])
            batch = sharding.shard_rows(Trajectory(**{k: saved[k][mine] for k in saved.files}), mesh)
        else:  # the same global rows everywhere, each process placing its slice
            batch = sharding.shard_global_rows(Trajectory(**{k: saved[k] for k in saved.files}), mesh)
        state, metrics = step(state, batch)
    params = sharding.to_host(state.params)
    if jax.process_index() == 0:
        np.savez(folder / "params.npz", loss=np.asarray(metrics["loss"]), **_flat(params))
    # a checkpoint written collectively carries process 0's checksums, and every process learns of a flipped bit
    from jax.experimental import multihost_utils

    from grpo_jax.io import checkpoint
    mngr = checkpoint.manager(folder / "run")
    checkpoint.save(mngr, state, keep_ref=True, meta={}, wait=True)
    restored, _, _ = checkpoint.restore_step(mngr, STEPS, state, keep_ref=True)
    assert _flat(sharding.to_host(restored.params)).keys() == _flat(params).keys()
    for name, value in _flat(sharding.to_host(restored.params)).items():
        np.testing.assert_array_equal(value, _flat(params)[name], err_msg=name)
    step_dir = folder / "run" / checkpoint.CHECKPOINTS / str(STEPS)
    if jax.process_index() == 0:
        assert checkpoint.verify_step(step_dir) == []
        largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data = bytearray(largest.read_bytes())
        data[len(data) // 2] ^= 1
        largest.write_bytes(bytes(data))
    multihost_utils.sync_global_devices("bit flipped")
    try:
        checkpoint.check_checksums(mngr.directory, STEPS)
        raise AssertionError("a flipped bit passed the checksums")
    except ValueError as e:
        assert ("contents differ" if jax.process_index() == 0 else "named in process 0's warning") in str(e), e
    mngr.close()
    # one writer per run: process 0 holds the output_dir's lock, and every process learns that it is taken
    from grpo_jax.io import lock
    held = lock.acquire(folder, multihost=True)
    try:
        lock.acquire(folder, multihost=True)
        raise AssertionError("a second lock on the folder was granted")
    except ValueError as e:
        assert ("held by this process already" if jax.process_index() == 0 else "process 0 says which") in str(e)
    held.release()
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
    import jax

    from grpo_jax.device import sharding
    from tests.algo.test_train_step import make_batch
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count>=4")
    graphdef, state, step = _build(sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    for i in range(STEPS):  # the batches (old/ref log-probs from the single-device policy), written for the workers
        batch = make_batch(graphdef, jax.device_get(state.params), seed=i)
        np.savez(tmp_path / f"batch{i}.npz", **{k: v for k, v in batch._asdict().items() if v is not None})
        state, _ = step(state, batch)
    # the same 2 x 2 mesh in this one process, over 4 of its 8 devices
    _, state, step = _build(sharding.make_mesh(2, 2, 1, devices=jax.devices()[:4]))
    for i in range(STEPS):
        saved = np.load(tmp_path / f"batch{i}.npz")
        state, metrics = step(state, type(batch)(**{k: saved[k] for k in saved.files}))
    expected = _flat(jax.device_get(state.params))

    port = _free_port()
    # the workers compile as this process does (conftest's XLA_FLAGS), with 2 devices each
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {flags}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    got = np.load(tmp_path / "params.npz")
    # same mesh, same programs: only gloo's all-reduce adds the two processes' partial sums in another order,
    # a float32 ulp or two of the largest gradient entries (~0.5: ulp 6e-8), seen here as 1.5e-7 on one element
    # the loss (0.03) sums per-token terms of order 1 (advantages about +-1): its rounding is theirs, 2.2e-7 on
    # an AVX-512 CPU
    np.testing.assert_allclose(got["loss"], np.asarray(metrics["loss"]), rtol=1e-6, atol=1e-6)
    assert sorted(k for k in got.files if k != "loss") == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=5e-7, err_msg=name)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))


def test_distributed_config_and_environment(monkeypatch):
    from grpo_jax.device.distributed import DistributedConfig, initialize, resolved_arguments
    with pytest.raises(ValueError, match="distributed.mode='yes'"):
        DistributedConfig(mode="yes")
    with pytest.raises(ValueError, match="process_id=2 must be < distributed.num_processes=2"):
        DistributedConfig(num_processes=2, process_id=2)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert resolved_arguments(DistributedConfig(process_id=1)) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 1}
    assert initialize(DistributedConfig(mode="never")) is False  # never touches jax.distributed
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                 "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    assert initialize(DistributedConfig(mode="auto")) is False  # nothing says this is a multi-process run
