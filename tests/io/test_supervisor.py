"""What `grpo-jax train` with several processes says when JAX's coordination service stopped it, read from that
service's messages as jaxlib 0.10.2 writes them (seen on two local processes, `tests/device/test_pod_faults.py` runs
the real thing); and the child's reports over its pipe."""

import os
import subprocess
import sys

from grpo_jax.config.sections import DistributedConfig
from grpo_jax.io import supervisor

HEARTBEATS = """E1202 07:19:12.896325   18919 coordination_service.cc:1549] [4601570659797591227] Use error polling to \
propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
3
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to \
debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
F1202 07:19:12.897118   18930 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors."""
COORDINATOR = """F1202 07:24:12.339045   19721 client.h:80] Terminating process because the JAX distributed service \
detected fatal errors. This most likely indicates that another task died
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}"""
JOINING = """F1202 07:32:28.561062   22403 client.h:80] Terminating process because the JAX distributed service detected \
fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded

RPC: /xla.coordination.CoordinationService/RegisterTask"""


def test_the_lost_processes_are_named_from_the_coordination_services_message():
    config = DistributedConfig(initialization_timeout=20)
    assert supervisor.lost_processes(HEARTBEATS, config).startswith("processes 1, 3 stopped sending heartbeats")
    assert supervisor.lost_processes(COORDINATOR, config).startswith("the coordinator, process 0, could not be reached")
    assert supervisor.lost_processes(JOINING, config).startswith(
        "the processes did not all join the run within distributed.initialization_timeout=20 s")


def test_the_training_child_reports_its_folder_and_steps_over_the_pipe(tmp_path):
    read, write = os.pipe()
    script = ("from grpo_jax.io import supervisor; supervisor.report('output_dir', '/runs/x'); "
              "supervisor.report('step', 7)")
    subprocess.run([sys.executable, "-c", script], env={**os.environ, supervisor.CHANNEL: str(write)},
                   pass_fds=(write,), check=True, timeout=60)
    os.close(write)
    with os.fdopen(read) as f:
        assert f.read() == "output_dir /runs/x\nstep 7\n"
    supervisor.report("step", 1)  # no supervisor: nothing, no error
