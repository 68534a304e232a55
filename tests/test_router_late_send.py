"""When an overlapped decode leg goes out (router/flow/pd_flow.py, prefill_estimate.overlap_delay), fast tier.

An in-process router over stub workers of this module and a real KV store (the router's prefix
lookups ask it): a prefill worker that counts a prompt's words as its tokens (/tokenize) and
answers each leg when the test lets it, and a decode worker that records every leg it gets
(when, and its body) and answers at once. Each test first teaches the router a prefill speed
(a leg held 0.2 s) and a decode leg's ingest (a streamed leg), as any router learns them from
its traffic. The router's figures are read from its /metrics, so each test states the order
that follows from them (a leg is never sent before it is due), not a duration of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx
import msgspec
import pytest
from aiohttp import web

from kvstore_fixtures import KVStoreProc
from worker_stubs import listening, metric, worker_app
from pdserve.kvstore.connector.handoff import HANDOFF_KEY
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig

TEACHING_HOLD_S = 0.2  # how long the first prefill leg takes: the speed the router learns
TIMING = "pdserve_router_overlap_timing_seconds"


@dataclass
class Leg:
    at: float  # time.perf_counter() when the stub got it (the router runs in this process: one clock)
    body: dict[str, Any]


class Stubs:
    """The stub prefill and decode workers; `gate` (when set to an Event) holds prefill answers until it is set."""

    def __init__(self, store_url: str) -> None:
        self.params = {"pdserve": 1, "kvstore_url": store_url, "namespace": "late-send", "chunk_size": 256}
        self.hold_s = 0.0
        self.gate: asyncio.Event | None = None
        self.fail = False  # prefill legs answer 500
        self.prefill_legs: list[Leg] = []
        self.prefill_answered = 0
        self.prefill_cancelled = 0
        self.decode_legs: list[Leg] = []

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub", "object": "model"}]})

    async def health(self, _r: web.Request) -> web.Response:
        return web.Response()

    async def tokenize(self, r: web.Request) -> web.Response:
        words = msgspec.json.decode(await r.read())["prompt"].split()
        return web.json_response({"tokens": [len(w) for w in words], "count": len(words)})

    async def prefill(self, r: web.Request) -> web.Response:
        self.prefill_legs.append(Leg(time.perf_counter(), msgspec.json.decode(await r.read())))
        try:
            await asyncio.sleep(self.hold_s)
            if self.gate is not None:
                await self.gate.wait()
        except asyncio.CancelledError:  # the router closed the leg: vLLM would abort it
            self.prefill_cancelled += 1
            raise
        if self.fail:
            return web.json_response({"error": {"message": "stub prefill down"}}, status=500)
        self.prefill_answered += 1
        return web.json_response({"choices": [{"index": 0, "text": "p"}], "kv_transfer_params": self.params})

    async def decode(self, r: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await r.read())
        self.decode_legs.append(Leg(time.perf_counter(), body))
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": "d", "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "d"}]}\n\ndata: [DONE]\n\n')
        return resp

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[tuple[str, str]]:
        """(prefill URL, decode URL) while both stubs listen."""
        async with listening(worker_app(self.health, self.models, self.prefill, {"/tokenize": self.tokenize}),
                             worker_app(self.health, self.models, self.decode)) as (prefill, decode):
            yield prefill, decode


@dataclass
class Routed:
    stubs: Stubs
    client: httpx.AsyncClient

    async def metric(self, name: str, **labels: str) -> float:
        """A sample of the router's /metrics (0 when absent)."""
        return await metric(self.client, name, **labels)

    def complete(self, words: int, stream: bool = True) -> "asyncio.Future[httpx.Response]":
        body = {"model": "stub", "prompt": " ".join(f"w{i}" for i in range(words)), "max_tokens": 2, "stream": stream}
        return asyncio.ensure_future(self.client.post("/v1/completions", json=body))


@pytest.fixture
async def routed(store: KVStoreProc, request: pytest.FixtureRequest) -> AsyncIterator[Routed]:
    """The stubs and a client of a router over them that has learned the producer's store, a prefill
    speed and a decode leg's ingest (from one streamed request in sequence); an indirect parameter
    adds RouterConfig fields."""
    stubs = Stubs(store.url)
    async with stubs.serve() as (prefill, decode):
        # the overlapped flow for every streamed request: the handed-token one runs the legs in sequence
        cfg = RouterConfig(prefill_urls=(prefill,), decode_urls=(decode,), pd_min_prompt_tokens=0,
                           pd_queue_aware=False, pd_first_token=False, health_interval=600.0,
                           **getattr(request, "param", {}))
        app = create_app(cfg)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=60) as client:
                r = Routed(stubs, client)
                stubs.hold_s = TEACHING_HOLD_S
                assert _text(await r.complete(100)) == "d"
                stubs.hold_s = 0.0
                assert await r.metric("pdserve_router_paths_total", path="pd") == 1  # no store known yet
                assert await r.metric(TIMING, figure="prefill_per_token") > 0
                assert await r.metric(TIMING, figure="decode_ingest") > 0
                stubs.prefill_legs.clear()
                stubs.decode_legs.clear()
                stubs.prefill_answered = 0
                yield r


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
    return "".join(msgspec.json.decode(e)["choices"][0]["text"] for e in events)


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.005)


