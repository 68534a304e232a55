"""Client connections that would hold the router's HTTP server without ever finishing a request.

uvicorn times out only idle connections between requests. Two holes are left, and
closed here (the body's own deadline and size limit are in requests.py):
- A request head that never completes (a connection that sends nothing, or a head
  sent a byte at a time) is held for good: `head_deadline_protocol` closes the
  connection when a head takes longer than `--header-timeout`.
- A request answered before its body was read (a 401, 404, 408 or 413) keeps its
  connection reading the rest of the body, and every byte that comes in resets the
  keep-alive timer: `CloseUnreadBodies` marks such answers `Connection: close`, which
  makes uvicorn close the connection once the answer is sent.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


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


def head_deadline_protocol(timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing a connection whose request head is not in within `timeout` s.

    The clock starts when the connection opens and again at a request's first byte
    (a keep-alive connection waits for its next request under uvicorn's own timeout).
    """

    class HeadDeadline(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout, self.transport.close)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadDeadline
