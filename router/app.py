"""`pdserve router`: the OpenAI-compatible front door of a P/D stack (FastAPI + uvicorn).

The app is a thin HTTP shell: it checks what must be checked before any worker is
bothered (auth, size, JSON shape, model), then hands the request to `PDFlow`.
Everything stateful lives in one `Router` object created in the lifespan, so a
test can run several routers in one process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from typing import Any, AsyncIterator, Sequence

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as StarletteRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.config import RouterConfig, build_parser, config_from_args
from pdserve.router.connections import CloseUnreadBodies, close_after, server_protocol
from pdserve.router.membership import MembershipWatcher
from pdserve.worker.registration import WorkerRecord
from pdserve.router.errors import RouterError
from pdserve.router.health import HealthChecker
from pdserve.router.metrics import RouterMetrics
from pdserve.router.flow.call import Call, ClientWatch
from pdserve.router.flow.pd_flow import PDFlow
from pdserve.router.policies import make_policy
from pdserve.router.pool import Pool, Worker
from pdserve.router.prefill_estimate import QueueEstimate
from pdserve.router.queue_view import QueueView
from pdserve.router.requests import PATHS, RequestHead, Route, read_body, validate
from pdserve.router.stall_reports import StallReports
from pdserve.router.stall_watch import CANARY_TIMEOUT_S, StallWatch
from pdserve.router.store_view import StoreView
from pdserve.router.tokens import PromptTokens
from pdserve.router.upstream import new_session
from pdserve.router.worker_http import WorkerHTTP

__all__ = ["build_parser", "create_app", "main"]

log = logging.getLogger("pdserve.router")

# Allocations (net of frees) of tracked objects between young-generation collections, and young
# (then middle) collections between older ones. CPython's defaults (700, 10, 10) collect the
# young generation every ~10 requests at c=16, while those requests' objects are still alive, so
# they are promoted and keep the older generations busy (see tune_gc).
GC_THRESHOLDS = (20_000, 20, 100)


class Router:
    """All state of one running router; built and torn down by the app's lifespan."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.prefill = Pool("prefill", cfg, self.metrics)
        self.decode = Pool("decode", cfg, self.metrics)
        self.prefill.add_static(cfg.prefill_urls)
        self.decode.add_static(cfg.decode_urls)
        self.worker_headers = {"Content-Type": "application/json"}
        self._bearer = f"Bearer {cfg.api_key}" if cfg.api_key else None  # what clients must send, and workers get
        if self._bearer:
            self.worker_headers["Authorization"] = self._bearer
        self.store = StoreView(cfg.kvstore_auth_token)
        self.watcher = (
            MembershipWatcher(cfg.redis_url, self._on_membership, model=cfg.model) if cfg.redis_url else None
        )

    async def _on_membership(self, records: dict[str, WorkerRecord]) -> None:
        for pool in (self.prefill, self.decode):
            self.health.check_soon(pool, pool.sync_redis(records.values()))
        if self.prefill.workers:
            for rec in records.values():
                self.tokens.prepare(rec.model)

    async def start(self) -> None:
        """Build the parts that need the event loop (the HTTP session), then find the workers."""
        self.http = new_session()
        self.legs_http = WorkerHTTP()  # the legs' own client: see worker_http.py
        self.health = HealthChecker((self.prefill, self.decode), self.http, self.worker_headers, self.cfg.health_interval,
                                    on_dead=self._end_legs_on, failures=self.cfg.health_failures)
        for pool in (self.prefill, self.decode):
            pool.recheck = lambda w, pool=pool: self.health.check_soon(pool, [w])[0]
        self.tokens = PromptTokens(self.http, self.worker_headers, self.cfg.tokenizer)
        self.queue_view = (
            QueueView((self.prefill, self.decode), self.http, self.worker_headers, self.cfg.pd_queue_poll_interval,
                      self.metrics)
            if self.cfg.pd_queue_aware else None
        )
        self.queue = QueueEstimate(self.queue_view)
        self.metrics.follow_token_cost("prefill", lambda: self.queue.prefill.per_token)
        self.metrics.follow_token_cost("decode", lambda: self.queue.recompute.per_token)
        self.flow = PDFlow(
            self.cfg, self.prefill, self.decode, make_policy(self.cfg.prefill_policy),
            make_policy(self.cfg.decode_policy), self.legs_http, self.tokens, self.store, self.metrics, self.worker_headers,
            self.queue,
        )
        # A report lives through a canary round (one health interval, or a canary's timeout) with room to spare.
        self.stall_reports = (StallReports(self.cfg.redis_url, 2 * CANARY_TIMEOUT_S + 3 * self.cfg.health_interval)
                              if self.cfg.redis_url else None)
        self.stalls = [
            StallWatch(pool, cost, self.legs_http, self.queue_view, self.http, self.worker_headers, timeout_s,
                       self.cfg.health_interval, self.metrics, self.stall_reports)
            for pool, cost, timeout_s in ((self.prefill, self.queue.prefill, self.cfg.prefill_stall_timeout),
                                          (self.decode, self.queue.recompute, self.cfg.decode_stall_timeout))
            if timeout_s > 0
        ]
        if self.watcher is not None:
            await self.watcher.start()
        await self.health.start()
        for watch in self.stalls:
            watch.start()
        if self.queue_view is not None:
            self.queue_view.start()
        if self.prefill.workers:  # token counts are needed only to decide about a prefill leg
            self.tokens.prepare(self.cfg.model)
            for card in self.decode.model_cards() + self.prefill.model_cards():
                self.tokens.prepare(str(card.get("id")))
        log.info("router ready: %d prefill, %d decode workers", len(self.prefill.workers), len(self.decode.workers))

    def _end_legs_on(self, w: Worker, why: str) -> None:
        """A health check found `w` dead: end the legs still open on it (worker_http.py `cut`), which
        retries them elsewhere or ends their streams with an error event."""
        if cut := self.legs_http.cut(w.url, f"{w.role} worker {w.url} is dead ({why})"):
            log.warning("%s worker %s is dead (%s); ended %d request(s) open on it", w.role, w.id, why, cut)

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        await self.health.stop()
        for watch in self.stalls:
            await watch.stop()
        if self.stall_reports is not None:
            await self.stall_reports.close()
        if self.queue_view is not None:
            await self.queue_view.stop()
        await self.flow.drain()
        await self.tokens.stop()
        await self.store.close()
        await self.legs_http.close()
        await self.http.close()

    def ready(self) -> bool:
        return bool(self.decode.candidates(None))

    def authorize(self, authorization: str) -> None:
        """Raise the 401 unless the client's Authorization header carries the API key (when one is set)."""
        if self._bearer is not None and authorization != self._bearer:
            raise RouterError(401, "invalid or missing API key (send Authorization: Bearer <key>)")


