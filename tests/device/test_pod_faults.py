"""One host of a multi-process run preempted, killed, slow, misconfigured or replaced: two `grpo-jax train`
processes on localhost (gloo CPU collectives, one CPU device each, mesh data 2), the embedded task at a tiny size.

- SIGTERM to one process: every process saves the same step and exits 143 in one line; the same command with a new
  coordinator port resumes bit for bit as the run that never stopped; one process with both devices resumes too
  (within float tolerance: another reduction order), and one whose devices the mesh does not divide says what to set.
- SIGKILL of one host (its `grpo-jax` and the training child): the other exits within seconds, naming the lost
  process, the step and the checkpoint; a save cut off is never taken for a checkpoint; the rerun is bitwise.
- A process slower than the heartbeat timeout (a reward that blocks) is not taken for a dead one: the run every
  other is compared with has one.
- Processes started with different configs or data are refused in one line, on every process, before compiling.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.io.test_checkpoint import ROOT, TINY, _assert_same_state, _flat, _lines

STEPS = 16
PACE, STALL = "GRPO_JAX_TEST_PACE", "GRPO_JAX_TEST_STALL"
RUN = [*TINY, f"max_steps={STEPS}", "reward.functions=[tests.device.test_pod_faults:paced_reward]", "mesh.data=2"]


def paced_reward(prompts, completions, answer, **kwargs):
    """The embedded task's reward, taking GRPO_JAX_TEST_PACE seconds a call (so that a signal lands mid-run), and
    GRPO_JAX_TEST_STALL="N:S" seconds S more at this process's N-th call (a slow tool or reward on one host)."""
    from grpo_jax.data.task import char_accuracy

    paced_reward.calls = getattr(paced_reward, "calls", 0) + 1
    time.sleep(float(os.environ.get(PACE, "0")))
    call, _, seconds = os.environ.get(STALL, "").partition(":")
    if call and int(call) == paced_reward.calls:
        time.sleep(float(seconds))
    return char_accuracy(prompts, completions, answer)


def _state(out: Path):
    """The newest checkpoint's train state on this process's first device (it was saved over two processes' devices),
    as a tree of dicts, and its step."""
    import jax
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(out.absolute() / "checkpoints", item_handlers={"state": ocp.StandardCheckpointHandler()})
    step = mngr.latest_step()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          mngr.item_metadata(step)["state"])
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
    mngr.close()
    return jax.device_get(state), step


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: Path, port: int, process_id: int, *extra: str, num_processes: int = 2, env: dict | None = None,
           cwd: Path = ROOT):
    """One host's `grpo-jax train` (its own session: killing the group is losing the host)."""
    cmd = [sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={out}", *RUN, "distributed.mode=always",
           f"distributed.num_processes={num_processes}", f"distributed.process_id={process_id}",
           f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.cpu_collectives=gloo", *extra]
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={
                                **os.environ, PACE: "0.25", **(env or {}), "PYTHONPATH": str(ROOT),
                                "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {flags}"})


