"""`pdserve kvstore`: run the KV store (ZMQ on --port, HTTP on --http-port).

Wiring only: configuration, metrics, the store, the HTTP thread and the ZMQ loop
in the main thread until SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import resource
import signal
import sys
import threading
from contextlib import ExitStack
from typing import Sequence

import zmq

from pdserve import __version__
from pdserve.kvstore.server.config import KVStoreConfig, build_parser, from_args
from pdserve.kvstore.server.http import start_http
from pdserve.kvstore.client.malloc import keep_large_buffers
from pdserve.kvstore.server.metrics import Metrics
from pdserve.kvstore.client.shm import ArenaError
from pdserve.kvstore.server.store import Store
from pdserve.kvstore.server.transport import ZmqServer

__all__ = ["build_parser", "main", "run"]

log = logging.getLogger("pdserve.kvstore")


def _static_info(cfg: KVStoreConfig) -> dict:
    return {
        "version": __version__,
        "store_id": cfg.identity,
        "advertise_url": cfg.advertised_url,
        "chunk_size": cfg.chunk_size,
        "l1_bytes": cfg.l1_bytes,
        "l2_bytes": cfg.l2_bytes,
        "l2_path": str(cfg.l2_path) if cfg.l2_path else None,
    }


def run(cfg: KVStoreConfig, stop: threading.Event) -> None:
    """Serve until `stop` is set; whatever was started is torn down, in reverse, however start-up ends."""
    metrics = Metrics()
    with ExitStack() as teardown:
        store = Store(cfg, metrics)
        teardown.callback(store.close)  # unlinks the arena from /dev/shm
        zmq_server = ZmqServer(cfg, store, metrics)
        teardown.callback(zmq_server.close)
        if cfg.http_port:
            http = start_http(cfg.host, cfg.http_port, metrics, lambda: _static_info(cfg))
            teardown.callback(http.server_close)
            teardown.callback(http.shutdown)
            log.info("kvstore HTTP on http://%s:%d", cfg.host, cfg.http_port)
        zmq_server.serve(stop)


def raise_open_file_limit() -> None:
    """Lift this process's soft limit on open files to its hard limit.

    Every client connection holds a descriptor, and at the limit libzmq's listener spins on a failing accept
    (a core at 100% until descriptors free, new clients unserved): measured with bare TCP connections against
    a soft limit of 4096. Servers such as nginx and vLLM raise it the same way."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = from_args(args)
    except ValueError as exc:
        print(f"pdserve kvstore: {exc}", file=sys.stderr)
        return 2
    keep_large_buffers()
    raise_open_file_limit()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        run(cfg, stop)
    except (ArenaError, OSError, zmq.ZMQError) as exc:
        print(f"pdserve kvstore: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
