"""A worker restarts a vLLM that routers report stalled (fast tier): the supervisor's side of the report.

A real Redis, the router's own report writer (stall_reports.py), and a stand-in vLLM server on loopback
that answers completions or hangs. Only `_restart_unresponsive` is replaced, to record the decision
instead of stopping a process. The whole chain on real engines (a stopped engine core under streamed
load, restarted and re-admitted): test_supervision.py.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from typing import Iterator

import pytest

from pdserve.router.pool import Worker
from pdserve.router.stall_reports import StallReports
from pdserve.worker import supervisor
from pdserve.worker.children import StopFlag
from pdserve.worker.config import config_from_args
from procs import free_port

TIMEOUT_S = 5.0  # the worker's --stall-restart-timeout here


class StandIn(http.server.BaseHTTPRequestHandler):
    """vLLM's completions endpoint, answering at once or after `hang_s`; records the requests' headers."""

    hang_s = 0.0
    seen: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(dict(self.headers))
        time.sleep(self.hang_s)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), StandIn)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    StandIn.hang_s, StandIn.seen = 0.0, []
    yield server.server_address[1]
    server.shutdown()


def test_a_reported_stall_that_lasts_restarts_vllm_only_when_it_answers_the_worker_neither(
        redis_url: str, stand_in: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "CANARY_TIMEOUT_S", 0.5)
    cfg = config_from_args("decode", ["--model", "m", "--no-connector", "--redis-url", redis_url, "--port",
                                      str(stand_in), "--stall-restart-timeout", str(TIMEOUT_S), "--", "--api-key", "k"])
    sup = supervisor.WorkerSupervisor(cfg, StopFlag())
    restarts: list[str] = []
    monkeypatch.setattr(sup, "_restart_unresponsive", restarts.append)
    sup._register()
    assert sup.registrar is not None
    record = sup.registrar.record

    def report(started_at: float) -> None:
        """What a router that took the worker out of its pool writes."""
        async def write() -> None:
            reports = StallReports(redis_url, ttl_s=30.0)
            await reports.refresh(Worker(cfg.worker_id, "decode", cfg.url, "redis", started_at=started_at), "silent")
            await reports.close()
        asyncio.run(write())

    try:
        sup._check_stall_report(100.0)
        assert sup.reported_since is None
        report(record.started_at - 1)  # about an earlier vLLM of this worker
        sup._check_stall_report(100.0)
        assert sup.reported_since is None

        report(record.started_at)
        sup._check_stall_report(100.0)
        sup._check_stall_report(100.0 + TIMEOUT_S - 0.1)
        assert sup.reported_since == 100.0 and StandIn.seen == [] and restarts == []

        # It answers the worker's own request: the routers' view is not the engine's, so no restart.
        sup._check_stall_report(100.0 + TIMEOUT_S)
        assert len(StandIn.seen) == 1 and StandIn.seen[0]["Authorization"] == "Bearer k" and restarts == []

        StandIn.hang_s = 2.0  # it answers nothing in time
        assert sup.reported_since is not None
        sup._check_stall_report(sup.reported_since + TIMEOUT_S)
        assert len(restarts) == 1 and "routers have reported vLLM stalled for 5 s (silent)" in restarts[0]
    finally:
        sup._deregister()
        sup.http.close()
