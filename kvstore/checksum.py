"""Payload checksums: every object carries one, and every reader verifies it.

xxh3-64 hashes at roughly memcpy speed, so hashing in line with a copy would
halve throughput. Instead, `copy_all` copies on the calling thread while a helper
thread hashes the same sources: both release the GIL (numpy's copy and xxhash do),
so a checked copy costs about one plain copy. The checksum guards against torn or
corrupt L2 files and against a same-host client scribbling over shared memory; it
is not a cryptographic guarantee.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash

# Below this many bytes a batch is copied and hashed in line: a thread hand-off costs more.
PARALLEL_MIN_BYTES = 1 << 20

_pool: ThreadPoolExecutor | None = None


def _helper() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kv-checksum")
    return _pool


def _forget_pool_after_fork() -> None:
    global _pool
    _pool = None  # a forked child has no threads: start a fresh pool on first use


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a contiguous buffer."""
    return xxhash.xxh3_64_intdigest(data)


def _checksums(views: Sequence[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(v) for v in views]


def _as_array(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)


def copy_all(dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> list[int]:
    """Copy each source into its destination (same lengths) and return the sources' checksums."""
    for d, s in zip(dsts, srcs):
        if len(d) != len(s):
            raise ValueError(f"copy of {len(s)} bytes into a {len(d)}-byte buffer")
    if sum(len(s) for s in srcs) < PARALLEL_MIN_BYTES:
        for d, s in zip(dsts, srcs):
            d[:] = s
        return _checksums(srcs)
    sums = _helper().submit(_checksums, srcs)
    for d, s in zip(dsts, srcs):
        np.copyto(_as_array(d), _as_array(s))
    return sums.result()


def checksums(views: Sequence[memoryview]) -> list[int]:
    """Checksums of several buffers, spread over the helper threads when large."""
    if len(views) < 2 or sum(len(v) for v in views) < PARALLEL_MIN_BYTES:
        return _checksums(views)
    return list(_helper().map(checksum, views))


def byte_view(buf: object) -> memoryview:
    """A flat, contiguous byte view of anything exporting the buffer protocol (bytes, numpy, torch CPU...)."""
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(f"payload must export the buffer protocol, got {type(buf).__name__}") from exc
    if not view.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
