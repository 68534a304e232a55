"""The router's HTTP/1.1 client for the legs of a request (prefill and decode), on keep-alive connections.

Why not aiohttp here: under `pdserve bench router` (c=16, the stub upstream), a bare uvicorn
app relaying each request through one aiohttp request used 0.115-0.145 ms of CPU per request,
the same app over a bare asyncio protocol 0.057-0.064 ms. aiohttp's per-request machinery
(request and response objects, header multidicts, payload objects, a timer rescheduled on
every read, cookie and tracing hooks) was about a quarter of the router's CPU, for what a leg
needs: a POST of a bytes body to a worker, the status, and the body as it arrives. This module
does that and no more; health checks, /tokenize, /metrics scrapes and store calls stay on
aiohttp (upstream.py).

It behaves as aiohttp does where the flow depends on it, so the legs and the breaker's
classification (upstream.py) need nothing else: `post()` is awaited (the response once its
head is in) or used as `async with`; `aiohttp.ClientTimeout`'s `connect`, `sock_read` (the
longest silence while a response is awaited or read) and `total` (to the body's end) mean what
they mean there; failures are aiohttp's exception types: ClientOSError (cannot connect, or reset
before the head), ServerDisconnectedError (closed before the head), ClientPayloadError (closed
mid-body, or not HTTP), ClientConnectionError (reading a response that was closed),
ConnectionTimeoutError, SocketTimeoutError, and TimeoutError for `total`.

Connections: an idle list per worker (host, port, TLS), reused newest first. A response read
to its end puts its connection back; one closed before its end closes the connection, which
makes vLLM abort the request (as closing an aiohttp response did). A connection idle for
KEEPALIVE_S is not reused, so the router never sends on one that the worker's keep-alive timer
(uvicorn's default, vLLM's too: 5 s) is closing; one the worker closed leaves the list when
the loop sees it close. `cut` ends every response open on a worker that a health check found
dead: a worker whose engine died can keep its connections open without a byte more (vLLM's API
server, shutting down after its engine core was killed, waits for its streams to end).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from types import TracebackType
from typing import Any, AsyncIterator, Coroutine, Generator, Mapping, NamedTuple
from urllib.parse import urlsplit

import aiohttp
import httptools

KEEPALIVE_S = 4.0  # below the 5 s after which uvicorn (vLLM's server) closes an idle connection
HIGH_WATER = 1 << 16  # body bytes held unread before the socket is paused (aiohttp's read buffer size)
_TARGETS_MAX = 4096  # parsed request URLs kept (workers times routes; cleared when exceeded)


class _Target(NamedTuple):
    """Where a URL's requests go, and the first lines of their head."""

    host: str
    port: int
    tls: bool
    head: bytes  # the request line and Host header


def _oldest(legs: list[WorkerResponse], now: float) -> tuple[float, int]:
    """Seconds since the oldest of `legs` was sent, and its prompt tokens: what its worker computes first."""
    oldest = min(legs, key=lambda r: r.sent_at)
    return now - oldest.sent_at, oldest.work


