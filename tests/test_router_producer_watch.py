"""The watch on an overlapped decode leg's producer (router/flow/producer_watch.py), fast tier.

First the watch's own decisions against a scripted health check, then whole requests
through an in-process router over stub workers: a prefill worker that answers and is then
found down (its overlapped decode leg waits for KV that never comes), and one that stays up
while the decode leg takes long. The stub decode worker holds overlapped legs until the
router closes them, and answers decode-only legs at once with a text of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import pytest
from aiohttp import web

from pdserve.kvstore.connector.handoff import HANDOFF_KEY
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.flow import producer_watch
from pdserve.router.flow.decode_leg import DecodeLeg
from pdserve.router.flow.producer_watch import ProducerWatch
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool, RouteContext, Worker
from worker_stubs import listening, worker_app


@pytest.fixture(autouse=True)
def _quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer_watch, "GRACE_S", 0.01)
    monkeypatch.setattr(producer_watch, "RECHECK_S", 0.01)


class ScriptedProbe:
    """A health check that answers from a script (the last answer repeats) and counts its calls."""

    def __init__(self, *answers: bool) -> None:
        self.answers = list(answers)
        self.calls = 0
        self.called = asyncio.Event()

    async def __call__(self, _w: Worker) -> bool:
        self.calls += 1
        self.called.set()
        return self.answers[min(self.calls, len(self.answers)) - 1]

    async def until(self, calls: int) -> None:
        while self.calls < calls:
            self.called.clear()
            await self.called.wait()


def _worker() -> Worker:
    return Worker(id="p", role="prefill", url="http://p", source="static", healthy=True)


async def test_a_live_producer_is_checked_again_and_again_and_never_lost() -> None:
    probe, lost = ScriptedProbe(True), []
    watch = ProducerWatch(_worker(), probe, lambda: lost.append(1))
    await probe.until(3)
    watch.stop()
    seen = probe.calls
    await asyncio.sleep(10 * producer_watch.RECHECK_S)
    assert lost == [] and probe.calls == seen


async def test_a_producer_found_down_is_lost_once_and_no_longer_checked() -> None:
    probe, lost = ScriptedProbe(True, False), []
    ProducerWatch(_worker(), probe, lambda: lost.append(1))
    await probe.until(2)
    await asyncio.sleep(10 * producer_watch.RECHECK_S)
    assert lost == [1] and probe.calls == 2


async def test_a_watch_stopped_within_its_grace_checks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer_watch, "GRACE_S", 0.05)
    probe, lost = ScriptedProbe(False), []
    ProducerWatch(_worker(), probe, lambda: lost.append(1)).stop()
    await asyncio.sleep(0.2)
    assert probe.calls == 0 and lost == []


async def test_a_stop_during_a_check_wins_over_its_verdict_but_the_check_completes() -> None:
    release, finished = asyncio.Event(), asyncio.Event()
    started = asyncio.Event()

    async def slow_down(_w: Worker) -> bool:
        started.set()
        await release.wait()
        finished.set()  # the pool's check goes on to mark the worker
        return False

    lost: list[int] = []
    watch = ProducerWatch(_worker(), slow_down, lambda: lost.append(1))
    await started.wait()
    watch.stop()  # the leg had its first token meanwhile
    release.set()
    await asyncio.wait_for(finished.wait(), 5)
    await asyncio.sleep(10 * producer_watch.RECHECK_S)  # time for a watch that was not stopped to act
    assert lost == []


class _Resp:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_giving_up_a_leg_frees_its_worker_without_a_verdict_and_sets_up_a_decode_only_retry() -> None:
    pool = Pool("decode", RouterConfig(decode_urls=("http://d",)), RouterMetrics())
    pool.add_static(["http://d"])
    w = pool.workers["http://d"]
    w.healthy = True
    slot = pool._take(w, 10)
    resp = _Resp()
    leg = DecodeLeg(slot, resp, b'{"overlapped": 1}', RouteContext(None, 10), {"http://d"}, 0.0, 1.0)  # type: ignore[arg-type]
    leg.give_up(b'{"raw": 1}')
    assert resp.closed and w.inflight == 0
    assert w.breaker.failures == 0 and w.available(0.0)  # the decode worker is not at fault
    assert leg.payload == b'{"raw": 1}' and leg.tried == set() and leg.t_prefill_done is None


# ---------------------------------------------------------------- through a router


class Stubs:
    """A stub prefill worker (its health scripted by `producer_up`) and a stub decode worker."""

    def __init__(self) -> None:
        self.producer_up = True
        self.die_after_answer = False  # the next prefill answer is its last one
        self.health_checks = 0
        self.release_overlapped = asyncio.Event()  # lets a held overlapped leg answer (its KV came)
        self.overlapped_aborted = 0
        self.decode_bodies: list[dict[str, Any]] = []

    async def health(self, _r: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(status=200 if self.producer_up else 503)

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub", "object": "model"}]})

    async def prefill(self, _r: web.Request) -> web.Response:
        if self.die_after_answer:
            self.producer_up = False
        params = {"pdserve": 1, "kvstore_url": "tcp://127.0.0.1:9", "namespace": "ns", "chunk_size": 256}
        return web.json_response({"choices": [{"index": 0, "text": "p"}], "kv_transfer_params": params})

    async def decode(self, r: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await r.read())
        self.decode_bodies.append(body)
        overlapped = HANDOFF_KEY in (body.get("kv_transfer_params") or {})
        text = "loaded" if overlapped else "recomputed"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if body.get("stream"):
            await resp.prepare(r)  # the headers go at once, as vLLM's do for a stream
        if overlapped:
            try:
                await self.release_overlapped.wait()
            except asyncio.CancelledError:  # the router closed the leg: vLLM would abort it
                self.overlapped_aborted += 1
                raise
        if body.get("stream"):
            await resp.write(b'data: {"choices": [{"index": 0, "text": "%s"}]}\n\ndata: [DONE]\n\n' % text.encode())
            return resp
        return web.json_response({"choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    async def decode_health(self, _r: web.Request) -> web.Response:
        return web.Response()

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[tuple[str, str]]:
        """(prefill URL, decode URL) while both stubs listen."""
        async with listening(worker_app(self.health, self.models, self.prefill),
                             worker_app(self.decode_health, self.models, self.decode)) as (prefill, decode):
            yield prefill, decode


Scrape = Callable[[str], Awaitable[float]]


@pytest.fixture
async def routed() -> AsyncIterator[tuple[Stubs, httpx.AsyncClient, Scrape]]:
    """The stubs, a client of an in-process router over them that has learned where the producer
    writes (so the next requests overlap), and the router's metrics by series name."""
    stubs = Stubs()
    async with stubs.serve() as (prefill, decode):
        cfg = RouterConfig(prefill_urls=(prefill,), decode_urls=(decode,), pd_min_prompt_tokens=0,
                           pd_queue_aware=False, pd_first_token=False, health_interval=600.0)
        app = create_app(cfg)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:

                async def scrape(series: str) -> float:
                    text = (await client.get("/metrics")).text
                    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(series + " ")
                               or ln.startswith(series + "{"))

                r = await client.post("/v1/completions", json={"model": "stub", "prompt": "first", "max_tokens": 2})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "recomputed"
                stubs.decode_bodies.clear()
                yield stubs, client, scrape


