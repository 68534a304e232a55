"""The router's HTTP server connections: those that would hold it without ever finishing a request,
and writes gathered into one send.

uvicorn times out only idle connections between requests. Three holes are left, and
closed here (the body's own deadline and size limit are in requests.py):
- A request head that never completes (a connection that sends nothing, or a head
  sent a byte at a time) is held for good: `server_protocol` closes the
  connection when a head takes longer than `--header-timeout`.
- httptools keeps a head's URL and headers, however long, until the head ends: one
  connection streaming header lines took the router's RSS past 4.8 GB within 20 s (of the
  30 s head deadline; before any authentication). A head over `--max-header-bytes` gets
  a 431 and its connection closed, as nginx and Node bound theirs. A header line (or a
  chunked body's trailer line, which httptools keeps the same way, under the body's
  deadline) that does not end reaches no callback: reads in a row that bring no progress
  (a request's start, the head's end, body, a chunk, the request's end) count against the
  same limit.
- A client that stops reading its answer holds it for good: uvicorn waits for the socket to
  drain, the relay stops reading the worker, and the request keeps its slot on that worker
  (`--max-inflight-per-worker`). Measured before this: four never-read streams on a worker
  capped at four got every other request a 429 for as long as they stayed open. The protocol
  aborts a connection whose writes stay paused with no byte taken for `--send-timeout` (as
  nginx's `send_timeout`); the request then ends as for a client that hung up.
- A request answered before its body was read (a 401, 404, 408 or 413) keeps its
  connection reading the rest of the body, and every byte that comes in resets the
  keep-alive timer: `CloseUnreadBodies` marks such answers `Connection: close`, which
  makes uvicorn close the connection once the answer is sent. The completion routes,
  which bypass the middleware (app.py), mark theirs with `close_after`.

uvicorn writes each ASGI message to the socket as it is sent: a streamed answer's head,
each chunk and the end are a send() each, and on loopback each wakes the reader again.
`GatheredWrites` holds what is written and sends it together when the response is complete
or else at the start of the event loop's next pass: a stream whose upstream events arrive
together (a short answer, a burst of tokens) goes out in one send, and a write waits no
longer than the callbacks already queued in the loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.router.errors import error_json

log = logging.getLogger("pdserve.router.connections")


class CloseUnreadBodies:
    """ASGI middleware: a response that starts before its request body was received to the end closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        unread = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers

        async def tracking_receive() -> Message:
            nonlocal unread
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                unread = False
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and unread:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracking_receive, closing_send)


def close_after(resp: Response) -> Response:
    """`resp` marked `Connection: close`: for an answer given before its request's body was read to the end."""
    resp.raw_headers.append((b"connection", b"close"))
    return resp


