"""Round trips through a real server, over TCP frames and over shared memory."""

from __future__ import annotations

import os
import time
import urllib.request
from typing import Iterator

import numpy as np
import pytest
from kvstore_fixtures import LAYOUT, KVStoreProc, start_kvstore

from pdserve.kvstore.client.client import KVStoreClient, KVStoreError
from pdserve.kvstore.client.keys import chunk_keys


@pytest.fixture(scope="module")
def server() -> Iterator[KVStoreProc]:
    srv = start_kvstore()
    yield srv
    srv.stop()


@pytest.fixture(params=[False, True], ids=["tcp", "shm"])
def client(request: pytest.FixtureRequest, server: KVStoreProc) -> Iterator[KVStoreClient]:
    with KVStoreClient(server.url, timeout_s=10, shm=request.param) as c:
        yield c


def test_info_and_register(client: KVStoreClient) -> None:
    info = client.info()
    assert info.chunk_size == 256 and info.version
    assert client.register_layout(LAYOUT) == LAYOUT.namespace()
    assert client.register_layout(LAYOUT, namespace=LAYOUT.namespace()) == LAYOUT.namespace()
    with pytest.raises(KVStoreError, match="hashes to namespace"):
        client.register_layout(LAYOUT, namespace="0" * 32)


def test_put_lookup_get(client: KVStoreClient) -> None:
    ns = client.register_layout(LAYOUT)
    keys = chunk_keys(ns, list(range(7 * 16 + 5)), 16, salt=os.urandom(8).hex())
    assert len(keys) == 7
    full = [os.urandom(4096 + i) for i in range(7)]
    side = [np.full(100, i, dtype=np.float32) for i in range(7)]
    assert client.put(ns, [(0, k, d) for k, d in zip(keys, full)]) == [True] * 7
    assert client.put(ns, [(1, k, d) for k, d in zip(keys[:4], side)]) == [True] * 4
    assert client.lookup(ns, keys, [0]) == 7
    assert client.lookup(ns, keys, [0, 1]) == 4  # group 1 stops after four chunks
    assert client.lookup(ns, keys[1:], [0]) == 6
    got = client.get(ns, [(0, k) for k in keys] + [(1, keys[5])])
    assert [bytes(g) for g in got[:7]] == full
    assert got[7] is None
    got1 = client.get(ns, [(1, keys[3])])
    assert np.array_equal(np.frombuffer(got1[0], dtype=np.float32), side[3])
    # already present counts as stored, and keeps the first payload
    assert client.put(ns, [(0, keys[0], b"other")]) == [True]
    assert bytes(client.get(ns, [(0, keys[0])])[0]) == full[0]


def test_get_into_caller_buffers(client: KVStoreClient) -> None:
    ns = client.register_layout(LAYOUT)
    key = os.urandom(16)
    payload = os.urandom(70_000)
    assert client.put(ns, [(0, key, payload)]) == [True]
    out = np.zeros(80_000, dtype=np.uint8)
    (view,) = client.get(ns, [(0, key)], out=[out])
    assert bytes(view) == payload and bytes(out[:70_000]) == payload


def test_tail_roundtrip(client: KVStoreClient) -> None:
    ns = client.register_layout(LAYOUT)
    rid = f"req-{os.urandom(4).hex()}"
    client.put_tail(ns, rid, [(0, b"partial-0"), (1, b"partial-1")])
    tail = client.get_tail(ns, rid)
    assert tail is not None and {g: bytes(v) for g, v in tail.items()} == {0: b"partial-0", 1: b"partial-1"}
    assert client.get_tail(ns, rid) is None  # loading released it
    client.put_tail(ns, rid, [(0, b"x")])
    client.drop_tail(ns, rid)
    assert client.get_tail(ns, rid) is None


def test_oversized_object_is_refused(client: KVStoreClient) -> None:
    ns = client.register_layout(LAYOUT)
    big = np.zeros(client.info().max_object_bytes + 1, dtype=np.uint8)
    assert client.put(ns, [(0, os.urandom(16), big), (0, os.urandom(16), b"small")]) == [False, True]


