"""Worker registration in Redis: the record a worker keeps alive, and the contract routers read.

Why TTL keys plus pub/sub: a worker that exits cleanly DELetes its key and publishes
`leave`, so the router drops it at once; a worker killed with SIGKILL can say nothing,
so its key simply expires and the router's periodic rescan notices within one TTL.
Records are JSON (msgspec), never pickles, because they cross a network.

Contract shared with the worker launchers:
- key `pdserve:worker:<id>` holds a JSON `WorkerRecord`, set with `EX ttl`;
- the `Registrar` refreshes it every ttl/3 and publishes `join`/`leave` on
  channel `pdserve:membership`;
- the router's `MembershipWatcher` (router/membership.py) subscribes to that channel
  and rescans `pdserve:worker:*` every `rescan_s`.

And one the other way: a router that finds a worker's engine making no progress while its
server answers /health (router/stall_watch.py) keeps `pdserve:stalled:<id>` set, a JSON
`StallReport` naming that engine's registration, with `EX` a few canary rounds, and deletes it
once the engine answers again. The worker's supervisor reads it each heartbeat and restarts
vLLM when it lasts (worker/supervisor.py): the router alone cannot restart anything.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Literal

import msgspec
import redis

from pdserve.kvstore.client.lmcache_mp import LMCacheKey

log = logging.getLogger("pdserve.worker.registration")

KEY_PREFIX = "pdserve:worker:"
STALL_PREFIX = "pdserve:stalled:"
CHANNEL = "pdserve:membership"
DEFAULT_TTL_S = 10.0

Role = Literal["prefill", "decode"]


class WorkerRecord(msgspec.Struct):
    """What a worker tells the router about itself."""

    id: str
    role: Role
    url: str  # http base URL of the vLLM OpenAI server, e.g. http://10.0.0.5:8100
    model: str  # served model name
    kvstore_url: str | None = None  # the URL of its KV backend: a pdserve store or an LMCache server
    kv_backend: Literal["pdserve", "lmcache"] = "pdserve"
    lmcache_key: LMCacheKey | None = None  # what the LMCache server keys its chunks by (router lookups)
    load: dict[str, int] = msgspec.field(default_factory=dict)  # e.g. {"running": 2, "waiting": 0}
    started_at: float = msgspec.field(default_factory=time.time)


class MembershipEvent(msgspec.Struct):
    """The pub/sub message; the record rides along so a join needs no extra round trip."""

    event: Literal["join", "leave"]
    id: str
    record: WorkerRecord | None = None


class StallReport(msgspec.Struct):
    """A router's word that a worker's engine answers nothing it was sent."""

    started_at: float  # the `WorkerRecord.started_at` of the registration it was seen under: one vLLM's life
    reason: str  # what the router saw, for the worker's log


_record_decoder = msgspec.json.Decoder(WorkerRecord)
_stall_decoder = msgspec.json.Decoder(StallReport)
event_decoder = msgspec.json.Decoder(MembershipEvent)  # what routers read from the channel


def new_worker_id(role: Role) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


def worker_key(worker_id: str) -> str:
    return KEY_PREFIX + worker_id


def stall_key(worker_id: str) -> str:
    return STALL_PREFIX + worker_id


def decode_record(raw: bytes | str) -> WorkerRecord | None:
    """A record from Redis, or None (logged) when the bytes are not a valid record."""
    try:
        return _record_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("ignoring malformed worker record: %s", exc)
        return None


class Registrar:
    """Keeps one worker's record alive in Redis from a daemon thread.

    A thread (not a task) so it works the same from a plain script, a process that
    runs vLLM's own event loop, or async code: every method is cheap and thread-safe,
    and the async helpers `astart`/`astop` just move the blocking calls off the loop.
    Redis being down is not fatal: the heartbeat logs and retries, and the record
    reappears once Redis is back.
    """

    def __init__(self, redis_url: str, record: WorkerRecord, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.record = record
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=max(1.0, ttl_s / 3))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return worker_key(self.record.id)

    def _write(self) -> None:
        with self._lock:
            payload = msgspec.json.encode(self.record)
        self._redis.set(self.key, payload, px=int(self.ttl_s * 1000))

    def _publish(self, event: Literal["join", "leave"]) -> None:
        with self._lock:
            msg = MembershipEvent(event=event, id=self.record.id, record=self.record if event == "join" else None)
            payload = msgspec.json.encode(msg)
        self._redis.publish(CHANNEL, payload)

    def _heartbeat(self) -> None:
        announced = False
        while not self._stop.wait(0 if not announced else self.ttl_s / 3):
            try:
                self._write()
                if not announced:
                    self._publish("join")
                    announced = True
                    log.info("registered %s %s at %s", self.record.role, self.record.id, self.record.url)
            except redis.RedisError as exc:
                log.warning("heartbeat for %s failed (retrying): %s", self.record.id, exc)
                if self._stop.wait(min(1.0, self.ttl_s / 3)):
                    return
                # Re-announce once Redis answers again: the watcher may have dropped us.
                announced = False

    def start(self) -> None:
        """Register now (first write happens on the thread at once) and keep the key alive."""
        if self._thread is not None:
            raise RuntimeError("Registrar already started")
        self._thread = threading.Thread(target=self._heartbeat, name=f"registrar-{self.record.id}", daemon=True)
        self._thread.start()

    def update_load(self, **load: int) -> None:
        """Replace the advertised load; the next heartbeat carries it."""
        with self._lock:
            self.record.load = {k: int(v) for k, v in load.items()}

    def stall_report(self) -> StallReport | None:
        """A router's live report that this registration's engine is stalled, or None (also when Redis
        cannot be read, or the report belongs to an earlier vLLM of this worker)."""
        try:
            raw = self._redis.get(stall_key(self.record.id))
        except redis.RedisError as exc:
            log.warning("reading stall reports for %s failed: %s", self.record.id, exc)
            return None
        if raw is None:
            return None
        try:
            report = _stall_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring malformed stall report for %s: %s", self.record.id, exc)
            return None
        return report if report.started_at == self.record.started_at else None

    def stop(self) -> None:
        """Stop heartbeating, delete the key and publish `leave` so routers drop us at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            self._redis.delete(self.key, stall_key(self.record.id))  # a report was about this registration
            self._publish("leave")
            log.info("deregistered %s", self.record.id)
        except redis.RedisError as exc:
            log.warning("deregistering %s failed (the key expires in %.0f s): %s", self.record.id, self.ttl_s, exc)
        finally:
            self._redis.close()

    async def astart(self) -> None:
        await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)
