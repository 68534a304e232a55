"""HTTP side door of the KV store: /health, /metrics (Prometheus), /stats (JSON).

A small threaded http.server in its own thread: it only reads the metrics
registry, so it never touches store state owned by the ZMQ thread. Each connection
holds a thread while it is open, so one that sends nothing is closed after
IDLE_TIMEOUT_S (without it, 500 idle connections held 500 threads for good, and a
burst of 2000 stalled the listener); the listen backlog is http.server's 5, raised
so a burst of scrapes is not refused.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.kvstore.server.metrics import Metrics

IDLE_TIMEOUT_S = 5.0  # a connection's request must come within this (HTTP/1.0: one request per connection)
BACKLOG = 128


def start_http(host: str, port: int, metrics: Metrics, info: Callable[[], dict]) -> ThreadingHTTPServer:
    """Serve in a daemon thread; `info()` adds static facts (capacity, version) to /stats."""

    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_TIMEOUT_S  # socket timeout of each connection: an idle one ends its thread

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self._reply(200, "application/json", b'{"status":"ok"}')
            elif path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, metrics.prometheus())
            elif path == "/stats":
                body = json.dumps({**info(), "metrics": metrics.snapshot()}).encode()
                self._reply(200, "application/json", body)
            else:
                self._reply(404, "application/json", b'{"error":"not found"}')

        def _reply(self, status: int, ctype: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # quiet: scraped every few seconds
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = BACKLOG
        daemon_threads = True

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="kvstore-http", daemon=True).start()
    return server
