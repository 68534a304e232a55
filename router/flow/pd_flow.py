"""The two-leg request: prefill on a prefill worker, then decode (streamed) on a decode worker.

`PDFlow` runs one request through the modules beside it, in data-path order:
1. paths.py: plan the path: decode-only (short, cached, batched or forking requests, no
   prefill worker, or a prefill queue longer than a recompute) or P/D;
2. prefill_leg.py: the prefill leg (one token; the prefill worker's connector saves the
   prompt's KV to the store) and the decode leg's body built from its answer;
3. decode_leg.py: the decode leg (its worker's connector loads the KV), retried on
   another decode worker until a response starts;
4. relay.py: the stream relayed to the client.
call.py holds the request as the flow sees it, and the errors that end it.

With `--pd-overlap` (the default) the decode leg does not wait for the prefill's answer:
once a prefill worker is chosen whose store is known (from an earlier answer), the legs go
out under one handoff id. The decode worker's connector holds the request until the
producer's upload has landed in that store (see kvstore/connector/handoff.py), so the
decode leg's ingest and scheduling overlap the prefill. It goes out late, though: at the
prefill's predicted end less the decode leg's ingest (prefill_estimate.py's
`overlap_delay`), because a leg held in vLLM is not free (its engine keeps stepping, a
core's worth of busy loop on a CPU host, which slowed the concurrent prefill by 1.8-2.8 s
at 2k tokens on the 2-core VM). Until the router has timed a prefill leg and a streamed
decode leg it sends the decode leg at once; if the prefill answers before the leg is due,
the leg is built from the answer, as in sequence. Whatever ends the request before the
leg went out (client gone, prefill failed) finds no leg to drop. If the prefill fails, or
wrote to another store than announced, a waiting decode leg is dropped (which aborts it)
and a new one goes out as in the sequential flow. `pdserve_router_overlap_sends` counts
which of these moments each overlapped request's decode leg went out at.

Once the prefill has answered, the producer is watched until the decode leg's first token
(producer_watch.py): a producer that died before its upload landed would leave that leg
waiting out the whole prefill timeout, so when a health check finds it down the leg is
given up and the request served decode-only (counted in pdserve_router_producer_lost).

Whatever ends a request early (client gone, decode failed) frees the prefill's store
tail, so no KV is left behind waiting for a decode that will not come.

On the LMCache backend the legs always run in sequence: an overlapped decode leg needs
pdserve's store to wait in (an LMCache worker never names a store it produces to, so the
overlap above never starts). LMCache's connector stores a prompt's chunks after the
prefill engine has answered, so before the decode leg goes out the router waits, briefly
and bounded, until the prefill worker's LMCache server holds them (lmcache_view.py);
otherwise a decode engine that looked too early would recompute what it could have loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Awaitable

import msgspec
from starlette.responses import Response, StreamingResponse

from pdserve.router.config import RouterConfig
from pdserve.router.flow.call import Call, ClientWatch
from pdserve.router.flow.decode_leg import DecodeLeg, DecodeLegs, drop_leg
from pdserve.router.flow.paths import PathPlanner
from pdserve.router.flow import first_token
from pdserve.router.flow.prefill_leg import PrefillLeg, decode_payload, overlap_params, prompt_ids
from pdserve.router.flow.producer_watch import ProducerWatch
from pdserve.router.flow.relay import Relay
from pdserve.router.lmcache_view import LMCacheView
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Policy, Pool, RouteContext, Worker
from pdserve.router.prefill_estimate import QueueEstimate
from pdserve.router.store_view import StoreView
from pdserve.router.tokens import PromptTokens
from pdserve.router.worker_http import WorkerHTTP

log = logging.getLogger("pdserve.router.flow")


class PDFlow:
    def __init__(
        self,
        cfg: RouterConfig,
        prefill: Pool,
        decode: Pool,
        prefill_policy: Policy,
        decode_policy: Policy,
        http: WorkerHTTP,
        tokens: PromptTokens,
        store: StoreView,
        metrics: RouterMetrics,
        headers: dict[str, str],
        queue: QueueEstimate,
    ) -> None:
        self.cfg = cfg
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.metrics = metrics
        self.queue = queue
        self.lmcache = LMCacheView()
        self.paths = PathPlanner(cfg, prefill, decode, tokens, store, self.lmcache, queue, metrics)
        self.prefill_leg = PrefillLeg(cfg, prefill, prefill_policy, http, headers, store, metrics, queue.prefill)
        self.decode_legs = DecodeLegs(cfg, decode, decode_policy, http, headers, metrics, queue.decode_ingest)
        metrics.overlap_timing.labels("prefill_per_token").set_function(lambda: queue.prefill.recent.value or 0.0)
        metrics.overlap_timing.labels("decode_ingest").set_function(lambda: queue.decode_ingest.value or 0.0)
        self.relay = Relay(self.decode_legs, metrics, self._end)
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------ entry

    async def handle(self, call: Call, watch: ClientWatch) -> Response:
        """Serve one completion request: a stream (which counts its own outcome) or a whole response.

        `watch` cancels this task when the client leaves: until a response is ready that is a 499
        here (the legs' own cleanup has run as the cancel passed through them); afterwards the
        stream's relay ends the same way."""
        self.decode.check_model(call.model)
        streaming = False
        try:
            resp = await self._serve(call)
            streaming = isinstance(resp, StreamingResponse)
            return resp
        except asyncio.CancelledError:
            if not watch.gone():
                raise
            log.info("client closed request %s before the response", call.request_id)
            return Response(status_code=499)
        finally:
            if not streaming:  # a stream cleans up when the relay ends
                self._end(call)

    async def _serve(self, call: Call) -> Response:
        path, ctx = await self.paths.plan(call)
        verdict, call.verdict = call.verdict, None
        if verdict is None:
            return await self._serve_path(call, path, ctx)
        return await self._serve_early(call, ctx, verdict)

    async def _serve_early(self, call: Call, ctx: RouteContext, verdict: asyncio.Future[str | None]) -> Response:
        """P/D with the prompt's count still running (paths.py `_early`): a decode-only verdict (the prompt
        short after all) that comes while the prefill leg is out cancels the P/D flow (its legs clean up as for
        a client that left) and serves decode-only. Once the prefill has answered, the verdict changes nothing:
        the prefill's work is done."""
        serving = asyncio.ensure_future(self._serve_path(call, "pd", ctx))
        try:
            await asyncio.wait((serving, verdict), return_when=asyncio.FIRST_COMPLETED)
            path = self._verdict(call, verdict) if not serving.done() else None
            if path is None:
                return await serving
            serving.cancel()
            await asyncio.wait((serving,))
            if not serving.cancelled():  # it ended while the cancel was on its way
                return serving.result()
            if call.producer_watch is not None:  # an overlapped leg's producer: nothing waits on it any more
                call.producer_watch.stop()
                call.producer_watch = None
            log.debug("request %s: %s after its prefill leg went out; cancelled it", call.request_id, path)
            return await self._serve_path(call, path, ctx)
        finally:
            verdict.cancel()
            serving.cancel()

    @staticmethod
    def _verdict(call: Call, verdict: asyncio.Future[str | None]) -> str | None:
        """The decode-only path an early prefill leg must give way to, or None: the verdict is not in, says
        P/D, failed (routing goes on as planned), or came after the prefill had answered."""
        if not verdict.done() or call.t_prefill_answer is not None:
            return None
        if verdict.exception() is not None:
            log.warning("request %s: counting the prompt failed: %r", call.request_id, verdict.exception())
            return None
        return verdict.result()

    async def _serve_path(self, call: Call, path: str, ctx: RouteContext) -> Response:
        if path == "pd" and self.cfg.pd_first_token and first_token.eligible(call):
            return await self._serve_first_token(call, ctx)
        if path == "pd" and self.cfg.pd_overlap:
            return await self._serve_overlapped(call, ctx)
        t_prefill_done: float | None = None
        payload = call.raw
        if path == "pd":
            data = await self.prefill_leg.run(call, ctx)
            path, payload, t_prefill_done = await self._after_prefill(call, data)
        self._count_path(call, path)
        return await self._respond(call, await self.decode_legs.open(call, payload, ctx, set(), t_prefill_done))

    def _count_path(self, call: Call, path: str) -> None:
        """The path the request takes, in the path counts and on the call (its TTFT is counted by path)."""
        call.path = path
        self.metrics.series(self.metrics.paths, path).inc()

    async def _after_prefill(self, call: Call, data: dict[str, Any] | None) -> tuple[str, bytes, float | None]:
        """(path, decode payload, when the prefill answered) once the prefill leg has ended and, on the
        LMCache backend, its server holds the prompt's chunks."""
        if data is None:
            return "decode_only_prefill_failed", call.raw, None
        t_prefill_done = await self._prefill_landed(call, data)
        return "pd", decode_payload(call, data), t_prefill_done

    async def _prefill_landed(self, call: Call, data: dict[str, Any]) -> float:
        """When the prefill answered; on LMCache, returns once its server holds the prompt's chunks."""
        t_prefill_done = time.perf_counter()
        if call.prefill_worker is not None:
            await self.lmcache.wait_stored(call.prefill_worker, prompt_ids(data), call.body.get("cache_salt"))
        return t_prefill_done

    async def _serve_first_token(self, call: Call, ctx: RouteContext) -> Response:
        """The legs in sequence, the prefill's token streamed as the first (first_token.py) once the decode leg,
        sent the prompt plus that token, has answered its headers. When the prefill did not hand
        one, the decode leg goes out as with --no-pd-overlap (sent the prompt, its own token first)."""
        data = await self.prefill_leg.run(call, ctx)
        # (the prompt's ids come from the prefill's answer, or the router's count: the decode leg is sent them)
        handed = first_token.handed_token(data) if data is not None and (prompt_ids(data) or call.prompt_ids) else None
        if data is None or handed is None:
            path, payload, t_prefill_done = await self._after_prefill(call, data)
            self._count_path(call, path)
            return await self._respond(call, await self.decode_legs.open(call, payload, ctx, set(), t_prefill_done))
        token, text = handed
        self._count_path(call, "pd_first_token")
        lead = first_token.first_chunk(call, text)
        opening = self._open_after_handed(call, data, token, ctx)
        if first_token.fits(call, data, self.decode.max_model_len(call.model)):
            # No decode engine refuses it for its length: the token goes out now, the decode leg's ingest after
            # it (a leg that fails to open ends the stream with an error event, as a failure mid-stream does).
            return self.relay.respond_handed(call, lead, opening)
        # Else the decode leg's headers before the token: a request its engine refuses (its context too long
        # for max_tokens, say) gets that engine's error as the response, as in the other flows, not a
        # token and then an error event. It costs the first token the decode engine's ingest.
        leg = await opening
        if leg.resp.status != 200:
            return await self.decode_legs.unary(call, leg)
        return self.relay.respond_handed(call, lead, leg)

    async def _open_after_handed(self, call: Call, data: dict[str, Any], token: int, ctx: RouteContext) -> DecodeLeg:
        t_prefill_done = await self._prefill_landed(call, data)
        return await self.decode_legs.open(call, first_token.decode_body(call, data, token), ctx, set(), t_prefill_done)

    async def _serve_overlapped(self, call: Call, ctx: RouteContext) -> Response:
        """The legs under one handoff id, when the chosen prefill worker's store is known; else in sequence.
        The decode leg goes out when it is due (`_until_due`) or, if the prefill answers first, from the answer."""
        handoff = uuid.uuid4().hex
        chosen: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        prefill = asyncio.ensure_future(self.prefill_leg.run(call, ctx, handoff, chosen))
        decode: asyncio.Future[DecodeLeg] | None = None
        try:
            await asyncio.wait((prefill, chosen), return_when=asyncio.FIRST_COMPLETED)
            store = chosen.result().produces_to if chosen.done() else None
            if store is not None:
                at = await self._until_due(call, chosen.result(), prefill)
                if not prefill.done():
                    payload = msgspec.json.encode({**call.body, "kv_transfer_params": overlap_params(handoff, store, self.cfg.prefill_timeout)})
                    decode = asyncio.ensure_future(self.decode_legs.open(call, payload, ctx, set(), None, held=True))
                    self.metrics.series(self.metrics.overlap_sends, at).inc()
            data = await prefill
            params = (data or {}).get("kv_transfer_params") or {}
            landed = store is not None and data is not None and (params.get("kvstore_url"), params.get("kvstore_id")) == store
            if decode is not None and landed:
                path, leg = "pd_overlap", await self._overlapped_leg(call, decode, ctx)
            else:  # the prefill answered before its decode leg was due, failed, or wrote elsewhere
                if decode is not None:
                    drop_leg(decode)
                path, payload, t_prefill_done = await self._after_prefill(call, data)
                if decode is None and landed:
                    path = "pd_overlap"
                    self.metrics.series(self.metrics.overlap_sends, "answer").inc()
                leg = await self.decode_legs.open(call, payload, ctx, set(), t_prefill_done)
        except BaseException:
            prefill.cancel()
            if decode is not None:
                drop_leg(decode)
            raise
        self._count_path(call, path)
        return await self._respond(call, leg)

    async def _until_due(self, call: Call, producer: Worker, prefill: "asyncio.Future[Any]") -> str:
        """Wait until the overlapped decode leg is due or the prefill has ended, whichever is first; the
        moment's label in pdserve_router_overlap_sends ("start": no timing to go by, so at once)."""
        delay = self.queue.overlap_delay(producer) if self.cfg.pd_overlap_send == "estimate" else None
        if delay is None:
            return "start"
        log.debug("request %s: decode leg due in %.3f s", call.request_id, delay)
        if delay > 0:
            await asyncio.wait((prefill,), timeout=delay)
        return "estimate"

    async def _overlapped_leg(self, call: Call, decode: asyncio.Future[DecodeLeg], ctx: RouteContext) -> DecodeLeg:
        """The overlapped decode leg once its prefill has answered, its producer watched until the leg's
        first token: when the producer is found down before the leg's headers, a decode-only leg instead;
        after them (a stream), the relay retries decode-only once the watch gives the leg up."""
        t_prefill_done = time.perf_counter()
        probe, producer = self.prefill.recheck, call.prefill_worker
        if probe is None or producer is None:  # no health checks: a dead producer cannot be told from a slow one
            leg = await decode
            self._landed(leg, t_prefill_done)
            return leg
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        call.producer_watch = ProducerWatch(producer, probe, lambda: lost.set_result(None))
        await asyncio.wait((decode, lost), return_when=asyncio.FIRST_COMPLETED)
        if not decode.done():
            drop_leg(decode)
            self._producer_lost(call)
            return await self.decode_legs.open(call, call.raw, ctx, set(), None)
        leg = decode.result()
        self._landed(leg, t_prefill_done)
        if call.stream and leg.resp.status == 200:  # the relay stops the watch at the first token
            call.producer_watch.on_lost = lambda: self._give_up(call, leg)
        else:  # a whole response (or an error) is there with its headers
            call.producer_watch.stop()
        return leg

    @staticmethod
    def _landed(leg: DecodeLeg, t_prefill_done: float) -> None:
        """The held leg's prefill answered at `t_prefill_done`: its silence now says something of its decode
        worker (the stall watch)."""
        leg.t_prefill_done = t_prefill_done
        leg.resp.speak()

    def _give_up(self, call: Call, leg: DecodeLeg) -> None:
        """The producer of a relayed leg that has no token yet is gone: make the relay retry it decode-only."""
        if leg.resp.closed:  # it failed already, and the relay is on another leg
            return
        leg.give_up(call.raw)
        self._producer_lost(call)

    def _producer_lost(self, call: Call) -> None:
        self.metrics.producer_lost.inc()
        log.info("request %s: its prefill worker died before its KV landed; serving it decode-only", call.request_id)
        if call.kv_params:  # whatever of the prompt's KV did land is nobody's now
            self._spawn(self.store.drop_tail(call.kv_params))
            call.kv_params = None

    async def _respond(self, call: Call, leg: DecodeLeg) -> Response:
        if leg.resp.status != 200 or not call.stream:
            return await self.decode_legs.unary(call, leg)
        return self.relay.respond(call, leg)

    # ------------------------------------------------------------ cleanup

    def _end(self, call: Call) -> None:
        """Free what the call still holds: a producer watch, and the store tail of a prefill whose decode
        did not complete."""
        if call.recompute is not None:
            call.recompute.release()
        if call.producer_watch is not None:
            call.producer_watch.stop()
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
        self.lmcache.close()
