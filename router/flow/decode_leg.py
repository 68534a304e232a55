"""The decode leg: the request, with the prefill's kv_transfer_params, on a decode worker.

Inside the decode worker's vLLM the connector loads the prompt's KV from the store the
params name, and the engine goes on from there. `open` sends the leg and waits for its
response headers, moving to another decode worker on any failure (nothing has reached
the client yet); `unary` reads a whole (non-streamed or error) response, retrying
elsewhere if the body is cut short. Streams go to relay.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from starlette.responses import Response

from pdserve.router.config import RouterConfig
from pdserve.router.errors import RouterError
from pdserve.router.flow.call import ERROR_REPLY_WORKERS, Call, UpstreamResponse
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Policy, Pool, RouteContext, WorkerSlot
from pdserve.router.prefill_estimate import RecentMedian
from pdserve.router.requests import PATHS
from pdserve.router.upstream import UPSTREAM_ERRORS, describe
from pdserve.router.worker_http import WorkerHTTP, WorkerResponse

log = logging.getLogger("pdserve.router.flow")


@dataclass
class DecodeLeg:
    """An open decode response and the bookkeeping a retry or the relay needs."""

    slot: WorkerSlot
    resp: WorkerResponse
    payload: bytes
    ctx: RouteContext
    tried: set[str]
    t_sent: float
    t_prefill_done: float | None

    def give_up(self, payload: bytes) -> None:
        """Give up this overlapped leg before its first token for `payload` (decode-only): closing it
        aborts the request in vLLM (ending its wait in the store), and the retry that follows (the
        relay's) may take the same worker, which is not at fault, so its slot gets no verdict."""
        self.slot.abandon()
        self.tried.discard(self.slot.worker.id)
        self.payload, self.t_prefill_done = payload, None
        self.resp.close()  # a relay reading it gets ClientConnectionError: it retries with the above


def pd_phases(call: Call, leg: DecodeLeg, t_token: float, relay_s: float) -> dict[str, float]:
    """Seconds of each phase of a P/D request's way to its first token (`t_token`, then `relay_s` to relay it).

    The first five add up to that whole way, so a gap between P/D and colocated TTFT has an owner:
    the router before its first call, the prefill leg (first prefill call to its answer, retries
    included), between the legs (the answer to the decode leg's call: the router's own work, on
    LMCache its wait for the chunks, and any decode leg that failed before its first token), the
    decode leg to its first token (from its call, or from the prefill's answer when it went out
    before it), relaying. `overlap_wait` (overlapped legs only) is the part of the prefill leg the
    decode leg spent waiting.
    """
    t_answer = call.t_prefill_answer if call.t_prefill_answer is not None else leg.t_sent
    t_first = call.t_first_call if call.t_first_call is not None else leg.t_sent
    phases = {
        "before_first_call": t_first - call.t0,
        "prefill_leg": t_answer - t_first,
        "between_legs": max(0.0, leg.t_sent - t_answer),
        "decode_first_token": t_token - max(leg.t_sent, t_answer),
        "relay": relay_s,
    }
    if leg.t_sent < t_answer:
        phases["overlap_wait"] = t_answer - leg.t_sent
    return phases


def drop_leg(task: "asyncio.Future[DecodeLeg]") -> None:
    """Give up an overlapped decode leg: cancel it, or close it if it already has its headers
    (closing the connection makes vLLM abort the request, which ends its wait in the store)."""
    if not task.done():
        task.cancel()
        task.add_done_callback(drop_leg)  # in case it completes despite the cancel
        return
    if task.cancelled() or task.exception() is not None:
        return
    leg = task.result()
    leg.slot.abandon()
    leg.resp.close()


class DecodeLegs:
    def __init__(self, cfg: RouterConfig, pool: Pool, policy: Policy, http: WorkerHTTP,
                 headers: dict[str, str], metrics: RouterMetrics, ingest: RecentMedian) -> None:
        self.pool = pool
        self.policy = policy
        self.http = http
        self.headers = headers
        self.metrics = metrics
        self.ingest = ingest  # learns how long a streamed leg takes to reach its engine (its headers)
        # A stream may run for long; what must not happen is a silence longer than decode_timeout.
        self.timeout = aiohttp.ClientTimeout(sock_read=cfg.decode_timeout, connect=cfg.connect_timeout)

    async def open(
        self, call: Call, payload: bytes, ctx: RouteContext, tried: set[str], t_prefill_done: float | None,
        held: bool = False,
    ) -> DecodeLeg:
        """Send the decode leg and wait for its headers, moving on from workers that fail (nothing is sent yet).
        `held`: an overlapped leg, silent in its engine until its prefill's KV lands (pd_flow `_landed`
        ends that once the prefill has answered)."""
        headers = {**self.headers, "X-Request-Id": call.request_id}
        last: RouterError | None = None
        error_replies = 0
        while True:
            try:
                slot = await self.pool.acquire(self.policy, ctx, exclude=tried)
            except RouterError as exc:
                raise last if (last is not None and exc.status == 503) else exc
            tried.add(slot.worker.id)
            t = time.perf_counter()
            call.t_first_call = call.t_first_call or t
            try:
                resp = await self.http.post(  # a whole answer says nothing until its end, however long
                    slot.worker.url + PATHS[call.route], data=payload, headers=headers, timeout=self.timeout,
                    silent=held, unary=not call.stream, work=ctx.prompt_tokens,
                )
            except UPSTREAM_ERRORS as exc:
                slot.failed(exc)
                last = RouterError(502, f"decode worker failed: {describe(exc)}")
            except BaseException:
                slot.abandon()
                raise
            else:
                if resp.status < 500:
                    if resp.status == 200 and call.stream:
                        self.ingest.observe(time.perf_counter() - t)
                    return DecodeLeg(slot, resp, payload, ctx, tried, t, t_prefill_done)
                try:
                    last = UpstreamResponse(resp.status, await resp.read())
                    slot.answered()
                    error_replies += 1
                except UPSTREAM_ERRORS as exc:
                    slot.failed(exc)
                    last = RouterError(502, f"decode worker failed: {describe(exc)}")
                finally:
                    resp.close()
                    slot.abandon()  # only when cancelled: the lines above gave the verdict otherwise
                if error_replies >= ERROR_REPLY_WORKERS:
                    raise last
            log.warning("decode on %s failed (%s); trying another worker", slot.worker.url, last.message)
            self.metrics.retries.labels("decode").inc()

    async def unary(self, call: Call, leg: DecodeLeg) -> Response:
        """A whole (non-streamed or error) decode response; a body cut short is retried elsewhere."""
        while True:
            try:
                body = await leg.resp.read()
                break
            except UPSTREAM_ERRORS as exc:
                leg.slot.failed(exc)
                leg.resp.close()
                self.metrics.retries.labels("decode").inc()
                leg = await self.open(call, leg.payload, leg.ctx, leg.tried, leg.t_prefill_done)
            except BaseException:
                leg.slot.abandon()
                leg.resp.close()
                raise
        status = leg.resp.status
        leg.slot.answered()
        if status == 200:
            call.finished = True
            self.metrics.series(self.metrics.leg, "decode").observe(time.perf_counter() - leg.t_sent)
        return Response(body, status_code=status, media_type="application/json",
                        headers={"X-Request-Id": call.request_id})
