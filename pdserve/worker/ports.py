"""Whether a server could bind its port now: a worker must not start vLLM where another server listens."""

from __future__ import annotations

import socket
import time


def server_can_bind(host: str, port: int) -> bool:
    """Whether a server could bind host:port now, as uvicorn or ZMQ would (SO_REUSEADDR: connections of an
    earlier server still in TIME_WAIT do not count; one still listening does)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        return True  # not ours to judge: the server's own bind reports a bad host
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return False
    return True


def wait_for_port(host: str, port: int, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Wait until a server could bind host:port (an earlier process may still be draining on it); False if
    it is still taken after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not server_can_bind(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
