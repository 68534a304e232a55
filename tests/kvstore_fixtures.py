"""Start real KV store servers for tests (a subprocess each, `pdserve kvstore ...`)."""

from __future__ import annotations

from dataclasses import dataclass

from procs import Proc, free_port, pdserve_argv, start_process

from pdserve.kvstore.client.layout import KVGroupLayout, KVLayout

# Two groups, like an MLA model with a sliding-window side group.
LAYOUT = KVLayout(
    model="tiny-test",
    groups=(
        KVGroupLayout("full", "bfloat16", 1152, 16, 4),
        KVGroupLayout("sliding", "bfloat16", 512, 16, 2, sliding_window=64),
    ),
)


@dataclass
class KVStoreProc:
    proc: Proc
    port: int
    http_port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def stop(self) -> int | None:
        return self.proc.stop()


def start_kvstore(
    *flags: str, port: int | None = None, l1_size_gb: float = 0.05, wrapper: tuple[str, ...] = ()
) -> KVStoreProc:
    """A server on free ports with a small L1; ready when /health answers (ZMQ is bound before HTTP).
    `wrapper` is a command line the server's is appended to (one that execs it keeps its pid)."""
    port = port or free_port()
    http_port = free_port()
    argv = [*wrapper] + pdserve_argv(
        "kvstore", "--port", str(port), "--http-port", str(http_port), "--l1-size-gb", str(l1_size_gb),
        "--log-level", "WARNING", *flags,
    )
    proc = start_process(argv, f"http://127.0.0.1:{http_port}/health", name="kvstore", port=port, timeout=30)
    return KVStoreProc(proc, port, http_port)