def _leases(server: KVStoreProc) -> float:
    """The server's count of objects leased to transfers in progress (its gauge, refreshed by its loop)."""
    with urllib.request.urlopen(server.http + "/metrics", timeout=5) as r:
        line = next(ln for ln in r.read().decode().splitlines() if ln.startswith("pdserve_kvstore_leases "))
    return float(line.split()[1])


def _leases_settle(server: KVStoreProc, want: float) -> float:
    deadline = time.monotonic() + 10
    while (got := _leases(server)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_read_visits_verified_payloads_where_they_lie(client: KVStoreClient) -> None:
    """`read` hands the payloads to the visitor without a copy: over shared memory they are slices of
    the store's arena (the GPU uploads them from there), over TCP the received frames."""
    ns = client.register_layout(LAYOUT)
    keys = [os.urandom(16) for _ in range(3)]
    payloads = [os.urandom(5000 + i) for i in range(2)]
    assert client.put(ns, [(0, k, d) for k, d in zip(keys, payloads)]) == [True, True]
    seen: dict[int, bytes] = {}
    addresses: list[int] = []

    def visit(indexes: list[int], views: list[memoryview]) -> None:
        for i, v in zip(indexes, views):
            seen[i] = bytes(v)
            addresses.append(np.frombuffer(v, dtype=np.uint8, count=1).ctypes.data)

    assert client.read(ns, [(0, k) for k in keys], visit) == [True, True, False]
    assert seen == {0: payloads[0], 1: payloads[1]}
    arena = client.arena
    if client.uses_shm:
        assert arena is not None and all(arena.address <= a < arena.address + arena.size for a in addresses)
    else:
        assert arena is None
    rid = f"req-{os.urandom(4).hex()}"
    client.put_tail(ns, rid, [(0, b"tail-0"), (1, b"tail-1")])
    groups: dict[int, bytes] = {}
    assert client.read_tail(ns, rid, lambda gs, vs: groups.update({g: bytes(v) for g, v in zip(gs, vs)}))
    assert groups == {0: b"tail-0", 1: b"tail-1"}
    assert not client.read_tail(ns, rid, lambda gs, vs: groups.clear())  # loading released it
    assert groups


def test_read_holds_leases_only_while_it_visits(server: KVStoreProc) -> None:
    """The arena slices are the store's until the visit returns, also when the visitor fails."""
    with KVStoreClient(server.url, timeout_s=10, shm=True) as client:
        ns = client.register_layout(LAYOUT)
        key = os.urandom(16)
        assert client.put(ns, [(0, key, os.urandom(4096))]) == [True]
        assert _leases_settle(server, 0) == 0
        during: list[float] = []

        def visit(indexes: list[int], views: list[memoryview]) -> None:
            during.append(_leases_settle(server, 1))
            raise RuntimeError("device copy failed")

        with pytest.raises(RuntimeError, match="device copy failed"):
            client.read(ns, [(0, key)], visit)
        assert during == [1]
        assert _leases_settle(server, 0) == 0
        assert client.read(ns, [(0, key)], lambda i, v: None) == [True]  # the client carries on


def test_read_never_visits_a_corrupt_payload(server: KVStoreProc) -> None:
    """A payload scribbled over in the shared arena fails its checksum: not visited, reported not found."""
    with KVStoreClient(server.url, timeout_s=10, shm=True) as client:
        ns = client.register_layout(LAYOUT)
        key = os.urandom(16)
        assert client.put(ns, [(0, key, os.urandom(8192))]) == [True]
        where: list[int] = []
        client.read(ns, [(0, key)], lambda i, views: where.append(
            np.frombuffer(views[0], dtype=np.uint8, count=1).ctypes.data - client.arena.address))  # type: ignore[union-attr]
        assert client.arena is not None
        client.arena.view[where[0] + 100] ^= 0xFF
        visited: list[int] = []
        assert client.read(ns, [(0, key)], lambda i, v: visited.extend(i)) == [False]
        assert visited == []