def _text(r: httpx.Response, stream: bool) -> str:
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["choices"][0]["text"])
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
    return "".join(msgspec.json.decode(e)["choices"][0]["text"] for e in events)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_producer_down_after_answering_means_decode_only_on_the_same_worker(
    routed: tuple[Stubs, httpx.AsyncClient, Scrape], stream: bool
) -> None:
    """Unary, the watch finds the producer down while the leg has no headers; streamed, while the
    relay waits for its first token. Either way the held leg is closed (vLLM aborts it) and the
    request goes decode-only to the one decode worker, which stays in service with no failure."""
    stubs, client, scrape = routed
    stubs.die_after_answer = True
    body = {"model": "stub", "prompt": "second", "max_tokens": 2, "stream": stream}
    assert _text(await client.post("/v1/completions", json=body), stream) == "recomputed"
    assert [HANDOFF_KEY in (b.get("kv_transfer_params") or {}) for b in stubs.decode_bodies] == [True, False]
    assert "kv_transfer_params" not in stubs.decode_bodies[1]
    assert await scrape("pdserve_router_producer_lost_total") == 1
    assert await scrape("pdserve_router_paths_total") == 2  # the first request, then this one (pd_overlap)
    await asyncio.wait_for(_until(lambda: stubs.overlapped_aborted == 1), 10)
    decode_up = [ln for ln in (await client.get("/metrics")).text.splitlines()
                 if ln.startswith('pdserve_router_worker_healthy{role="decode"')]
    assert decode_up and all(ln.endswith(" 1.0") for ln in decode_up)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_live_producer_never_costs_a_slow_decode_leg(
    routed: tuple[Stubs, httpx.AsyncClient, Scrape], stream: bool
) -> None:
    """The decode leg answers only once the producer has passed two health checks after its answer:
    the leg is kept, however long it takes."""
    stubs, client, scrape = routed
    checks = stubs.health_checks
    body = {"model": "stub", "prompt": "third", "max_tokens": 2, "stream": stream}
    answer = asyncio.ensure_future(client.post("/v1/completions", json=body))
    await asyncio.wait_for(_until(lambda: stubs.health_checks >= checks + 2), 10)
    stubs.release_overlapped.set()
    assert _text(await answer, stream) == "loaded"
    assert await scrape("pdserve_router_producer_lost_total") == 0
    assert stubs.overlapped_aborted == 0 and len(stubs.decode_bodies) == 1


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.01)
