"""A prefill worker that answers 200 with what is not a prefill answer (fast tier: an in-process router over
stub workers on real sockets). Such a worker failed every request with the router's 500 (not JSON, a JSON
list), or filled the router's memory (a 1.5 GB answer took it to 3.1 GB); now its leg is a failed leg,
counted and moved on from, and the request is served decode-only."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest
from aiohttp import web

from worker_stubs import healthy, listening, metric, router_client, serves_stub, worker_app
from pdserve.router.config import RouterConfig
from pdserve.router.flow import prefill_leg

ANSWER_CAP = 1 << 20  # the test's prefill answer allowance (ANSWER_BASE_BYTES), so "too large" is 3 MiB here


class BrokenPrefill:
    """Answers every prefill leg 200 with `self.body`, or with `self.stream_mib` MiB of one JSON string."""

    def __init__(self) -> None:
        self.body = b""
        self.stream_mib = 0
        self.legs = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.legs += 1
        if not self.stream_mib:
            return web.Response(body=self.body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            await resp.write(b'{"choices":[{"text":"')
            for _ in range(self.stream_mib):
                await resp.write(b"a" * (1 << 20))
            await resp.write(b'"}]}')
        except (ConnectionError, RuntimeError):  # the router closed the connection
            pass
        return resp


async def decode(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"choices": [{"index": 0, "text": " fine", "finish_reason": "length"}]})


@pytest.fixture
async def routed(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[BrokenPrefill, httpx.AsyncClient]]:
    monkeypatch.setattr(prefill_leg, "ANSWER_BASE_BYTES", ANSWER_CAP)
    broken = BrokenPrefill()
    async with listening(worker_app(healthy, serves_stub, broken.completions),
                         worker_app(healthy, serves_stub, decode)) as (prefill_url, decode_url):
        cfg = RouterConfig(prefill_urls=(prefill_url,), decode_urls=(decode_url,), pd_min_prompt_tokens=0,
                           pd_queue_aware=False, pd_first_token=False, pd_overlap=False, health_interval=600.0)
        async with router_client(cfg) as client:
            yield broken, client


@pytest.mark.parametrize("body", [b"<html>a proxy's page</html>", b"[1,2,3]", b'"text"', b'{"choices":'])
async def test_an_unreadable_answer_is_the_workers_failure(routed: tuple[BrokenPrefill, httpx.AsyncClient],
                                                           body: bytes) -> None:
    broken, client = routed
    broken.body = body
    for n in (1, 2):
        r = await client.post("/v1/completions", json={"model": "stub", "prompt": "a b c d", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " fine", r.text
        assert broken.legs == n  # it was asked, and its answer not taken
    assert await metric(client, "pdserve_router_paths_total", path="decode_only_prefill_failed") == 2
    assert await metric(client, "pdserve_router_retries_total", leg="prefill") == 2


async def test_an_answer_without_end_is_cut_at_its_limit(routed: tuple[BrokenPrefill, httpx.AsyncClient]) -> None:
    broken, client = routed
    broken.stream_mib = 3  # three times what the test allows a short prompt's answer
    r = await client.post("/v1/completions", json={"model": "stub", "prompt": "a b c d", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " fine", r.text
    assert await metric(client, "pdserve_router_paths_total", path="decode_only_prefill_failed") == 1
    assert broken.legs == 1


def test_the_limit_grows_with_the_prompt() -> None:
    assert prefill_leg.answer_limit(0) == prefill_leg.ANSWER_BASE_BYTES
    # a 1M-token prompt's ids are at most 8 MiB as JSON: its allowance is far above that
    assert prefill_leg.answer_limit(1 << 20) - prefill_leg.ANSWER_BASE_BYTES >= 4 * 8 * (1 << 20)
