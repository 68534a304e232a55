"""`--pd-first-token` when things go wrong after the handed token reached the client (fast tier): a real
`pdserve router` over stub workers. The client hangs up while the decode leg is being opened (the leg
is aborted, the router keeps serving), and decode workers that fail give the client the token and an
OpenAI error event, never a hang or a bare 5xx."""

from __future__ import annotations

import asyncio
import json

import httpx
from aiohttp import web

from router_fixtures import metric, start_router, sse_events
from worker_stubs import listening, worker_app

BODY = {"model": "stub", "prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True, "temperature": 0.0}


class Workers:
    """A prefill stub that hands token 42 (" hi") and a decode stub told how to behave."""

    def __init__(self) -> None:
        self.decode_mode = "hang"
        self.decode_started = asyncio.Event()
        self.decode_aborted = asyncio.Event()

    @staticmethod
    async def ok(_r: web.Request) -> web.Response:
        return web.Response()

    @staticmethod
    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub", "object": "model"}]})

    @staticmethod
    async def prefill(r: web.Request) -> web.Response:
        body = await r.json()
        return web.json_response({"choices": [{"index": 0, "text": " hi", "finish_reason": "length", "token_ids": [42],
                                               "prompt_token_ids": body["prompt"]}],
                                  "kv_transfer_params": {"pdserve": 1, "num_tokens": len(body["prompt"])}})

    async def decode(self, r: web.Request) -> web.StreamResponse:
        await r.read()
        self.decode_started.set()
        if self.decode_mode == "error":
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError"}}, status=500)
        try:
            await asyncio.sleep(3600)  # "hang": no headers until the router hangs up
        except asyncio.CancelledError:
            self.decode_aborted.set()
            raise
        return web.Response()


async def test_a_client_gone_after_the_handed_token_aborts_the_decode_leg() -> None:
    w = Workers()
    async with listening(worker_app(w.ok, w.models, w.prefill), worker_app(w.ok, w.models, w.decode)) as (p, d):
        router = await asyncio.to_thread(start_router, "--prefill", p, "--decode", d, "--pd-min-prompt-tokens", "0",
                                         "--pd-first-token", "--no-pd-queue-aware")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", router.url + "/v1/completions", json=BODY) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    first = await anext(lines)
                    assert json.loads(first[len("data: "):])["choices"][0]["text"] == " hi"
                    await asyncio.wait_for(w.decode_started.wait(), 10)
                # the client is gone: the router hangs up its decode leg (vLLM would abort the request)
                await asyncio.wait_for(w.decode_aborted.wait(), 10)
                for _ in range(100):
                    if metric(router.url, "pdserve_router_requests_total", {"status": "499"}) == 1:
                        break
                    await asyncio.sleep(0.1)
                assert metric(router.url, "pdserve_router_requests_total", {"status": "499"}) == 1

                # every decode worker failing: the token, then an OpenAI error event, and the stream ends
                w.decode_mode = "error"
                r = await client.post(router.url + "/v1/completions", json=BODY)
                assert r.status_code == 200
                events = sse_events(r.text.splitlines())
                assert json.loads(events[0])["choices"][0]["text"] == " hi"
                assert "error" in json.loads(events[-1])
                assert (await client.get(router.url + "/health")).status_code == 200
            log = router.log_path.read_text(errors="replace")
            assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        finally:
            router.stop()
