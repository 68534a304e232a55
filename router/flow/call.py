"""One client request on its way through the flow, and the ways it ends early.

`Call` carries what the flow learns about a request (its prefill's kv_transfer_params,
whether its decode leg finished), so the cleanup at the end knows whether the store
still holds a tail for it. A 5xx reply is tried on one more worker (the first may be
broken in a way its health check does not show), but a request that gets an error reply
from `ERROR_REPLY_WORKERS` workers is the request's fault: the client gets that reply
(`UpstreamResponse`), and no worker is blamed for it (see breaker.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, TypeVar

import msgspec
from starlette.requests import Request

from pdserve.router.errors import RouterError
from pdserve.router.pool import Worker
from pdserve.router.prefill_estimate import Recompute
from pdserve.router.requests import Route

T = TypeVar("T")

# Workers that must answer one request with a 5xx before the client gets it (see the module docstring).
ERROR_REPLY_WORKERS = 2


class ClientGone(Exception):
    """The client disconnected while the router was still working on its request."""


@dataclass
class Call:
    """One client request as the flow sees it, plus what it has learned on the way."""

    route: Route
    raw: bytes
    body: dict[str, Any]
    request_id: str
    t0: float = field(default_factory=time.perf_counter)
    t_first_call: float | None = None  # when the router first called a worker for this request
    t_prefill_answer: float | None = None  # when the prefill leg's answer arrived (its JSON not yet read)
    kv_params: dict[str, Any] | None = None  # from the prefill response: owns a store tail until decode ends
    prefill_worker: Worker | None = None  # the worker whose prefill answered
    finished: bool = False  # the decode leg completed (its worker consumed the tail)
    recompute: Recompute | None = None  # sent decode-only for the prefill queue: counted until its first token

    @property
    def model(self) -> str | None:
        m = self.body.get("model")
        return m if isinstance(m, str) else None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (closing its upstream connections) and raise ClientGone."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


class UpstreamResponse(RouterError):
    """A worker's own error response, handed to the client unchanged (status and body)."""

    def __init__(self, status: int, body: bytes) -> None:
        try:
            message = str(msgspec.json.decode(body)["error"]["message"])
        except (msgspec.DecodeError, KeyError, TypeError):
            message = body[:500].decode(errors="replace") or f"worker answered {status}"
        super().__init__(status, message)
        self._body = body

    def body(self) -> bytes:
        try:
            if isinstance(msgspec.json.decode(self._body).get("error"), dict):
                return self._body
        except (msgspec.DecodeError, AttributeError):
            pass
        return super().body()
