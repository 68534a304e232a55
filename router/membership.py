"""The router's view of worker membership in Redis: pub/sub for promptness, a rescan for expiry.

Workers keep their records alive themselves (pdserve/worker/registration.py, which also
holds the contract: key prefix, channel, record format); this module only reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import msgspec
import redis
import redis.asyncio as aioredis

from pdserve.worker.registration import CHANNEL, DEFAULT_TTL_S, KEY_PREFIX, WorkerRecord, decode_record, event_decoder

log = logging.getLogger("pdserve.router.membership")

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
                        event_decoder.decode(message["data"])
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
