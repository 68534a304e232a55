"""The worker half of PDServeConnector: moves KV bytes between the paged cache and the store.

Saves gather the blocks out of the paged cache inside `wait_for_save` (so the blocks
are free as soon as the step ends) and upload on a background thread. Loads run on
a few background threads, so one request waiting for its producer's upload (or for
a store that stopped answering) holds up no other: fetch the objects, check every
size, scatter into the blocks vLLM allocated, then report the request as received.
The scatter reads each payload where the store client has it (a same-host store's
arena, leased while the copy runs; or the received frames), so a load copies its
bytes once on the host side at most (host_pins.py: none, on CUDA).
A missing or corrupt object is a load error for exactly the blocks it covers, never
data. Every store is a fault domain (kvstore/client/health.py): a store that misses a deadline
is marked down, and loads and saves on it fail at once until it answers again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvstore.client.client import KVStoreClient, KVStoreError, KVStoreUnavailable
from pdserve.kvstore.connector.cache import GroupCache, Pinner
from pdserve.kvstore.connector.host_pins import pins_of
from pdserve.kvstore.connector.plan import UNALLOCATED, ObjectSpec, TransferJob
from pdserve.kvstore.connector.counters import StatsCounter
from pdserve.kvstore.client.health import StoreDown, StoreHealth, health_of

log = logging.getLogger("pdserve.connector")

# Loaded payloads are read-only views over received frames; torch only reads them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

# A decode leg can arrive while its producer is still uploading: the store holds an Await
# until the upload lands, in slices of this long (a dead store is noticed after one slice
# plus the reply deadline, not after the whole handoff wait).
AWAIT_SLICE_S = 0.5
# How long an idle step (nothing scheduled, loads in flight) may wait for a load to finish.
# vLLM steps without pause while a request waits for its KV; each empty step holds the
# GIL, starving the load thread (measured: a 3 ms fetch took 20-130 ms to be reported,
# 7-84 empty steps later). Waiting on the outcome queue hands the CPU to the load and
# reports it the moment it lands; the bound keeps a new arrival's wait short.
IDLE_WAIT_S = 0.01
NULL_BLOCK = 0
# Loads in progress at once (each thread has its own clients).
LOAD_THREADS = 4
# How long a failed P/D handoff save is kept for another upload once its store answers again
# (the decode side's default wait for a producer's upload, handoff_wait_s), and how often the
# save thread looks whether the store is back meanwhile.
SAVE_RETRY_S = 10.0
RETRY_POLL_S = 0.1


@dataclass
class _PendingSave:
    job: TransferJob
    buffers: list[torch.Tensor]
    deadline: float  # monotonic time after which a failed handoff save is given up
    retried: bool = False


def _log_failure(exc: Exception, what: str) -> None:
    """A store error is an expected failure (one line); anything else is a bug (with its traceback)."""
    if isinstance(exc, KVStoreError):
        log.warning("%s: %s", what, exc)
    else:
        log.exception("%s: unexpected error", what)


def _by_group(objects: list[ObjectSpec]) -> dict[int, list[int]]:
    """Indexes of `objects` per KV group, in order."""
    groups: dict[int, list[int]] = {}
    for i, spec in enumerate(objects):
        groups.setdefault(spec.group, []).append(i)
    return groups


def _targets(spec: ObjectSpec) -> list[int]:
    """The blocks a load of `spec` writes."""
    return [b for b in spec.block_ids[spec.skip_blocks:] if b != UNALLOCATED]


@dataclass
class LoadOutcome:
    req_id: str
    failed_block_ids: set[int] = field(default_factory=set)
    ok: bool = True
    loaded_bytes: int = 0


class WorkerIO:
    """Background save and load threads for one worker process, each with its own clients."""

    def __init__(
        self,
        client_args: dict[str, Any],
        namespace: str,
        groups: list[GroupCache],
        writes: bool,
        reads: bool = False,
    ):
        self.client_args = client_args
        self.namespace = namespace
        self.groups = groups
        self.writes = writes
        self._saves: queue.Queue[tuple[TransferJob, list[torch.Tensor]] | None] = queue.Queue()
        self._loads: queue.Queue[tuple[TransferJob, float] | None] = queue.Queue()  # (job, when handed over)
        self._done: queue.Queue[LoadOutcome] = queue.Queue()
        self.stats = StatsCounter()
        self._cuda = any(group.cuda for group in groups)
        self._write_lock = threading.Lock()  # one scatter into the paged cache at a time
        self._foreign_stores: set[tuple[str | None, str]] = set()  # (url, id) mismatches already logged
        self._in_flight = 0  # loads handed to the load threads and not yet reported
        self._threads = [threading.Thread(target=self._save_loop, name="pdserve-save", daemon=True)] + [
            threading.Thread(target=self._load_loop, args=(reads and i == 0,), name=f"pdserve-load-{i}", daemon=True)
            for i in range(LOAD_THREADS)
        ]
        for t in self._threads:
            t.start()

    def _map_store_arena(self, clients: dict[str | None, KVStoreClient]) -> None:
        """Map our same-host store's arena, fault its pages in and, on CUDA, page-lock it while the
        engine is still starting, not at the first loads: on the H200 host those copied into the
        paged cache in 13 ms (2k tokens) and 173 ms (8k) while the arena was being registered, 2.0 ms
        (2k) once it was, and a 32k load's fetch spent most of its 27 ms mapping fresh pages. The
        client is the load thread's own, so a store restart remaps it as for any load (a client
        kept aside would hold the dead store's arena, and its memory, for good)."""
        client = clients[None] = self._client()
        try:
            client.info()
        except Exception as exc:  # the store may start later: then the first load maps it
            log.debug("kvstore %s not reachable at start (%s): its arena is mapped on first load", client.url, exc)
            return
        if client.arena is not None:  # None: another host's store, or TCP only
            client.arena.populate()
            if self._cuda:
                pins_of(client.arena)

    def _client(self, url: str | None = None) -> KVStoreClient:
        """A client of our store, or of `url` (a producer's store on another node)."""
        return KVStoreClient(**self._args(url))

    def _args(self, url: str | None) -> dict[str, Any]:
        return self.client_args if url is None else {**self.client_args, "url": url}

    # saves ----------------------------------------------------------------
    def save(self, job: TransferJob) -> None:
        """Copy the job's blocks out now (they may be reused after this step), upload later."""
        if not self.writes:
            return
        # Block 0 is vLLM's null block: a sliding-window group's released blocks point
        # there. An object over it holds no KV, so it is not saved (a later lookup just
        # stops at that chunk).
        job.objects = [o for o in job.objects if NULL_BLOCK not in o.block_ids]
        buffers: list[torch.Tensor] = [torch.empty(0)] * len(job.objects)
        for group, members in _by_group(job.objects).items():  # one copy-out per group, not per object
            gathered = self.groups[group].gather_objects([job.objects[i].block_ids for i in members])
            for i, buf in zip(members, gathered):
                buffers[i] = buf
        self._saves.put((job, buffers))

    def _save_loop(self) -> None:
        """Upload saves in order. A P/D handoff's save that fails while the store blinks (its decode
        worker may be waiting for exactly these objects: an overlapped decode leg waits for as long
        as a prefill may take) is kept and uploaded again as soon as the store answers, for up to
        SAVE_RETRY_S; other failed saves only cost a later recompute and are dropped."""
        client: KVStoreClient | None = None
        health = health_of(self.client_args)
        waiting: deque[_PendingSave] = deque()  # handoff saves that failed, oldest first
        while True:
            todo: list[_PendingSave] = []
            try:
                item = self._saves.get(timeout=RETRY_POLL_S if waiting else None)
                if item is None:
                    return
                todo.append(_PendingSave(*item, deadline=time.monotonic() + SAVE_RETRY_S))
            except queue.Empty:  # nothing new: see whether the store is back for the waiting ones
                pass
            while waiting and waiting[0].deadline <= time.monotonic():
                self._lost(waiting.popleft())
            if waiting and health.up:
                todo[:0], waiting = list(waiting), deque()
            for save in todo:
                try:
                    with health.guard():
                        client = client or self._client()
                        self._upload(client, save.job, save.buffers)
                    self.stats.add(saved_bytes=sum(b.numel() for b in save.buffers), saves_retried=int(save.retried))
                except Exception as exc:  # a dead save thread would cost every save
                    if not isinstance(exc, StoreDown):  # (a store marked down was logged once when it went down)
                        _log_failure(exc, f"save of {save.job.req_id} failed")
                        if client is not None:
                            client.close()
                        client = None
                    if save.job.handoff and isinstance(exc, KVStoreUnavailable) and time.monotonic() < save.deadline:
                        save.retried = True
                        waiting.append(save)
                    elif save.job.handoff:
                        self._lost(save)

    def _lost(self, save: "_PendingSave") -> None:
        log.warning("handoff save of %s lost: its decode recomputes", save.job.req_id)
        self.stats.add(saves_lost=1)

    def _upload(self, client: KVStoreClient, job: TransferJob, buffers: list[torch.Tensor]) -> None:
        chunks = [(o.group, o.key, b.numpy()) for o, b in zip(job.objects, buffers) if o.key is not None]
        if chunks:
            stored = client.put(self.namespace, chunks, job.generation)
            if not all(stored):
                log.warning("store refused %d of %d chunks of %s", stored.count(False), len(stored), job.req_id)
        tail = [(o.group, b.numpy()) for o, b in zip(job.objects, buffers) if o.key is None]
        if tail and job.tail_id:
            client.put_tail(self.namespace, job.tail_id, tail, generation=job.generation)

    # loads ----------------------------------------------------------------
    def load(self, job: TransferJob) -> None:
        self._in_flight += 1
        self._loads.put((job, time.perf_counter()))

    def finished_loads(self, wait_s: float = 0.0) -> list[LoadOutcome]:
        """Loads done since the last call; with `wait_s`, wait that long for one when some are in flight."""
        out = []
        if wait_s > 0 and self._in_flight:
            try:
                out.append(self._done.get(timeout=wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                self._in_flight -= len(out)
                return out

    def _load_loop(self, map_arena: bool) -> None:
        # One client per store: a P/D handoff loads from the store its producer wrote
        # to (named in kv_transfer_params), which may be another node's.
        clients: dict[str | None, KVStoreClient] = {}
        if map_arena:
            self._map_store_arena(clients)
        while (item := self._loads.get()) is not None:
            job, handed = item
            self.stats.add(load_queue_seconds=time.perf_counter() - handed)
            self._done.put(self._load_guarded(clients, job))

    def _load_guarded(self, clients: dict[str | None, KVStoreClient], job: TransferJob) -> LoadOutcome:
        """Load one job unless its store is down; whatever fails, the request is recomputed, never left waiting."""
        health = health_of(self._args(job.store_url))
        outcome = LoadOutcome(job.req_id, {b for o in job.objects for b in _targets(o)}, False)  # until loaded
        timed_out = store_down = False
        # our own store's client, whether the job names it or not (the one that maps its arena at start)
        key = None if job.store_url == self.client_args.get("url") else job.store_url
        try:
            with health.guard():
                if key not in clients:
                    clients[key] = self._client(job.store_url)
                outcome = self._load_one(clients[key], job, health)
        except StoreDown as exc:  # logged once when it went down
            log.debug("load of %s not tried, vLLM recomputes it: %s", job.req_id, exc)
            store_down = True
        except Exception as exc:
            _log_failure(exc, f"load of {job.req_id} failed, vLLM recomputes it")
            timed_out = isinstance(exc, KVStoreUnavailable)
            stale = clients.pop(key, None)
            if stale is not None:
                stale.close()
        self.stats.add(
            loads=1, failed_loads=int(not outcome.ok), loaded_bytes=outcome.loaded_bytes,
            store_timeouts=int(timed_out), loads_store_down=int(store_down),
        )
        return outcome

    def _wait_budget(self, client: KVStoreClient, job: TransferJob) -> float:
        """How long to wait for a producer's upload: job.wait_s, or 0 when the store at the URL is not
        the producer's (e.g. the producer advertised tcp://127.0.0.1:5556 from another host). Its objects
        are still valid KV (keys hash the tokens), but nothing the producer promised will arrive there."""
        found = client.info().store_id
        if not job.store_id or not found or found == job.store_id:
            return job.wait_s
        if (job.store_url, job.store_id) not in self._foreign_stores:
            self._foreign_stores.add((job.store_url, job.store_id))
            log.warning(
                "kvstore %s is %s, not the producer's store %s (set the producer store's --advertise-url): "
                "loading what it has without waiting", client.url, found, job.store_id,
            )
        return 0.0

    def _load_one(self, client: KVStoreClient, job: TransferJob, health: StoreHealth) -> LoadOutcome:
        """Fetch every object, waiting up to job.wait_s for ones a producer is still uploading, and
        scatter what each round finds into the paged cache straight from where the client has it."""
        deadline = time.monotonic() + self._wait_budget(client, job)  # (its info() maps a same-host arena)
        pins = pins_of(client.arena).pieces if client.arena is not None and self._cuda else None
        outcome = LoadOutcome(job.req_id)
        done = [False] * len(job.objects)  # loaded, or found unusable: not asked for again
        refs = {i: (o.group, o.key) for i, o in enumerate(job.objects) if o.key is not None}  # the chunks
        chunk_idx = list(refs)
        tail_of_group = {job.objects[i].group: i for i, o in enumerate(job.objects) if o.key is None}
        tail_pending = bool(tail_of_group and job.tail_id)
        waits, start, scatter_s = 0, time.perf_counter(), 0.0

        def scatter(indexes: list[int], views: list[memoryview]) -> None:
            nonlocal scatter_s
            t = time.perf_counter()
            self._scatter_found(job, indexes, views, outcome, done, pins)
            scatter_s += time.perf_counter() - t

        while True:
            health.check()  # another load may have found the store dead meanwhile
            missing = [i for i in chunk_idx if not done[i]]
            if missing:
                client.read(self.namespace, [refs[i] for i in missing],
                            lambda pos, views: scatter([missing[j] for j in pos], views))
            if tail_pending and client.read_tail(self.namespace, job.tail_id or "",
                                                 lambda groups, views: scatter([tail_of_group[g] for g in groups], views)):
                tail_pending = False
            left = deadline - time.monotonic()
            if (all(done[i] for i in chunk_idx) and not tail_pending) or left <= 0:
                break
            # The producer is still uploading: the store answers when the rest has landed. In slices,
            # so a store that dies meanwhile is noticed within about a reply deadline.
            still = [refs[i] for i in chunk_idx if not done[i]]
            ready = client.await_ready(self.namespace, still, job.tail_id if tail_pending else None,
                                       min(left, AWAIT_SLICE_S))
            waits += 1
            if ready.tail_gone:  # loaded by another engine or dropped: it will not come, so load no longer
                tail_pending = False
        self.stats.add(load_fetch_seconds=time.perf_counter() - start - scatter_s, load_fetch_waits=waits)
        for i, spec in enumerate(job.objects):
            if not done[i]:  # missing (or its tail never came): vLLM recomputes those blocks
                outcome.ok = False
                outcome.failed_block_ids.update(_targets(spec))
        if not outcome.ok:
            log.warning("load of %s: %d blocks missing or corrupt, vLLM recomputes them", job.req_id, len(outcome.failed_block_ids))
        return outcome

    def _scatter_found(self, job: TransferJob, indexes: list[int], views: list[memoryview], outcome: LoadOutcome,
                       done: list[bool], pins: Pinner | None) -> None:
        """Write the objects a read found (verified, still leased) into their blocks, complete on return."""
        usable = []
        for i, data in zip(indexes, views):
            if self._usable(job.objects[i], data):
                usable.append((i, data))
            else:
                outcome.ok = False
                outcome.failed_block_ids.update(_targets(job.objects[i]))
        with self._write_lock:  # one group's objects in one copy-in
            for group, members in _by_group([job.objects[i] for i, _ in usable]).items():
                chosen = [usable[m] for m in members]
                self.groups[group].scatter_objects(
                    [(data, job.objects[i].block_ids, job.objects[i].skip_blocks) for i, data in chosen], pins
                )
                outcome.loaded_bytes += sum(len(data) for _, data in chosen)
        for i in indexes:
            done[i] = True

    def _usable(self, spec: ObjectSpec, data: memoryview | None) -> bool:
        """A fetched object may be written: present, over real blocks, and of the size its blocks hold."""
        if data is None or NULL_BLOCK in _targets(spec):
            return False
        expected = self.groups[spec.group].object_bytes(len(spec.block_ids))
        if len(data) != expected:
            log.warning("object of group %d has %d bytes, expected %d", spec.group, len(data), expected)
            return False
        return True

    def close(self) -> None:
        self._saves.put(None)
        for _ in range(LOAD_THREADS):
            self._loads.put(None)
        for t in self._threads:
            t.join(timeout=5)
