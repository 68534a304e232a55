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
from typing import Any, AsyncIterator

import httpx
import pytest
import uvicorn

from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.connections import GatheredWrites, server_protocol

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
        conn.transport.send_held()  # a response's end (the server protocol's on_response_complete): at once
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


async def _ok(_scope: object, _receive: object, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


HEAD_TIMEOUT_S = 0.2


@pytest.fixture
async def deadline_server() -> AsyncIterator[tuple[str, int]]:
    """uvicorn with the router's server protocol, a short head deadline and a long keep-alive."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_ok, loop="none", http=server_protocol(HEAD_TIMEOUT_S), lifespan="off",
                            timeout_keep_alive=60, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        await task


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    return await reader.read(1) == b""  # EOF: the server closed it


async def test_a_request_head_that_does_not_come_in_time_gets_the_connection_closed(deadline_server) -> None:  # type: ignore[no-untyped-def]
    silent_r, silent_w = await asyncio.open_connection(*deadline_server)  # sends nothing
    partial_r, partial_w = await asyncio.open_connection(*deadline_server)
    partial_w.write(b"POST /v1/completions HTTP/1.1\r\nHost: r")  # part of a head, then nothing
    assert await _closed_by_server(silent_r) and await _closed_by_server(partial_r)
    silent_w.close()
    partial_w.close()


async def test_a_keep_alive_connection_waits_for_its_next_request_beyond_the_head_deadline(deadline_server) -> None:  # type: ignore[no-untyped-def]
    reader, writer = await asyncio.open_connection(*deadline_server)
    request = b"GET / HTTP/1.1\r\nHost: r\r\n\r\n"
    for _ in range(2):
        writer.write(request)
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(3 * HEAD_TIMEOUT_S)  # idle between requests: uvicorn's keep-alive rules, not the deadline
    writer.write(b"GET / HTTP/1.1\r\n")  # a head begun after the idle time is held to the deadline again
    assert await _closed_by_server(reader)
    writer.close()
