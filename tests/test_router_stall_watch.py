"""The stall watch on its own (fast tier): when a worker counts as stalled, what happens to its legs, how a
canary puts it back, and that a slow reader's silence is not the worker's. Real WorkerHTTP legs and canaries
over loopback to aiohttp stub workers; the pool's speed is set by hand (one observed leg). The whole feature
on a real engine whose core is stopped: test_router_prefill_stall.py and bench faults' hung engines."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool, Worker
from pdserve.router.prefill_estimate import LEARN_MIN_TOKENS, TokenCost
from pdserve.router.stall_reports import StallReports
from pdserve.router.stall_watch import STALL_FACTOR, StallWatch
from pdserve.router.upstream import is_hard_failure
from pdserve.router.worker_http import HIGH_WATER, WorkerHTTP
from pdserve.worker.registration import Registrar, WorkerRecord, stall_key
from worker_stubs import healthy, listening, serves_stub, worker_app

TIMEOUT_S = 0.3
NO_TIMEOUT = aiohttp.ClientTimeout(total=60)


class HeldWorker:
    """Completions wait until `release` is set (after `lead` body bytes when it streams); `bodies` records
    what came."""

    def __init__(self, lead: int = 0) -> None:
        self.release = asyncio.Event()
        self.bodies: list[dict] = []
        self.lead = lead

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if not self.lead:
            await self.release.wait()
            return web.json_response({"choices": [{"text": "x"}]})
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"x" * self.lead)
        await self.release.wait()
        await resp.write_eof()
        return resp


def one_worker_pool(url: str) -> tuple[Pool, Worker]:
    pool = Pool("decode", RouterConfig(decode_urls=("http://d",)), RouterMetrics())
    pool.add_static([url])
    (w,) = pool.workers.values()
    w.healthy = True
    w.model_cards = [{"id": "stub"}]
    return pool, w


def learned(cost: TokenCost, w: Worker) -> None:
    """One finished leg of 1000 tokens in 1 s: 1 ms a token."""
    t = time.perf_counter()
    cost.observe(w, 1000, t - 1.0, t)


def unscraped_watch(url: str) -> tuple[Pool, Worker, WorkerHTTP, StallWatch]:
    """A one-worker pool with a learned speed (1 ms a token) and its watch, with no scrapes and no canaries."""
    pool, w = one_worker_pool(url)
    cost, legs = TokenCost(), WorkerHTTP()
    learned(cost, w)
    return pool, w, legs, StallWatch(pool, cost, legs, None, None, {}, TIMEOUT_S, 1.0, pool.metrics)  # type: ignore[arg-type]


async def wait_for(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {what}")


async def test_a_quiet_worker_is_stalled_its_legs_cut_and_a_canary_puts_it_back() -> None:
    held = HeldWorker()
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w = one_worker_pool(url)
        cost, legs = TokenCost(), WorkerHTTP()
        async with aiohttp.ClientSession() as http:
            watch = StallWatch(pool, cost, legs, None, http, {}, TIMEOUT_S, 1.0, pool.metrics)

            async def leg() -> None:
                async with legs.post(url + "/v1/completions", data=b'{"prompt": "p"}', headers={},
                                     timeout=NO_TIMEOUT, work=100) as resp:
                    await resp.read()

            task = asyncio.create_task(leg())
            await wait_for(lambda: held.bodies, "leg at the worker")
            await asyncio.sleep(2 * TIMEOUT_S)
            assert watch.check() == []  # no speed learned yet: nothing is judged
            assert not task.done()

            learned(cost, w)
            assert watch.window(100) == pytest.approx(max(TIMEOUT_S, STALL_FACTOR * 100 * 1e-3))
            assert watch.check() == [w]
            with pytest.raises(Exception) as err:
                await task
            assert is_hard_failure(err.value)  # as from a worker that went away: the leg moves on
            assert w.stalled and pool.candidates(None) == []
            assert watch.check() == []  # judged once

            canary = asyncio.create_task(watch.canary(w))
            await wait_for(lambda: len(held.bodies) == 2, "canary at the worker")
            assert held.bodies[-1] == {"prompt": [0], "max_tokens": 1, "temperature": 0.0, "model": "stub"}
            assert not canary.done() and w.stalled  # no answer, no return
            held.release.set()
            assert await canary
            assert not w.stalled and pool.candidates(None) == [w]
        await legs.close()


async def test_a_leg_paused_for_its_slow_reader_keeps_the_worker_in() -> None:
    """A client that stops reading its stream pauses the router's socket to the worker: that silence is the
    client's, and must not take out the worker and cut every other stream on it."""
    held = HeldWorker(lead=4 * HIGH_WATER)
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w, legs, watch = unscraped_watch(url)
        resp = await legs.post(url + "/v1/completions", data=b'{"prompt": "p"}', headers={}, timeout=NO_TIMEOUT)
        (conns,) = legs._open.values()  # one worker, one connection
        (conn,) = conns
        await wait_for(lambda: conn.paused, "paused socket")  # nothing reads the body
        await asyncio.sleep(2 * TIMEOUT_S)
        assert watch.check() == [] and not w.stalled
        held.release.set()
        assert len(await resp.read()) == 4 * HIGH_WATER
        await legs.close()


