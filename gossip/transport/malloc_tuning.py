"""Keep freed receive buffers in the process instead of giving them back to the kernel.

ZeroMQ allocates every received message with malloc. With glibc's defaults, a large message
(tens of MiB) freed by its reader is returned to the kernel, so the next one of the same size
page-faults in freshly zeroed memory, about one fault per 4 KiB: for a 25M-float ring
all-reduce that was over 10,000 faults per call, a sizeable share of the CPU on a small machine.
glibc also gives each thread its own arena, whose heaps are capped at 64 MiB and unmapped
when they empty, so the I/O thread's buffers churn even with larger thresholds.

``keep_freed_buffers()`` makes this process reuse its freed memory instead (one arena, no
mmap for large blocks, no trimming), like the registered buffer pools of MPI libraries. The
cost is that the process keeps its peak message memory mapped. Opt out with
``GOSSIP_MALLOC_TUNING=0``. A no-op on anything but glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_done = False


def keep_freed_buffers() -> bool:
    """Tune glibc malloc once per process; True if it was tuned (now or before)."""
    global _done
    if _done:
        return True
    if os.environ.get("GOSSIP_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_ARENA_MAX, 1)
                 & mallopt(_M_MMAP_THRESHOLD, 1 << 30)
                 & mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))
    return _done
