"""The store's logic, free of any transport: namespaces, L1/L2, leases, tails.

Every method runs on the server thread. Requests are validated as a whole before
anything changes, so a bad batch leaves the store as it was. Objects are keyed by
(namespace, object group, chunk key): a namespace is part of every key, so no
lookup or load can ever reach another namespace's objects.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from pdserve.kvstore.client import protocol as p
from pdserve.kvstore.client.checksum import copy_all
from pdserve.kvstore.server.config import KVStoreConfig
from pdserve.kvstore.server.l1 import L1, ChunkId, Obj
from pdserve.kvstore.server.l2 import L2, L2Corrupt
from pdserve.kvstore.client.layout import KVLayout
from pdserve.kvstore.server.metrics import Metrics
from pdserve.kvstore.client.shm import Arena

log = logging.getLogger(__name__)

TailKey = tuple[str, str]  # (namespace, request id)
_NO_ROOM = Obj(id=0, offset=0, size=0, span=0)  # sentinel: stored in L2, no unleased room in L1 now
MAX_TAIL_TTL_S = 3600.0
# A tail that was here and is gone (loaded, dropped, expired) is remembered this long, at most this many, so
# an Await for it is answered at once instead of waiting for a tail that will not come: a decode leg retried
# on another engine after the first one loaded the tail (and died) asks for a tail nobody will write again.
GONE_TAIL_KEEP_S = 600.0  # as long as the longest handoff wait (the connector's MAX_HANDOFF_WAIT_S)
GONE_TAILS_MAX = 65536
# Distinct layouts registered: one per model and parallel layout in use, a few in any real deployment;
# the cap keeps a client registering made-up layouts from growing the store without bound.
MAX_NAMESPACES = 1024


class Conflict(ValueError):
    """A layout that does not hash to the namespace claimed for it; a tail planned before its namespace was cleared."""


class NoRoom(RuntimeError):
    """L1 cannot hold the request even after evicting every unleased chunk."""


@dataclass(eq=False)
class Tail:
    objs: dict[int, Obj]
    deadline: float
    pending: int = 0  # shm slots not yet committed; the tail is invisible until 0


@dataclass(eq=False, slots=True)
class Lease:
    obj: Obj
    deadline: float
    # a write lease names what the object becomes on commit; a read lease has None
    target: ChunkId | tuple[TailKey, int] | None = None


@dataclass
class LoadResult:
    """Result of a load: reply items plus what the transport needs to send and later release."""

    found: list[p.Found | None]
    shm: bool
    objs: list[Obj] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    retry: list[int] = field(default_factory=list)  # in L2, no room in L1 right now


class Store:
    def __init__(self, cfg: KVStoreConfig, metrics: Metrics, clock=time.monotonic) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self.arena = Arena.create(cfg.l1_bytes, shared=cfg.shm)
        self.l1 = L1(self.arena, spill=self._spill)
        self.l2 = L2(cfg.l2_path, cfg.l2_bytes, on_evict=self._l2_evicted) if cfg.l2_path else None
        self.layouts: dict[str, KVLayout] = {}
        self.tails: dict[TailKey, Tail] = {}
        # A namespace's generation: how many times it was cleared since the store started. Puts that
        # name an older one were planned before a clear and are refused (`Clear`). Kept in memory only:
        # after a restart every namespace is at 0 again and newer generations are accepted, so a handoff
        # save retried across a restart still lands.
        self.generations: dict[str, int] = {}
        self.gone_tails: OrderedDict[TailKey, float] = OrderedDict()  # when each is forgotten, oldest first
        self.leases: dict[int, Lease] = {}  # insertion order == deadline order
        self._next_lease = 1
        self.sending = 0  # objects leased to frames ZMQ has not sent yet
        metrics.tier_capacity.labels("l1").set(self.l1.capacity)
        metrics.tier_capacity.labels("l2").set(cfg.l2_bytes)
        self.refresh_gauges()

    @property
    def max_object_bytes(self) -> int:
        return self.l1.capacity

    def close(self) -> None:
        """Stop. With L2, what L1 holds is written to disk first, so a clean restart keeps the whole
        cache, not only what was evicted (each file is atomic: a stop cut short loses no file)."""
        if self.l2 is not None:
            self._flush_l1()
        self.arena.close()

    def _flush_l1(self) -> None:
        assert self.l2 is not None
        chunks = list(self.l1.index.items())  # least recent first, so L2 keeps the most recent if full
        if chunks:
            log.info("writing %d L1 objects (%.2f GiB) to L2 before exit", len(chunks),
                     sum(obj.size for _, obj in chunks) / 2**30)
        for cid, obj in chunks:
            if not self._write_l2(cid, obj):
                return  # the disk refused one: the rest of L1 is dropped

    # ------------------------------------------------------------ namespaces

    def register(self, layout: KVLayout, namespace: str | None) -> str:
        self._check_layout(layout)
        ns = layout.namespace()
        if namespace is not None and namespace != ns:
            raise Conflict(
                f"layout of model {layout.model!r} hashes to namespace {ns}, not {namespace}: "
                "the claimed namespace belongs to a different model, KV layout or parallel layout"
            )
        if ns not in self.layouts and len(self.layouts) >= MAX_NAMESPACES:
            raise NoRoom(f"{MAX_NAMESPACES} namespaces are registered already: no room for another layout")
        known = self.layouts.setdefault(ns, layout)
        if known != layout:
            raise Conflict(f"namespace {ns} is already registered with a different layout")
        return ns

    # ------------------------------------------------------------ chunks

    def _has(self, cid: ChunkId) -> bool:
        return self.l1.get(cid) is not None or (self.l2 is not None and self.l2.contains(cid))

    def lookup(self, ns: str, groups: Sequence[int], keys: Sequence[bytes]) -> int:
        p.check_namespace(ns)
        p.check_items(len(keys))
        if not groups:
            raise p.BadRequest("lookup needs at least one object group")
        for g in groups:
            p.check_group(g)
        for k in keys:
            p.check_key(k)
        count = 0
        for key in keys:
            if not all(self._has((ns, g, key)) for g in groups):
                break
            count += 1
        self.metrics.lookup_hits.inc(count)
        return count

    def ready(self, ns: str, refs: Sequence[p.ItemRef], tail_id: str | None) -> p.Ready:
        """Which items are stored, and whether the named tail is complete or gone (an Await's answer)."""
        present = [self._has((ns, ref.group, ref.key)) for ref in refs]
        if tail_id is None:
            return p.Ready(present=present)
        tail = self.tails.get((ns, tail_id))
        return p.Ready(present=present, tail=tail is not None and not tail.pending,
                       tail_gone=tail is None and (ns, tail_id) in self.gone_tails)

    def check_await(self, ns: str, refs: Sequence[p.ItemRef], tail_id: str | None, wait_ms: int) -> None:
        p.check_namespace(ns)
        p.check_items(len(refs))
        for ref in refs:
            p.check_group(ref.group)
            p.check_key(ref.key)
        if tail_id is not None:
            p.check_request_id(tail_id)
        if not 0 <= wait_ms <= p.MAX_WAIT_MS:
            raise p.BadRequest(f"wait of {wait_ms} ms out of range 0..{p.MAX_WAIT_MS}")

    def _check_layout(self, layout: KVLayout) -> None:
        if not layout.model or not layout.groups:
            raise p.BadRequest("a layout needs a model and at least one KV group")
        for g in layout.groups:
            if g.bytes_per_token <= 0 or g.block_size <= 0 or g.num_layers <= 0:
                raise p.BadRequest(f"KV group {g.name!r}: bytes_per_token, block_size and num_layers must be positive")

    def _check_items(self, ns: str, items: Sequence[p.ItemMeta]) -> None:
        p.check_namespace(ns)
        p.check_items(len(items))
        for it in items:
            p.check_group(it.group)
            p.check_key(it.key)
            if it.size < 0:
                raise p.BadRequest(f"negative size {it.size}")

    def _admit(self, cid: ChunkId, size: int) -> tuple[Obj | None, bool, str | None]:
        """(new leased object, stored, error): present -> (None, True), refused -> (None, False, why)."""
        if self._has(cid):
            return None, True, None
        if size > self.max_object_bytes:
            self.metrics.refused.inc()
            return None, False, f"object of {size} bytes exceeds L1 ({self.max_object_bytes} bytes)"
        obj = self.l1.allocate(size)
        if obj is None:
            self.metrics.refused.inc()
            return None, False, "no room: L1 is full of objects in transfer"
        return obj, True, None

    def generation(self, ns: str) -> int:
        return self.generations.get(ns, 0)

    def _stale(self, ns: str, generation: int | None) -> str | None:
        """Why a put planned in `generation` is refused, or None (no generation named: not checked)."""
        if generation is None or generation >= self.generation(ns):
            return None
        return f"namespace {ns} was cleared after this save was planned (generation {generation}, now {self.generation(ns)})"

    def put_frames(
        self, ns: str, items: Sequence[p.ItemMeta], frames: Sequence[memoryview], generation: int | None = None
    ) -> tuple[list[bool], list[str | None]]:
        """Store payloads that arrived as frames (one per item)."""
        self._check_items(ns, items)
        _check_frames(items, frames)
        if stale := self._stale(ns, generation):
            return [False] * len(items), [stale] * len(items)
        stored: list[bool] = []
        errors: list[str | None] = []
        for part in p.split_by_bytes([it.size for it in items], self.max_object_bytes // 4):
            admitted: list[tuple[ChunkId, Obj, memoryview]] = []
            for i in part:
                cid = (ns, items[i].group, items[i].key)
                obj, ok, err = self._admit(cid, items[i].size)
                if obj is not None:
                    admitted.append((cid, obj, frames[i]))
                stored.append(ok)
                errors.append(err)
            sums = copy_all([self.l1.view(obj) for _, obj, _ in admitted], [frame for _, _, frame in admitted])
            for (cid, obj, _), cs in zip(admitted, sums):
                obj.checksum = cs
                self.l1.unlease(obj)
                self.l1.insert(cid, obj)
                self.metrics.bytes_in["tcp"].inc(obj.size)
        return stored, errors

    def reserve(self, ns: str, items: Sequence[p.ItemMeta], generation: int | None = None) -> p.Reserved:
        """First half of a shm put: arena slots under write leases."""
        self._check_items(ns, items)
        if stale := self._stale(ns, generation):
            return p.Reserved(slots=[None] * len(items), stored=[False] * len(items), errors=[stale] * len(items))
        slots: list[p.Slot | None] = []
        stored: list[bool] = []
        errors: list[str | None] = []
        for it in items:
            cid = (ns, it.group, it.key)
            obj, ok, err = self._admit(cid, it.size)
            slots.append(None if obj is None else p.Slot(self._lease(obj, cid), obj.offset, obj.size))
            stored.append(ok)
            errors.append(err)
        return p.Reserved(slots=slots, stored=stored, errors=errors)

    def commit(self, leases: Sequence[int], checksums: Sequence[int]) -> tuple[list[bool], list[str | None]]:
        """Second half of a shm put: the leased slots are filled; make them visible."""
        if len(leases) != len(checksums):
            raise p.BadRequest(f"{len(leases)} leases but {len(checksums)} checksums")
        p.check_items(len(leases))
        stored: list[bool] = []
        errors: list[str | None] = []
        for lease_id, cs in zip(leases, checksums):
            lease = self.leases.get(lease_id)
            if lease is None or lease.target is None:
                stored.append(False)
                errors.append("lease expired or unknown")
                continue
            del self.leases[lease_id]
            obj = lease.obj
            obj.checksum = cs
            self.l1.unlease(obj)
            if isinstance(lease.target[0], tuple):  # a tail's group
                tail = self.tails.get(lease.target[0])
                if tail is None or tail.objs.get(lease.target[1]) is not obj:
                    self.l1.discard(obj)  # expired or replaced meanwhile
                    stored.append(False)
                    errors.append("tail expired or replaced")
                    continue
                tail.pending -= 1
            else:
                self.l1.insert(lease.target, obj)
            self.metrics.bytes_in["shm"].inc(obj.size)
            stored.append(True)
            errors.append(None)
        return stored, errors

    def get(self, ns: str, refs: Sequence[p.ItemRef], shm: bool) -> LoadResult:
        """Find and lease each object (see `_loaded`); L2 hits are promoted into L1 first."""
        p.check_namespace(ns)
        p.check_items(len(refs))
        for ref in refs:
            p.check_group(ref.group)
            p.check_key(ref.key)
        out = LoadResult(found=[], shm=shm)
        for i, ref in enumerate(refs):
            cid = (ns, ref.group, ref.key)
            obj = self.l1.get(cid)
            tier = "l1"
            if obj is None and self.l2 is not None and self.l2.contains(cid):
                obj, tier = self._promote(cid), "l2"
                if obj is _NO_ROOM:
                    out.retry.append(i)
                    out.found.append(None)
                    continue
            if obj is None:
                self.metrics.misses.inc()
                out.found.append(None)
                continue
            self.metrics.hits.labels(tier).inc()
            out.found.append(self._loaded(obj, shm, out))
        return out

    def _loaded(self, obj: Obj, shm: bool, out: LoadResult) -> p.Found:
        """Lease `obj` to a load: until the client's Release (shm, with a deadline in case it vanishes),
        or until ZMQ has sent the frame (`sent`; a vanished peer's frames are dropped, which ends it too)."""
        obj.leases += 1
        out.objs.append(obj)
        self.metrics.bytes_out["shm" if shm else "tcp"].inc(obj.size)
        if not shm:
            self.sending += 1
            return p.Found(obj.id, obj.size, obj.checksum)
        lease = self._lease(obj, None)
        out.leases.append(lease)
        return p.Found(obj.id, obj.size, obj.checksum, lease, obj.offset)

    def sent(self, objs: Sequence[Obj]) -> None:
        """ZMQ is done with these objects' frames."""
        for obj in objs:
            self.sending -= 1
            self.l1.unlease(obj)

    def _promote(self, cid: ChunkId) -> Obj | None:
        """Copy an L2 object back into L1 (verifying it); None if corrupt, _NO_ROOM if L1 is all leased."""
        assert self.l2 is not None
        fresh: list[Obj] = []

        def into(size: int) -> memoryview | None:
            obj = self.l1.allocate(size) if size <= self.max_object_bytes else None
            if obj is None:
                return None
            fresh.append(obj)
            return self.l1.view(obj)

        try:
            cs = self.l2.read(cid, into)
        except L2Corrupt as exc:
            log.warning("L2 object dropped: %s", exc)
            self.metrics.corrupt.labels("l2").inc()
            for obj in fresh:
                self.l1.unlease(obj)
                self.l1.discard(obj)
            return None
        if cs is None:
            return _NO_ROOM
        obj = fresh[0]
        obj.checksum = cs
        self.l1.unlease(obj)
        return self.l1.insert(cid, obj)

    def release(self, leases: Sequence[int], corrupt: Sequence[p.Corrupt] = ()) -> None:
        """End read leases; drop objects a client found corrupt (if still the same object)."""
        for lease_id in leases:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.target is None:
                del self.leases[lease_id]
                self.l1.unlease(lease.obj)
        for c in corrupt:
            self.metrics.corrupt.labels("l1").inc()
            if not c.key:
                continue
            cid = (c.ns, c.group, c.key)
            obj = self.l1.get(cid, touch=False)
            if obj is not None and obj.id == c.obj:
                log.warning("dropping corrupt object %s/%d/%s", c.ns, c.group, c.key.hex())
                self.l1.remove(cid)

    def _lease(self, obj: Obj, target: ChunkId | tuple[TailKey, int] | None) -> int:
        lease_id = self._next_lease
        self._next_lease += 1
        self.leases[lease_id] = Lease(obj, self.clock() + self.cfg.lease_timeout_s, target)
        return lease_id

    # ------------------------------------------------------------ tails

    def _tail_ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None:
            return self.cfg.tail_ttl_s
        if not 0 < ttl_s <= MAX_TAIL_TTL_S:
            raise p.BadRequest(f"tail ttl {ttl_s} s out of range (0, {MAX_TAIL_TTL_S}]")
        return ttl_s

    def _new_tail(
        self, ns: str, request_id: str, items: Sequence[p.TailItem], ttl_s: float | None, generation: int | None
    ) -> Tail:
        """Allocate every group of a tail (all or nothing) and make it the request's tail."""
        p.check_namespace(ns)
        p.check_request_id(request_id)
        p.check_items(len(items))
        if not items:  # it would hold nothing, yet live for its TTL
            raise p.BadRequest("a tail lists no objects")
        if stale := self._stale(ns, generation):
            raise Conflict(stale)
        groups = [it.group for it in items]
        for g in groups:
            p.check_group(g)
        if len(set(groups)) != len(groups):
            raise p.BadRequest("a tail lists an object group twice")
        ttl = self._tail_ttl(ttl_s)
        tail = Tail(objs={}, deadline=self.clock() + ttl)
        for it in items:
            if it.size < 0:
                raise p.BadRequest(f"negative size {it.size}")
            obj = self.l1.allocate(it.size) if it.size <= self.max_object_bytes else None
            if obj is None:
                for o in tail.objs.values():
                    self.l1.unlease(o)
                    self.l1.discard(o)
                self.metrics.refused.inc()
                raise NoRoom(f"tail of request {request_id!r} does not fit in L1")
            tail.objs[it.group] = obj
        self.drop_tail(ns, request_id)
        self.tails[(ns, request_id)] = tail
        self.gone_tails.pop((ns, request_id), None)
        return tail

    def put_tail_frames(
        self, ns: str, request_id: str, items: Sequence[p.TailItem], frames: Sequence[memoryview], ttl_s: float | None,
        generation: int | None = None,
    ) -> None:
        _check_frames(items, frames)
        tail = self._new_tail(ns, request_id, items, ttl_s, generation)
        objs = [tail.objs[it.group] for it in items]
        for obj, cs in zip(objs, copy_all([self.l1.view(obj) for obj in objs], frames)):
            obj.checksum = cs
            self.l1.unlease(obj)
            self.metrics.bytes_in["tcp"].inc(obj.size)

    def reserve_tail(
        self, ns: str, request_id: str, items: Sequence[p.TailItem], ttl_s: float | None, generation: int | None = None
    ) -> p.Reserved:
        tail = self._new_tail(ns, request_id, items, ttl_s, generation)
        tail.pending = len(items)
        slots: list[p.Slot | None] = []
        for it in items:
            obj = tail.objs[it.group]
            slots.append(p.Slot(self._lease(obj, ((ns, request_id), it.group)), obj.offset, obj.size))
        return p.Reserved(slots=slots, stored=[True] * len(items), errors=[None] * len(items))

    def get_tail(self, ns: str, request_id: str, shm: bool) -> tuple[list[int], LoadResult] | None:
        """Load and release the tail; None if there is none (or it is still being written)."""
        p.check_namespace(ns)
        p.check_request_id(request_id)
        tail = self.tails.get((ns, request_id))
        if tail is None or tail.pending:
            self.metrics.misses.inc()
            return None
        del self.tails[(ns, request_id)]
        self._bury((ns, request_id))
        out = LoadResult(found=[], shm=shm)
        for obj in tail.objs.values():
            self.metrics.hits.labels("tail").inc()
            out.found.append(self._loaded(obj, shm, out))
            self.l1.discard(obj)  # freed when the lease ends
        return list(tail.objs), out

    def drop_tail(self, ns: str, request_id: str) -> None:
        p.check_namespace(ns)
        p.check_request_id(request_id)
        tail = self.tails.pop((ns, request_id), None)
        if tail is not None:
            self._bury((ns, request_id))
            for obj in tail.objs.values():
                self.l1.discard(obj)

    def clear(self, ns: str) -> int:
        """Drop every object and tail of `ns` (L1, L2, tails) and advance its generation; answer how many
        objects went. A leased object's bytes stay until its transfer ends, as for any removal; a write
        reserved before the clear is not committed."""
        p.check_namespace(ns)
        if ns not in self.generations and len(self.generations) >= MAX_NAMESPACES:
            raise NoRoom(f"{MAX_NAMESPACES} namespaces were cleared already: no room to clear another")
        self.generations[ns] = self.generation(ns) + 1
        for lease_id, lease in list(self.leases.items()):
            if lease.target is not None and _namespace_of(lease.target) == ns:
                del self.leases[lease_id]
                self.l1.unlease(lease.obj)
                self.l1.discard(lease.obj)
        chunks = [cid for cid in self.l1.index if cid[0] == ns]
        for cid in chunks:
            self.l1.remove(cid)
        spilled = self.l2.drop_namespace(ns) if self.l2 is not None else 0
        tails = [key for key in self.tails if key[0] == ns]
        for key in tails:
            self.drop_tail(*key)
        self.refresh_gauges()  # at once, not at the next upkeep: whoever cleared may look next
        return len(chunks) + spilled + len(tails)

    def _bury(self, key: TailKey) -> None:
        """Remember that this tail is gone (see GONE_TAIL_KEEP_S)."""
        self.gone_tails[key] = self.clock() + GONE_TAIL_KEEP_S
        self.gone_tails.move_to_end(key)
        while len(self.gone_tails) > GONE_TAILS_MAX:
            self.gone_tails.popitem(last=False)

    # ------------------------------------------------------------ upkeep

    def expire(self) -> None:
        """Drop tails past their TTL and leases past their deadline (clients that vanished mid-transfer)."""
        now = self.clock()
        for key in [k for k, t in self.tails.items() if t.deadline <= now]:
            self.drop_tail(*key)
        while self.gone_tails and next(iter(self.gone_tails.values())) <= now:
            self.gone_tails.popitem(last=False)
        while self.leases:
            lease_id, lease = next(iter(self.leases.items()))
            if lease.deadline > now:
                break
            del self.leases[lease_id]
            self.l1.unlease(lease.obj)
            if lease.target is not None:  # a write never committed: the bytes are not trustworthy
                self.l1.discard(lease.obj)
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.tier_bytes.labels("l1").set(self.l1.used_bytes)
        m.tier_objects.labels("l1").set(self.l1.live_objects)
        if self.l2 is not None:
            m.tier_bytes.labels("l2").set(self.l2.used_bytes)
            m.tier_objects.labels("l2").set(len(self.l2.index))
        m.live_tails.set(len(self.tails))
        m.leases.set(len(self.leases) + self.sending)

    def _spill(self, cid: ChunkId, obj: Obj) -> None:
        self.metrics.evictions.labels("l1").inc()
        if self.l2 is not None:
            self._write_l2(cid, obj)

    def _write_l2(self, cid: ChunkId, obj: Obj) -> bool:
        """Copy an L1 object to L2; a failed write drops the object (logged and counted)."""
        assert self.l2 is not None
        try:
            self.l2.write(cid, self.l1.view(obj), obj.checksum)
        except OSError as exc:
            log.warning("L2 write failed, object dropped: %s", exc)
            self.metrics.errors.labels("l2_write").inc()
            return False
        return True

    def _l2_evicted(self, cid: ChunkId) -> None:
        self.metrics.evictions.labels("l2").inc()


def _check_frames(items: Sequence[p.ItemMeta | p.TailItem], frames: Sequence[memoryview]) -> None:
    if len(frames) != len(items):
        raise p.BadRequest(f"truncated message: {len(items)} items but {len(frames)} payload frames")
    for i, (it, frame) in enumerate(zip(items, frames)):
        if len(frame) != it.size:
            raise p.BadRequest(f"item {i}: header says {it.size} bytes, frame has {len(frame)}")


def _namespace_of(target: ChunkId | tuple[TailKey, int]) -> str:
    """The namespace of a write lease's target: a chunk (ns, group, key) or a tail's group ((ns, request id), group)."""
    first = target[0]
    return first[0] if isinstance(first, tuple) else first
