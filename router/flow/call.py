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
from typing import Any

import msgspec
from starlette.types import Receive

from pdserve.router.errors import RouterError
from pdserve.router.flow.producer_watch import ProducerWatch
from pdserve.router.pool import Worker
from pdserve.router.prefill_estimate import Recompute
from pdserve.router.requests import Route

# Workers that must answer one request with a 5xx before the client gets it (see the module docstring).
ERROR_REPLY_WORKERS = 2


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
    prompt_ids: list[int] | None = None  # the prompt as the router counted it (its tokenizer's or a worker's)
    kv_params: dict[str, Any] | None = None  # from the prefill response: owns a store tail until decode ends
    prefill_worker: Worker | None = None  # the worker whose prefill answered
    finished: bool = False  # the decode leg completed (its worker consumed the tail)
    recompute: Recompute | None = None  # sent decode-only for the prefill queue: counted until its first token
    producer_watch: ProducerWatch | None = None  # an overlapped decode leg's producer, watched until its first token
    token_shown: bool = False  # the client has its first token already (the prefill's: first_token.py)
    # the prompt's count, still running beside an early prefill leg (paths.py `_early`):
    # a decode-only path, or None for P/D
    verdict: asyncio.Future[str | None] | None = None
    path: str = "unplanned"  # as counted in pdserve_router_paths, once the flow has chosen it

    @property
    def model(self) -> str | None:
        m = self.body.get("model")
        return m if isinstance(m, str) else None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class ClientWatch:
    """Cancels the task serving a request when its client disconnects, for as long as the block runs.

    One watcher task per request, from the body's end to the response's end, covers the upstream
    calls and the relayed stream alike: the cancel lands wherever the serving task waits, and the
    code there cleans up as it does for any cancel (closing upstream connections, which aborts the
    request in vLLM). Because it is one task and no task group, it costs less than a watcher per
    phase (a task pair and asyncio.wait for the legs, Starlette's anyio task group for the stream):
    those were ~15% of the router's CPU per request in `pdserve bench router`.

    `gone()` tells a cancel this watcher made (the client left: the request is over) from any
    other (shutdown), which must propagate; leaving the block swallows a cancel of its own that
    nothing caught. Use it in the task that serves the request, after the body was read (the
    watcher consumes the ASGI receive channel).
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._owner: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._active = False  # inside the block: a disconnect now cancels the owner
        self._cancelled = False  # this watcher cancelled the owner
        self._settled = False  # that cancel has been judged (and taken back) by gone()
        self._alone = False  # ... and no other cancel was pending on the owner

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if self._active and self._owner is not None:
            self._cancelled = True
            self._owner.cancel()

    def __enter__(self) -> "ClientWatch":
        self._owner = asyncio.current_task()
        self._active = True
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    def gone(self) -> bool:
        """In an `except CancelledError`: True when the cancel is this watcher's alone (the client left),
        so the caller ends the request instead of re-raising; False for any other cancel."""
        if not self._cancelled or self._owner is None:
            return False
        if not self._settled:
            self._settled = True
            self._alone = self._owner.uncancel() == 0
        return self._alone

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        # Stop first: uvicorn's receive reports the end of a response as a disconnect too. Let go of the
        # watcher: the CancelledError it ends with keeps its frames, which refer back to this object, a
        # cycle (task, traceback, frames, uvicorn's receive state) that only the cyclic GC would free.
        self._active = False
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
        return exc_type is asyncio.CancelledError and not self._settled and self.gone()


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
