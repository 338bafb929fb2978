"""tests/device/test_cpu.py at XLA's default flags. The CPU speed code promises the default path's numbers bit for bit in
the programs users run; the rest of the suite compiles at LLVM -O0 (conftest), which rounds some float32 ops
differently, so the promise is checked where it is made."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parents[2]


# two halves of about equal time, so that neither is the suite's last long test on one worker
@pytest.mark.parametrize("select", ["sampler", "not sampler"])
def test_cpu_speed_code_at_xla_default_flags(select):
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level=0" not in flags:
        pytest.skip("this session compiles at XLA's default flags: tests/device/test_cpu.py runs in it")
    default = " ".join(f for f in flags.split() if f not in FAST_COMPILE_FLAGS)
    env = {**os.environ, "XLA_FLAGS": default}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0",
                             "-k", select, "tests/device/test_cpu.py"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "test_cpu_default_flags" not in result.stdout, result.stdout[-2000:]
