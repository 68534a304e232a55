"""Worker discovery through Redis: workers register with a TTL, the router follows membership.

Why TTL keys plus pub/sub: a worker that exits cleanly DELetes its key and publishes
`leave`, so the router drops it at once; a worker killed with SIGKILL can say nothing,
so its key simply expires and the router's periodic rescan notices within one TTL.
Records are JSON (msgspec), never pickles, because they cross a network.

Contract shared with the worker launchers:
- key `pdserve:worker:<id>` holds a JSON `WorkerRecord`, set with `EX ttl`;
- the `Registrar` refreshes it every ttl/3 and publishes `join`/`leave` on
  channel `pdserve:membership`;
- the router's `MembershipWatcher` subscribes to that channel and rescans
  `pdserve:worker:*` every `rescan_s`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Awaitable, Callable, Literal

import msgspec
import redis
import redis.asyncio as aioredis

log = logging.getLogger("pdserve.router.discovery")

KEY_PREFIX = "pdserve:worker:"
CHANNEL = "pdserve:membership"
DEFAULT_TTL_S = 10.0

Role = Literal["prefill", "decode"]


class WorkerRecord(msgspec.Struct):
    """What a worker tells the router about itself."""

    id: str
    role: Role
    url: str  # http base URL of the vLLM OpenAI server, e.g. http://10.0.0.5:8100
    model: str  # served model name
    kvstore_url: str | None = None
    load: dict[str, int] = msgspec.field(default_factory=dict)  # e.g. {"running": 2, "waiting": 0}
    started_at: float = msgspec.field(default_factory=time.time)


class MembershipEvent(msgspec.Struct):
    """The pub/sub message; the record rides along so a join needs no extra round trip."""

    event: Literal["join", "leave"]
    id: str
    record: WorkerRecord | None = None


_record_decoder = msgspec.json.Decoder(WorkerRecord)
_event_decoder = msgspec.json.Decoder(MembershipEvent)


def new_worker_id(role: Role) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


def worker_key(worker_id: str) -> str:
    return KEY_PREFIX + worker_id


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

    def stop(self) -> None:
        """Stop heartbeating, delete the key and publish `leave` so routers drop us at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            self._redis.delete(self.key)
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


OnChange = Callable[[dict[str, WorkerRecord]], Awaitable[None] | None]


class MembershipWatcher:
    """Follows the live set of workers: pub/sub for promptness, a rescan for expiry.

    `on_change` gets the full current membership (id -> record) whenever it changes,
    including a load-only change, so the caller can reconcile without tracking events.
    `model`, when given, keeps only workers that serve that model name.
    """

    def __init__(
        self,
        redis_url: str,
        on_change: OnChange,
        *,
        model: str | None = None,
        rescan_s: float = 1.0,
        grace_s: float = DEFAULT_TTL_S,
    ) -> None:
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=5.0)
        self._on_change = on_change
        self._model = model
        self._rescan_s = rescan_s
        # After Redis was unreachable it may come back empty (restarted): workers rewrite their
        # records on their next heartbeat (a third of their TTL). Until `grace_s` after it answers
        # again, a worker missing from a scan is kept, so a Redis restart takes no worker out;
        # their health checks still do if they are down.
        self._grace_s = grace_s
        self._redis_back_at: float | None = None  # monotonic; None while Redis has not failed
        self._redis_failed = False
        self.records: dict[str, WorkerRecord] = {}
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._closed = False

    def _wanted(self, rec: WorkerRecord) -> bool:
        return self._model is None or rec.model == self._model

    async def scan(self) -> dict[str, WorkerRecord]:
        """Read every live record from Redis (keys whose TTL has not run out)."""
        keys = [k async for k in self._redis.scan_iter(match=KEY_PREFIX + "*", count=256)]
        if not keys:
            return {}
        found: dict[str, WorkerRecord] = {}
        for raw in await self._redis.mget(keys):
            if raw is None:
                continue
            rec = decode_record(raw)
            if rec is not None and self._wanted(rec):
                found[rec.id] = rec
        return found

    async def _apply(self, found: dict[str, WorkerRecord]) -> None:
        if found == self.records:
            return
        joined = found.keys() - self.records.keys()
        left = self.records.keys() - found.keys()
        for wid in joined:
            log.info("worker joined: %s %s %s", found[wid].role, wid, found[wid].url)
        for wid in left:
            log.info("worker left: %s", wid)
        self.records = found
        result = self._on_change(dict(found))
        if asyncio.iscoroutine(result):
            await result

    async def _rescan_loop(self) -> None:
        # Loops end on `_closed`, not only on cancellation: redis-py can swallow a cancel
        # that lands inside a command, and stop() must never wait forever.
        while not self._closed:
            try:
                found = await self.scan()
                if self._redis_failed:
                    self._redis_failed, self._redis_back_at = False, time.monotonic()
                if self._redis_back_at is not None and time.monotonic() - self._redis_back_at < self._grace_s:
                    found = {**{k: v for k, v in self.records.items() if k not in found}, **found}
                await self._apply(found)
            except (redis.RedisError, OSError) as exc:
                self._redis_failed = True
                log.warning("membership rescan failed (keeping last view): %s", exc)
            try:
                async with asyncio.timeout(self._rescan_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def _subscribe(self) -> aioredis.client.PubSub:
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(CHANNEL)
        return pubsub

    async def _listen_loop(self, pubsub: aioredis.client.PubSub | None) -> None:
        while not self._closed:
            try:
                pubsub = pubsub or await self._subscribe()
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        _event_decoder.decode(message["data"])
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        log.warning("ignoring malformed membership message")
                        continue
                    # A rescan applies the event and anything else that changed meanwhile.
                    self._wake.set()
            except (redis.RedisError, OSError) as exc:
                log.warning("membership subscription lost (resubscribing): %s", exc)
                await asyncio.sleep(self._rescan_s)
            finally:
                if pubsub is not None:
                    await pubsub.aclose()
                pubsub = None

    async def start(self) -> None:
        """Subscribe and load the current membership before returning, then follow it.

        Subscribing first means a worker that registers right after start() is seen
        through its `join` message, not only by the next rescan.
        """
        pubsub: aioredis.client.PubSub | None = None
        try:
            pubsub = await self._subscribe()
            await self._apply(await self.scan())
        except (redis.RedisError, OSError) as exc:
            log.warning("initial membership scan failed (will retry): %s", exc)
        self._tasks = [
            asyncio.create_task(self._rescan_loop(), name="membership-rescan"),
            asyncio.create_task(self._listen_loop(pubsub), name="membership-listen"),
        ]

    async def stop(self) -> None:
        self._closed = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # bounded: a loop blocked in a command that ate its cancel must not block shutdown
            await asyncio.wait(self._tasks, timeout=5.0)
        self._tasks = []
        await self._redis.aclose()
