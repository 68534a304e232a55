"""Payload checksums: computed by the writer, verified by every reader.

xxh3-64 runs faster than memcpy, so verifying costs little; hashing each piece
right after copying it (while it is still in the CPU cache) makes a checked copy
cost about as much as a plain one. The checksum guards against torn or corrupt L2
files and against a same-host client scribbling over shared memory; it is not a
cryptographic guarantee.
"""

from __future__ import annotations

import xxhash

# Copy and hash in pieces that stay in the L2 cache between the two passes.
PIECE_BYTES = 256 * 1024


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a contiguous buffer."""
    return xxhash.xxh3_64_intdigest(data)


def copy_with_checksum(dst: memoryview, src: memoryview) -> int:
    """Copy `src` into `dst` (same length, both byte views) and return the checksum of the bytes copied."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into a {len(dst)}-byte buffer")
    h = xxhash.xxh3_64()
    for start in range(0, len(src), PIECE_BYTES):
        end = start + PIECE_BYTES
        dst[start:end] = src[start:end]
        h.update(dst[start:end])
    return h.intdigest()


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
