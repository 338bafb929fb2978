"""The host allocator policy, observed through glibc's own accounting (mallinfo2) in a fresh process."""

import json
import subprocess
import sys

import pytest

from grpo_jax.config import load_config
from grpo_jax.host_memory import _glibc, configure_host_allocator

# mallinfo2: hblkhd = bytes in mmap'd blocks, arena = bytes of the brk heap (glibc >= 2.33)
PROBE = """
import ctypes, json, sys
from grpo_jax.host_memory import configure_host_allocator
applied = configure_host_allocator(sys.argv[1])
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
mapped_before = libc.mallinfo2().hblkhd
block = libc.malloc(64 << 20)
mapped_delta = libc.mallinfo2().hblkhd - mapped_before
libc.free(block)
print(json.dumps(dict(applied=applied, mapped_delta=mapped_delta, heap_after_free=libc.mallinfo2().arena)))
"""

needs_glibc = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"),
                                 reason="glibc >= 2.33 only")


def _probe(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@needs_glibc
def test_retain_serves_a_64_mib_block_from_the_heap_and_keeps_it_after_free():
    got = _probe("retain")
    assert got["applied"] is True
    assert got["mapped_delta"] == 0
    assert got["heap_after_free"] >= 64 << 20


@needs_glibc
def test_system_leaves_glibc_mapping_large_blocks():
    got = _probe("system")
    assert got["applied"] is False
    assert got["mapped_delta"] >= 64 << 20  # glibc's default: a fresh mmap, unmapped again on free


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="host_allocator='tcmalloc'.*retain, system"):
        configure_host_allocator("tcmalloc")
    with pytest.raises(ValueError, match="host_allocator='tcmalloc'.*retain, system"):
        load_config(None, ["host_allocator=tcmalloc"])