def create_app(cfg: RouterConfig) -> FastAPI:
    router = Router(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.add_middleware(CloseUnreadBodies)

    def counted(route: str, resp: Response) -> Response:
        if not isinstance(resp, StreamingResponse):  # a stream counts its own outcome when it ends
            router.metrics.series(router.metrics.requests, route, str(resp.status_code)).inc()
        return resp

    @app.exception_handler(RouterError)
    async def _router_error(_request: Request, exc: RouterError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return RouterError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return RouterError(400, str(exc.errors())).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return RouterError(500, f"internal router error: {exc!r}").response()

    class Completion:
        """A completion route as a bare ASGI app, reached straight from `CompletionsFirst`.

        FastAPI's endpoint machinery (dependency solving, its exit stack, the response sent by its
        wrapper) and Starlette's Request do nothing these routes use, and the stream must be sent
        inside the request's ClientWatch, which this app holds from the body's end to the response's end.
        """

        def __init__(self, route: Route) -> None:
            self.route = route

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            route = self.route
            head = RequestHead.of(scope["headers"])
            try:
                router.authorize(head.authorization.decode("latin-1"))
                raw = await read_body(receive, head, cfg.max_request_bytes, cfg.body_timeout)
            except RouterError as exc:  # answered before the body was read to its end
                resp = exc.response()
                if head.has_body:
                    close_after(resp)
                await counted(route, resp)(scope, receive, send)
                return
            except ClientDisconnect:
                router.metrics.series(router.metrics.requests, route, "499").inc()
                return
            try:
                body = validate(route, raw)
            except RouterError as exc:
                await counted(route, exc.response())(scope, receive, send)
                return
            # 128 random bits in hex, as uuid4().hex but without building a UUID
            request_id = head.request_id.decode("latin-1") if head.request_id else os.urandom(16).hex()
            call = Call(route=route, raw=raw, body=body, request_id=request_id)
            with ClientWatch(receive) as watch:
                try:
                    resp = await router.flow.handle(call, watch)
                except RouterError as exc:
                    resp = exc.response()
                await counted(route, resp)(scope, receive, send)

    class CompletionsFirst:
        """ASGI middleware: POSTs to the completion routes go straight to their `Completion` app.

        The rest of the stack (CloseUnreadBodies, Starlette's exception middleware, FastAPI's exit
        stack, route matching) was ~8% of the router's CPU per streamed request under `pdserve bench
        router`, for nothing these routes use; they answer their own errors and close a connection
        whose body they did not read themselves. Outside this, only Starlette's ServerErrorMiddleware,
        which turns an unexpected exception into a 500 as for every route. Other methods on those
        paths go through the stack to the same apps' routes, which answer 405.
        """

        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                completion = completions.get(scope["path"])
                if completion is not None:
                    await completion(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    completions = {PATHS[route]: Completion(route) for route in PATHS}
    app.add_middleware(CompletionsFirst)  # outside CloseUnreadBodies: added last
    for path, completion in completions.items():
        app.router.routes.append(StarletteRoute(path, completion, methods=["POST"]))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router.authorize(request.headers.get("authorization", ""))
        return JSONResponse({"object": "list", "data": router.decode.model_cards()})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        counts: dict[str, Any] = {
            role: {"healthy": len(pool.candidates(None)), "known": len(pool.workers)}
            for role, pool in (("prefill", router.prefill), ("decode", router.decode))
        }
        return JSONResponse({"ready": router.ready(), **counts}, status_code=200 if router.ready() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def tune_gc() -> None:
    """Keep the cyclic GC off the request path: freeze what start-up built, collect young objects less often.

    Measured under `pdserve bench router` at c=16 (defaults): a full collection every ~1000
    requests walked the ~90k objects of the imports (FastAPI, pydantic, aiohttp, prometheus)
    for 58 ms of CPU, stalling every request in flight (the p99 tail), and GC took ~12% of the
    router's CPU. Frozen objects are never walked again, and with a young generation of
    GC_THRESHOLDS[0] a request's objects are mostly freed by reference counting before a
    collection sees them, so few are promoted. Cycles are still collected, only in larger batches.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    prometheus_client.disable_created_metrics()  # `_created` series double /metrics for no use here
    app = create_app(cfg)
    protocol = server_protocol(cfg.header_timeout, cfg.send_timeout, app.state.router.metrics.send_timeouts.inc,
                               cfg.max_header_bytes)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
            loop="uvloop", http=protocol, timeout_graceful_shutdown=5,
        )
    )
    tune_gc()  # after the imports and the app are built: those live as long as the process
    server.run()
    return 0