class GatheredWrites(asyncio.Transport):
    """A server transport that holds its writes until `send_held` (a response's end), the loop's next
    pass or a close, and sends them as one (see the module docstring).

    It stands for the socket's transport towards uvicorn's protocol, which uses only the methods below.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self.send_held)
        self._held.append(bytes(data))

    def send_held(self) -> None:
        """Send what is held now (a response's end: nothing more will come for it)."""
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.send_held()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


class HeadTooLarge(Exception):
    """Raised in a parser callback to stop parsing a head over the limit."""


def _head_too_large(limit: int) -> bytes:
    body = error_json(431, f"request head (URL and headers) or trailers over {limit} bytes")
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def server_protocol(timeout: float, send_timeout: float, on_send_timeout: Callable[[], None] = lambda: None,
                    max_head_bytes: int = 64 << 10) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing a connection whose request head is not in within `timeout` s
    or whose head or trailers run past `max_head_bytes` (after a 431), aborting one that takes no byte of
    its answer for `send_timeout` s while its writes are paused (and calling `on_send_timeout`), and
    writing through `GatheredWrites`.

    The head's clock starts when the connection opens and again at a request's first byte
    (a keep-alive connection waits for its next request under uvicorn's own timeout). The send's
    clock runs only while the transport has paused writing (its buffer over the high-water mark),
    so a client that reads costs no timer at all.
    """

    class ClientDeadlines(HttpToolsProtocol):
        # One timer at a time, checked when it fires rather than moved for every request: a keep-alive
        # connection serving requests back to back would otherwise set and cancel one per request.
        _timer: asyncio.TimerHandle | None = None
        _head_since: float | None = None  # when the request head now coming began (None: none is)
        _send_timer: asyncio.TimerHandle | None = None  # set while writing is paused
        _unsent = 0  # bytes the transport held when the send timer was last set
        _head_size = 0  # the head's URL and header lines so far (and a chunked body's trailer lines)
        _head_too_large = False
        _progress = False  # the read being parsed began a request, ended its head, or carried body or its end
        _stalled_bytes = 0  # bytes of the reads in a row without progress (a head or trailer line being sent)

        def _head_begins(self) -> None:
            self._head_since = self.loop.time()
            self._head_size = 0
            self._progress = True
            if self._timer is None:
                self._timer = self.loop.call_at(self._head_since + timeout, self._expire)

        def _expire(self) -> None:
            self._timer = None
            if self._head_since is None:  # in: the next head sets a timer again
                return
            due = self._head_since + timeout
            if self.loop.time() >= due:
                self.transport.close()
            else:  # a later head than the one this timer was set for
                self._timer = self.loop.call_at(due, self._expire)

        def _watch_send(self) -> None:
            self._unsent = self.transport.get_write_buffer_size()
            self._send_timer = self.loop.call_later(send_timeout, self._send_expired)

        def _send_expired(self) -> None:
            """Still paused `send_timeout` s on: a client that took some bytes meanwhile gets another period,
            one that took none is cut (abort: closing would wait for the buffer it does not read)."""
            if self.transport.get_write_buffer_size() < self._unsent:
                self._watch_send()
                return
            self._send_timer = None
            log.info("client %s took no byte of its answer for %.0f s: connection aborted",
                     self.client, send_timeout)
            on_send_timeout()
            self.transport.abort()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._watch_send()

        def resume_writing(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None
            super().resume_writing()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._gathered = GatheredWrites(transport, self.loop)
            super().connection_made(self._gathered)
            self._head_begins()

        def data_received(self, data: bytes) -> None:
            self._progress = False
            super().data_received(data)
            if self.transport.is_closing():
                return
            # A read without progress belongs to a head or trailer line being sent (or a chunk extension), which
            # httptools keeps until the line ends; the read a request began in is not counted, as the end of
            # the request before it (and so any body) may share it.
            if self._progress:
                self._stalled_bytes = 0
                return
            self._stalled_bytes += len(data)
            if self._stalled_bytes > max_head_bytes:
                self._head_too_large = True
                self.send_400_response("")

        def on_body(self, body: bytes) -> None:
            self._progress = True
            super().on_body(body)

        def on_chunk_header(self) -> None:
            self._progress = True

        def on_message_complete(self) -> None:
            self._progress = True
            super().on_message_complete()

        def _grow_head(self, size: int) -> None:
            self._head_size += size
            if self._head_size > max_head_bytes:
                self._head_too_large = True
                raise HeadTooLarge  # httptools stops parsing; uvicorn answers with send_400_response

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._grow_head(len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            self._grow_head(len(name) + len(value) + 4)  # as on the wire: ": " and CRLF

        def send_400_response(self, msg: str) -> None:
            if not self._head_too_large:
                super().send_400_response(msg)
                return
            log.info("client %s sent a request head or trailers over %d bytes: 431, connection closed", self.client,
                     max_head_bytes)
            self._head_since = None
            self.transport.write(_head_too_large(max_head_bytes))
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_begins()

        def on_headers_complete(self) -> None:
            self._head_since = None
            self._progress = True
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._gathered.send_held()  # at once rather than on the loop's next pass
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._timer, self._send_timer):
                if timer is not None:
                    timer.cancel()
            self._timer = self._send_timer = None
            super().connection_lost(exc)

    return ClientDeadlines
