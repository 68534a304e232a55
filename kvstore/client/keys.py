"""Chunk keys: a rolling prefix hash over full chunks of token ids.

key_i = H(key_{i-1} || tokens of chunk i), seeded by the namespace and an optional
per-request cache salt. Two prompts share key_i exactly when they share the whole
prefix up to the end of chunk i (and the salt), so a lookup by keys is a prefix match.
"""

from __future__ import annotations

from typing import Sequence

import blake3
import numpy as np

KEY_BYTES = 16


def seed_key(namespace: str, salt: str | None = None) -> bytes:
    """The chain's starting value: different namespaces or salts never share a key."""
    h = blake3.blake3(b"pdserve-chunk-v1\0")
    h.update(namespace.encode())
    h.update(b"\0")
    if salt:
        h.update(salt.encode())
    return h.digest(length=KEY_BYTES)


def chunk_keys(
    namespace: str,
    token_ids: Sequence[int],
    chunk_size: int,
    salt: str | None = None,
) -> list[bytes]:
    """One key per *full* chunk of `token_ids`; a trailing partial chunk has no key."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    prev = seed_key(namespace, salt)
    keys: list[bytes] = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        h = blake3.blake3(prev)
        h.update(tokens[start : start + chunk_size].tobytes())
        prev = h.digest(length=KEY_BYTES)
        keys.append(prev)
    return keys


def prompt_digest(token_ids: Sequence[int], salt: str | None = None) -> str:
    """A short hex digest of a whole prompt (and its cache salt): binds a handoff to one prompt."""
    h = blake3.blake3(b"pdserve-prompt-v1\0")
    if salt:
        h.update(salt.encode())
    h.update(b"\0")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.hexdigest(length=12)