def _both(out: Path, *extra: str, env1: dict | None = None, timeout: int = 400, **kwargs):
    """Both processes to their end: [(exit code, stdout, stderr)] and the seconds they took."""
    port, start = _port(), time.time()
    procs = [_start(out, port, i, *extra, env=env1 if i == 1 else None, **kwargs) for i in range(2)]
    try:
        results = [(p, *p.communicate(timeout=timeout)) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, o, e) for p, o, e in results], time.time() - start


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def _wait_for_steps(out: Path, procs, steps: int) -> None:
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        assert all(p.poll() is None for p in procs) and time.time() < deadline, [p.communicate() for p in procs]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run that never stopped: two processes, STEPS steps; a slow host, not a lost one: a reward blocks process
    1 for three heartbeat timeouts (a slow tool, a slow disk), and the run goes on."""
    out = tmp_path_factory.mktemp("pods") / "whole"
    results, _ = _both(out, "save_steps=0", "distributed.heartbeat_timeout=3", env1={STALL: "2:9"})
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    return out


def test_a_slow_host_is_not_a_lost_one(whole):
    """The `whole` run's process 1 was blocked for 9 s at its second reward call, heartbeat timeout 3 s: process 0
    waited for it (its steps' times hold the 9 s) and both went on to the end."""
    lines = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == STEPS and sum(line["step_time"] for line in lines) > 9


def _same_as_whole(out: Path, whole: Path) -> None:
    assert _lines(out) == _lines(whole)
    _assert_same_state(_state(out)[0], _state(whole)[0])


def test_sigterm_on_one_host_saves_every_host_at_one_step_and_resumes_anywhere(tmp_path, whole):
    """Before: the signalled process saved alone and died on the coordination service's fatal check (exit 134), the
    other hung in a collective, and a rerun with a new coordinator port was refused (distributed.* must stay)."""
    out, port = tmp_path / "run", _port()
    procs = [_start(out, port, i, "save_steps=0") for i in range(2)]
    try:
        _wait_for_steps(out, procs, 2)
        procs[1].send_signal(signal.SIGTERM)  # the host's `grpo-jax`: it passes it on to the training
        results = [(p, *p.communicate(timeout=120)) for p in procs]
    finally:
        for p in procs:
            p.kill()
    step = _state(out)[1]
    assert 2 <= step < STEPS
    for p, stdout, stderr in results:
        assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
        assert _last_line(stderr) == (f"grpo-jax: a preemption notice (SIGTERM) reached the run: its 2 processes "
                                      f"stopped after optimizer step {step} and saved {out / 'checkpoints' / str(step)}"
                                      " together; run the same command again on every host to resume")
        assert f"every process stops after optimizer step {step} and saves it" in stdout
    assert len(_lines(out)) == step
    for name in ("two", "one", "three"):
        shutil.copytree(out, tmp_path / name)
    # the same command on both hosts, the coordinator elsewhere: bit for bit the run that never stopped
    results, _ = _both(tmp_path / "two")
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert f"resuming from checkpoint {tmp_path / 'two' / 'checkpoints' / str(step)} at step {step}" in results[0][1]
    _same_as_whole(tmp_path / "two", whole)
    # one host with both devices: the same mesh in one process (gloo's sums in another order: an ulp or two)
    one = subprocess.run([sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={tmp_path / 'one'}", *RUN],
                         cwd=ROOT, capture_output=True, text=True, timeout=400, env={
                             **os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(
                                 "device_count=8", "device_count=2")})
    assert one.returncode == 0, one.stderr[-3000:]
    got, expected = _flat(_state(tmp_path / "one")[0]["params"]), _flat(_state(whole)[0]["params"])
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # three devices, which mesh.data=2 does not divide: one line naming the mesh and what to set
    three = subprocess.run([sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={tmp_path / 'three'}",
                            *RUN], cwd=ROOT, capture_output=True, text=True, timeout=400, env={
                                **os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(
                                    "device_count=8", "device_count=3")})
    assert three.returncode == 1
    assert _last_line(three.stderr) == ("grpo-jax: mesh {'data': 2, 'fsdp': 1, 'tensor': 1, 'expert': 1} needs 2 "
                                        "devices but 3 are present: make mesh.data*fsdp*tensor*expert equal the device "
                                        "count"), three.stderr[-2000:]


def test_a_lost_host_stops_the_other_in_seconds_and_the_rerun_resumes_bitwise(tmp_path, whole):
    """Before: the survivor waited in a collective until the default 100 s heartbeat timeout, then died on a C++
    check failure (exit 134, a stack trace, no word of which process, step or checkpoint), and the rerun was refused."""
    out, port = tmp_path / "run", _port()
    procs = [_start(out, port, i, "save_steps=4", "distributed.heartbeat_timeout=5") for i in range(2)]
    try:
        _wait_for_steps(out, procs, 5)
        while not (out / "checkpoints" / "4").is_dir():
            time.sleep(0.05)
        os.killpg(procs[1].pid, signal.SIGKILL)  # the host is gone: its `grpo-jax` and the training under it
        killed = time.time()
        stdout, stderr = procs[0].communicate(timeout=120)
        seconds = time.time() - killed
    finally:
        for p in procs:
            p.kill()
    newest = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    line = _last_line(stderr)
    assert procs[0].returncode == 1, stderr[-3000:]
    assert "process 1 stopped sending heartbeats" in line and "distributed.heartbeat_timeout=5 s" in line, line
    assert line.endswith(f"Run the same command again on every host to resume from the newest complete checkpoint, "
                         f"{out / 'checkpoints' / str(newest)} (step {newest})"), line
    step = int(line.split("after optimizer step ")[1].split(":")[0])
    assert newest <= step < STEPS
    assert "Check failure stack trace" not in stderr  # the abort's C++ stack is not copied through
    assert seconds < 60, seconds  # the heartbeat timeout's bound, not the collective's wait
    print(f"the survivor exited {seconds:.1f} s after its peer's SIGKILL (heartbeat timeout 5 s)")
    # a save that a lost host cut off is a temporary folder: never taken for a checkpoint
    shutil.copytree(out / "checkpoints" / str(newest), out / "checkpoints" / f"{STEPS - 1}.orbax-checkpoint-tmp")
    results, _ = _both(out)
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert f"resuming from checkpoint {out / 'checkpoints' / str(newest)} at step {newest}" in results[0][1]
    _same_as_whole(out, whole)


@pytest.mark.parametrize("differ", ["config", "num_processes", "data"])
def test_processes_started_differently_are_refused_before_anything_compiles(tmp_path, differ):
    """Before: each process went on with its own config or data until a collective disagreed or hung."""
    from grpo_jax.data import task

    task.build_tokenizer(tmp_path / "tok")
    rows = [{"prompt": f"{n}>", "answer": str(n)[::-1]} for n in (12, 34, 56, 78, 91, 23, 45, 67)]
    for i in range(2):
        changed = [dict(r, answer=r["answer"] + "0") for r in rows] if i == 1 and differ == "data" else rows
        (tmp_path / f"data{i}").mkdir()
        (tmp_path / f"data{i}" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))
    port, out = _port(), tmp_path / "run"
    procs = []
    for i in range(2):
        # the same path on each host, and on one of them other rows there
        extra = ["data.path=rows.jsonl", f"data.tokenizer_path={tmp_path / 'tok'}", "model.init=random",
                 "distributed.initialization_timeout=60"]
        if i == 1 and differ == "config":
            extra.append("train.learning_rate=1e-3")
        if i == 1 and differ == "num_processes":
            extra.append("distributed.num_processes=3")
        procs.append(_start(out, port, i, *extra, cwd=tmp_path / (f"data{i}" if differ == "data" else "data0")))
    outputs = [p.communicate(timeout=300) for p in procs]
    expected = {"config": "configs or code (config.train.learning_rate: process 0 0.003, process 1 0.001)",
                "num_processes": "configs or code (config.distributed.num_processes: process 0 2, process 1 3)",
                "data": "data or reward code (data."}[differ]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 1, stderr[-3000:]
        line = _last_line(stderr)
        assert line.startswith(f"grpo-jax: distributed: the 2 processes were started with different {expected}"), line
        assert line.endswith("start every process with the same command, code and data")
        assert "compiled" not in stdout  # refused before the programs compile
