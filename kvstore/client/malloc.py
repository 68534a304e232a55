"""glibc malloc tuning for a process that receives large ZMQ messages.

ZMQ allocates a buffer for every received message. glibc serves buffers above its
mmap threshold with a fresh mmap and unmaps them on free, so every multi-MiB
message pays a page fault per 4 KiB page, which on a VM costs more than the copy
itself (measured: TCP loads of 16 MiB objects at 0.27x memcpy without this, 0.56x
with it). Raising the mmap threshold to its maximum (32 MiB) and the trim threshold
keeps such buffers in the heap for reuse. ZMQ's I/O thread allocates them, and a
thread's own malloc arena drops a heap it has emptied (the trim threshold does not
apply there), so the tuning also keeps every thread on the main arena (perf showed
the I/O thread zeroing fresh pages on every load without it). The server and the
bench apply all of it to themselves. pdserve's worker launcher gives vLLM the two
thresholds (`ENV`); it leaves the arena count alone, since one arena for every
engine thread is a trade a user should choose (MALLOC_ARENA_MAX=1 where workers load
over TCP).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD = 1 << 30

ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def keep_large_buffers() -> bool:
    """Apply the tuning (best before threads start); False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(
        bool(mallopt(opt, value))
        for opt, value in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    )
