"""Active health checks: GET /health on every worker each `health_interval` seconds.

Passive signals (a refused connection, a 5xx) take a worker out quickly; only an
active check puts it back, so a worker returns after it really answers again. The
first passing check also fetches the worker's /v1/models, which is how the router
learns what a statically configured worker serves.

A check that finds a worker dead, not merely slow or busy (nothing listens on its port any
more), also ends what the router has open on it (`on_dead`): a server half-way through shutting
down stops listening first and can then hold a stream open without sending another byte (uvicorn
waits for open requests with no limit), and its client would wait until the decode timeout
(minutes). A
check that times out, is reset, or gets a non-200 (an overloaded proxy in front of a worker may
answer 503 while its streams are fine) takes the worker out of rotation but leaves its
requests running, once `--health-failures` routine checks in a row have failed: a vLLM API
server busy with one huge prompt misses a check now and then while it still serves (a 16 MB
text prompt on the 2-core VM took each of the two workers of a `pdserve up` stack out for one
check, and with a single decode worker 281 of 664 other requests got 503 meanwhile). A worker
suspected already (a leg to it failed: `check_soon`) goes out on its first failed check.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import weakref
from typing import Callable, Sequence

import aiohttp
import msgspec

from pdserve.router.pool import Pool, Worker
from pdserve.router.upstream import SIDE_REQUEST_ERRORS, describe

log = logging.getLogger("pdserve.router.health")

OnDead = Callable[[Worker, str], None]  # (the worker, why it is dead)


class HealthChecker:
    def __init__(
        self, pools: Sequence[Pool], http: aiohttp.ClientSession, headers: dict[str, str], interval: float,
        on_dead: OnDead | None = None, failures: int = 1,
    ) -> None:
        self.pools = pools
        self.failures = failures  # routine checks failed in a row that take a worker out
        self.on_dead = on_dead
        self.http = http
        self.headers = headers
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=min(interval, 5.0))
        self._task: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()
        self._missed: weakref.WeakKeyDictionary[Worker, int] = weakref.WeakKeyDictionary()  # failed checks in a row

    async def _probe(self, w: Worker) -> tuple[bool, str]:
        """(up, why it is dead): the reason is empty unless nothing listens on the worker's port."""
        try:
            async with self.http.get(w.url + "/health", headers=self.headers, timeout=self.timeout) as resp:
                if resp.status != 200:
                    return False, ""
            if w.model_cards is None:
                async with self.http.get(w.url + "/v1/models", headers=self.headers, timeout=self.timeout) as models:
                    if models.status == 200:
                        w.model_cards = list(msgspec.json.decode(await models.read()).get("data") or [])
            return True, ""
        except SIDE_REQUEST_ERRORS as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno == errno.ECONNREFUSED
            log.debug("health check of %s failed: %s", w.url, describe(exc))
            return False, f"/health: {describe(exc)}" if refused else ""

    async def check(self, pool: Pool, w: Worker, suspected: bool = False) -> bool:
        """Check `w` and apply the result; True when it answered (a caller may act on a worker found down).
        A failed check takes it out only when nothing listens on its port, it was `suspected`, or the
        routine checks before this one failed too (`failures` in a row)."""
        ok, dead = await self._probe(w)
        missed = 0 if ok else self._missed.get(w, 0) + 1
        self._missed[w] = missed
        if pool.workers.get(w.id) is w:  # it may have left while we waited
            if ok or dead or suspected or missed >= self.failures:
                pool.set_health(w, ok)
            else:
                log.debug("%s worker %s missed a health check (%d in a row); still in the pool", w.role, w.id, missed)
        if dead and self.on_dead is not None:  # also when it left: what is open on it still waits
            self.on_dead(w, dead)
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(p, w) for p in self.pools for w in list(p.workers.values())))

    def check_soon(self, pool: Pool, workers: Sequence[Worker]) -> list[asyncio.Task[bool]]:
        """Check these workers now rather than at the next round (joined, or suspected down); the
        checks run whether or not anyone awaits them."""
        tasks = []
        for w in workers:
            task = asyncio.create_task(self.check(pool, w, suspected=True))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            tasks.append(task)
        return tasks

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()

    async def start(self) -> None:
        """One full round before returning, so a router with live workers is ready at once."""
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="health-checks")

    async def stop(self) -> None:
        for task in [self._task, *self._pending]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._pending] if t is not None), return_exceptions=True)