def _worker_key(url: str) -> tuple[str, int, bool]:
    """(host, port, TLS) of a worker's base URL: what its connections are filed under."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    return parts.hostname or "", parts.port or (443 if tls else 80), tls


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]  # as the URL names it (an IPv6 address in brackets), without credentials
    return _Target(parts.hostname, port, tls, f"POST {path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1"))


def _head(target: _Target, headers: Mapping[str, str], length: int) -> bytes:
    lines = [target.head]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} holds a line break")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(b"Content-Length: %d\r\n\r\n" % length)
    return b"".join(lines)


class WorkerResponse:
    """A leg's response: `status` once its head is in, then its body as it arrives (`iter_any`, `read`)."""

    def __init__(self, conn: _Connection, timeout: aiohttp.ClientTimeout, deadline: float | None,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.closed = False  # read to its end, released or closed (as aiohttp's `closed`)
        self._conn: _Connection | None = conn  # until the body's end
        self._loop = loop
        self._headed: asyncio.Future[None] = loop.create_future()
        self._chunks: list[bytes] = []
        self._held = 0
        self._done = False  # the whole body is in
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sock_read = timeout.sock_read
        self._deadline = deadline
        self.sent_at = self._heard = loop.time()  # _heard: when the worker last sent bytes
        self.heard_any = False  # a byte of it came (its head, at least)
        self.bodied = False  # a byte of its body came: a stream that runs, or a whole answer
        self.silent = False  # waits, sending nothing, for what is not the worker's doing: no sign of a stall
        self.unary = False  # a whole answer generated: its engine steps with nothing sent (`generating`)
        self.work = 0  # prompt tokens the worker computes before its body can start (the stall watch's window)
        self._timer: asyncio.TimerHandle | None = None
        if self._sock_read or deadline is not None:
            self._timer = loop.call_at(self._next_check(), self._check)

    # ------------------------------------------------------------ the consumer's side

    @property
    def content(self) -> WorkerResponse:
        """The body stream, as aiohttp names it: `resp.content.iter_any()`."""
        return self

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives: all bytes in at each step, joined."""
        while True:
            if self._error is not None:
                raise self._error
            if self._chunks:
                chunks, self._chunks, self._held = self._chunks, [], 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                    self._heard = self._loop.time()  # a paused socket's silence was the reader's
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
                continue
            if self._done:
                return
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def speak(self) -> None:
        """From now on its silence counts, as if sent now (`silent` no more): a held decode leg whose prefill
        has answered."""
        self.silent = False
        self.sent_at = self._heard = self._loop.time()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; over `limit` bytes the connection is closed (the worker aborts the request) and
        ClientPayloadError raised, so a worker that answers without end cannot fill the router's memory."""
        chunks: list[bytes] = []
        held = 0
        async for chunk in self.iter_any():
            held += len(chunk)
            if limit is not None and held > limit:
                self.close()
                raise aiohttp.ClientPayloadError(f"answer over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Done with it: before the body's end this closes the connection (the worker aborts the request)."""
        self.closed = True
        self._fail(aiohttp.ClientConnectionError("Connection closed"))

    release = close  # aiohttp's name for it at the end of `async with`

    # ------------------------------------------------------------ the connection's side

    def _on_head(self, status: int) -> None:
        self.status = status
        if not self._headed.done():
            self._headed.set_result(None)

    def _on_body(self, body: bytes) -> None:
        self.bodied = True
        self._chunks.append(body)
        self._held += len(body)
        conn = self._conn
        if self._held > HIGH_WATER and conn is not None and not conn.paused:
            conn.pause()
        self._wake()

    def _on_end(self) -> None:
        """The body's end: the connection is no longer this response's."""
        self._done = self.closed = True
        self._conn = None
        self._stop_timer()
        self._wake()

    def _cut(self, reason: str) -> None:
        """The worker is gone while this response is open: fail it as a connection the worker dropped."""
        if self._headed.done():
            self._fail(aiohttp.ClientPayloadError(f"Response payload is not completed: {reason}"))
        else:
            self._fail(aiohttp.ServerDisconnectedError(reason))

    def _on_lost(self, exc: BaseException | None) -> None:
        if not self._headed.done():
            if isinstance(exc, OSError):
                self._fail(aiohttp.ClientOSError(*exc.args))
            else:
                self._fail(aiohttp.ServerDisconnectedError())
        else:
            self._fail(aiohttp.ClientPayloadError(f"Response payload is not completed: {exc!r}"))

    def _fail(self, exc: BaseException) -> None:
        """End with `exc` for whoever waits or reads next (the first failure wins; as in aiohttp, also a
        body read to its end is not read after a close), closing an unfinished connection."""
        self._stop_timer()
        if self._error is None:
            self._error = exc
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response = None
            conn.close()
        if not self._headed.done():
            self._headed.set_exception(exc)
            self._headed.exception()  # retrieved: a head nobody awaits any more must not be logged
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _heard_from(self) -> None:
        self._heard = self._loop.time()
        self.heard_any = True

    # ------------------------------------------------------------ timeouts: one timer, moved lazily

    def _next_check(self) -> float:
        times = [self._deadline] if self._deadline is not None else []
        if self._sock_read:
            times.append(self._heard + self._sock_read)
        return min(times)

    def _check(self) -> None:
        self._timer = None
        if self._done or self._error is not None:
            return
        now = self._loop.time()
        if self._deadline is not None and now >= self._deadline:
            self._fail(asyncio.TimeoutError())
            return
        conn = self._conn
        if conn is not None and conn.paused:
            self._heard = now  # the reader is slow, not the worker
        elif self._sock_read and now - self._heard >= self._sock_read:
            self._fail(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))
            return
        self._timer = self._loop.call_at(self._next_check(), self._check)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker, parsing the responses of the requests sent on it."""

    def __init__(self, client: WorkerHTTP, key: tuple[str, int, bool]) -> None:
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: WorkerResponse | None = None
        self.idle_since = 0.0
        self.lost = False
        self.paused = False
        self._framed = False  # the response head gave a length or chunked encoding

    def send(self, response: WorkerResponse, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.response = response
        self._framed = False
        self.transport.writelines((head, body))

    def pause(self) -> None:
        if self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request goes out in one write

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing was asked: a connection in an unknown state is not reused
            self.close()
            return
        response._heard_from()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(aiohttp.ClientPayloadError(f"not an HTTP response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        self.lost = True  # the worker is closing it: not to be taken from the idle list any more
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._forget(self)
        response, self.response = self.response, None
        if response is None:
            return
        if response._headed.done() and not self._framed and exc is None:
            response._on_end()  # a body without a length ends where the connection does
        else:
            response._on_lost(exc)

    # httptools' callbacks

    def on_message_begin(self) -> None:
        if self.response is None:  # a response nobody asked for: the connection is out of step
            self.close()

    def on_header(self, name: bytes, _value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response._on_head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._on_body(body)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        keep = self._framed and self.parser.should_keep_alive()
        response._on_end()
        if keep:
            if self.paused:
                self.resume()
            self.client._put_back(self)
        else:
            self.close()


class _Post:
    """`WorkerHTTP.post`'s result: awaited, the response once its head is in; or `async with`, which
    releases the response at the end."""

    def __init__(self, sending: Coroutine[Any, Any, WorkerResponse]) -> None:
        self._sending = sending
        self._response: WorkerResponse | None = None

    def __await__(self) -> Generator[Any, None, WorkerResponse]:
        return self._sending.__await__()

    async def __aenter__(self) -> WorkerResponse:
        self._response = await self._sending
        return self._response

    async def __aexit__(self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None) -> None:
        if self._response is not None:
            self._response.release()


class WorkerHTTP:
    """POSTs to workers over pooled keep-alive connections (see the module docstring)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: dict[tuple[str, int, bool], set[_Connection]] = {}  # every live connection, idle or busy
        self._targets: dict[str, _Target] = {}
        self._tls: ssl.SSLContext | None = None

    def post(self, url: str, *, data: bytes, headers: Mapping[str, str], timeout: aiohttp.ClientTimeout,
             silent: bool = False, unary: bool = False, work: int = 0) -> _Post:
        """`silent`: the leg waits for something else before its worker can do anything (an overlapped decode
        leg before its prefill answers: `speak` ends that), so its silence says nothing of the worker.
        `unary`: the answer comes whole at its end however long it generates (a non-streamed generation), so
        its bytes say nothing of the worker's progress either (`silence` leaves both out; `generating`).
        `work`: the prompt tokens the worker computes before the body can start."""
        return _Post(self._post(url, data, headers, timeout, silent, unary, work))

    async def _post(self, url: str, data: bytes, headers: Mapping[str, str],
                    timeout: aiohttp.ClientTimeout, silent: bool, unary: bool, work: int) -> WorkerResponse:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _TARGETS_MAX:
                self._targets.clear()
            target = self._targets[url] = _target(url)
        head = _head(target, headers, len(data))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout.total if timeout.total else None
        conn = self._reuse((target.host, target.port, target.tls), loop.time())
        if conn is None:
            conn = await self._connect(target, timeout, deadline, loop)
        response = WorkerResponse(conn, timeout, deadline, loop)
        response.silent, response.unary, response.work = silent, unary, work
        conn.send(response, head, data)
        try:
            await response._headed
        except BaseException:  # failed, or cancelled (the client left): the connection goes with it
            response.close()
            raise
        return response

    def _reuse(self, key: tuple[str, int, bool], now: float) -> _Connection | None:
        idle = self._pools.get(key)
        while idle:
            conn = idle.pop()
            usable = conn.transport is not None and not conn.lost and not conn.transport.is_closing()
            if usable and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, target: _Target, timeout: aiohttp.ClientTimeout, deadline: float | None,
                       loop: asyncio.AbstractEventLoop) -> _Connection:
        limit = timeout.connect
        if deadline is not None:
            limit = min(limit, deadline - loop.time()) if limit else deadline - loop.time()
        key = (target.host, target.port, target.tls)
        if target.tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), target.host, target.port,
                    ssl=self._tls if target.tls else None,
                )
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(f"Connection timeout to {target.host}:{target.port}") from None
        except OSError as exc:
            raise aiohttp.ClientOSError(
                exc.errno, f"Cannot connect to {target.host}:{target.port}: {exc.strerror or exc}"
            ) from exc
        if not conn.lost:
            self._open.setdefault(key, set()).add(conn)
        return conn

    def _put_back(self, conn: _Connection) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        self._pools.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        idle = self._pools.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        live = self._open.get(conn.key)
        if live is not None:
            live.discard(conn)
            if not live:
                del self._open[conn.key]

    def silence(self, url: str) -> tuple[float, int] | None:
        """How long the worker at `url` (its base URL) has sent nothing it owed on the legs open on it, and the
        prompt tokens it had to compute first; None when it owes nothing (no leg open, or one paused for its
        slow reader: that silence is the reader's). Legs marked `silent` or `unary` are left out.

        While one of its legs runs (a body byte came), an engine that steps sends it more every step: the
        silence is since the latest byte of any leg, with nothing to compute first. Otherwise it is since
        the oldest leg was sent, with that leg's prompt to compute (what came later waits behind it: a leg
        sent to a stuck worker does not move the clock)."""
        owing = [(c, r) for c in self._open.get(_worker_key(url), ())
                 if (r := c.response) is not None and not r.silent and not r.unary]
        if not owing or any(c.paused for c, _ in owing):
            return None
        legs = [r for _, r in owing]
        now = asyncio.get_running_loop().time()
        if any(r.bodied for r in legs):
            return now - max(r._heard for r in legs if r.heard_any), 0
        return _oldest(legs, now)

    def generating(self, url: str) -> tuple[float, int] | None:
        """For a worker whose only legs (`silent` ones aside) are whole answers being generated (`unary`):
        how long since the oldest was sent, and its prompt tokens; None when it has other legs, or none.
        Their bytes say nothing until their end, so only its engine's own counters can show a stall."""
        legs = [c.response for c in self._open.get(_worker_key(url), ()) if c.response is not None
                and not c.response.silent]
        if not legs or not all(r.unary for r in legs):
            return None
        return _oldest(legs, asyncio.get_running_loop().time())

    def cut(self, url: str, reason: str) -> int:
        """End every response open on the worker at `url` (its base URL) with a hard failure and drop its
        connections, idle ones too; returns how many responses were open. For a worker found dead or
        stalled: what reads from it then fails as if the worker had closed the connection (retried before
        a stream's first token, an error event after it), and the worker's server, if any of it is left,
        sees its clients leave and aborts their requests."""
        cut = 0
        for conn in list(self._open.get(_worker_key(url), ())):
            response = conn.response
            if response is not None:
                response._cut(reason)
                cut += 1
            conn.close()
        return cut

    async def close(self) -> None:
        """Close the idle connections (a response still being read closes its own)."""
        for idle in self._pools.values():
            for conn in idle:
                conn.close()
        self._pools.clear()