async def _due_after(r: Routed, words: int) -> float:
    """Seconds after a prefill leg of `words` tokens is placed (on an idle worker) that the router
    should send its decode leg, by the router's own figures."""
    per_token = await r.metric(TIMING, figure="prefill_per_token")
    ingest = await r.metric(TIMING, figure="decode_ingest")
    return words * per_token - ingest


async def test_the_decode_leg_goes_out_at_the_prefills_predicted_end_not_before(routed: Routed) -> None:
    """A prompt 5x the taught one is due about 1 s in: its decode leg goes out while the prefill is
    still held (an overlapped leg, waiting in the store by the handoff id), and not before it is due."""
    stubs = routed.stubs
    due = await _due_after(routed, 500)
    assert due > 0
    stubs.gate = asyncio.Event()
    t_request = time.perf_counter()
    answer = routed.complete(500)
    await asyncio.wait_for(_until(lambda: len(stubs.decode_legs) == 1), 30)
    assert stubs.prefill_answered == 0 and len(stubs.prefill_legs) == 1  # the prefill is still held
    leg = stubs.decode_legs[0]
    # The prefill leg was placed after the request came in, and the decode leg is due `due` after that.
    assert leg.at - t_request >= due
    assert leg.body["kv_transfer_params"][HANDOFF_KEY] == stubs.prefill_legs[0].body["kv_transfer_params"][HANDOFF_KEY]
    stubs.gate.set()
    assert _text(await answer) == "d"
    assert await routed.metric("pdserve_router_overlap_sends_total", at="estimate") == 1
    assert await routed.metric("pdserve_router_paths_total", path="pd_overlap") == 1


@pytest.mark.parametrize("routed", [{"pd_overlap_send": "start"}], indirect=True)
async def test_overlap_send_start_sends_the_decode_leg_with_the_prefill_leg(routed: Routed) -> None:
    """--pd-overlap-send start: with the timing learned all the same, the decode leg goes out while
    the prefill is held, under the same handoff id, counted at=start."""
    stubs = routed.stubs
    assert await _due_after(routed, 500) > 0
    stubs.gate = asyncio.Event()
    answer = routed.complete(500)
    await asyncio.wait_for(_until(lambda: len(stubs.decode_legs) == 1), 30)
    assert stubs.prefill_answered == 0 and len(stubs.prefill_legs) == 1
    assert (stubs.decode_legs[0].body["kv_transfer_params"][HANDOFF_KEY]
            == stubs.prefill_legs[0].body["kv_transfer_params"][HANDOFF_KEY])
    stubs.gate.set()
    assert _text(await answer) == "d"
    assert await routed.metric("pdserve_router_overlap_sends_total", at="start") == 1
    assert await routed.metric("pdserve_router_overlap_sends_total", at="estimate") == 0


async def test_a_prefill_that_answers_before_its_decode_leg_is_due_gets_a_leg_built_from_its_answer(
    routed: Routed,
) -> None:
    """A prompt due a minute in whose prefill answers at once: no leg was out, so the one that goes
    out is the sequential flow's, carrying the prefill's kv_transfer_params."""
    assert await _due_after(routed, 30000) > 30
    assert _text(await routed.complete(30000)) == "d"
    stubs = routed.stubs
    assert len(stubs.decode_legs) == 1 and stubs.decode_legs[0].at > stubs.prefill_legs[0].at
    assert stubs.decode_legs[0].body["kv_transfer_params"] == stubs.params
    assert await routed.metric("pdserve_router_overlap_sends_total", at="answer") == 1
    assert await routed.metric("pdserve_router_overlap_sends_total", at="estimate") == 0
    assert await routed.metric("pdserve_router_paths_total", path="pd_overlap") == 1


async def test_a_prefill_that_fails_before_its_decode_leg_is_due_means_one_decode_only_leg(routed: Routed) -> None:
    stubs = routed.stubs
    stubs.fail = True
    assert _text(await routed.complete(30000)) == "d"
    assert len(stubs.prefill_legs) == 1  # one prefill worker: its 500 leaves none to retry on
    assert len(stubs.decode_legs) == 1 and "kv_transfer_params" not in stubs.decode_legs[0].body
    assert await routed.metric("pdserve_router_overlap_sends_total") == 0
    assert await routed.metric("pdserve_router_paths_total", path="decode_only_prefill_failed") == 1


async def test_a_request_cancelled_before_its_decode_leg_is_due_sends_none_and_closes_its_prefill(
    routed: Routed,
) -> None:
    """The cancel a client's hang-up makes (ClientWatch cancels the request's task; here the client's
    own task is the router's, through ASGITransport) lands while the leg is not yet due."""
    stubs = routed.stubs
    stubs.gate = asyncio.Event()
    answer = routed.complete(30000)
    await asyncio.wait_for(_until(lambda: len(stubs.prefill_legs) == 1), 30)
    answer.cancel()
    await asyncio.wait_for(_until(lambda: stubs.prefill_cancelled == 1), 30)
    assert stubs.decode_legs == [] and stubs.prefill_answered == 0
    assert await routed.metric("pdserve_router_overlap_sends_total") == 0
