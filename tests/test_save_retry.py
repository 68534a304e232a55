"""A P/D handoff's save survives a store that blinks; other saves are dropped (real store, CPU caches).

An overlapped decode leg waits in the store for its producer's upload for as long as a prefill
may take (the router's prefill timeout). If the producer's upload failed while the store missed
a deadline and nothing tried again, the decode waited out that whole time (seen in a loaded
bench run: one request held 270 s). The save thread keeps such a save and uploads it again as
soon as the store answers; a save no decode waits for costs only a later recompute.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Iterator

import pytest
import torch
from kvstore_fixtures import LAYOUT, KVStoreProc, start_kvstore

from pdserve.kvstore.client.client import KVStoreClient
from pdserve.kvstore.connector import worker_side
from pdserve.kvstore.connector.cache import GroupCache
from pdserve.kvstore.connector.plan import ObjectSpec, TransferJob
from pdserve.kvstore.connector.worker_side import WorkerIO


@pytest.fixture
def store() -> Iterator[KVStoreProc]:
    srv = start_kvstore()
    yield srv
    os.killpg(srv.proc.popen.pid, signal.SIGCONT)
    srv.stop()


def _cache() -> GroupCache:
    return GroupCache([torch.randn(8, 2304).to(torch.bfloat16) for _ in range(2)])


def _until(pred, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


@dataclass
class Producer:
    """A producer's save thread on `store` (1 s reply deadline), a probe client and the counters seen."""

    store: KVStoreProc
    probe: KVStoreClient
    ns: str
    io: WorkerIO
    cache: GroupCache
    seen: dict[str, float] = field(default_factory=dict)

    def counts(self) -> dict[str, float]:
        for name, value in (self.io.stats.take() or {}).items():
            self.seen[name] = self.seen.get(name, 0) + value
        return self.seen

    def signal_store(self, sig: signal.Signals) -> None:
        os.killpg(self.store.proc.popen.pid, sig)


@pytest.fixture
def producer(store: KVStoreProc) -> Iterator[Producer]:
    cache = _cache()
    with KVStoreClient(store.url, timeout_s=10) as probe:
        ns = probe.register_layout(LAYOUT)
        io = WorkerIO({"url": store.url, "timeout_s": 1.0}, ns, [cache], writes=True)
        try:
            yield Producer(store, probe, ns, io, cache)
        finally:
            io.close()


def test_a_handoff_save_is_uploaded_again_once_the_store_answers(producer: Producer) -> None:
    p = producer
    p.signal_store(signal.SIGSTOP)
    plain = os.urandom(16)
    p.io.save(TransferJob("prefix-only", [ObjectSpec(0, plain, [1])]))
    p.io.save(TransferJob("pd", [ObjectSpec(0, b"c" * 16, [2]), ObjectSpec(0, None, [3])], "tail-pd", handoff=True))
    time.sleep(2.5)  # past the 1 s reply deadline: the store is marked down, both uploads failed
    p.signal_store(signal.SIGCONT)
    assert _until(lambda: p.probe.lookup(p.ns, [b"c" * 16], [0]) == 1), "the handoff's chunk never landed"
    tail = p.probe.get_tail(p.ns, "tail-pd")
    assert tail is not None and bytes(tail[0]) == bytes(p.cache.gather([3]).numpy())
    assert _until(lambda: p.counts().get("saves_retried", 0) >= 1)
    assert p.seen.get("saves_lost", 0) == 0
    assert p.probe.lookup(p.ns, [plain], [0]) == 0  # the save no decode waited for was dropped


def test_a_handoff_save_is_given_up_when_the_store_stays_away(producer: Producer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_side, "SAVE_RETRY_S", 1.5)
    p = producer
    p.signal_store(signal.SIGSTOP)
    p.io.save(TransferJob("pd", [ObjectSpec(0, None, [3])], "tail-late", handoff=True))
    assert _until(lambda: p.counts().get("saves_lost", 0) == 1, seconds=15)
    p.signal_store(signal.SIGCONT)
    time.sleep(1.0)  # the probe marks the store up; nothing is uploaded any more
    assert p.probe.get_tail(p.ns, "tail-late") is None
    assert p.counts().get("saves_retried", 0) == 0
