"""Unit tests of router/breaker.py and of the verdicts a pool's lease feeds it.

The rule pinned here: only transport failures count against a worker. An HTTP
error reply is an answer (the request's fault), so any number of them leaves
every breaker closed.
"""

from __future__ import annotations

import asyncio

import aiohttp

from pdserve.router.breaker import Breaker, Ruling
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import LeastLoaded
from pdserve.router.pool import Pool, RouteContext


def test_breaker_opens_after_threshold_failures_in_a_row_and_a_success_resets_the_count() -> None:
    b = Breaker(threshold=3, cooldown=10.0)
    assert not b.failed(0.0) and not b.failed(0.0)
    b.succeeded()  # the run is broken: counting starts over
    assert not b.failed(1.0) and not b.failed(1.0)
    assert b.closed(1.0)
    assert b.failed(1.0)  # the third in a row opens it
    assert not b.closed(1.0) and not b.closed(10.9)
    assert b.closed(11.0)


def test_breaker_closes_only_on_a_health_check_after_the_cooldown() -> None:
    b = Breaker(threshold=1, cooldown=5.0)
    assert b.failed(0.0)
    assert not b.health_passed(4.0)  # still cooling down: the check cannot close it
    assert not b.closed(4.0)
    assert b.closed(5.0)
    assert b.failed(5.0)  # no check passed yet: a failure right after the cooldown reopens it
    assert b.health_passed(10.0) and b.failures == 0
    assert b.closed(10.0)


def test_failures_while_open_do_not_extend_the_cooldown() -> None:
    b = Breaker(threshold=1, cooldown=5.0)
    assert b.failed(0.0)
    assert not b.failed(3.0)  # already open
    assert b.closed(5.0)


def _pool(n: int, failures: int) -> Pool:
    pool = Pool("decode", RouterConfig(decode_urls=("http://d",), breaker_failures=failures), RouterMetrics())
    pool.add_static(f"http://w{i}" for i in range(n))
    for w in pool.workers.values():
        pool.set_health(w, True)
    return pool


async def _lease_on(pool: Pool, wid: str):  # type: ignore[no-untyped-def]
    others = {w for w in pool.workers if w != wid}
    return await pool.acquire(LeastLoaded(), RouteContext(model=None, prompt_tokens=1), exclude=others)


async def test_error_replies_never_open_a_breaker() -> None:
    pool = _pool(n=2, failures=2)
    for _ in range(10):
        for wid in pool.workers:
            (await _lease_on(pool, wid)).answered()
    assert len(pool.candidates(None)) == 2
    assert all(w.breaker.failures == 0 and w.inflight == 0 for w in pool.workers.values())


async def test_transport_failures_open_the_breaker_and_unreachable_marks_down() -> None:
    pool = _pool(n=2, failures=2)
    w0, w1 = pool.workers.values()
    (await _lease_on(pool, w0.id)).failed(asyncio.TimeoutError())
    assert w0.healthy and w0 in pool.candidates(None)  # slow once: still in
    (await _lease_on(pool, w0.id)).failed(asyncio.TimeoutError())
    assert w0.healthy and w0 not in pool.candidates(None)  # breaker open
    (await _lease_on(pool, w1.id)).failed(aiohttp.ClientConnectionError("refused"))
    assert not w1.healthy and w1 not in pool.candidates(None)  # out until a health check passes
    pool.set_health(w1, True)
    assert pool.candidates(None) == [w1]


async def test_an_abandoned_lease_gives_no_verdict_and_only_the_first_verdict_counts() -> None:
    pool = _pool(n=1, failures=1)
    (w,) = pool.workers.values()
    with await _lease_on(pool, w.id):
        pass  # left without a verdict (the client hung up)
    assert w.breaker.failures == 0 and w.inflight == 0
    lease = await _lease_on(pool, w.id)
    lease.answered()
    lease.failed(asyncio.TimeoutError())  # too late: released already
    assert w.breaker.failures == 0 and w.inflight == 0 and pool.candidates(None) == [w]


def test_a_reset_connection_asks_for_a_health_check_instead_of_taking_the_worker_out() -> None:
    """vLLM resets the stream of a request it cannot serve (a malformed structured_outputs): with the
    app's recheck wired, the worker stays in until a health check says it is down."""

    async def run() -> None:
        pool = _pool(2, failures=1)
        asked: list[str] = []
        pool.recheck = lambda w: asked.append(w.id)
        for _ in range(3):  # a client repeating the bad request
            lease = await _lease_on(pool, "http://w0")
            lease.failed(aiohttp.ServerDisconnectedError())
        w0 = pool.workers["http://w0"]
        assert asked == ["http://w0"] * 3
        assert w0.healthy and w0.breaker.closed(0.0) and w0.breaker.failures == 0
        pool.set_health(w0, False)  # the check found it dead: out, and the failure counts
        assert not w0.healthy and w0.breaker.failures == 1

    asyncio.run(run())


def test_judge_rules_on_each_verdict() -> None:
    """The breaker alone decides what a slot's verdict means; the pool only carries the ruling out."""
    b = Breaker(threshold=2, cooldown=5.0)
    assert b.judge("abandoned", 0.0, can_recheck=False) == Ruling()
    assert b.judge("failed", 0.0, can_recheck=True) == Ruling()  # one timeout: counted, not open yet
    assert b.failures == 1
    assert b.judge("answered", 0.0, can_recheck=False) == Ruling() and b.failures == 0
    assert b.judge("unreachable", 0.0, can_recheck=True) == Ruling(recheck=True)  # the check counts it
    assert b.failures == 0
    assert b.judge("unreachable", 0.0, can_recheck=False) == Ruling(take_out=True)
    assert b.judge("unreachable", 1.0, can_recheck=False) == Ruling(opened=True, take_out=True)
    assert not b.closed(1.0) and b.closed(6.0)