async def test_a_whole_answer_still_being_generated_is_no_sign_of_a_stall() -> None:
    """A non-streamed generation sends nothing until its end, however long it runs (`unary`): alone, with no
    scrapes of its engine, it never makes its worker stalled; a stream on the same worker that goes quiet
    does."""
    held = HeldWorker()
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w, legs, watch = unscraped_watch(url)

        async def leg(unary: bool) -> bytes:
            async with legs.post(url + "/v1/completions", data=b'{"prompt": "p"}', headers={}, timeout=NO_TIMEOUT,
                                 unary=unary) as resp:
                return await resp.read()

        whole = asyncio.create_task(leg(unary=True))
        await wait_for(lambda: held.bodies, "leg at the worker")
        await asyncio.sleep(2 * TIMEOUT_S)
        assert watch.check() == [] and not w.stalled
        stream = asyncio.create_task(leg(unary=False))
        await wait_for(lambda: len(held.bodies) == 2, "second leg at the worker")
        await asyncio.sleep(2 * TIMEOUT_S)
        assert watch.check() == [w]
        for task in (whole, stream):  # both cut, as for a dead worker
            with pytest.raises(Exception) as err:
                await task
            assert is_hard_failure(err.value)
        await legs.close()


async def test_a_held_leg_counts_from_when_its_prefill_answered() -> None:
    """An overlapped decode leg says nothing while it waits for its prefill's KV (`silent`); once the prefill
    has answered (`speak`) its silence is the worker's, counted from then."""
    held = HeldWorker()
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w, legs, watch = unscraped_watch(url)
        post = legs.post(url + "/v1/completions", data=b"{}", headers={}, timeout=NO_TIMEOUT, silent=True)
        task = asyncio.ensure_future(post)
        await wait_for(lambda: held.bodies, "leg at the worker")
        await asyncio.sleep(2 * TIMEOUT_S)
        assert watch.check() == []
        (conns,) = legs._open.values()
        (conn,) = conns
        conn.response.speak()
        assert watch.check() == []  # heard now
        await asyncio.sleep(2 * TIMEOUT_S)
        assert watch.check() == [w]
        with pytest.raises(Exception):
            await task
        await legs.close()


class EngineSteps:
    """What a QueueView says of an engine's steps (the scrape side is tested in test_router_queue.py)."""

    def __init__(self, still_for: float | None) -> None:
        self.still_for = still_for
        self.touched = 0  # asked to keep scraping

    def engine_still_for(self, _w: Worker) -> float | None:
        return self.still_for

    def touch(self) -> None:
        self.touched += 1


