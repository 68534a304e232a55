"""`--pd-first-token` when things go wrong around the handed token (fast tier): a real `pdserve router`
over stub workers. While the decode workers' context length is unknown, the decode leg answers its
headers before the client gets the token, so a decode engine that refuses the request gives the client
its error response, as in the default flow. Once their /v1/models say it (vLLM's cards carry
`max_model_len`), a request that fits gets its token before the decode leg's headers, and a refusal
then ends the stream with an error event. A client that hangs up before or after the token has its
decode leg aborted, and the router serves on."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

import httpx
from aiohttp import web

from procs import Proc
from router_fixtures import metric, start_router
from worker_stubs import Handler, healthy, listening, serves_stub, worker_app

BODY = {"model": "stub", "prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True, "temperature": 0.0}


class Workers:
    """A prefill stub that hands token 42 (" hi") and a decode stub told how to behave."""

    def __init__(self) -> None:
        self.decode_mode = "hang"
        self.decode_started = asyncio.Event()
        self.decode_aborted = asyncio.Event()

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
            return web.json_response({"error": {"message": "too long", "type": "BadRequestError"}}, status=400)
        if self.decode_mode == "drop":  # the engine dies with the request: the connection closes, no answer
            assert r.transport is not None
            r.transport.close()
            return web.Response()
        try:
            if self.decode_mode == "slow":  # headers, then no token until the router hangs up
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(r)
            await asyncio.sleep(3600)  # "hang": not even headers
        except asyncio.CancelledError:
            self.decode_aborted.set()
            raise
        return web.Response()

    def reset(self, mode: str) -> None:
        self.decode_mode = mode
        self.decode_started.clear()
        self.decode_aborted.clear()


async def _aborts_counted(url: str, n: int, status: str = "499") -> None:
    for _ in range(100):
        if metric(url, "pdserve_router_requests_total", {"status": status}) == n:
            return
        await asyncio.sleep(0.1)
    assert metric(url, "pdserve_router_requests_total", {"status": status}) == n


async def serves_stub_of_length(_r: web.Request) -> web.Response:
    """/v1/models of a stub serving "stub" with a 64-token context, as vLLM's cards say it."""
    return web.json_response({"data": [{"id": "stub", "object": "model", "max_model_len": 64}]})


@contextlib.asynccontextmanager
async def first_token_router(w: Workers, models: Handler) -> AsyncIterator[Proc]:
    """A `--pd-first-token` router over the stubs (their /v1/models from `models`); its log clean at the end."""
    async with listening(worker_app(healthy, models, w.prefill), worker_app(healthy, models, w.decode)) as (p, d):
        router = await asyncio.to_thread(start_router, "--prefill", p, "--decode", d, "--pd-min-prompt-tokens", "0",
                                         "--pd-first-token", "--no-pd-queue-aware")
        try:
            yield router
            log = router.log_path.read_text(errors="replace")
            assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        finally:
            router.stop()


def _events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]


async def test_hang_ups_and_refusals_around_the_handed_token() -> None:
    w = Workers()
    async with first_token_router(w, serves_stub) as router, httpx.AsyncClient(timeout=30) as client:
        # gone after the token: the decode leg (headers sent, no token yet) is aborted
        w.reset("slow")
        async with client.stream("POST", router.url + "/v1/completions", json=BODY) as r:
            assert r.status_code == 200
            assert _events(await anext(r.aiter_lines()))[0]["choices"][0]["text"] == " hi"
        await asyncio.wait_for(w.decode_aborted.wait(), 10)
        await _aborts_counted(router.url, 1)

        # gone before the token (the decode engine never answers its headers): aborted the same
        w.reset("hang")
        try:
            await client.post(router.url + "/v1/completions", json=BODY, timeout=1.0)
            raise AssertionError("the router answered without its decode leg's headers")
        except httpx.ReadTimeout:
            pass
        await asyncio.wait_for(w.decode_aborted.wait(), 10)
        await _aborts_counted(router.url, 2)

        # the decode engine refuses the request: its error is the response, no token before it
        w.reset("error")
        r = await client.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 400 and r.json()["error"]["message"] == "too long"
        assert (await client.get(router.url + "/health")).status_code == 200


async def test_a_request_that_fits_the_context_gets_its_token_before_the_decode_legs_headers() -> None:
    w = Workers()
    async with first_token_router(w, serves_stub_of_length) as router, httpx.AsyncClient(timeout=30) as client:
        # the decode engine has not even answered its headers, and the token is out
        w.reset("hang")
        async with client.stream("POST", router.url + "/v1/completions", json=BODY) as r:
            assert r.status_code == 200
            first = await asyncio.wait_for(anext(r.aiter_lines()), 10)
            assert _events(first)[0]["choices"][0]["text"] == " hi"
            await asyncio.wait_for(w.decode_started.wait(), 10)
        # gone while the decode leg was opening: it is aborted and counted as the client's
        await asyncio.wait_for(w.decode_aborted.wait(), 10)
        await _aborts_counted(router.url, 1)

        # a refusal after the token ends the stream with the engine's error as an event; an engine that
        # dies before its headers ends it with the router's 502 event
        for mode, status, last in (("error", "400", {"message": "too long"}), ("drop", "502", {"code": 502})):
            w.reset(mode)
            r = await client.post(router.url + "/v1/completions", json=BODY)
            events = _events(r.text)
            assert r.status_code == 200 and events[0]["choices"][0]["text"] == " hi"
            assert last.items() <= events[-1]["error"].items(), r.text
            await _aborts_counted(router.url, 1, status=status)

        # too long for the context (4 + 61 > 64): headers first, the refusal is the response
        w.reset("error")
        r = await client.post(router.url + "/v1/completions", json={**BODY, "max_tokens": 61})
        assert r.status_code == 400 and r.json()["error"]["message"] == "too long"
        await _aborts_counted(router.url, 2, status="400")
        assert (await client.get(router.url + "/health")).status_code == 200
