"""KV layouts and the namespaces derived from them.

A namespace isolates every object in the store by what the bytes mean: the model,
how each KV cache group lays out a token (dtype, bytes per token, block size) and
how the engine is parallelised. Two engines share objects exactly when they would
read the same bytes the same way; anything else gets a different namespace, so the
store can never hand one engine another's KV.
"""

from __future__ import annotations

import msgspec
import blake3


class KVGroupLayout(msgspec.Struct, frozen=True):
    """One KV cache group as the paged cache holds it."""

    name: str  # e.g. "full", "sliding", "compressed", "c4_state"
    dtype: str  # torch dtype name or a packed format, e.g. "bfloat16", "fp8_ds_mla"
    bytes_per_token: int  # per layer, all heads of one rank
    block_size: int  # tokens per paged-cache block
    num_layers: int
    sliding_window: int | None = None  # tokens kept behind each chunk boundary, None = full


class KVLayout(msgspec.Struct, frozen=True):
    """Everything that decides whether two engines' KV bytes are interchangeable."""

    model: str
    groups: tuple[KVGroupLayout, ...]
    parallel: str = "tp1"  # e.g. "tp8", "tp4-pp2"; MLA stores one copy for all TP ranks

    def namespace(self) -> str:
        """A stable 128-bit hex digest of the canonical msgpack encoding."""
        return blake3.blake3(msgspec.msgpack.encode(self)).hexdigest(length=16)
