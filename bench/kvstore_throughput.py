"""`pdserve bench kvstore`: store/load throughput against a plain memcpy.

Starts a KV store on free local ports (or uses --url), then for each object size
stores and loads --total-mib of random payloads over shared memory and over TCP
loopback, and copies the same bytes with numpy (memcpy) in the same run. Loads
land where the connector reads them from: over shared memory in caller-provided
buffers (`get(..., out=...)`: an arena slot is reused once its lease ends), over
TCP in the received frames, verified (the connector scatters straight from them).
Two last rows per size move as many bytes, in distinct buffers, between two processes
over TCP loopback with no store and no checksum: over ZMQ, and over a plain socket
received straight into place (recv_into). They are the ceilings of a TCP path on the
machine the bench runs on, through ZMQ and through any socket, so the store's TCP
figures can be read against them.
Each figure is the best of --repeat runs, since the machine may be shared. The
bench process tunes its malloc as the server does (pdserve.kvstore.client.malloc): without
it, TCP loads of large objects pay a page fault per page of every received message.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import zmq

from pdserve.deploy.ports import free_port
from pdserve.kvstore.client.client import KVStoreClient, KVStoreError
from pdserve.kvstore.client.malloc import keep_large_buffers

MIB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench kvstore", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="an already running store (default: start one locally)")
    p.add_argument("--auth-token", default=None)
    p.add_argument("--total-mib", type=int, default=256, help="bytes stored then loaded per case")
    p.add_argument("--object-mib", type=int, nargs="+", default=[1, 16], help="object sizes")
    p.add_argument("--batch-mib", type=int, default=64, help="payload bytes per put/get round trip")
    p.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported")
    return p


@contextmanager
def _local_server(l1_gb: float) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.kvstore.server.main", "--port", str(port), "--http-port", "0",
            "--l1-size-gb", f"{l1_gb:.3f}", "--log-level", "WARNING"]
    proc = subprocess.Popen(argv)
    url = f"tcp://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with KVStoreClient(url, timeout_s=1.0, shm=False) as c:
                    c.info()
                break
            except KVStoreError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"kvstore did not start (exit code {proc.poll()})")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _batches(n: int, per_batch: int) -> Iterator[range]:
    for start in range(0, n, per_batch):
        yield range(start, min(n, start + per_batch))


def _best(runs: int, fn) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_case(url: str, token: str | None, shm: bool, src: list[np.ndarray], dst: list[np.ndarray],
               batch: int, repeat: int) -> tuple[float, float]:
    """Seconds (best of `repeat`) to store all of `src`, then to load it all into `dst`."""
    with KVStoreClient(url, auth_token=token, shm=shm, prefault=True) as c:
        c.info()
        if shm and not c.uses_shm:
            raise SystemExit("shared memory is not available with this server")
        ns = f"bench{os.getpid()}"
        store_s = load_s = float("inf")
        for _ in range(repeat):
            keys = [os.urandom(16) for _ in src]

            def store() -> None:
                for r in _batches(len(src), batch):
                    if not all(c.put(ns, [(0, keys[i], src[i]) for i in r])):
                        raise SystemExit("a put was refused (L1 too small?)")

            def load() -> None:
                for r in _batches(len(src), batch):
                    got = c.get(ns, [(0, keys[i]) for i in r], out=[dst[i] for i in r] if shm else None)
                    if any(g is None for g in got):
                        raise SystemExit("a load missed")
                    if not shm:
                        received[r.start : r.stop] = got

            received: list = [None] * len(src)
            store_s = min(store_s, _best(1, store))  # fresh keys each run: a store, not a re-touch
            load_s = min(load_s, _best(1, load))
        loaded = dst if shm else [np.frombuffer(v, dtype=np.uint8) for v in received]
        if not all(np.array_equal(a, b) for a, b in zip(src, loaded)):
            raise SystemExit("loaded bytes differ from stored bytes")
    return store_s, load_s


def _payloads(size: int, count: int) -> list[np.ndarray]:
    """Distinct buffers, as the store's cases send: one buffer sent again and again would be read
    from cache and overstate a ceiling for objects that fit in it."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(count)]


def _zmq_sender(port: int, size: int, count: int) -> None:
    """Child process of `zmq_ceiling`: on each b"go", send `count` frames of `size` bytes, zero-copy."""
    keep_large_buffers()
    payloads = _payloads(size, count)
    with zmq.Context() as ctx, ctx.socket(zmq.PAIR) as sock:
        sock.connect(f"tcp://127.0.0.1:{port}")
        while sock.recv() == b"go":
            for payload in payloads:
                sock.send(payload.data, copy=False)


