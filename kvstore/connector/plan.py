"""Which blocks of which KV group each store object covers.

Pure arithmetic, shared by the scheduler half (which plans loads and saves) and the
worker half (which moves the bytes), so both agree on every object's extent without
sending it over the wire.

An object is one (KV group, chunk) pair, or one KV group of a request's tail (the
final partial chunk). A full-attention group's object holds the blocks of its own
chunk. A sliding-window group's object holds only the window that ends at the
object's end (chunk-aligned retention): that is all a decode resuming at that
boundary reads, so resuming at any chunk boundary is exact.

`check_geometry` is the start-up check of the same arithmetic: a chunk that is not a whole
number of blocks, or a sliding window retained at other boundaries, would show up as wrong
tokens later, so the engine refuses to start instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvstore.client.layout import KVLayout

TAIL = None  # the `key` of a tail object
UNALLOCATED = -1  # a payload block a load does not write (past the tokens it loads)


@dataclass(frozen=True)
class GroupGeometry:
    """What the planner needs to know of one KV cache group."""

    block_size: int
    sliding_window: int | None = None

    def block_span(self, start_token: int, end_token: int) -> tuple[int, int]:
        """Block indexes [first, last) that hold tokens [start_token, end_token)."""
        first = start_token // self.block_size
        last = -(-end_token // self.block_size)
        return first, last

    def object_span(self, chunk_start: int, end_token: int) -> tuple[int, int]:
        """Blocks an object ending at `end_token` carries.

        Full attention: its own tokens from `chunk_start`. Sliding window: the window
        before `end_token` (one token of slack for either window convention), which may
        reach back into earlier chunks.
        """
        if self.sliding_window is None:
            return self.block_span(chunk_start, end_token)
        return self.block_span(max(0, end_token - self.sliding_window - 1), end_token)


@dataclass
class ObjectSpec:
    """One object to move: its group, its chunk key (None for a tail) and its blocks."""

    group: int
    key: bytes | None
    block_ids: list[int]  # one per block of the payload; UNALLOCATED where a load has no target block
    skip_blocks: int = 0  # leading blocks already valid locally: loaded bytes are not written there


@dataclass
class TransferJob:
    """All objects of one request that move in one step, in one direction."""

    req_id: str
    objects: list[ObjectSpec] = field(default_factory=list)
    tail_id: str | None = None
    wait_s: float = 0.0  # loads: how long to wait for objects a producer promised
    store_url: str | None = None  # loads: the producer's store when it is not our own
    store_id: str | None = None  # loads: the id the producer's store announced (checked before waiting on it)
    handoff: bool = False  # saves: a P/D decode may be waiting for these objects (retried if the store blinks)
    generation: int | None = None  # saves: the namespace's generation when planned (a clear since refuses them)


def plan_objects(
    geometries: list[GroupGeometry],
    block_ids: list[list[int]],
    keys: list[bytes],
    chunk_size: int,
    first_chunk: int,
    num_chunks: int,
    tail_end: int | None,
    computed_tokens: int = 0,
    last_only_for_sliding: bool = False,
    allow_short_table: bool = False,
) -> list[ObjectSpec]:
    """Objects for chunks [first_chunk, num_chunks) and, if `tail_end`, the tail.

    `block_ids` holds the request's block table per group. `computed_tokens` marks
    blocks that are already valid locally (loads skip writing them). With
    `last_only_for_sliding`, a sliding-window group gets only its last object: a load
    needs just the window at the point where it resumes. With `allow_short_table`
    (loads), payload blocks past the end of the block table are UNALLOCATED: a load
    stops one token short of the prompt, so a tail's last block may not exist yet.
    """
    specs: list[ObjectSpec] = []
    ends: list[tuple[bytes | None, int, int]] = [
        (keys[i], i * chunk_size, (i + 1) * chunk_size) for i in range(first_chunk, num_chunks)
    ]
    if tail_end is not None:
        ends.append((TAIL, num_chunks * chunk_size, tail_end))
    for group, geo in enumerate(geometries):
        group_ends = ends[-1:] if (last_only_for_sliding and geo.sliding_window is not None) else ends
        for key, start, end in group_ends:
            first, last = geo.object_span(start, end)
            ids = block_ids[group][first:last]
            if allow_short_table:
                ids = ids + [UNALLOCATED] * (last - first - len(ids))
            if len(ids) != last - first:
                raise ValueError(
                    f"group {group}: request has {len(block_ids[group])} blocks, object needs [{first}, {last})"
                )
            skip = max(0, min(last, computed_tokens // geo.block_size) - first)
            specs.append(ObjectSpec(group=group, key=key, block_ids=list(ids), skip_blocks=skip))
    return specs


class ConnectorConfigError(RuntimeError):
    """A start-up check failed; the message names the fix."""


def check_geometry(layout: KVLayout, chunk_size: int, retention_interval: int | None) -> None:
    """Start-up checks whose failure would otherwise show up as wrong tokens later."""
    for g in layout.groups:
        if chunk_size % g.block_size:
            raise ConnectorConfigError(
                f"the KV store's chunk size {chunk_size} is not a multiple of KV group {g.name}'s block size "
                f"{g.block_size}: restart the store with --chunk-size {g.block_size * max(1, chunk_size // g.block_size)} "
                f"(or another multiple of {g.block_size})"
            )
    if any(g.sliding_window for g in layout.groups):
        if retention_interval is not None and (retention_interval <= 0 or chunk_size % retention_interval):
            raise ConnectorConfigError(
                f"this model has sliding-window KV groups: pass --prefix-cache-retention-interval N with N dividing "
                f"the store's chunk size {chunk_size} (e.g. --prefix-cache-retention-interval {chunk_size}); "
                f"got {retention_interval}"
            )
