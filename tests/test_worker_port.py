"""A worker starts vLLM only once nothing else listens on its port (fast tier: no vLLM is started for long).

Seen under Ray: a restarted actor's worker found its predecessor's vLLM still draining on the same port; that
server answered the new worker's /health, so the worker reported itself ready and registered before its own
vLLM had started, then killed that vLLM as unhealthy once the old one went. Here a stand-in server holds the
port for a few seconds: the worker must wait it out, say so, and never call itself ready meanwhile.
"""

from __future__ import annotations

import http.server
import signal
import socket
import subprocess
import threading
import time

from pdserve.worker.ports import server_can_bind, wait_for_port
from procs import free_port, pdserve_argv

HELD_S = 4.0


class Healthy(http.server.BaseHTTPRequestHandler):
    """Answers every GET (the worker's /health) with 200, as a draining vLLM would."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_held_port_is_waited_for_and_reported() -> None:
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    assert not server_can_bind("127.0.0.1", port)
    assert not wait_for_port("127.0.0.1", port, timeout_s=0.5, poll_s=0.1)
    worker = subprocess.Popen(pdserve_argv("decode", "--model", "m", "--no-connector", "--port", str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), ln) for ln in worker.stdout), daemon=True)
    reader.start()
    try:
        time.sleep(HELD_S)
        server.shutdown()
        server.server_close()
        freed_at = time.monotonic()
        deadline = freed_at + 60
        while not any("started vLLM" in ln for _, ln in lines) and time.monotonic() < deadline:
            assert worker.poll() is None, "".join(ln for _, ln in lines)
            time.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        reader.join(10)
    text = "".join(ln for _, ln in lines)
    assert f"port {port} is in use" in text, text
    started = [t for t, ln in lines if "started vLLM" in ln]
    assert started and started[0] >= freed_at, text
    assert "ready at" not in text, text
    with socket.create_server(("127.0.0.1", port)):  # the worker's vLLM is gone with it
        pass
