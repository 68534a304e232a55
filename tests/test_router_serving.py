"""The router's HTTP serving layer, fast tier: its completion routes' own error answers and the
server connections' gathered writes and deadlines (router/app.py, router/connections.py).

The completion routes bypass the middleware stack, so what the stack did for them they must
do themselves: answer bad input with OpenAI error JSON and close a connection whose body they
did not read; other methods on their paths still reach the stack's 405. These run an
in-process router (no worker needs to answer: every request here ends before a leg).
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager
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


@asynccontextmanager
async def _serving(app: Any, http: type, send_buffer: int | None = None,
                   **config: Any) -> AsyncIterator[tuple[str, int]]:
    """uvicorn in this loop with the protocol class `http`, on a loopback port; `send_buffer` sizes the
    listening socket's send buffer, which accepted connections inherit."""
    sock = socket.socket()
    if send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, loop="none", http=http, lifespan="off", log_level="warning", **config))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def deadline_server() -> AsyncIterator[tuple[str, int]]:
    """uvicorn with the router's server protocol, a short head deadline and a long keep-alive."""
    async with _serving(_ok, server_protocol(HEAD_TIMEOUT_S, 60.0), timeout_keep_alive=60) as address:
        yield address


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


HEAD_LIMIT = 4096


@pytest.fixture
async def head_limit_server() -> AsyncIterator[tuple[str, int]]:
    """uvicorn with the router's server protocol and a small head size limit."""
    async with _serving(_ok, server_protocol(60.0, 60.0, max_head_bytes=HEAD_LIMIT)) as address:
        yield address


async def _refused_as_too_large(reader: asyncio.StreamReader) -> None:
    answer = await asyncio.wait_for(reader.read(), 10)  # to EOF: the connection is closed after it
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert b'"code":431' in answer and b"over 4096 bytes" in answer


