"""router/worker_http.py, the legs' HTTP client, against a real HTTP server on loopback.

The server is scripted per path (tests/ owns it, below), because the client's job is as much
the misbehaving worker as the good one: a stream in pieces, keep-alive reuse, a body cut off,
a close before the head, bytes that are not HTTP, a silence, a request never answered. Each
failure must come out as the aiohttp exception type the breaker classifies (upstream.py).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import httptools
import pytest

from pdserve.router.upstream import is_hard_failure
from pdserve.router.worker_http import WorkerHTTP

Handler = Callable[[asyncio.Transport, bytes], Awaitable[None]]


def _chunked_head(extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + extra + b"\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Scripted:
    """An HTTP/1.1 server whose answer to each path is a coroutine writing raw bytes to the socket."""

    def __init__(self) -> None:
        self.connections = 0
        self.bodies: list[bytes] = []
        self.hung_up: asyncio.Queue[str] = asyncio.Queue()  # paths whose client closed before the answer's end
        self.release = asyncio.Event()  # lets /stream's last piece go
        self.handlers: dict[bytes, Handler] = {
            b"/unary": self.unary, b"/stream": self.stream, b"/cut-body": self.cut_body,
            b"/no-head": self.no_head, b"/not-http": self.not_http, b"/silent": self.silent,
            b"/never": self.never, b"/close-after": self.close_after, b"/until-close": self.until_close,
        }

    async def unary(self, t: asyncio.Transport, body: bytes) -> None:
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    async def stream(self, t: asyncio.Transport, _body: bytes) -> None:
        t.write(_chunked_head() + _chunk(b"data: 1\n\n"))
        await self.release.wait()
        t.write(_chunk(b"data: 2\n\n") + b"0\r\n\r\n")

    async def cut_body(self, t: asyncio.Transport, _body: bytes) -> None:
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
        t.close()

    async def no_head(self, t: asyncio.Transport, _body: bytes) -> None:
        t.close()

    async def not_http(self, t: asyncio.Transport, _body: bytes) -> None:
        t.write(b"SPEAKING SOMETHING ELSE\r\n\r\n")

    async def silent(self, t: asyncio.Transport, _body: bytes) -> None:
        t.write(_chunked_head())  # and then nothing

    async def never(self, _t: asyncio.Transport, _body: bytes) -> None:
        pass

    async def close_after(self, t: asyncio.Transport, _body: bytes) -> None:
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    async def until_close(self, t: asyncio.Transport, _body: bytes) -> None:
        t.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        t.close()


OPEN_ENDED = (b"/never", b"/silent")  # answers that never end: the client hangs up on them


class _ServerConn(asyncio.Protocol):
    def __init__(self, server: Scripted) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = b""
        self.pending: str | None = None  # the path being answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connections += 1

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        url, body, self.url, self.body = self.url, self.body, b"", b""
        self.server.bodies.append(body)
        self.pending = url.decode()
        task = asyncio.ensure_future(self.server.handlers[url](self.transport, body))  # type: ignore[arg-type]
        if url not in OPEN_ENDED:
            task.add_done_callback(lambda _t: setattr(self, "pending", None))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pending is not None:
            self.server.hung_up.put_nowait(self.pending)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Scripted, str, WorkerHTTP]]:
    scripted = Scripted()
    server = await asyncio.get_running_loop().create_server(lambda: _ServerConn(scripted), "127.0.0.1", 0)
    base = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
    http = WorkerHTTP()
    try:
        yield scripted, base, http
    finally:
        await http.close()
        server.close()


T = aiohttp.ClientTimeout(sock_read=30.0, connect=5.0)
HEADERS = {"Content-Type": "application/json", "X-Request-Id": "r1"}


async def test_a_stream_comes_in_pieces_and_its_connection_serves_the_next_request(served) -> None:  # type: ignore[no-untyped-def]
    scripted, base, http = served
    resp = await http.post(base + "/stream", data=b'{"prompt": "x"}', headers=HEADERS, timeout=T)
    assert resp.status == 200 and not resp.closed
    pieces = []
    async for chunk in resp.content.iter_any():
        pieces.append(chunk)
        scripted.release.set()  # the second piece only once the first was read
    assert pieces == [b"data: 1\n\n", b"data: 2\n\n"] and resp.closed
    async with http.post(base + "/unary", data=b"echo", headers=HEADERS, timeout=T) as again:
        assert again.status == 200 and await again.read() == b"echo"
    assert scripted.connections == 1  # both on one keep-alive connection
    assert scripted.bodies == [b'{"prompt": "x"}', b"echo"]


async def test_closing_a_response_before_its_end_hangs_up_and_the_next_request_connects_anew(served) -> None:  # type: ignore[no-untyped-def]
    scripted, base, http = served
    resp = await http.post(base + "/stream", data=b"{}", headers=HEADERS, timeout=T)
    resp.close()  # as the relay does when the client leaves: vLLM aborts the request
    assert await scripted.hung_up.get() == "/stream"
    with pytest.raises(aiohttp.ClientConnectionError):
        await resp.read()
    assert await (await http.post(base + "/unary", data=b"x", headers=HEADERS, timeout=T)).read() == b"x"
    assert scripted.connections == 2


async def test_a_response_closed_while_its_reader_waits_wakes_the_reader_with_a_connection_error(served) -> None:  # type: ignore[no-untyped-def]
    _scripted, base, http = served
    resp = await http.post(base + "/stream", data=b"{}", headers=HEADERS, timeout=T)
    pieces = resp.content.iter_any()
    assert await pieces.__anext__() == b"data: 1\n\n"
    waiting = asyncio.ensure_future(pieces.__anext__())
    await asyncio.sleep(0)
    resp.close()  # a given-up overlapped leg (DecodeLeg.give_up): the relay must get an error and retry
    with pytest.raises(aiohttp.ClientConnectionError):
        await waiting


@pytest.mark.parametrize(("path", "error"), [
    ("/cut-body", aiohttp.ClientPayloadError),
    ("/no-head", aiohttp.ServerDisconnectedError),
    ("/not-http", aiohttp.ClientPayloadError),
])
async def test_a_worker_that_breaks_the_exchange_is_a_hard_failure(served, path: str, error: type) -> None:  # type: ignore[no-untyped-def]
    _scripted, base, http = served
    with pytest.raises(error) as exc:
        resp = await http.post(base + path, data=b"{}", headers=HEADERS, timeout=T)
        await resp.read()
    assert is_hard_failure(exc.value)


async def test_no_worker_listening_is_a_hard_failure() -> None:
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(aiohttp.ClientOSError) as exc:
        await WorkerHTTP().post(f"http://127.0.0.1:{port}/v1/completions", data=b"{}", headers=HEADERS, timeout=T)
    assert is_hard_failure(exc.value)


async def test_a_silence_longer_than_sock_read_is_a_soft_failure_and_hangs_up(served) -> None:  # type: ignore[no-untyped-def]
    scripted, base, http = served
    resp = await http.post(base + "/silent", data=b"{}", headers=HEADERS,
                           timeout=aiohttp.ClientTimeout(sock_read=0.2, connect=5.0))
    assert resp.status == 200
    with pytest.raises(aiohttp.SocketTimeoutError) as exc:
        await resp.read()
    assert not is_hard_failure(exc.value)  # slow, not dead
    assert await scripted.hung_up.get() == "/silent"


async def test_a_total_deadline_covers_the_wait_for_the_head(served) -> None:  # type: ignore[no-untyped-def]
    scripted, base, http = served
    with pytest.raises(asyncio.TimeoutError) as exc:
        await http.post(base + "/never", data=b"{}", headers=HEADERS, timeout=aiohttp.ClientTimeout(total=0.2))
    assert not is_hard_failure(exc.value)
    assert await scripted.hung_up.get() == "/never"


async def test_a_request_cancelled_before_its_head_hangs_up(served) -> None:  # type: ignore[no-untyped-def]
    scripted, base, http = served
    task = asyncio.ensure_future(http.post(base + "/never", data=b"{}", headers=HEADERS, timeout=T))
    while not scripted.bodies:
        await asyncio.sleep(0.01)
    task.cancel()  # the client left while the worker had not answered
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await scripted.hung_up.get() == "/never"


async def test_connections_the_worker_ends_are_not_reused(served) -> None:  # type: ignore[no-untyped-def]
    scripted, base, http = served
    async with http.post(base + "/close-after", data=b"{}", headers=HEADERS, timeout=T) as resp:
        assert await resp.read() == b"ok"
    async with http.post(base + "/until-close", data=b"{}", headers=HEADERS, timeout=T) as resp:
        assert await resp.read() == b"all of it"  # no length: the body ends with the connection
    assert await (await http.post(base + "/unary", data=b"x", headers=HEADERS, timeout=T)).read() == b"x"
    assert scripted.connections == 3


async def test_cut_fails_what_is_open_on_one_worker_and_leaves_other_workers_alone(served) -> None:  # type: ignore[no-untyped-def]
    scripted, base, http = served
    other = Scripted()
    server = await asyncio.get_running_loop().create_server(lambda: _ServerConn(other), "127.0.0.1", 0)
    other_base = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
    try:
        streaming = await http.post(base + "/stream", data=b"{}", headers=HEADERS, timeout=T)
        pieces = streaming.content.iter_any()
        assert await pieces.__anext__() == b"data: 1\n\n"
        before_head = asyncio.ensure_future(http.post(base + "/never", data=b"{}", headers=HEADERS, timeout=T))
        while len(scripted.bodies) < 2:
            await asyncio.sleep(0.01)
        await (await http.post(base + "/unary", data=b"x", headers=HEADERS, timeout=T)).read()  # a third, now idle
        elsewhere = await http.post(other_base + "/stream", data=b"{}", headers=HEADERS, timeout=T)
        # A worker whose engine died keeps its connections open without a byte more: the health check cuts them.
        assert http.cut(base, "decode worker is dead") == 2
        with pytest.raises(aiohttp.ClientPayloadError) as mid_body:
            await pieces.__anext__()
        with pytest.raises(aiohttp.ServerDisconnectedError) as no_head:
            await before_head
        assert is_hard_failure(mid_body.value) and is_hard_failure(no_head.value)  # retried elsewhere, not slow
        assert "dead" in str(mid_body.value) and "dead" in str(no_head.value)
        assert sorted([await scripted.hung_up.get(), await scripted.hung_up.get()]) == ["/never", "/stream"]
        # The idle connection went too: the next request connects anew.
        assert await (await http.post(base + "/unary", data=b"y", headers=HEADERS, timeout=T)).read() == b"y"
        assert scripted.connections == 4
        other.release.set()  # the other worker's stream was not touched
        assert await elsewhere.read() == b"data: 1\n\ndata: 2\n\n"
        assert http.cut(other_base, "nothing open") == 0
    finally:
        server.close()
