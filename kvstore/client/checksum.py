"""Payload checksums: every object carries one, and every reader verifies it.

xxh3-64 hashes several times faster than memcpy, so a checked copy costs what its
memory traffic costs. Two ways to do it, picked by the cores this process may use:
- spare cores: copy on the calling thread while a helper thread hashes the same
  sources (both release the GIL), so a checked copy costs about one plain copy; on a
  16-core Xeon host a checked copy ran at 1.03-1.06x memcpy this way, 0.76-0.82x the
  one-thread way.
- two cores or fewer: walk each payload in 256 KiB blocks, hashing a block (which
  pulls it into the core's L2 cache) and then copying it from cache, on one thread;
  on the 2-core dev VM (1 MiB L2 per core) this ran at 0.85-1.08x memcpy against
  0.62-0.85x for the helper thread, which there competes with the ZMQ I/O threads for
  the same cores. 1 MiB blocks gave 0.80-0.92x: a block and its copy must both fit in
  L2 (on that VM shm stores of 1 MiB objects went from 0.63-0.72x to 0.69-0.78x).
The checksum guards against torn or corrupt L2 files and against a same-host client
scribbling over shared memory; it is not a cryptographic guarantee.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash

BLOCK_BYTES = 256 << 10  # one-thread way: hashed then copied while still in the core's own (L2) cache
PARALLEL_MIN_BYTES = 1 << 20  # below this a thread hand-off costs more than it saves


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


HASH_ON_HELPER = _usable_cpus() > 2
HELPERS = min(4, os.cpu_count() or 1)

_pool: ThreadPoolExecutor | None = None


def _helper() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=HELPERS, thread_name_prefix="kv-checksum")
    return _pool


def _forget_pool_after_fork() -> None:
    global _pool
    _pool = None  # a forked child has no threads: start a fresh pool on first use


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a contiguous buffer."""
    return xxhash.xxh3_64_intdigest(data)


def _checksums_here(views: Sequence[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(v) for v in views]


def _shares(views: Sequence[memoryview], parts: int) -> list[Sequence[memoryview]]:
    """`views` cut into at most `parts` runs of consecutive views of about equal bytes."""
    total = sum(len(v) for v in views)
    runs: list[Sequence[memoryview]] = []
    start, acc = 0, 0
    for i, v in enumerate(views):
        acc += len(v)
        if acc * parts >= total * (len(runs) + 1) and len(runs) < parts - 1:
            runs.append(views[start : i + 1])
            start = i + 1
    runs.append(views[start:])
    return [r for r in runs if len(r)]


def checksums(views: Sequence[memoryview]) -> list[int]:
    """Checksums of several buffers, in order. A large read verified in place (a loading worker's
    whole prompt, 150 MB at 32k tokens of a tiny DeepSeek) is hashed on the helper threads too
    when there are spare cores: xxh3 on one thread runs at memory-read speed of one core, and
    the load's copy to the device waits for the verdict."""
    if not HASH_ON_HELPER or len(views) < 2 or sum(len(v) for v in views) < PARALLEL_MIN_BYTES * 4:
        return _checksums_here(views)
    runs = _shares(views, HELPERS + 1)
    later = [_helper().submit(_checksums_here, run) for run in runs[1:]]
    first = _checksums_here(runs[0])  # this thread takes a share too
    return first + [s for f in later for s in f.result()]


def _copy_hashed(dst: memoryview, src: memoryview) -> int:
    """One thread: hash a block, then copy it while it is in cache."""
    if len(src) <= BLOCK_BYTES:
        dst[:] = src
        return checksum(src)
    h = xxhash.xxh3_64()
    d, s = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    for start in range(0, len(src), BLOCK_BYTES):
        block = s[start : start + BLOCK_BYTES]
        h.update(block.data)
        np.copyto(d[start : start + BLOCK_BYTES], block)
    return h.intdigest()


def copy_all(dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> list[int]:
    """Copy each source into its destination (same lengths) and return the sources' checksums."""
    for d, s in zip(dsts, srcs):
        if len(d) != len(s):
            raise ValueError(f"copy of {len(s)} bytes into a {len(d)}-byte buffer")
    if HASH_ON_HELPER and sum(len(s) for s in srcs) >= PARALLEL_MIN_BYTES:
        sums = _helper().submit(_checksums_here, srcs)  # (checksums would wait on its own pool)
        for d, s in zip(dsts, srcs):
            np.copyto(np.frombuffer(d, dtype=np.uint8), np.frombuffer(s, dtype=np.uint8))
        return sums.result()
    return [_copy_hashed(d, s) for d, s in zip(dsts, srcs)]


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
