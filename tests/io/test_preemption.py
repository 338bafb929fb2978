"""Preemption: SIGTERM saves, exits with 128 + signal and resumes to the same params; a second signal exits."""

import signal
import subprocess
import sys
import textwrap
import time

from grpo_jax.io import preemption
from tests.io.test_checkpoint import ROOT, TINY, _assert_same_state, _lines, _state, _train


def test_sigterm_saves_exits_and_resumes_to_the_same_params(tmp_path):
    """SIGTERM in a subprocess: the step finishes, a checkpoint is written, exit code 143; resuming matches."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_jax", "--no-progress", f"output_dir={out}", *TINY, "max_steps=1000",
           "save_steps=0", "train.num_iterations=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM received" in stdout and "run the same command again to resume" in stderr
    state, stopped = _state(out)
    assert stopped == len(metrics.read_text().splitlines()) >= 3
    # resume in this process (same devices) for two more steps, and compare with a run that never stopped
    _train(out, f"max_steps={stopped + 2}", "save_steps=0", "train.num_iterations=2")
    _train(tmp_path / "whole", f"max_steps={stopped + 2}", "save_steps=0", "train.num_iterations=2")
    assert _lines(out) == _lines(tmp_path / "whole")
    _assert_same_state(_state(out)[0], _state(tmp_path / "whole")[0])


GUARD_SCRIPT = textwrap.dedent("""
    import os, signal
    from grpo_jax.io.preemption import PreemptionGuard
    with PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGINT)
        print("requested", guard.requested, guard.signum == signal.SIGINT, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("still running", flush=True)
""")


def test_a_second_signal_exits_at_once():
    result = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "requested True True" in result.stdout and "still running" not in result.stdout
    assert "second SIGTERM: exiting now without saving" in result.stdout


def test_a_run_stops_right_past_the_non_finite_limit_or_when_its_gradient_stays_zero():
    """Over `limit` skipped steps stop the run at once; so do `limit` steps in a row with a gradient norm of exactly 0
    (a saturated model, or rewards that never differ with beta 0), while a zero norm now and then does not."""
    ok, skipped, dead = {"skipped": 0, "grad_norm": 0.5}, {"skipped": 1, "grad_norm": None}, {"skipped": 0,
                                                                                             "grad_norm": 0.0}
    assert preemption.stalled([ok, skipped, dead, skipped, ok], 2) is None
    assert preemption.stalled([skipped, ok, skipped, skipped], 2).startswith("3 optimizer steps had a non-finite loss")
    assert preemption.stalled([dead, ok, dead], 2) is None
    assert "gradient norm was exactly 0 on the last 2 optimizer steps" in preemption.stalled([ok, dead, dead], 2)
    # train.stop_on_zero_gradient=false (GRPOConfig's, as TRL goes on): only the non-finite limit stops it
    assert preemption.stalled([ok, dead, dead, dead], 2, zero_gradient=False) is None
    assert preemption.stalled([skipped, dead, skipped, skipped], 2, zero_gradient=False).startswith("3 optimizer")


MULTIHOST_GUARD_SCRIPT = textwrap.dedent("""
    import os, signal, time
    from grpo_jax.io.preemption import PreemptionGuard
    with PreemptionGuard(multihost=True) as guard:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # left to JAX's preemption notifier
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("not passed on", flush=True)
""")


def test_several_processes_pass_sigint_on_to_jaxs_preemption_notifier_as_sigterm():
    """With several processes SIGTERM is JAX's (its notifier tells every process); SIGINT becomes a SIGTERM to this
    process, here with no notifier installed, so the default action ends it."""
    result = subprocess.run([sys.executable, "-c", MULTIHOST_GUARD_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "SIGINT received: every process finishes the optimizer step that all of them reach" in result.stdout
    assert "not passed on" not in result.stdout