async def test_a_head_over_the_limit_gets_431_whatever_makes_it_large(head_limit_server) -> None:  # type: ignore[no-untyped-def]
    under = b"GET / HTTP/1.1\r\nHost: r\r\nX-Pad: " + b"a" * (HEAD_LIMIT - 100) + b"\r\n\r\n"
    heads = [
        b"GET /" + b"u" * HEAD_LIMIT + b" HTTP/1.1\r\nHost: r\r\n\r\n",  # the URL
        b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * (HEAD_LIMIT // 5) + b"\r\n",  # many small headers
        under[: under.index(b"\r\n\r\n")] + b"b" * 200 + b"\r\n\r\n",  # one line too long
    ]
    for head in heads:
        reader, writer = await asyncio.open_connection(*head_limit_server)
        writer.write(under)  # a head just under the limit, then the next one on the same connection
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        writer.write(head)
        await _refused_as_too_large(reader)
        writer.close()


async def test_a_header_line_that_never_ends_is_cut_near_the_limit(head_limit_server) -> None:  # type: ignore[no-untyped-def]
    """httptools buffers an unfinished header line and reports nothing: the bytes of the reads are counted."""
    reader, writer = await asyncio.open_connection(*head_limit_server)
    writer.write(b"GET / HTTP/1.1\r\nHost: r\r\nX-Pad: ")
    sent = 0
    with pytest.raises(ConnectionError):
        while sent < 100 * HEAD_LIMIT:  # the server stops reading it long before
            writer.write(b"a" * 1024)
            await writer.drain()
            sent += 1024
            await asyncio.sleep(0.001)  # separate reads, as a slow client's are
    assert sent < 100 * HEAD_LIMIT
    writer.close()


async def test_a_trailer_that_never_ends_is_cut_and_small_chunks_are_not(head_limit_server) -> None:  # type: ignore[no-untyped-def]
    """A chunked body's trailers are kept whole by httptools too; chunks, however small, are body."""
    head = b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
    reader, writer = await asyncio.open_connection(*head_limit_server)
    writer.write(head)
    for _ in range(2 * HEAD_LIMIT // 8):  # more chunk framing than the limit, in reads of their own
        writer.write(b"1\r\nx\r\n")
        await writer.drain()
        await asyncio.sleep(0)
    writer.write(b"0\r\n\r\n")
    assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    writer.write(head + b"3\r\nabc\r\n0\r\nX-Trailer: ")
    sent = 0
    with pytest.raises(ConnectionError):
        while sent < 100 * HEAD_LIMIT:
            writer.write(b"a" * 1024)
            await writer.drain()
            sent += 1024
            await asyncio.sleep(0.001)
    assert sent < 100 * HEAD_LIMIT
    writer.close()


async def test_a_body_in_the_same_read_as_its_head_does_not_count_as_head(head_limit_server) -> None:  # type: ignore[no-untyped-def]
    body = b"x" * (4 * HEAD_LIMIT)
    reader, writer = await asyncio.open_connection(*head_limit_server)
    writer.write(b"POST / HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    writer.close()


SEND_TIMEOUT_S = 0.3
STREAM_BYTES = 600_000
PIECE = b"x" * 16384


class Streamer:
    """An ASGI app streaming STREAM_BYTES; records how each of its responses ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    async def __call__(self, _scope: object, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(STREAM_BYTES // len(PIECE)):
            await send({"type": "http.response.body", "body": PIECE, "more_body": True})
            await asyncio.sleep(0)  # a pass per piece, as the relay's come from the worker's reads
        # uvicorn's send returns quietly once the client is gone; before the response's end, receive says so
        self.ended.append("http.disconnect" if await _gone(receive) else "complete")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _gone(receive: Any) -> bool:
    try:
        return (await asyncio.wait_for(receive(), 0.05))["type"] == "http.disconnect"
    except asyncio.TimeoutError:
        return False


@pytest.fixture
async def stream_server() -> AsyncIterator[tuple[tuple[str, int], Streamer]]:
    """uvicorn with the router's server protocol and a short send timeout. Its listening socket's small send
    buffer (inherited by the connections) keeps the kernel from absorbing the answer: writes pause soon."""
    app = Streamer()
    async with _serving(app, server_protocol(60.0, SEND_TIMEOUT_S), send_buffer=16384) as address:
        yield address, app


async def _request(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, address)
    await asyncio.get_running_loop().sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: r\r\n\r\n")
    return sock


async def _read(sock: socket.socket, size: int) -> bytes:
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, size), 5)
    except ConnectionResetError:
        return b""


async def test_a_client_that_takes_no_byte_for_the_send_timeout_is_cut(stream_server) -> None:  # type: ignore[no-untyped-def]
    address, app = stream_server
    sock = await _request(address)
    try:
        await asyncio.sleep(4 * SEND_TIMEOUT_S)  # reads nothing
        got = b""
        while chunk := await _read(sock, 1 << 20):
            got += chunk
        assert got.startswith(b"HTTP/1.1 200") and len(got) < STREAM_BYTES  # cut: what was buffered, then the end
        assert app.ended == ["http.disconnect"]
    finally:
        sock.close()


async def test_a_client_that_reads_slower_than_the_send_timeout_drains_is_not_cut(stream_server) -> None:  # type: ignore[no-untyped-def]
    """8 KB every 0.1 s: draining the transport's buffer from its high-water mark to its low one takes longer
    than the send timeout, so the timer fires while writing is paused, and finds bytes taken."""
    address, app = stream_server
    sock = await _request(address)
    got = b""
    try:
        while not got.endswith(b"0\r\n\r\n"):
            chunk = await _read(sock, 8192)
            assert chunk, f"cut after {len(got)} bytes while reading"
            got += chunk
            await asyncio.sleep(0.1)
    finally:
        sock.close()
    assert got.count(b"x") == STREAM_BYTES - STREAM_BYTES % len(PIECE) and app.ended == ["complete"]
