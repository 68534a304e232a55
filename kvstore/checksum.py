"""Payload checksums: every object carries one, and every reader verifies it.

xxh3-64 hashes several times faster than memcpy, so the cost of a checked copy is
where the bytes are read from, not the hash. `copy_all` walks each payload in
blocks that fit in a core's cache: it hashes a block (pulling it into cache), then
copies that block from cache, so the payload is read from memory once. Measured on
the 2-core dev VM this beat hashing on a helper thread beside the copy (shm store
0.80-1.0x memcpy against 0.63-0.76x): the second thread competed with the ZMQ I/O
threads for the same two cores. The checksum guards against torn or corrupt L2
files and against a same-host client scribbling over shared memory; it is not a
cryptographic guarantee.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

BLOCK_BYTES = 1 << 20  # hashed then copied while still in cache


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a contiguous buffer."""
    return xxhash.xxh3_64_intdigest(data)


def checksums(views: Sequence[memoryview]) -> list[int]:
    """Checksums of several buffers."""
    return [xxhash.xxh3_64_intdigest(v) for v in views]


def _copy_hashed(dst: memoryview, src: memoryview) -> int:
    if len(src) <= BLOCK_BYTES:
        dst[:] = src
        return checksum(src)
    h = xxhash.xxh3_64()
    d, s = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    for start in range(0, len(src), BLOCK_BYTES):
        block = s[start : start + BLOCK_BYTES]
        h.update(block)
        np.copyto(d[start : start + BLOCK_BYTES], block)
    return h.intdigest()


def copy_all(dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> list[int]:
    """Copy each source into its destination (same lengths) and return the sources' checksums."""
    for d, s in zip(dsts, srcs):
        if len(d) != len(s):
            raise ValueError(f"copy of {len(s)} bytes into a {len(d)}-byte buffer")
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
