"""Free TCP ports for the stacks and benchmarks pdserve starts on one machine.

`bind(0)` picks a port from the kernel's ephemeral range, the range outgoing
connections also take their local ports from. A port picked that way and bound
later (a vLLM engine binds its port 40 s or more after it was chosen) can be taken
meanwhile by any outgoing connection on the machine; seen here as a worker failing
with "Address already in use". Picking below the ephemeral range avoids that.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from pdserve.worker.ports import server_can_bind

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # below: well-known services, hand-set ports and Ray's worker ports (10002-19999)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _EPHEMERAL.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and outside the ephemeral range (falls back to the kernel's pick)."""
    low, high = _ephemeral_range()
    span = range(_LOWEST, low) if low - _LOWEST >= 1000 else range(high + 1, 65536)
    for _ in range(200):
        port = random.choice(span)
        if server_can_bind(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
