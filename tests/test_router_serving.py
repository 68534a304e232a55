"""The router's HTTP serving layer, fast tier: its completion routes' own error answers and the
server connections' gathered writes (router/app.py, router/connections.py).

The completion routes bypass the middleware stack, so what the stack did for them they must
do themselves: answer bad input with OpenAI error JSON and close a connection whose body they
did not read; other methods on their paths still reach the stack's 405. These run an
in-process router (no worker needs to answer: every request here ends before a leg).
"""

from __future__ import annotations

import asyncio
import socket
from typing import AsyncIterator

import httpx
import pytest

from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.connections import GatheredWrites

KEY = "sk-serving-test"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(RouterConfig(decode_urls=("http://127.0.0.1:9",), api_key=KEY, max_request_bytes=1000))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            yield c


def _error(r: httpx.Response) -> dict[str, object]:
    err = r.json()["error"]
    assert err["code"] == r.status_code
    return err  # type: ignore[no-any-return]


async def test_completion_routes_answer_bad_input_with_openai_errors(client: httpx.AsyncClient) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    r = await client.post("/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and _error(r)["type"] == "BadRequestError"
    assert "connection" not in r.headers  # the body was read: the connection may serve the next request
    r = await client.post("/v1/chat/completions", json={"messages": "hi"}, headers=auth)
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    r = await client.post("/v1/completions", content=b"x" * 2000, headers=auth)
    assert r.status_code == 413 and _error(r)["type"] == "RequestTooLargeError"
    assert r.headers["connection"] == "close"
    r = await client.get("/v1/completions", headers=auth)  # not a POST: through the stack to the route's 405
    assert r.status_code == 405 and _error(r)["type"] == "MethodNotAllowed"


async def test_an_unauthorized_completion_closes_the_connection_only_when_a_body_was_left_unread(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and _error(r)["type"] == "AuthenticationError"
    assert r.headers["connection"] == "close"
    r = await client.post("/v1/completions", headers={"Authorization": "Bearer wrong", "Content-Length": "0"})
    assert r.status_code == 401 and "connection" not in r.headers
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_router_requests_total{route="completions",status="401"} 2.0' in metrics


class _Held(asyncio.Protocol):
    """A server connection that writes an answer in three pieces, as uvicorn writes a short stream."""

    def __init__(self, made: asyncio.Future[_Held]) -> None:
        self.made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = GatheredWrites(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        self.made.set_result(self)

    def answer(self) -> None:
        for piece in (b"head|", b"chunk|", b"end"):
            self.transport.write(piece)


async def _connected() -> tuple[asyncio.Server, _Held, socket.socket]:
    loop = asyncio.get_running_loop()
    made: asyncio.Future[_Held] = loop.create_future()
    server = await loop.create_server(lambda: _Held(made), "127.0.0.1", 0)
    sock = socket.create_connection(server.sockets[0].getsockname()[:2])
    sock.setblocking(False)
    return server, await made, sock


def _received(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except BlockingIOError:
        return b""


async def test_writes_of_one_loop_pass_go_out_together_on_the_next() -> None:
    server, conn, sock = await _connected()
    try:
        conn.answer()
        assert _received(sock) == b""  # held: nothing sent while the pass that wrote runs
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert _received(sock) == b"head|chunk|end"
        conn.answer()
        conn.transport.close()  # closing sends what is held first
        await asyncio.sleep(0)
        data = b""
        while (more := _received(sock)) or not data:
            data += more
            await asyncio.sleep(0)
        assert data == b"head|chunk|end"
    finally:
        sock.close()
        server.close()
