"""Stub vLLM workers for router tests: aiohttp apps with a worker's routes, each on a loopback port."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Awaitable, Callable, Mapping

import httpx
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def planner_pools(cfg: RouterConfig, metrics: RouterMetrics) -> tuple[Pool, Pool]:
    """A prefill pool of http://p and a decode pool of http://d, both marked healthy: what a PathPlanner
    needs when no worker is called."""
    prefill, decode = Pool("prefill", cfg, metrics), Pool("decode", cfg, metrics)
    prefill.add_static(["http://p"])
    decode.add_static(["http://d"])
    for w in (*prefill.workers.values(), *decode.workers.values()):
        w.healthy = True
    return prefill, decode


async def healthy(_r: web.Request) -> web.Response:
    """/health of a stub that is always up."""
    return web.Response()


async def serves_stub(_r: web.Request) -> web.Response:
    """/v1/models of a stub serving the model "stub"."""
    return web.json_response({"data": [{"id": "stub", "object": "model"}]})


def worker_app(health: Handler, models: Handler, completions: Handler,
               posts: Mapping[str, Handler] | None = None) -> web.Application:
    """/health, /v1/models and /v1/completions as a vLLM worker serves them, plus other POST routes."""
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    for path, handler in (posts or {}).items():
        app.router.add_post(path, handler)
    return app


@contextlib.asynccontextmanager
async def listening(*apps: web.Application) -> AsyncIterator[list[str]]:
    """Each app's base URL while it listens; a connection the router closes cancels its handler,
    as a hung-up leg aborts the request in vLLM."""
    runners = []
    try:
        for app in apps:
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield ["http://127.0.0.1:%d" % runner.addresses[0][1] for runner in runners]
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def router_client(cfg: RouterConfig) -> AsyncIterator[httpx.AsyncClient]:
    """A client of an in-process router (its lifespan run) configured by `cfg`."""
    app = create_app(cfg)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                     timeout=60) as client:
            yield client


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """The sum of a router's /metrics samples named `name` whose labels include `labels` (0 when absent)."""
    text = (await client.get("/metrics")).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
