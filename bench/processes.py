"""Services a benchmark starts as child processes: started, waited for until ready, stopped.

Benchmarks run the router (and `bench router`'s stub) as separate processes, as users do,
so the router's event loop never shares a core's time slices with the load generator's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import httpx

from pdserve.deploy.ports import free_port


_SCHEDSTAT = os.path.exists("/proc/self/schedstat")  # CONFIG_SCHEDSTATS: nanosecond CPU times per thread


def cpu_seconds(pid: int) -> float:
    """CPU time a process's live threads have used so far (Linux /proc). From schedstat, to the
    nanosecond, where the kernel keeps it: /proc/PID/stat counts clock ticks (10 ms), coarser than a
    short run of a router that spends ~0.1 ms a request."""
    if not _SCHEDSTAT:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except FileNotFoundError:  # the thread ended after the listing
            continue
    return ns / 1e9


@contextmanager
def service(argv: Sequence[str], ready_url: str, name: str, timeout_s: float = 120.0,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run `argv` until the block ends; yields once `ready_url` answers 200 (fails if it exits first)."""
    log = tempfile.TemporaryFile()  # its stderr, for the error message if it never gets ready
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                err = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{name} did not get ready: {err or 'no output'}")
            time.sleep(0.2)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def router_argv(port: int, *flags: str) -> list[str]:
    """`pdserve router` on 127.0.0.1:`port` with `flags`, as this Python runs it."""
    return [sys.executable, "-m", "pdserve.deploy.cli", "router", "--host", "127.0.0.1", "--port", str(port), *flags]


@contextmanager
def router(*flags: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `pdserve router` with `flags` on a free port; yields (its URL, its process) once it is ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(router_argv(port, *flags), f"{url}/ready", f"router {' '.join(flags)}", env=env) as proc:
        yield url, proc


@contextmanager
def router_stub(tokens: int) -> Iterator[str]:
    """`bench router`'s stub upstream (router_stub.py) streaming `tokens` token events, on a free port;
    yields its URL once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pdserve.bench.router_stub", "--port", str(port), "--tokens", str(tokens)]
    with service(argv, f"{url}/health", "router stub"):
        yield url
