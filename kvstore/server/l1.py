"""L1: objects in the shared-memory arena under a byte budget, evicted LRU.

The arena is carved by a best-fit extent allocator. An object is leased while a
client writes or reads it (and while ZMQ still sends it from the arena); a leased
object is never evicted, and one removed while leased is freed only when its last
lease ends, so no transfer ever sees its bytes reused.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from pdserve.kvstore.client.shm import Arena

ALIGN = 64
# The least arena room an object takes. Each indexed object also costs the process about 400 bytes of
# index, allocator and lease state outside the arena: charging at least a page bounds that at a tenth of
# --l1-size-gb, where 64-byte objects let it grow to six times the budget (1M objects in a 64 MiB L1:
# +450 MiB RSS). KV chunks are far larger; only a broken or hostile client sends objects this small.
MIN_SPAN = 4096
ChunkId = tuple[str, int, bytes]  # (namespace, object group, chunk key)


class Allocator:
    """Best-fit over free extents, coalescing neighbours on free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_size: list[tuple[int, int]] = []  # sorted (length, start)
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end -> start
        self.free_bytes = 0
        if size > 0:
            self._add(0, size)

    def _add(self, start: int, length: int) -> None:
        bisect.insort(self._by_size, (length, start))
        self._by_start[start] = length
        self._by_end[start + length] = start
        self.free_bytes += length

    def _remove(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[i]
        del self._by_start[start]
        del self._by_end[start + length]
        self.free_bytes -= length

    def alloc(self, length: int) -> int | None:
        i = bisect.bisect_left(self._by_size, (length, -1))
        if i == len(self._by_size):
            return None
        free_len, start = self._by_size[i]
        self._remove(start, free_len)
        if free_len > length:
            self._add(start + length, free_len - length)
        return start

    def free(self, start: int, length: int) -> None:
        before = self._by_end.get(start)
        if before is not None:
            before_len = self._by_start[before]
            self._remove(before, before_len)
            start, length = before, length + before_len
        after_len = self._by_start.get(start + length)
        if after_len is not None:
            self._remove(start + length, after_len)
            length += after_len
        self._add(start, length)


@dataclass(eq=False, slots=True)
class Obj:
    """One payload in the arena."""

    id: int
    offset: int
    size: int  # payload bytes
    span: int  # allocated bytes (aligned)
    checksum: int = 0
    leases: int = 0
    dead: bool = False  # no longer indexed; freed when the last lease ends


class L1:
    """Index + LRU over arena objects; `spill` is called with each evicted chunk before its bytes are freed."""

    def __init__(self, arena: Arena, spill: Callable[[ChunkId, Obj], None]) -> None:
        self.arena = arena
        self._alloc = Allocator(arena.size)
        self._spill = spill
        self.index: OrderedDict[ChunkId, Obj] = OrderedDict()
        self.used_bytes = 0  # payload bytes of live objects (indexed, pending, tails)
        self.live_objects = 0
        self.evictions = 0
        self._next_id = 1

    @property
    def capacity(self) -> int:
        return self.arena.size

    def view(self, obj: Obj) -> memoryview:
        return self.arena.slice(obj.offset, obj.size)

    def get(self, cid: ChunkId, touch: bool = True) -> Obj | None:
        obj = self.index.get(cid)
        if obj is not None and touch:
            self.index.move_to_end(cid)
        return obj

    def allocate(self, size: int) -> Obj | None:
        """A new unindexed object with one lease (its writer), evicting LRU chunks for room; None if all are leased."""
        span = max(MIN_SPAN, -(-size // ALIGN) * ALIGN)
        if span > self.capacity:
            return None
        while (offset := self._alloc.alloc(span)) is None:
            if not self._evict_one():
                return None
        obj = Obj(id=self._next_id, offset=offset, size=size, span=span, leases=1)
        self._next_id += 1
        self.used_bytes += size
        self.live_objects += 1
        return obj

    def _evict_one(self) -> bool:
        victim = next((cid for cid, obj in self.index.items() if obj.leases == 0), None)
        if victim is None:
            return False
        obj = self.index.pop(victim)
        self._spill(victim, obj)
        self.evictions += 1
        self.discard(obj)
        return True

    def insert(self, cid: ChunkId, obj: Obj) -> Obj:
        """Index `obj` (most recent); if a concurrent writer got there first, keep theirs and discard this one."""
        existing = self.index.get(cid)
        if existing is not None:
            self.discard(obj)
            self.index.move_to_end(cid)
            return existing
        self.index[cid] = obj
        return obj

    def remove(self, cid: ChunkId) -> None:
        obj = self.index.pop(cid, None)
        if obj is not None:
            self.discard(obj)

    def discard(self, obj: Obj) -> None:
        """Drop `obj`; its bytes are freed now, or when its last lease ends."""
        if obj.dead:
            return
        obj.dead = True
        self.used_bytes -= obj.size
        self.live_objects -= 1
        if obj.leases == 0:
            self._alloc.free(obj.offset, obj.span)

    def unlease(self, obj: Obj) -> None:
        obj.leases -= 1
        if obj.leases == 0 and obj.dead:
            self._alloc.free(obj.offset, obj.span)
