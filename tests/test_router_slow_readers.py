"""Clients that stop reading their answers: the router cuts them after `--send-timeout`, not before.

Real processes, real HTTP, no engine: a router in front of the bench's stub upstream, whose
streamed answers (60000 token events, about 9 MB) are larger than what the router's transport
and both kernels' socket buffers hold (2.8 MB on the 2-core VM, where the kernel may grow a
send buffer to 4 MB), so a client that does not read makes the router wait. Before the send
timeout, two such clients on a worker capped at two in-flight requests got every other client
a 429 for as long as they kept their connections open. (A client that reads slowly but reads is
not cut: test_router_serving.py, where the server's buffers can be kept small.)
"""

from __future__ import annotations

import socket
from typing import Iterator

import httpx
import pytest

from pdserve.bench import processes
from procs import Proc
from router_fixtures import metric, start_router, wait_until

SEND_TIMEOUT_S = 1.0
CAP = 2
_BODY = b'{"model": "stub", "prompt": "hi", "stream": true}'
_REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


@pytest.fixture(scope="module")
def router() -> Iterator[Proc]:
    with processes.router_stub(60000) as stub:
        proc = start_router("--decode", stub, "--send-timeout", str(SEND_TIMEOUT_S),
                            "--max-inflight-per-worker", str(CAP), "--queue-timeout", "2")
        try:
            yield proc
        finally:
            proc.stop()


def _reader(router: Proc) -> socket.socket:
    """A connection with a small receive buffer (so the router's writes back up soon) that sent a streamed request."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", router.port))
    sock.sendall(_REQUEST)
    return sock


def _inflight(router: Proc) -> float:
    return metric(router.url, "pdserve_router_inflight", {"role": "decode"})


def test_clients_that_never_read_are_cut_and_free_their_worker(router: Proc) -> None:
    stuck = [_reader(router) for _ in range(CAP)]
    try:
        wait_until(lambda: _inflight(router) == CAP, 10, "the two streams taking the worker's slots")
        # The worker is full; the stuck streams are let go after the send timeout, and this one is served.
        served = httpx.post(f"{router.url}/v1/completions", json={"model": "stub", "prompt": "hi"}, timeout=30)
        assert served.status_code == 200 and served.json()["choices"][0]["text"].startswith(" t0 t1")
        wait_until(lambda: _inflight(router) == 0, 10, "the stuck streams' slots freed")
        for sock in stuck:  # what was sent before the cut can still be read, then the connection ends
            sock.settimeout(10)
            got = b""
            try:
                while chunk := sock.recv(65536):
                    got += chunk
            except ConnectionResetError:
                pass
            assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in got
    finally:
        for sock in stuck:
            sock.close()
    assert "took no byte of its answer" in router.log_tail(20000)
    assert metric(router.url, "pdserve_router_send_timeouts_total") == CAP
