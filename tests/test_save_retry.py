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


def _counts(io: WorkerIO, seen: dict[str, float]) -> dict[str, float]:
    for name, value in (io.stats.take() or {}).items():
        seen[name] = seen.get(name, 0) + value
    return seen


def _until(pred, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


def test_a_handoff_save_is_uploaded_again_once_the_store_answers(store: KVStoreProc) -> None:
    cache = _cache()
    with KVStoreClient(store.url, timeout_s=10) as probe:
        ns = probe.register_layout(LAYOUT)
        io = WorkerIO({"url": store.url, "timeout_s": 1.0}, ns, [cache], writes=True)
        counts: dict[str, float] = {}
        try:
            os.killpg(store.proc.popen.pid, signal.SIGSTOP)
            plain = os.urandom(16)
            io.save(TransferJob("prefix-only", [ObjectSpec(0, plain, [1])]))
            io.save(TransferJob("pd", [ObjectSpec(0, b"c" * 16, [2]), ObjectSpec(0, None, [3])], "tail-pd", handoff=True))
            time.sleep(2.5)  # past the 1 s reply deadline: the store is marked down, both uploads failed
            os.killpg(store.proc.popen.pid, signal.SIGCONT)
            assert _until(lambda: probe.lookup(ns, [b"c" * 16], [0]) == 1), "the handoff's chunk never landed"
            tail = probe.get_tail(ns, "tail-pd")
            assert tail is not None and bytes(tail[0]) == bytes(cache.gather([3]).numpy())
            assert _until(lambda: _counts(io, counts).get("saves_retried", 0) >= 1)
            assert counts.get("saves_lost", 0) == 0
            assert probe.lookup(ns, [plain], [0]) == 0  # the save no decode waited for was dropped
        finally:
            io.close()


def test_a_handoff_save_is_given_up_when_the_store_stays_away(store: KVStoreProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_side, "SAVE_RETRY_S", 1.5)
    cache = _cache()
    with KVStoreClient(store.url, timeout_s=10) as probe:
        ns = probe.register_layout(LAYOUT)
        io = WorkerIO({"url": store.url, "timeout_s": 1.0}, ns, [cache], writes=True)
        counts: dict[str, float] = {}
        try:
            os.killpg(store.proc.popen.pid, signal.SIGSTOP)
            io.save(TransferJob("pd", [ObjectSpec(0, None, [3])], "tail-late", handoff=True))
            assert _until(lambda: _counts(io, counts).get("saves_lost", 0) == 1, seconds=15)
            os.killpg(store.proc.popen.pid, signal.SIGCONT)
            time.sleep(1.0)  # the probe marks the store up; nothing is uploaded any more
            assert probe.get_tail(ns, "tail-late") is None
            assert _counts(io, counts).get("saves_retried", 0) == 0
        finally:
            io.close()
