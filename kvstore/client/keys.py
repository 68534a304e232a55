"""Chunk keys: a rolling prefix hash over full chunks of token ids.

key_i = H(key_{i-1} || tokens of chunk i), seeded by the namespace, an optional
per-request cache salt and the request's LoRA adapter, if any. Two prompts share key_i
exactly when they share the whole prefix up to the end of chunk i (and the salt and the
adapter), so a lookup by keys is a prefix match.

The adapter is in the seed because it changes the KV of the same tokens (any adapter on
a layer changes the hidden states every later layer caches); without it, a request on
adapter B loaded what adapter A's request had stored and answered with other tokens
(tiny Gemma-3, two random o_proj adapters, 2026-12-07). Seeds with an adapter come from
a domain of their own, and the adapter's identity is length-prefixed, so no salt a client
chooses can give a seed of an adapter's requests. An adapter is its name and the path it was
loaded from (`adapter_identity`), as in vLLM's own block hashes: a name pointed at other
weights does not reuse the KV of the old ones, and engines share an adapter's KV when they
load it from the same path.
"""

from __future__ import annotations

import json
from typing import Sequence

import blake3
import numpy as np

KEY_BYTES = 16


def adapter_identity(name: str, path: str | None) -> str:
    """What keys a LoRA adapter's KV: its name and the path it was loaded from (vLLM's `lora_path`, which
    its /v1/models card shows as `root`)."""
    return json.dumps([name, path or ""])


def _adapter_bytes(adapter: str) -> bytes:
    name = adapter.encode()
    return len(name).to_bytes(4, "little") + name


def seed_key(namespace: str, salt: str | None = None, adapter: str | None = None) -> bytes:
    """The chain's starting value: different namespaces, salts or adapters never share a key."""
    h = blake3.blake3(b"pdserve-chunk-lora-v1\0" if adapter else b"pdserve-chunk-v1\0")
    h.update(namespace.encode())
    h.update(b"\0")
    if adapter:
        h.update(_adapter_bytes(adapter))
    if salt:
        h.update(salt.encode())
    return h.digest(length=KEY_BYTES)


def chunk_keys(
    namespace: str,
    token_ids: Sequence[int],
    chunk_size: int,
    salt: str | None = None,
    adapter: str | None = None,
) -> list[bytes]:
    """One key per *full* chunk of `token_ids`; a trailing partial chunk has no key."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    prev = seed_key(namespace, salt, adapter)
    keys: list[bytes] = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        h = blake3.blake3(prev)
        h.update(tokens[start : start + chunk_size].tobytes())
        prev = h.digest(length=KEY_BYTES)
        keys.append(prev)
    return keys


def prompt_digest(token_ids: Sequence[int], salt: str | None = None, adapter: str | None = None) -> str:
    """A short hex digest of a whole prompt (and its cache salt and adapter): binds a handoff to one prompt."""
    h = blake3.blake3(b"pdserve-prompt-lora-v1\0" if adapter else b"pdserve-prompt-v1\0")
    if adapter:
        h.update(_adapter_bytes(adapter))
    if salt:
        h.update(salt.encode())
    h.update(b"\0")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.hexdigest(length=12)
