"""The relay before a decode stream's first token (router/flow/relay.py, fast tier: an in-process router over
a stub decode worker on a real socket). It holds what comes until an event carries a token; it reads each
event once (it read everything again at every chunk: a worker that sent 64 MiB before an event's end held
the router's loop for 14 s of CPU), and past PENDING_MAX it relays what it holds as it is."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx
import pytest
from aiohttp import web

from worker_stubs import healthy, listening, router_client, serves_stub, worker_app
from pdserve.router.config import RouterConfig
from pdserve.router.flow import relay

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Decode:
    """Streams `self.chunks` as they are (each one write), whatever the request."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.pause_s = 0.0  # between writes, so that the router reads them apart

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in self.chunks:
            await resp.write(chunk)
            await asyncio.sleep(self.pause_s)
        return resp


@pytest.fixture
async def routed() -> AsyncIterator[tuple[Decode, httpx.AsyncClient]]:
    stub = Decode()
    app_ = worker_app(healthy, serves_stub, stub.completions, {"/v1/chat/completions": stub.completions})
    async with listening(app_) as (decode_url,):
        async with router_client(RouterConfig(decode_urls=(decode_url,), health_interval=600.0)) as client:
            yield stub, client


async def _chat(client: httpx.AsyncClient) -> bytes:
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        return b"".join([b async for b in r.aiter_bytes()])


async def test_events_split_anywhere_are_relayed_whole(routed: tuple[Decode, httpx.AsyncClient]) -> None:
    """The role event (no token), then a token whose event's end straddles two chunks ("\\n" | "\\n")."""
    stub, client = routed
    stream = ROLE + TOKEN + DONE
    cut = len(ROLE) + len(TOKEN) - 1
    stub.chunks = [ROLE[:10], ROLE[10:] + TOKEN[:5], stream[len(ROLE) + 5:cut], stream[cut:]]
    assert await _chat(client) == stream


@pytest.fixture
def inspected(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every buffer the relay inspects for a token, in order."""
    read: list[bytes] = []
    has_token = relay._has_token

    def recording(route: str, buf: bytes) -> bool:
        read.append(bytes(buf))
        return has_token(route, buf)  # type: ignore[arg-type]

    monkeypatch.setattr(relay, "_has_token", recording)
    return read


async def test_a_first_event_that_ends_in_a_later_chunk_is_read_from_its_start(
        routed: tuple[Decode, httpx.AsyncClient], inspected: list[bytes]) -> None:
    """The token's event opens the stream and ends in the next chunk: the relay reads it from its first byte
    (it once marked one byte of a chunk with no event's end as read, so `data:` lost its `d` and the event
    its token)."""
    stub, client = routed
    stub.chunks, stub.pause_s = [TOKEN[:20], TOKEN[20:], DONE], 0.1
    assert await _chat(client) == TOKEN + DONE
    assert inspected and inspected[0].startswith(TOKEN)


async def test_each_byte_before_the_first_token_is_read_once(routed: tuple[Decode, httpx.AsyncClient],
                                                             inspected: list[bytes]) -> None:
    stub, client = routed
    roles = [ROLE] * 2000  # events without a token, one chunk each, then the token
    stub.chunks = [*roles, TOKEN, DONE]
    assert await _chat(client) == b"".join(stub.chunks)
    assert sum(map(len, inspected)) <= len(b"".join(stub.chunks))  # the old relay read all it held at every read


async def test_a_stream_past_the_cap_is_relayed_as_it_is(routed: tuple[Decode, httpx.AsyncClient],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    stub, client = routed
    monkeypatch.setattr(relay, "PENDING_MAX", 1 << 20)
    head = b'data: {"choices":[{"index":0,"delta":{"content":"'
    stub.chunks = [head, *[b"a" * (1 << 16)] * 48, b'"}}]}\n\n', DONE]  # 3 MiB before the event ends
    assert await _chat(client) == b"".join(stub.chunks)