def _socket_sender(port: int, size: int, count: int) -> None:
    """Child process of `socket_ceiling`: on each b"g", write `count` buffers of `size` bytes."""
    payloads = _payloads(size, count)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        while sock.recv(1) == b"g":
            for payload in payloads:
                sock.sendall(payload.data)


@contextmanager
def _sender(target, port: int, size: int, count: int) -> Iterator[None]:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=(port, size, count))
    proc.start()
    try:
        yield
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def zmq_ceiling(size: int, count: int, repeat: int) -> float:
    """Seconds (best of `repeat`) for another process to send count x size bytes over ZMQ on TCP loopback."""
    with zmq.Context() as ctx, ctx.socket(zmq.PAIR) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        with _sender(_zmq_sender, port, size, count):

            def move() -> None:
                sock.send(b"go")
                for _ in range(count):
                    if len(sock.recv(copy=False)) != size:
                        raise SystemExit("zmq ceiling: short frame")

            try:
                move()  # connect and warm the buffers
                return _best(repeat, move)
            finally:
                sock.send(b"stop")


def socket_ceiling(dst: list[np.ndarray], repeat: int) -> float:
    """Seconds (best of `repeat`) for another process to write len(dst) buffers over a plain TCP loopback
    socket, received straight into `dst` (recv_into): what a payload channel with no copy of its own
    beside the ZMQ one could reach at best."""
    size = dst[0].nbytes
    with socket.create_server(("127.0.0.1", 0)) as server, _sender(
        _socket_sender, server.getsockname()[1], size, len(dst)
    ):
        server.settimeout(30)
        conn, _ = server.accept()
        with conn:
            views = [d.data.cast("B") for d in dst]

            def move() -> None:
                conn.sendall(b"g")
                for view in views:
                    got = 0
                    while got < size:
                        n = conn.recv_into(view[got:])
                        if not n:
                            raise SystemExit("socket ceiling: sender closed")
                        got += n

            try:
                move()
                return _best(repeat, move)
            finally:
                conn.sendall(b"s")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if keep_large_buffers():
        print("client malloc tuned as the server's (see pdserve.kvstore.client.malloc)", file=sys.stderr)
    total = args.total_mib * MIB
    rows: list[tuple[str, str, float, float]] = []
    with _local_server(l1_gb=(2.5 * total + 64 * MIB) / 2**30) if args.url is None else _nullctx(args.url) as url:
        for obj_mib in args.object_mib:
            size = obj_mib * MIB
            n = max(1, total // size)
            nbytes = n * size
            rng = np.random.default_rng(obj_mib)
            src = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]
            dst = [np.empty(size, dtype=np.uint8) for _ in range(n)]
            for a, b in zip(src, dst):
                np.copyto(b, a)  # fault the pages in, as a connector's KV cache would be

            def memcpy() -> None:
                for a, b in zip(src, dst):
                    np.copyto(b, a)

            memcpy_gbs = nbytes / _best(args.repeat, memcpy) / 1e9
            batch = max(1, args.batch_mib // obj_mib)
            for name, shm in (("shm", True), ("tcp", False)):
                store_s, load_s = bench_case(url, args.auth_token, shm, src, dst, batch, args.repeat)
                rows.append((f"{obj_mib} MiB", name, nbytes / store_s / 1e9, nbytes / load_s / 1e9))
            rows.append((f"{obj_mib} MiB", "memcpy", memcpy_gbs, memcpy_gbs))
            for name, seconds in (("zmq tcp alone", zmq_ceiling(size, n, args.repeat)),
                                  ("socket tcp alone", socket_ceiling(dst, args.repeat))):
                rows.append((f"{obj_mib} MiB", name, nbytes / seconds / 1e9, nbytes / seconds / 1e9))
            print(f"{obj_mib} MiB objects x {n}: memcpy {memcpy_gbs:.2f} GB/s", file=sys.stderr)
    print(_table(rows))
    return 0


@contextmanager
def _nullctx(url: str) -> Iterator[str]:
    yield url


def _table(rows: list[tuple[str, str, float, float]]) -> str:
    memcpy = {obj: gbs for obj, path, gbs, _ in rows if path == "memcpy"}
    lines = ["| object | path | store GB/s | load GB/s | store / memcpy | load / memcpy |",
             "|---|---|---|---|---|---|"]
    for obj, path, store, load in rows:
        m = memcpy[obj]
        lines.append(f"| {obj} | {path} | {store:.2f} | {load:.2f} | {store / m:.2f}x | {load / m:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
