"""The KV store server's configuration: one typed place, filled from the same flags LMCache users know."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from pdserve.kvstore.client.auth import TOKEN_ENV

GIB = 1 << 30


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = "127.0.0.1"
    port: int = 5556
    http_port: int = 18556  # 0 disables HTTP
    chunk_size: int = 256
    l1_size_gb: float = 4.0
    eviction_policy: str = "lru"
    l2_path: Path | None = None
    l2_size_gb: float = 0.0
    auth_token: str | None = None
    tail_ttl_s: float = 60.0
    lease_timeout_s: float = 60.0  # a client that vanished mid-transfer loses its leases after this
    shm: bool = True  # put the L1 arena in /dev/shm so same-host clients can map it
    log_level: str = "INFO"
    store_id: str | None = None  # default: HOSTNAME/advertised URL
    advertise_url: str | None = None  # default: tcp://host:port unless bound to a wildcard address

    @property
    def l1_bytes(self) -> int:
        return int(self.l1_size_gb * GIB)

    @property
    def l2_bytes(self) -> int:
        return int(self.l2_size_gb * GIB)

    def validate(self) -> None:
        """Raise ValueError with the flag to fix."""
        if self.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be positive, got {self.chunk_size}")
        if self.l1_bytes < 1 << 20:
            raise ValueError(f"--l1-size-gb must be at least 1 MiB, got {self.l1_size_gb}")
        if self.eviction_policy.lower() != "lru":
            raise ValueError(f"--eviction-policy {self.eviction_policy!r} is not supported (only lru)")
        if self.l2_path is not None and self.l2_bytes <= 0:
            raise ValueError("--l2-path needs a positive --l2-size-gb")
        if self.l2_path is None and self.l2_size_gb:
            raise ValueError("--l2-size-gb needs --l2-path")
        if not self.auth_token and not is_loopback(self.host):
            raise ValueError(f"--auth-token is required when binding a non-loopback address ({self.host})")
        if self.tail_ttl_s <= 0 or self.lease_timeout_s <= 0:
            raise ValueError("--tail-ttl-s and --lease-timeout-s must be positive")
        if self.advertise_url is not None and not _TCP_URL.match(self.advertise_url):
            raise ValueError(f"--advertise-url must be tcp://HOST:PORT, got {self.advertise_url!r}")
        if self.store_id is not None and not self.store_id.strip():
            raise ValueError("--store-id must not be empty")

    @property
    def identity(self) -> str:
        """The store's id: unique across hosts even where every host's store has the same URL."""
        return self.store_id or f"{socket.gethostname()}/{self.advertised_url or self.zmq_url}"

    @property
    def advertised_url(self) -> str | None:
        """The URL clients on other hosts use; None when bound to a wildcard address (clients then
        publish the URL they reach the store at)."""
        if self.advertise_url:
            return self.advertise_url
        return None if _is_wildcard(self.host) else self.zmq_url

    @property
    def zmq_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


_TCP_URL = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):\d{1,5}$")


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host in ("", "*")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    d = KVStoreConfig()
    p = argparse.ArgumentParser(prog="pdserve kvstore", description="Run the pdserve KV store server.")
    p.add_argument("--host", default=d.host, help="address to bind (a non-loopback address needs --auth-token)")
    p.add_argument("--port", type=int, default=d.port, help="ZMQ port")
    p.add_argument("--http-port", type=int, default=d.http_port, help="HTTP port for /health /metrics /stats (0: off)")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="tokens per chunk, announced to clients")
    p.add_argument("--l1-size-gb", type=float, default=d.l1_size_gb, help="L1 (memory) budget in GiB")
    p.add_argument("--eviction-policy", default=d.eviction_policy, help="only lru")
    p.add_argument("--l2-path", type=Path, default=None, help="directory for L2 (objects evicted from L1)")
    p.add_argument("--l2-size-gb", type=float, default=d.l2_size_gb, help="L2 budget in GiB")
    p.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"shared secret clients must send (default: ${TOKEN_ENV})")
    p.add_argument("--tail-ttl-s", type=float, default=d.tail_ttl_s, help="default lifetime of request tails")
    p.add_argument("--lease-timeout-s", type=float, default=d.lease_timeout_s, help="lifetime of a transfer lease")
    p.add_argument("--no-shm", dest="shm", action="store_false", help="keep L1 private (clients use TCP frames)")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--store-id", default=None,
                   help="this store's id in kv_transfer_params and the router's prefix view (default: HOSTNAME/ADVERTISED_URL)")
    p.add_argument("--advertise-url", default=None,
                   help="tcp://HOST:PORT where other hosts reach this store (default: tcp://HOST:PORT of --host and "
                        "--port unless --host is a wildcard address)")
    return p


def from_args(args: argparse.Namespace) -> KVStoreConfig:
    cfg = KVStoreConfig(**vars(args))
    cfg.validate()
    return cfg
