"""Telling a stalled worker's supervisor, through Redis, that its engine answers nothing.

The router can take a stalled worker out of its pool (stall_watch.py) but not restart it: only the
worker's supervisor can, and it sees an engine whose server answers /health as healthy. So while a
worker stays stalled, the router keeps a report in Redis (the contract is in
pdserve/worker/registration.py: `StallReport` under `stall_key(id)`) and deletes it once the worker
answers again; a report whose router died expires. Only workers that registered through Redis get
one: a static worker has no supervisor listening.
"""

from __future__ import annotations

import logging

import msgspec
import redis
import redis.asyncio as aioredis

from pdserve.router.pool import Worker
from pdserve.worker.registration import StallReport, stall_key

log = logging.getLogger("pdserve.router.stall_reports")


class StallReports:
    """The reports one router keeps for the workers it finds stalled."""

    def __init__(self, redis_url: str, ttl_s: float) -> None:
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=5.0)
        self.ttl_s = ttl_s  # outlives the gap between two refreshes (one canary round)

    async def refresh(self, w: Worker, reason: str) -> None:
        """Say (again) that `w` is stalled, over any report of an earlier vLLM of the same worker."""
        if w.started_at is None:
            return
        payload = msgspec.json.encode(StallReport(started_at=w.started_at, reason=reason))
        try:
            await self._redis.set(stall_key(w.id), payload, px=int(self.ttl_s * 1000))
        except redis.RedisError as exc:
            log.warning("could not report stalled %s worker %s in Redis: %s", w.role, w.id, exc)

    async def clear(self, w: Worker) -> None:
        """`w` answered: no supervisor should restart it on this router's word."""
        if w.started_at is None:
            return
        try:
            await self._redis.delete(stall_key(w.id))
        except redis.RedisError as exc:  # the report expires by itself
            log.warning("could not clear the stall report of %s worker %s: %s", w.role, w.id, exc)

    async def close(self) -> None:
        await self._redis.aclose()
