"""A worker that misses one health check stays in the pool; one that misses them in a row goes (fast tier).

A vLLM API server busy with one huge prompt (16 MB of text: two minutes of tokenizing on the
2-core VM) answered most health checks but missed one now and then, and each miss took it out of
the pool: with a single decode worker every other client got 503 until the next check passed.
Here a real `pdserve router` checks a stand-in worker (aiohttp, in this process) whose /health
can be told to answer late; the router's checks time out after `--health-interval`.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx
import pytest
from aiohttp import web

from procs import Proc
from router_fixtures import start_router

INTERVAL_S = 1.0  # the router's health interval, and so its check timeout (a loaded 2-core VM answers well inside it)


class Worker:
    """A decode worker whose next `late` health checks answer after the router's timeout."""

    def __init__(self) -> None:
        self.late = 0
        self.checks = 0
        self.late_checks = 0

    async def health(self, _request: web.Request) -> web.Response:
        self.checks += 1
        if self.late > 0:
            self.late -= 1
            self.late_checks += 1
            await asyncio.sleep(3 * INTERVAL_S)
        return web.Response()

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def completions(self, _request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "text_completion", "model": "stub",
                                  "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Worker, str]]:
    w = Worker()
    app = web.Application()
    app.router.add_get("/health", w.health)
    app.router.add_get("/v1/models", w.models)
    app.router.add_post("/v1/completions", w.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield w, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _router(url: str, failures: int) -> Proc:
    return await asyncio.to_thread(start_router, "--decode", url, "--health-interval", str(INTERVAL_S),
                                   "--health-failures", str(failures))


async def _late_checks(w: Worker, late: int) -> None:
    """Make the next `late` checks answer late, and wait until they and one more check have been made."""
    start = w.checks
    w.late = late
    while w.checks < start + late + 1:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # the verdict of the last one applied


def _downs(router: Proc, url: str) -> int:
    return router.log_path.read_text(errors="replace").count(f"decode worker {url} is down")


async def test_one_late_check_keeps_the_worker_two_in_a_row_take_it_out(worker: tuple[Worker, str]) -> None:
    w, url = worker
    router = await _router(url, failures=2)
    try:
        await _late_checks(w, 1)
        assert w.late_checks == 1 and _downs(router, url) == 0, router.log_tail()
        async with httpx.AsyncClient() as client:  # served throughout
            r = await client.post(router.url + "/v1/completions", json={"model": "stub", "prompt": "hi"})
            assert r.status_code == 200
        await _late_checks(w, 2)
        assert _downs(router, url) == 1, router.log_tail()
    finally:
        router.stop()


async def test_with_one_failure_allowed_a_single_late_check_takes_it_out(worker: tuple[Worker, str]) -> None:
    w, url = worker
    router = await _router(url, failures=1)
    try:
        await _late_checks(w, 1)
        assert _downs(router, url) == 1, router.log_tail()
    finally:
        router.stop()
