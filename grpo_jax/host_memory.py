"""Host allocator policy: keep freed memory in the process instead of handing it back to the OS every call.

XLA:CPU gives each call of a jitted program one large block for all of its temporaries. glibc's malloc serves
blocks above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and unmaps them on free (and trims the heap top above
``M_TRIM_THRESHOLD``), so every call page-faults its whole working set in again. On the 2-core benchmark machine
that was 40 % of the tiny model's update step (36 -> 23 ms, `benchmarks/RESULTS.md`). Raising both thresholds
makes glibc reuse the freed blocks; the price is that the process keeps its peak heap instead of returning it
between steps, which a training process holds again on the next step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

HOST_ALLOCATORS = ("retain", "system")
RETAIN_BYTES = 1 << 30  # blocks below 1 GiB come from (and go back to) the heap; mallopt takes a C int
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


def _glibc():
    """The process's C library when it is glibc (mallopt's parameters are glibc's), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):  # musl, or no libc to load: leave its allocator alone
        return None
    return libc


def configure_host_allocator(policy: str) -> bool:
    """Apply ``policy`` to this process's malloc; True when glibc accepted the thresholds.

    ``retain``: blocks under `RETAIN_BYTES` are never mmap'd per call nor trimmed (glibc only; elsewhere a
    no-op). ``system``: leave malloc as it is, e.g. for an ``LD_PRELOAD``-ed jemalloc or tcmalloc.
    """
    if policy not in HOST_ALLOCATORS:
        raise ValueError(f"host_allocator={policy!r} is not supported: use one of {', '.join(HOST_ALLOCATORS)}")
    libc = None if policy == "system" else _glibc()
    if libc is None:
        return False
    return (libc.mallopt(_M_MMAP_THRESHOLD, RETAIN_BYTES) == 1) & (libc.mallopt(_M_TRIM_THRESHOLD, RETAIN_BYTES) == 1)