async def test_a_quiet_worker_whose_engine_still_steps_is_slow_not_stalled() -> None:
    """One prompt far longer (or less cached) than the pool's recent ones can keep every leg on its worker
    quiet past the window; the /metrics scrapes still see its engine step, so it stays in."""
    held = HeldWorker()
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w = one_worker_pool(url)
        cost, legs, steps = TokenCost(), WorkerHTTP(), EngineSteps(still_for=0.1)
        learned(cost, w)
        watch = StallWatch(pool, cost, legs, steps, None, {}, TIMEOUT_S, 1.0, pool.metrics)  # type: ignore[arg-type]
        async def leg() -> None:
            await legs.post(url + "/v1/completions", data=b"{}", headers={}, timeout=NO_TIMEOUT)

        task = asyncio.create_task(leg())
        await wait_for(lambda: held.bodies, "leg at the worker")
        await asyncio.sleep(2 * TIMEOUT_S)
        assert watch.check() == [] and not w.stalled
        steps.still_for = 10.0  # scrapes that saw no step for longer than the window: stuck
        assert watch.check() == [w]
        with pytest.raises(Exception):
            await task
        await legs.close()


async def test_a_worker_holding_only_whole_answers_is_judged_by_its_engines_counters() -> None:
    """Non-streamed generations (`unary`) say nothing until their end, but every decode step moves the
    engine's /metrics counters: with those scraped, a worker whose engine has not stepped for the window of
    its oldest such leg is stalled; while they move, or with no fresh scrape, it is not."""
    held = HeldWorker()
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w = one_worker_pool(url)
        cost, legs, steps = TokenCost(), WorkerHTTP(), EngineSteps(still_for=None)
        learned(cost, w)
        watch = StallWatch(pool, cost, legs, steps, None, {}, TIMEOUT_S, 1.0, pool.metrics)  # type: ignore[arg-type]

        async def leg() -> None:
            await legs.post(url + "/v1/completions", data=b"{}", headers={}, timeout=NO_TIMEOUT, unary=True,
                            work=100)

        task = asyncio.create_task(leg())
        await wait_for(lambda: held.bodies, "leg at the worker")
        await asyncio.sleep(2 * TIMEOUT_S)
        assert watch.check() == [] and steps.touched == 1  # no scrape to tell: not judged, scrapes kept going
        steps.still_for = 0.1
        assert watch.check() == []  # it steps: generating
        steps.still_for = 10.0
        assert watch.check() == [w]
        with pytest.raises(Exception) as err:
            await task
        assert is_hard_failure(err.value)  # moved on, as from a worker that went away
        await legs.close()


async def test_the_silence_runs_from_the_oldest_leg_or_the_latest_byte_of_a_running_one() -> None:
    """A leg sent to a stuck worker does not restart its clock; once a leg runs (body bytes came), the
    silence is since the latest byte, with no prompt left to wait for."""
    held, streaming = HeldWorker(), HeldWorker(lead=10)
    async with listening(worker_app(healthy, serves_stub, held.completions),
                         worker_app(healthy, serves_stub, streaming.completions)) as (url, stream_url):
        legs = WorkerHTTP()

        async def leg(to: str, work: int) -> None:
            async with legs.post(to + "/v1/completions", data=b"{}", headers={}, timeout=NO_TIMEOUT, work=work) as r:
                await r.read()

        tasks = [asyncio.create_task(leg(url, 500))]
        await wait_for(lambda: held.bodies, "first leg")
        await asyncio.sleep(0.2)
        tasks.append(asyncio.create_task(leg(url, 50)))
        await wait_for(lambda: len(held.bodies) == 2, "second leg")
        quiet, work = legs.silence(url)  # type: ignore[misc]
        assert quiet >= 0.2 and work == 500

        tasks.append(asyncio.create_task(leg(stream_url, 500)))
        await wait_for(lambda: streaming.bodies, "streamed leg")
        await asyncio.sleep(0.2)
        quiet, work = legs.silence(stream_url)  # type: ignore[misc]
        assert 0.15 <= quiet < 1.0 and work == 0  # running: since its first body bytes, nothing to compute first
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await legs.close()


