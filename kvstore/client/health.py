"""A KV store as a fault domain: one health state per store, shared by a whole process.

A store that misses one deadline (KVStoreUnavailable: dead, wedged, unreachable) is
marked down for every client of this process at once. The connector's loads, saves
and lookups on a store that is down fail immediately (vLLM recomputes) instead of
each waiting out its own deadline behind the others. While a store is down, one
probe thread asks it for its info every PROBE_INTERVAL_S and marks it up the moment
it answers, so a restarted (or resumed) store is used again without any request
paying for the probe.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from pdserve.kvstore.client.client import KVStoreClient, KVStoreError, KVStoreUnavailable

log = logging.getLogger("pdserve.connector")

PROBE_INTERVAL_S = 0.5


class StoreDown(KVStoreUnavailable):
    """Refused without asking: the store is marked down."""


class StoreHealth:
    """Up or down for one store URL; see the module docstring."""

    def __init__(self, client_args: dict[str, Any]) -> None:
        self.url: str = client_args["url"]
        # the probe maps no arena: it only needs an answer
        self._probe_args = {**client_args, "shm": False}
        self._lock = threading.Lock()
        self._down_since: float | None = None

    @property
    def up(self) -> bool:
        return self._down_since is None

    def check(self) -> None:
        """Raise StoreDown if the store is marked down."""
        since = self._down_since
        if since is not None:
            raise StoreDown(f"kvstore {self.url}: down for {time.monotonic() - since:.1f} s, not waiting for it")

    def mark_down(self, exc: Exception) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
        log.warning("kvstore %s is down (%s): recomputing instead of waiting, until it answers again", self.url, exc)
        threading.Thread(target=self._probe, name="pdserve-store-probe", daemon=True).start()

    def _probe(self) -> None:
        with KVStoreClient(**self._probe_args) as client:
            while True:
                time.sleep(PROBE_INTERVAL_S)
                try:
                    client.info()
                except KVStoreUnavailable:
                    continue
                except KVStoreError:
                    pass  # an error reply (e.g. a wrong token) still proves the store is alive
                break
        down_s = time.monotonic() - (self._down_since or 0.0)
        with self._lock:
            self._down_since = None
        log.warning("kvstore %s answers again after %.1f s down", self.url, down_s)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run store calls only while the store is up; a call that gets no answer marks it down."""
        self.check()
        try:
            yield
        except StoreDown:
            raise
        except KVStoreUnavailable as exc:
            self.mark_down(exc)
            raise


_registry: dict[str, StoreHealth] = {}
_registry_lock = threading.Lock()


def health_of(client_args: dict[str, Any]) -> StoreHealth:
    """The process-wide health state of the store at client_args["url"]."""
    url = client_args["url"]
    with _registry_lock:
        health = _registry.get(url)
        if health is None:
            health = _registry[url] = StoreHealth(client_args)
        return health
