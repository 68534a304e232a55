"""A streamed decode leg retried on another worker, whose answer then goes wrong (fast tier): a real
`pdserve router` over stub workers. The first decode worker drops its stream before any token; the
router opens the leg again on the second, which refuses the request (a 4xx) and drops the connection
before its body is whole. The client's stream still ends with an OpenAI error event, counted as the
router's 502, and the router stays healthy with no slot left in flight."""

from __future__ import annotations

import asyncio
import json

import httpx
from aiohttp import web

from router_fixtures import metric, start_router
from worker_stubs import healthy, listening, serves_stub, worker_app

BODY = {"model": "stub", "prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True}


class Decoders:
    """Both decode stubs' handler: the first leg, wherever it lands, drops its stream before any token; the
    next is refused (a 4xx, the request's fault, so the router tries no further worker) with a body that
    stops halfway (its Content-Length promises more than comes)."""

    def __init__(self) -> None:
        self.legs = 0

    async def handle(self, r: web.Request) -> web.StreamResponse:
        await r.read()
        self.legs += 1
        if self.legs == 1:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(r)
            await resp.write(b": keep-alive\n\n")
        else:
            resp = web.StreamResponse(status=400, headers={"Content-Type": "application/json", "Content-Length": "200"})
            await resp.prepare(r)
            await resp.write(b'{"error": {"message": "over')
        assert r.transport is not None
        r.transport.close()
        return resp


async def test_a_retried_decode_leg_whose_refusal_cannot_be_read_ends_the_stream_with_an_error_event() -> None:
    decoders = Decoders()
    async with listening(*(worker_app(healthy, serves_stub, decoders.handle) for _ in range(2))) as urls:
        router = await asyncio.to_thread(start_router, "--decode", *urls, "--health-interval", "600")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", router.url + "/v1/completions", json=BODY) as r:
                    assert r.status_code == 200
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                assert len(lines) == 1, lines
                error = json.loads(lines[0][len("data: "):])["error"]
                assert error["code"] == 502 and "decode worker failed" in error["message"], error
                assert metric(router.url, "pdserve_router_retries_total", {"leg": "decode"}) == 1
                assert metric(router.url, "pdserve_router_requests_total", {"status": "502"}) == 1
                assert decoders.legs == 2
                assert metric(router.url, "pdserve_router_inflight") == 0
                assert (await client.get(router.url + "/health")).status_code == 200
            log = router.log_path.read_text(errors="replace")
            assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        finally:
            router.stop()