def test_a_window_is_the_slowest_recent_legs_time_scaled_to_the_prompt_the_oldest_leg_computes_first() -> None:
    pool, w = one_worker_pool("http://p")
    cost = TokenCost()
    watch = StallWatch(pool, cost, WorkerHTTP(), None, None, {}, TIMEOUT_S, 1.0, pool.metrics)  # type: ignore[arg-type]
    assert watch.window(0) == TIMEOUT_S  # a running leg: the engine owes it bytes every step
    assert watch.window(5000) is None  # a prompt first, and no speed to judge its time by
    assert watch.window(LEARN_MIN_TOKENS - 1) == TIMEOUT_S  # a short one: fixed costs, never learned
    learned(cost, w)  # 1000 tokens in 1 s
    assert watch.window(500) == pytest.approx(STALL_FACTOR * 0.5)
    assert watch.window(10) == TIMEOUT_S
    # Longer than any leg seen: its attention part grows with its length, so up to the square of the ratio.
    assert watch.window(5000) == pytest.approx(STALL_FACTOR * 25.0)
    # Prompts of the same length served from a prefix cache, ten times faster: the mean speed falls, the
    # window an uncached one gets does not.
    for _ in range(10):
        t = time.perf_counter()
        cost.observe(w, 1000, t - 0.1, t)
    assert cost.per_token is not None and cost.per_token < 2e-4
    assert watch.window(1000) == pytest.approx(STALL_FACTOR * 1.0)


async def test_a_stalled_workers_report_reaches_its_registrar_and_goes_once_it_answers(redis_url: str) -> None:
    """The router's stall report in Redis (stall_reports.py) is what a worker's supervisor restarts vLLM on:
    it names the registration it was seen under, lives while the worker is out, and goes with its canary."""
    held = HeldWorker()
    async with listening(worker_app(healthy, serves_stub, held.completions)) as (url,):
        pool, w, legs, _ = unscraped_watch(url)
        record = WorkerRecord(id=w.id, role="decode", url=url, model="stub")
        w.started_at = record.started_at
        registrar, later = Registrar(redis_url, record), Registrar(redis_url, WorkerRecord(
            id=w.id, role="decode", url=url, model="stub", started_at=record.started_at + 1))
        reports = StallReports(redis_url, ttl_s=30.0)
        async with aiohttp.ClientSession() as http:
            watch = StallWatch(pool, TokenCost(), legs, None, http, {}, TIMEOUT_S, 1.0, pool.metrics, reports)
            learned(watch.cost, w)

            async def held_leg() -> None:
                async with legs.post(url + "/v1/completions", data=b"{}", headers={}, timeout=NO_TIMEOUT, work=1):
                    pass

            leg = asyncio.create_task(held_leg())
            await wait_for(lambda: held.bodies, "leg at the worker")
            await asyncio.sleep(2 * TIMEOUT_S)
            assert watch.check() == [w]
            await asyncio.gather(leg, return_exceptions=True)
            assert await asyncio.to_thread(registrar.stall_report) is None  # not before the first canary round

            canary = asyncio.create_task(watch.canary(w))
            await wait_for(lambda: len(held.bodies) == 2, "canary at the worker")
            report = await asyncio.to_thread(registrar.stall_report)
            assert report is not None and report.reason.startswith(f"decode worker {url} sent nothing on its requests")
            assert await asyncio.to_thread(later.stall_report) is None  # another vLLM of the worker: not its report

            held.release.set()
            assert await canary
            assert await asyncio.to_thread(registrar.stall_report) is None

            # A report is only ever the router's JSON: anything else in its key is ignored, and a worker that
            # deregisters takes its report with it.
            direct = aioredis.Redis.from_url(redis_url)
            await direct.set(stall_key(w.id), b"\x80\x04not json")
            assert await asyncio.to_thread(registrar.stall_report) is None
            await reports.refresh(w, "stalled")
            await asyncio.to_thread(registrar.stop)
            assert await direct.get(stall_key(w.id)) is None
            await direct.aclose()
        await reports.close()
        await legs.close()
