"""The stall watch on its own (fast tier): when a prefill worker counts as stalled, what happens to its
legs, and how a canary puts it back. A real WorkerHTTP leg and canary over loopback to an aiohttp stub
worker that holds completions until released; the pool's speed is set by hand (one observed leg).
The whole feature on a real engine whose core is stopped: test_router_prefill_stall.py."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool, Worker
from pdserve.router.prefill_estimate import TokenCost
from pdserve.router.stall_watch import STALL_FACTOR, StallWatch
from pdserve.router.upstream import is_hard_failure
from pdserve.router.worker_http import WorkerHTTP
from worker_stubs import healthy, listening, serves_stub, worker_app

WINDOW_S = 0.3


class HeldWorker:
    """Completions wait until `release` is set; `bodies` records what came."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.bodies: list[dict] = []

    async def completions(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        await self.release.wait()
        return web.json_response({"choices": [{"text": "x"}]})


def one_worker_pool(url: str) -> tuple[Pool, Worker]:
    pool = Pool("prefill", RouterConfig(decode_urls=("http://d",)), RouterMetrics())
    pool.add_static([url])
    (w,) = pool.workers.values()
    w.healthy = True
    w.model_cards = [{"id": "stub"}]
    return pool, w


async def test_a_worker_quiet_past_its_window_is_stalled_its_leg_cut_and_a_canary_puts_it_back() -> None:
    held = HeldWorker()
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w = one_worker_pool(url)
        cost, legs = TokenCost(), WorkerHTTP()
        async with aiohttp.ClientSession() as http:
            watch = StallWatch(pool, cost, legs, http, {}, WINDOW_S, 1.0, pool.metrics)

            async def leg() -> None:
                with cost.leg(w, 100):
                    async with legs.post(url + "/v1/completions", data=b'{"prompt": "p"}', headers={},
                                         timeout=aiohttp.ClientTimeout(total=60)) as resp:
                        await resp.read()

            task = asyncio.create_task(leg())
            while not held.bodies:
                await asyncio.sleep(0.01)
            await asyncio.sleep(2 * WINDOW_S)
            assert watch.check() == []  # no speed learned yet: nothing is judged
            assert not task.done()

            t = time.perf_counter()
            cost.observe(w, 1000, t - 1.0, t)  # a finished leg elsewhere in time: 1 ms a token
            assert watch.window(w) == pytest.approx(max(WINDOW_S, STALL_FACTOR * 100 * 1e-3))
            assert watch.check(now=t) == []  # its end counts as progress: quiet again from now
            assert watch.check(now=t + 2 * WINDOW_S) == [w]
            with pytest.raises(Exception) as err:
                await task
            assert is_hard_failure(err.value)  # as from a worker that went away: the leg moves on
            assert w.stalled and pool.candidates(None) == []
            assert watch.check(now=t + 10.0) == []  # judged once

            canary = asyncio.create_task(watch.canary(w))
            while len(held.bodies) < 2:
                await asyncio.sleep(0.01)
            assert held.bodies[-1] == {"prompt": [0], "max_tokens": 1, "temperature": 0.0, "model": "stub"}
            assert not canary.done() and w.stalled  # no answer, no return
            held.release.set()
            assert await canary
            assert not w.stalled and pool.candidates(None) == [w]
        await legs.close()


async def test_a_window_grows_with_the_tokens_a_worker_holds() -> None:
    pool, w = one_worker_pool("http://p")
    cost = TokenCost()
    watch = StallWatch(pool, cost, WorkerHTTP(), None, {}, WINDOW_S, 1.0, pool.metrics)  # type: ignore[arg-type]
    t = time.perf_counter()
    cost.observe(w, 1000, t - 1.0, t)
    with cost.leg(w, 5000):  # 5 s of work at 1 ms a token
        assert watch.window(w) == pytest.approx(STALL_FACTOR * 5.0)
        assert watch.check(now=t + 10.0) == []
        assert watch.check(now=t + STALL_FACTOR * 5.0 + 1.0) == [w]
