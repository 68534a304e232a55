"""The two-leg request: prefill on a prefill worker, then decode (streamed) on a decode worker.

Flow for one request:
1. Plan: decode-only when no prefill worker is available, the prompt is short
   (`--pd-min-prompt-tokens`) or mostly in the KV store already; else P/D.
2. Prefill leg: the client's body with `max_tokens=1`, `stream=false`,
   `kv_transfer_params={"do_remote_decode": true}` and `return_token_ids`, under the
   same X-Request-Id as the decode leg. Transport failures and 5xx replies move it
   to another prefill worker; when none is left the request falls back to
   decode-only.
3. Decode leg: the client's body plus the prefill's `kv_transfer_params` and the
   prompt token ids (vLLM then skips re-rendering the prompt, so both legs see the
   same tokens). Before the first token any failure moves it to another decode
   worker; after it, the stream ends with an OpenAI error event.

A 5xx reply is tried on one more worker (the first may be broken in a way its
health check does not show), but a request that gets an error reply from
`ERROR_REPLY_WORKERS` workers is the request's fault: the client gets that reply,
and no worker is blamed for it (see breaker.py).

The decode stream is relayed as the bytes arrive: only events before the first token
are parsed (to tell a role-only chunk from a token and to keep a retry invisible);
afterwards bytes pass through untouched. The one token the prefill leg generated is
never shown: decode regenerates it from the transferred KV, so nothing is lost or
duplicated at the seam.

With `--pd-overlap` (the default) the decode leg does not wait for the prefill's answer:
once a prefill worker is chosen whose store is known (from an earlier answer), both legs
go out together under one handoff id. The decode worker's connector holds the request
until the producer's upload has landed in that store (see kvstore/handoff.py), so the
decode leg's ingest and scheduling overlap the prefill. If the prefill fails, or wrote to
another store than announced, the waiting decode leg is dropped (which aborts it) and a
new one goes out as in the sequential flow.

Whatever ends a request early (client gone, decode failed) frees the prefill's store
tail, so no KV is left behind waiting for a decode that will not come.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Literal, TypeVar

import aiohttp
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdserve.kvstore.handoff import HANDOFF_KEY, HANDOFF_WAIT_KEY
from pdserve.router.config import RouterConfig
from pdserve.router.errors import RouterError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Lease, Policy, Pool, RouteContext, Worker
from pdserve.router.store import StoreView
from pdserve.router.tokens import PromptTokens
from pdserve.router.upstream import UPSTREAM_ERRORS, describe

log = logging.getLogger("pdserve.router.flow")

Route = Literal["chat", "completions"]
PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
T = TypeVar("T")

# Fields of the client's body that would contradict a one-token, unstreamed prefill.
_PREFILL_DROP = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n", "best_of")
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
    kv_params: dict[str, Any] | None = None  # from the prefill response: owns a store tail until decode ends
    finished: bool = False  # the decode leg completed (its worker consumed the tail)

    @property
    def model(self) -> str | None:
        m = self.body.get("model")
        return m if isinstance(m, str) else None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class DecodeLeg:
    """An open decode response and the bookkeeping a retry or the relay needs."""

    lease: Lease
    resp: aiohttp.ClientResponse
    payload: bytes
    ctx: RouteContext
    tried: set[str]
    t_sent: float
    t_prefill_done: float | None


def _is_batch(body: dict[str, Any]) -> bool:
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not all(type(t) is int for t in prompt)


def _forks(body: dict[str, Any]) -> bool:
    """n > 1 (or beam search) makes vLLM fork child requests that would all claim the prefill's one tail."""
    return (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1 or bool(body.get("use_beam_search"))


def _carries_token(route: Route, choice: Any) -> bool:
    """True when a stream choice reports generated tokens, even ones whose text is still empty.

    A token that ends inside a UTF-8 character comes with empty text, so text alone
    would hold such chunks back. On completions every choice reports output; on
    chat the one choice that does not is the role announcement opening the stream.
    """
    if not isinstance(choice, dict):
        return True  # not ours to judge: relay it
    if choice.get("finish_reason") or choice.get("logprobs") or choice.get("token_ids"):
        return True
    if route == "completions":
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return True
    return "role" not in delta or any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


def _has_token(route: Route, buf: bytes) -> bool:
    """True once the SSE bytes hold an event that carries output (or ends the stream)."""
    for event in buf.split(b"\n\n")[:-1]:  # the last piece is incomplete
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            try:
                obj = msgspec.json.decode(data)
            except (msgspec.DecodeError, RecursionError):
                return True  # not ours to judge: relay it
            if not isinstance(obj, dict) or "error" in obj:
                return True
            choices = obj.get("choices") or ()
            if not isinstance(choices, list) or any(_carries_token(route, c) for c in choices):
                return True
    return False


def prefill_body(body: dict[str, Any], handoff: str | None = None) -> dict[str, Any]:
    """The prefill leg's body: the client's, cut to one unstreamed token that keeps its KV for decode;
    with `handoff`, the producer names its upload after it (an overlapped decode leg waits for that)."""
    sent = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    sent["max_tokens"] = 1
    sent["stream"] = False
    sent["return_token_ids"] = True  # the decode leg reuses these ids instead of re-rendering
    sent["kv_transfer_params"] = {"do_remote_decode": True, **({HANDOFF_KEY: handoff} if handoff else {})}
    return sent


def overlap_params(handoff: str, store: tuple[str, str | None], wait_s: float) -> dict[str, Any]:
    """An overlapped decode leg's kv_transfer_params: wait in `store` (URL, id) for handoff `handoff`, as
    long as the prefill may take (`wait_s`: the router drops the leg sooner if the prefill fails)."""
    url, store_id = store
    return {"pdserve": 1, HANDOFF_KEY: handoff, "kvstore_url": url, "kvstore_id": store_id, HANDOFF_WAIT_KEY: wait_s}


def _drop_leg(task: "asyncio.Future[DecodeLeg]") -> None:
    """Give up an overlapped decode leg: cancel it, or close it if it already has its headers
    (closing the connection makes vLLM abort the request, which ends its wait in the store)."""
    if not task.done():
        task.cancel()
        task.add_done_callback(_drop_leg)  # in case it completes despite the cancel
        return
    if task.cancelled() or task.exception() is not None:
        return
    leg = task.result()
    leg.lease.abandon()
    leg.resp.close()


def _prompt_ids(data: dict[str, Any]) -> list[int] | None:
    ids = data.get("prompt_token_ids")
    if ids is None:  # completions put them on the choice
        choices = data.get("choices") or [{}]
        ids = choices[0].get("prompt_token_ids")
    return ids if isinstance(ids, list) and ids else None


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


class PDFlow:
    def __init__(
        self,
        cfg: RouterConfig,
        prefill: Pool,
        decode: Pool,
        prefill_policy: Policy,
        decode_policy: Policy,
        http: aiohttp.ClientSession,
        tokens: PromptTokens,
        store: StoreView,
        metrics: RouterMetrics,
        headers: dict[str, str],
    ) -> None:
        self.cfg = cfg
        self.prefill, self.decode = prefill, decode
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.http = http
        self.tokens = tokens
        self.store = store
        self.metrics = metrics
        self.headers = headers
        self.prefill_timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout, connect=cfg.connect_timeout)
        # A stream may run for long; what must not happen is a silence longer than decode_timeout.
        self.decode_timeout = aiohttp.ClientTimeout(sock_read=cfg.decode_timeout, connect=cfg.connect_timeout)
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------ entry

    async def handle(self, call: Call, request: Request) -> Response:
        """Serve one completion request: a stream (which counts its own outcome) or a whole response."""
        self.decode.check_model(call.model)
        streaming = False
        try:
            resp = await until_disconnect(request, self._serve(call))
            streaming = isinstance(resp, StreamingResponse)
            return resp
        except ClientGone:
            log.info("client closed request %s before the response", call.request_id)
            return Response(status_code=499)
        finally:
            if not streaming:  # a stream cleans up when the relay ends
                self._end(call)

    async def _serve(self, call: Call) -> Response:
        path, ctx = await self._plan(call)
        if path == "pd" and self.cfg.pd_overlap:
            return await self._serve_overlapped(call, ctx)
        t_prefill_done: float | None = None
        payload = call.raw
        if path == "pd":
            data = await self._prefill(call, ctx)
            path, payload, t_prefill_done = self._after_prefill(call, data)
        self.metrics.paths.labels(path).inc()
        return await self._respond(call, await self._open_decode(call, payload, ctx, set(), t_prefill_done))

    def _after_prefill(self, call: Call, data: dict[str, Any] | None) -> tuple[str, bytes, float | None]:
        """(path, decode payload, when the prefill answered) once the prefill leg has ended."""
        if data is None:
            return "decode_only_prefill_failed", call.raw, None
        return "pd", self._decode_payload(call, data), time.perf_counter()

    async def _serve_overlapped(self, call: Call, ctx: RouteContext) -> Response:
        """Both legs at once, when the chosen prefill worker's store is known; else in sequence."""
        handoff = uuid.uuid4().hex
        chosen: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        prefill = asyncio.ensure_future(self._prefill(call, ctx, handoff, chosen))
        decode: asyncio.Future[DecodeLeg] | None = None
        try:
            await asyncio.wait((prefill, chosen), return_when=asyncio.FIRST_COMPLETED)
            store = chosen.result().produces_to if chosen.done() else None
            if store is not None:
                payload = msgspec.json.encode({**call.body, "kv_transfer_params": overlap_params(handoff, store, self.cfg.prefill_timeout)})
                decode = asyncio.ensure_future(self._open_decode(call, payload, ctx, set(), None))
            data = await prefill
            params = (data or {}).get("kv_transfer_params") or {}
            if decode is not None and data is not None and (params.get("kvstore_url"), params.get("kvstore_id")) == store:
                path, leg = "pd_overlap", await decode
                leg.t_prefill_done = time.perf_counter()
            else:  # no overlap after all: the prefill failed or wrote elsewhere
                if decode is not None:
                    _drop_leg(decode)
                path, payload, t_prefill_done = self._after_prefill(call, data)
                leg = await self._open_decode(call, payload, ctx, set(), t_prefill_done)
        except BaseException:
            prefill.cancel()
            if decode is not None:
                _drop_leg(decode)
            raise
        self.metrics.paths.labels(path).inc()
        return await self._respond(call, leg)

    async def _respond(self, call: Call, leg: DecodeLeg) -> Response:
        if leg.resp.status != 200 or not call.stream:
            return await self._unary(call, leg)
        return StreamingResponse(
            self._relay(call, leg), media_type="text/event-stream", headers={"X-Request-Id": call.request_id}
        )

    # ------------------------------------------------------------ planning

    async def _plan(self, call: Call) -> tuple[str, RouteContext]:
        estimate = len(call.raw) // 4  # a rough count for load accounting when no tokenization is needed
        ctx = RouteContext(model=call.model, prompt_tokens=estimate)
        if _is_batch(call.body):
            return "decode_only_batch", ctx
        if _forks(call.body):
            return "decode_only_n", ctx
        prefill_workers = self.prefill.candidates(call.model)
        if not prefill_workers:
            return "decode_only_no_prefill", ctx
        ids = await self.tokens.ids(call.route, call.body, prefill_workers[0].url)
        if ids is not None:
            ctx.prompt_tokens = len(ids)
        if ctx.prompt_tokens < self.cfg.pd_min_prompt_tokens:
            return "decode_only_short", ctx
        if ids is not None and self.store.layouts:
            salt = call.body.get("cache_salt")
            ctx.prefix_tokens = await self.store.prefix_tokens(ids, salt if isinstance(salt, str) else None)
            if max(ctx.prefix_tokens.values()) >= self.cfg.pd_max_cached_fraction * len(ids):
                return "decode_only_cached", ctx
        return "pd", ctx

    # ------------------------------------------------------------ prefill leg

    async def _prefill(
        self, call: Call, ctx: RouteContext, handoff: str | None = None, chosen: "asyncio.Future[Worker] | None" = None
    ) -> dict[str, Any] | None:
        """The prefill response, or None when no prefill worker could serve it (then decode prefills).
        `chosen` learns the first worker picked (an overlapped decode leg waits in its store)."""
        payload = msgspec.json.encode(prefill_body(call.body, handoff))
        headers = {**self.headers, "X-Request-Id": call.request_id}
        tried: set[str] = set()
        error_replies = 0
        while True:
            try:
                lease = await self.prefill.acquire(self.prefill_policy, ctx, exclude=tried)
            except RouterError as exc:
                if exc.status == 503:  # none (left) alive: decode-only
                    return None
                raise
            tried.add(lease.worker.id)
            if chosen is not None and not chosen.done():
                chosen.set_result(lease.worker)
            with lease:
                t = time.perf_counter()
                call.t_first_call = call.t_first_call or t
                try:
                    async with self.http.post(
                        lease.worker.url + PATHS[call.route], data=payload, headers=headers, timeout=self.prefill_timeout
                    ) as resp:
                        status, content = resp.status, await resp.read()
                except UPSTREAM_ERRORS as exc:
                    lease.failed(exc)
                    log.warning("prefill on %s failed (%s); trying another worker", lease.worker.url, describe(exc))
                    self.metrics.retries.labels("prefill").inc()
                    continue
                lease.answered()
            if status >= 500:
                error_replies += 1
                if error_replies < ERROR_REPLY_WORKERS:
                    log.warning("prefill on %s answered %d; trying another worker", lease.worker.url, status)
                    self.metrics.retries.labels("prefill").inc()
                    continue
            if status != 200:  # the request's fault: the client gets the worker's error
                raise UpstreamResponse(status, content)
            self.metrics.leg.labels("prefill").observe(time.perf_counter() - t)
            data = msgspec.json.decode(content)
            params = data.get("kv_transfer_params")
            if isinstance(params, dict):
                call.kv_params = params
                store_url = self.store.learn(params)
                if store_url and lease.worker.kvstore_url is None:
                    lease.worker.kvstore_url = store_url
                if store_url:
                    store_id = params.get("kvstore_id")
                    lease.worker.produces_to = (store_url, store_id if isinstance(store_id, str) else None)
            return data

    def _decode_payload(self, call: Call, prefill: dict[str, Any]) -> bytes:
        params = dict(call.kv_params or {})
        ids = _prompt_ids(prefill)
        if ids is not None:
            params["prompt_token_ids"] = ids
        if not params:
            return call.raw
        return msgspec.json.encode({**call.body, "kv_transfer_params": params})

    # ------------------------------------------------------------ decode leg

    async def _open_decode(
        self, call: Call, payload: bytes, ctx: RouteContext, tried: set[str], t_prefill_done: float | None
    ) -> DecodeLeg:
        """Send the decode leg and wait for its headers, moving on from workers that fail (nothing is sent yet)."""
        headers = {**self.headers, "X-Request-Id": call.request_id}
        last: RouterError | None = None
        error_replies = 0
        while True:
            try:
                lease = await self.decode.acquire(self.decode_policy, ctx, exclude=tried)
            except RouterError as exc:
                raise last if (last is not None and exc.status == 503) else exc
            tried.add(lease.worker.id)
            t = time.perf_counter()
            call.t_first_call = call.t_first_call or t
            try:
                resp = await self.http.post(
                    lease.worker.url + PATHS[call.route], data=payload, headers=headers, timeout=self.decode_timeout
                )
            except UPSTREAM_ERRORS as exc:
                lease.failed(exc)
                last = RouterError(502, f"decode worker failed: {describe(exc)}")
            except BaseException:
                lease.abandon()
                raise
            else:
                if resp.status < 500:
                    return DecodeLeg(lease, resp, payload, ctx, tried, t, t_prefill_done)
                try:
                    last = UpstreamResponse(resp.status, await resp.read())
                    lease.answered()
                    error_replies += 1
                except UPSTREAM_ERRORS as exc:
                    lease.failed(exc)
                    last = RouterError(502, f"decode worker failed: {describe(exc)}")
                finally:
                    resp.close()
                    lease.abandon()  # only when cancelled: the lines above gave the verdict otherwise
                if error_replies >= ERROR_REPLY_WORKERS:
                    raise last
            log.warning("decode on %s failed (%s); trying another worker", lease.worker.url, last.message)
            self.metrics.retries.labels("decode").inc()

    async def _unary(self, call: Call, leg: DecodeLeg) -> Response:
        """A whole (non-streamed or error) decode response; a body cut short is retried elsewhere."""
        while True:
            try:
                body = await leg.resp.read()
                break
            except UPSTREAM_ERRORS as exc:
                leg.lease.failed(exc)
                leg.resp.close()
                self.metrics.retries.labels("decode").inc()
                leg = await self._open_decode(call, leg.payload, leg.ctx, leg.tried, leg.t_prefill_done)
            except BaseException:
                leg.lease.abandon()
                leg.resp.close()
                raise
        status = leg.resp.status
        leg.lease.answered()
        if status == 200:
            call.finished = True
            self.metrics.leg.labels("decode").observe(time.perf_counter() - leg.t_sent)
        return Response(body, status_code=status, media_type="application/json",
                        headers={"X-Request-Id": call.request_id})

    async def _relay(self, call: Call, leg: DecodeLeg) -> AsyncIterator[bytes]:
        """Relay the decode stream; retry on another worker until the first token, then pass bytes through."""
        outcome = "499"  # unless the stream ends otherwise, the client left
        first = False
        relayed_done = False  # the client has had the stream's last event
        try:
            while True:
                pending = b""
                t_last = 0.0
                try:
                    async for chunk in leg.resp.content.iter_any():
                        now = time.perf_counter()
                        if first:
                            self.metrics.itl.observe(now - t_last)
                            t_last = now
                            relayed_done = relayed_done or b"data: [DONE]" in chunk
                            yield chunk
                            continue
                        pending += chunk
                        if _has_token(call.route, pending):
                            first, t_last = True, now
                            relayed_done = b"data: [DONE]" in pending
                            try:
                                yield pending  # resumes once the server has sent it on
                            finally:  # also when the client, having it all, hangs up here
                                self._observe_first_token(call, leg, now, time.perf_counter() - now)
                    if pending and not first:
                        yield pending  # a stream without any token (e.g. max_tokens=0): relay as is
                    leg.lease.answered()
                    call.finished = True
                    outcome = "200"
                    return
                except UPSTREAM_ERRORS as exc:
                    leg.lease.failed(exc)
                    leg.resp.close()
                    if first:
                        outcome = "502"
                        log.warning("decode worker %s failed mid-stream: %s", leg.lease.worker.url, describe(exc))
                        yield RouterError(502, f"decode worker failed mid-stream: {describe(exc)}").sse_event()
                        return
                    self.metrics.retries.labels("decode").inc()
                    try:
                        leg = await self._open_decode(call, leg.payload, leg.ctx, leg.tried, leg.t_prefill_done)
                    except RouterError as err:
                        outcome = str(err.status)
                        yield err.sse_event()
                        return
                    if leg.resp.status != 200:
                        outcome = str(leg.resp.status)
                        body = await leg.resp.read()
                        leg.lease.answered()
                        yield UpstreamResponse(leg.resp.status, body).sse_event()
                        return
        finally:
            # Runs on client disconnect too (the generator is cancelled): nothing here may await.
            if outcome == "499" and relayed_done:  # served whole; the client left before the upstream's EOF
                outcome = "200"
                call.finished = True
                leg.lease.answered()
            # Closing (not releasing) an unfinished response drops its connection, which aborts the request.
            leg.lease.abandon()
            leg.resp.close()
            self.metrics.requests.labels(call.route, outcome).inc()
            self._end(call)

    def _observe_first_token(self, call: Call, leg: DecodeLeg, now: float, relay_s: float) -> None:
        self.metrics.ttft.labels(call.route).observe(now - call.t0)
        self.metrics.leg.labels("decode").observe(now - leg.t_sent)
        own = (call.t_first_call or leg.t_sent) - call.t0 + relay_s
        if leg.t_prefill_done is not None:
            self.metrics.handoff.observe(now - leg.t_prefill_done)
            own += max(0.0, leg.t_sent - leg.t_prefill_done)  # an overlapped leg went out before
        self.metrics.overhead.observe(own)

    # ------------------------------------------------------------ cleanup

    def _end(self, call: Call) -> None:
        """A request that had a prefill but no completed decode leaves a tail in the store: free it."""
        if call.kv_params and not call.finished:
            self._spawn(self.store.drop_tail(call.kv_params))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Let pending cleanups (tail drops, closes) finish at shutdown."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)


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
