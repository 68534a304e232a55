"""The KV store server end to end: real `pdserve kvstore` processes, real ZMQ, real HTTP, real files."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import numpy as np
import pytest
import zmq
from kvstore_fixtures import LAYOUT, KVStoreProc, start_kvstore
from procs import free_port

from pdserve.kvstore.client import protocol as p
from pdserve.bench.kvstore_throughput import main as bench_main
from pdserve.kvstore.client.client import AsyncKVStoreClient, KVStoreClient, KVStoreError
from pdserve.kvstore.server.http import IDLE_TIMEOUT_S
from pdserve.kvstore.server.store import MAX_NAMESPACES
from pdserve.kvstore.server.main import main as server_main
from pdserve.kvstore.client.shm import Arena

NS = LAYOUT.namespace()
MIB = 1 << 20


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `cond` (a wait for an event, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stat(c: KVStoreClient, name: str) -> float:
    return c.stats().get(name, 0.0)


@pytest.fixture(scope="module")
def server() -> Iterator[KVStoreProc]:
    """A shared server with a 24 MiB L1 and a short default tail TTL."""
    srv = start_kvstore("--tail-ttl-s", "60", l1_size_gb=24 / 1024)
    yield srv
    srv.stop()


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


# ------------------------------------------------------------------ namespaces, HTTP


def test_namespaces_are_isolated(server: KVStoreProc) -> None:
    other = LAYOUT.__class__(model="another-model", groups=LAYOUT.groups)
    with KVStoreClient(server.url) as c:
        ns_a, ns_b = c.register_layout(LAYOUT), c.register_layout(other)
        assert ns_a != ns_b
        k = keys(2)
        assert c.put(ns_a, [(0, k[0], b"A"), (0, k[1], b"A")]) == [True, True]
        assert c.lookup(ns_b, k, [0]) == 0
        assert c.get(ns_b, [(0, k[0])]) == [None]
        with pytest.raises(KVStoreError, match="hashes to namespace") as err:
            c.register_layout(other, namespace=ns_a)
        assert err.value.code == "conflict"


def test_clear_drops_one_namespace_in_memory_and_on_disk(tmp_path: Path) -> None:
    """What a weight update leaves stale goes (L1, L2, tails), and saves planned before it are refused;
    another model's KV stays."""
    srv = start_kvstore("--l2-path", str(tmp_path), "--l2-size-gb", "0.1", l1_size_gb=2 / 1024)
    other = LAYOUT.__class__(model="another-model", groups=LAYOUT.groups).namespace()
    try:
        with KVStoreClient(srv.url, timeout_s=30) as c:
            mine, theirs = keys(6), keys(2)
            assert all(c.put(NS, [(0, k, os.urandom(MIB // 2)) for k in mine]))  # 3 MiB through a 2 MiB L1
            assert all(c.put(other, [(0, k, b"theirs") for k in theirs]))
            c.put_tail(NS, "req-1", [(0, b"tail")])
            assert stat(c, "tier_objects{tier=l2}") >= 2
            before = c.lookup_with_generation(NS, mine[:1], [0]).generation
            cleared = c.clear(NS)
            assert cleared.objects == 6 + 1 and cleared.generation != before
            assert c.lookup_with_generation(NS, mine[:1], [0]).generation == cleared.generation
            assert c.lookup(NS, mine[:1], [0]) == 0 and c.get(NS, [(0, k) for k in mine]) == [None] * 6
            assert c.get_tail(NS, "req-1") is None
            assert not list((tmp_path / NS).rglob("*.kv"))  # moved aside at once, deleted in the background
            wait_until(lambda: not list(tmp_path.glob(".trash-*")), "the dropped files to be deleted")
            assert [bytes(g) for g in c.get(other, [(0, k) for k in theirs])] == [b"theirs"] * 2
            # a save planned before the clear (still uploading when it came) is refused; later ones are not
            assert c.put(NS, [(0, mine[0], b"stale")], generation=before) == [False]
            with pytest.raises(KVStoreError, match="was cleared") as err:
                c.put_tail(NS, "req-2", [(0, b"stale")], generation=before)
            assert err.value.code == "conflict"
            assert c.put(NS, [(0, mine[1], b"new")], generation=cleared.generation) == [True]
            assert c.put(NS, [(0, mine[2], b"unchecked")]) == [True]
            assert c.clear(NS).objects == 2
    finally:
        srv.stop()


def test_made_up_layouts_cannot_grow_the_store_without_bound() -> None:
    """Past MAX_NAMESPACES layouts a new one is refused with a clear error; known ones still register."""
    srv = start_kvstore()
    try:
        with KVStoreClient(srv.url) as c:
            models = [f"made-up-{i}" for i in range(MAX_NAMESPACES)]
            for model in models:
                c.register_layout(LAYOUT.__class__(model=model, groups=LAYOUT.groups))
            with pytest.raises(KVStoreError, match="namespaces are registered already") as err:
                c.register_layout(LAYOUT)
            assert err.value.code == "no_room"
            assert c.register_layout(LAYOUT.__class__(model=models[0], groups=LAYOUT.groups))
    finally:
        srv.stop()


def test_http_health_metrics_stats(server: KVStoreProc) -> None:
    def counted() -> dict[str, float]:
        with urllib.request.urlopen(server.http + "/stats") as r:
            return json.load(r)["metrics"]

    before = counted()
    k = keys(2)
    with KVStoreClient(server.url, shm=True) as c:
        c.put(NS, [(0, k[0], b"payload")])
        c.get(NS, [(0, k[0]), (0, b"missing-key")])
    with KVStoreClient(server.url, shm=False) as c:
        c.put(NS, [(0, k[1], b"payload over tcp")])
        c.get(NS, [(0, k[1])])
    with urllib.request.urlopen(server.http + "/health") as r:
        assert json.load(r)["status"] == "ok"
    with urllib.request.urlopen(server.http + "/metrics") as r:
        text = r.read().decode()
    for name in ("hits_total", "misses_total", "bytes_in_total", "bytes_out_total", "evictions_total",
                 "tier_bytes", "live_tails", "errors_total", "checksum_mismatches_total"):
        assert f"pdserve_kvstore_{name}" in text
    with urllib.request.urlopen(server.http + "/stats") as r:
        stats = json.load(r)
    assert stats["chunk_size"] == 256
    assert stats["metrics"]["hits_total{tier=l1}"] >= 1 and stats["metrics"]["misses_total"] >= 1
    for direction in ("in", "out"):  # the fixture's server is shared: count this test's bytes only
        for path, payload in (("shm", b"payload"), ("tcp", b"payload over tcp")):
            name = f"bytes_{direction}_total{{path={path}}}"
            assert stats["metrics"][name] - before.get(name, 0.0) == len(payload)


# ------------------------------------------------------------------ LRU and leases under concurrency


def test_idle_http_connections_are_closed_and_free_their_threads(server: KVStoreProc) -> None:
    """Each open connection to the HTTP side door holds a thread: ones that send nothing are closed after
    IDLE_TIMEOUT_S, and /health answers meanwhile (before, 500 of them held 500 threads for good)."""
    threads = lambda: len(os.listdir(f"/proc/{server.proc.pid}/task"))  # noqa: E731
    before = threads()
    idle = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(50)]
    try:
        # most of them, at least: `before` may count a thread of an earlier request still ending (seen once
        # in the fast tier beside another worker's tests), and the first idle ones end after IDLE_TIMEOUT_S
        wait_until(lambda: threads() >= before + 40, "a thread per idle connection")
        with urllib.request.urlopen(server.http + "/health", timeout=5) as r:
            assert r.status == 200
        for sock in idle:
            sock.settimeout(3 * IDLE_TIMEOUT_S)
            assert sock.recv(1) == b""  # closed by the store
        wait_until(lambda: threads() <= before, "the idle connections' threads to end")
    finally:
        for sock in idle:
            sock.close()



@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_concurrent_clients_evict_lru_and_never_see_torn_data(server: KVStoreProc, shm: bool) -> None:
    """Four writers/readers overflow L1 (24 MiB) twice over, with at most ~16 MB leased at once;
    whatever a get returns is exactly what was put."""
    errors: list[str] = []
    loaded = [0]

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine: list[tuple[bytes, bytes]] = []
        with KVStoreClient(server.url, shm=shm, timeout_s=30) as c:
            for _ in range(12):
                batch = [(os.urandom(16), rng.bytes(int(rng.integers(100_000, 500_000)))) for _ in range(4)]
                if not all(c.put(NS, [(1, k, d) for k, d in batch])):
                    errors.append("put refused")
                mine.extend(batch)
                picks = [mine[int(i)] for i in rng.integers(0, len(mine), 4)]
                for (k, d), got in zip(picks, c.get(NS, [(1, k) for k, _ in picks])):
                    if got is not None:
                        loaded[0] += 1
                        if bytes(got) != d:
                            errors.append("torn or foreign payload")

    with KVStoreClient(server.url) as c:
        before = stat(c, "evictions_total{tier=l1}")
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert loaded[0] > 0
        assert stat(c, "evictions_total{tier=l1}") > before  # ~57 MB through 24 MiB
        assert stat(c, "checksum_mismatches_total{tier=l1}") == 0
        wait_until(lambda: stat(c, "leases") == 0, "all leases to be released")
        assert stat(c, "tier_bytes{tier=l1}") <= 24 * MIB


def test_most_recently_used_survives_eviction(server: KVStoreProc) -> None:
    with KVStoreClient(server.url) as c:
        hot = keys(1)[0]
        c.put(NS, [(0, hot, b"h" * MIB)])
        for _ in range(6):  # 60 MiB through a 24 MiB L1, touching `hot` in between
            assert c.lookup(NS, [hot], [0]) == 1
            assert all(c.put(NS, [(0, k, os.urandom(MIB)) for k in keys(10)]))
        assert bytes(c.get(NS, [(0, hot)])[0]) == b"h" * MIB


def test_large_tcp_batches_travel_in_pipelined_parts() -> None:
    """48 MiB in one put and one get: several Put messages in flight, a Loaded reply in parts."""
    srv = start_kvstore(l1_size_gb=64 / 1024)
    try:
        with KVStoreClient(srv.url, shm=False) as c:
            k = keys(48)
            data = [np.random.default_rng(i).bytes(MIB) for i in range(48)]
            assert c.put(NS, list(zip([0] * 48, k, data))) == [True] * 48
            assert stat(c, "requests_total{op=put}") == 48 * MIB // p.PIPELINE_BYTES
            got = c.get(NS, [(0, key) for key in k] + [(0, b"absent")])
            assert [bytes(g) for g in got[:48]] == data and got[48] is None
            out = [np.empty(MIB, dtype=np.uint8) for _ in range(48)]
            c.get(NS, [(0, key) for key in k], out=out)
            assert [o.tobytes() for o in out] == data
    finally:
        srv.stop()


# ------------------------------------------------------------------ tails


def test_tail_expires_after_ttl(server: KVStoreProc) -> None:
    with KVStoreClient(server.url) as c:
        c.put_tail(NS, "req-ttl", [(0, b"tail")], ttl_s=0.2)
        c.put_tail(NS, "req-keep", [(0, b"keep")])
        assert stat(c, "live_tails") >= 2
        wait_until(lambda: c.get_tail(NS, "req-ttl") is None, "the tail to expire")
        kept = c.get_tail(NS, "req-keep")
        assert kept is not None and bytes(kept[0]) == b"keep"
        wait_until(lambda: stat(c, "live_tails") == 0, "the live-tail gauge to drop")
        with pytest.raises(KVStoreError, match="ttl"):
            c.put_tail(NS, "req-bad", [(0, b"x")], ttl_s=-1)
        with pytest.raises(KVStoreError, match="twice"):
            c.put_tail(NS, "req-bad", [(0, b"x"), (0, b"y")])


# ------------------------------------------------------------------ awaiting an upload


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_await_is_answered_when_the_upload_lands(server: KVStoreProc, shm: bool) -> None:
    """A consumer waiting for chunks and a tail is answered by the store once the producer's
    upload lands: before its wait ends, and with everything present."""
    k1, k2 = keys(2)
    tail_id = f"req-await-{shm}"
    answer: list[p.Ready] = []

    def consumer() -> None:
        with KVStoreClient(server.url, shm=shm, timeout_s=5) as c:
            answer.append(c.await_ready(NS, [(0, k1), (0, k2)], tail_id, wait_s=30))

    waiter = threading.Thread(target=consumer)
    waiter.start()
    with KVStoreClient(server.url, shm=shm) as producer:
        wait_until(lambda: stat(producer, "requests_total{op=await}") >= 1 or not waiter.is_alive(), "the await to arrive")
        assert waiter.is_alive(), "the store answered before anything was stored"
        producer.put(NS, [(0, k1, b"one")])
        time.sleep(0.2)  # not a timing assertion: gives a wrong early answer the chance to show
        assert waiter.is_alive(), "answered with one of two chunks and no tail"
        producer.put(NS, [(0, k2, b"two")])
        producer.put_tail(NS, tail_id, [(0, b"tail")])
        waiter.join(timeout=20)
        assert not waiter.is_alive(), "the await was not answered after the upload landed"
        assert [(a.present, a.tail, a.tail_gone) for a in answer] == [([True, True], True, False)]
        got = producer.get(NS, [(0, k1), (0, k2)])
        assert [bytes(g) for g in got if g is not None] == [b"one", b"two"]


def test_await_ends_with_what_is_there_and_does_not_block_others(server: KVStoreProc) -> None:
    k_there, k_never = keys(2)
    with KVStoreClient(server.url) as c, KVStoreClient(server.url) as other:
        c.put(NS, [(0, k_there, b"x")])
        assert c.await_ready(NS, [(0, k_there)], wait_s=30).present == [True]  # ready: no wait at all
        never = c.await_ready(NS, [(0, k_there), (0, k_never)], "no-such-tail", wait_s=0)
        assert (never.present, never.tail, never.tail_gone) == ([True, False], False, False)
        done: list[p.Ready] = []
        waiter = threading.Thread(target=lambda: done.append(c.await_ready(NS, [(0, k_never)], wait_s=0.5)))
        waiter.start()
        # the store keeps serving everyone else while an await is parked
        assert other.lookup(NS, [k_there], [0]) == 1
        waiter.join(timeout=20)
        assert [(d.present, d.tail) for d in done] == [([False], False)]


@pytest.mark.parametrize("end", ["loaded", "dropped", "expired"])
def test_await_for_a_tail_that_is_gone_is_answered_at_once(server: KVStoreProc, end: str) -> None:
    """A tail loaded by one consumer (or dropped, or expired) will not come again: a second consumer awaiting it
    (a decode leg retried on another engine after the first loaded the tail and died) is told so at once rather
    than held for its whole wait; a tail written again under that name is awaited as usual."""
    tail_id = f"req-gone-{end}"
    with KVStoreClient(server.url, timeout_s=5) as c:
        c.put_tail(NS, tail_id, [(0, b"tail")], ttl_s=0.2 if end == "expired" else None)
        if end == "loaded":
            assert c.get_tail(NS, tail_id) is not None
        elif end == "dropped":
            c.drop_tail(NS, tail_id)
        else:
            wait_until(lambda: not c.await_ready(NS, [], tail_id, wait_s=0).tail, "the tail to expire")
        waits_before = stat(c, "requests_total{op=await}")
        ready = c.await_ready(NS, [], tail_id, wait_s=50)  # held 50 s if the store did not know it is gone
        assert (ready.tail, ready.tail_gone) == (False, True)
        assert stat(c, "requests_total{op=await}") == waits_before + 1
        assert not c.await_ready(NS, [], "req-never-written", wait_s=0).tail_gone
        c.put_tail(NS, tail_id, [(0, b"again")])
        again = c.await_ready(NS, [], tail_id, wait_s=0)
        assert (again.tail, again.tail_gone) == (True, False)


def test_a_parked_await_is_answered_when_its_tail_is_taken() -> None:
    """An await parked on a tail that another consumer then loads is answered by that load, not at its wait's end."""
    from pdserve.kvstore.server.waiters import Waiters

    gone: set[str] = set()
    waiters = Waiters(clock=lambda: 0.0, cap=4)
    req = p.Await(ns=NS, items=[], tail_id="req-taken", wait_ms=60_000)
    assert waiters.park(b"a", req)

    def check(r: p.Await) -> p.Ready:
        return p.Ready(present=[], tail_gone=r.tail_id in gone)

    assert waiters.ready(check) == []
    gone.add("req-taken")
    answered = waiters.ready(check)
    assert [(parked.ident, reply.tail_gone) for parked, reply in answered] == [(b"a", True)]


def test_parked_awaits_are_capped() -> None:
    """Past the cap an await is answered at once: a flood cannot pin the store's memory."""
    from pdserve.kvstore.server.waiters import Waiters

    clock = [0.0]
    waiters = Waiters(clock=lambda: clock[0], cap=2)
    req = p.Await(ns=NS, items=[p.ItemRef(0, b"k")], wait_ms=1000)
    assert waiters.park(b"a", req) and waiters.park(b"b", req)
    assert not waiters.park(b"c", req)
    never = lambda r: p.Ready(present=[False])  # noqa: E731
    assert waiters.ready(never) == [] and waiters.due(never) == []
    assert waiters.ready(lambda r: p.Ready(present=[True]))[0][0].ident == b"a"
    assert len(waiters) == 0 and waiters.park(b"d", req)
    clock[0] = 2.0
    assert [parked.ident for parked, _ in waiters.due(never)] == [b"d"]
    assert waiters.next_deadline_ms(200) == 200


# ------------------------------------------------------------------ bad input


def raw_socket(server: KVStoreProc) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    return sock


def raw_call(sock: zmq.Socket, frames: list[bytes], timeout_ms: int = 10_000) -> p.Reply | None:
    sock.send_multipart(frames)
    if not sock.poll(timeout_ms):
        return None
    return p.decode_reply(sock.recv_multipart()[0])


def header(msg: msgspec.Struct, req_id: int = 5) -> bytes:
    msg.id = req_id
    return p.encode(msg)


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"\xc1\xc1 not msgpack"], ""),
        ([msgspec.msgpack.encode({"op": "rm_rf", "id": 5})], "op"),
        ([msgspec.msgpack.encode({"op": "get", "id": 5, "ns": 3})], ""),
        ([header(p.Put(ns=NS, items=[p.ItemMeta(0, b"k1", 3), p.ItemMeta(0, b"k2", 3)])), b"abc"], "truncated"),
        ([header(p.Put(ns=NS, items=[p.ItemMeta(0, b"k1", 3)])), b"abcdef"], "header says 3 bytes"),
        ([header(p.Lookup(ns="../../etc", groups=[0], keys=[b"k"]))], "invalid namespace"),
        ([header(p.Lookup(ns=NS, groups=[5000], keys=[b"k"]))], "out of range"),
        ([header(p.Lookup(ns=NS, groups=[], keys=[b"k"]))], "at least one"),
        ([header(p.Get(ns=NS, items=[p.ItemRef(0, b"")]))], "chunk key"),
        ([header(p.Lookup(ns=NS, groups=[0], keys=[b"k"] * (p.MAX_ITEMS + 1)))], "exceeds"),
        ([header(p.Commit(leases=[1, 2], checksums=[1]))], "2 leases but 1 checksums"),
        ([header(p.Await(ns=NS, items=[p.ItemRef(0, b"k")], wait_ms=p.MAX_WAIT_MS + 1))], "out of range"),
        ([header(p.Await(ns=NS, items=[p.ItemRef(0, b"k")], tail_id="a b", wait_ms=10))], "invalid request id"),
        ([header(p.PutTail(ns=NS, request_id="r1", items=[]))], "lists no objects"),
    ],
    ids=["garbage", "unknown-op", "wrong-type", "truncated", "size-mismatch", "path-namespace",
         "group-range", "no-groups", "empty-key", "too-many-items", "commit-mismatch", "await-too-long",
         "await-bad-tail", "empty-tail"],
)
def test_bad_messages_get_error_replies(server: KVStoreProc, frames: list[bytes], message: str) -> None:
    sock = raw_socket(server)
    try:
        reply = raw_call(sock, frames)
    finally:
        sock.close()
    assert isinstance(reply, p.Error), reply
    assert reply.code == "bad_request" and message in reply.message


def test_shm_requests_must_name_this_servers_arena(server: KVStoreProc) -> None:
    with KVStoreClient(server.url) as c:
        nonce = c.info().shm_nonce
    assert nonce
    sock = raw_socket(server)
    try:
        stale = raw_call(sock, [header(p.Put(ns=NS, items=[p.ItemMeta(0, b"k1", 3)], shm="0" * 32))])
        assert isinstance(stale, p.Error) and stale.code == p.STALE_SHM
        framed = raw_call(sock, [header(p.Put(ns=NS, items=[p.ItemMeta(0, b"k1", 3)], shm=nonce)), b"abc"])
        assert isinstance(framed, p.Error) and "no payload frames" in framed.message
    finally:
        sock.close()


def test_server_survives_hostile_input_with_data_intact(server: KVStoreProc) -> None:
    with KVStoreClient(server.url) as c:
        k = keys(1)[0]
        c.put(NS, [(0, k, b"precious")])
        # raw bytes that are not ZMQ at all
        for junk in (b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096), b"\xff" * 64):
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(junk)
        # a frame beyond MAXMSGSIZE (L1 + header limit): the server drops that connection
        sock = raw_socket(server)
        try:
            big = np.zeros(24 * MIB + p.MAX_HEADER_BYTES + 1, dtype=np.uint8)
            assert raw_call(sock, [header(p.Put(ns=NS, items=[p.ItemMeta(0, b"k", len(big))])), big], 2000) is None
        finally:
            sock.close()
        # unknown leases, corrupt reports for objects that do not exist, an empty message
        sock = raw_socket(server)
        try:
            sock.send_multipart([header(p.Release(leases=[10**9, -1], corrupt=[p.Corrupt(NS, 0, b"nope", 3)]))])
            reply = raw_call(sock, [header(p.Commit(leases=[10**9], checksums=[0]))])
            assert isinstance(reply, p.Stored) and reply.stored == [False]
        finally:
            sock.close()
        assert server.proc.alive()
        assert bytes(c.get(NS, [(0, k)])[0]) == b"precious"
        assert stat(c, "errors_total{code=internal}") == 0


# ------------------------------------------------------------------ client behaviour


def test_a_client_that_reads_none_of_its_loads_loses_them_after_the_lease_timeout() -> None:
    """Loads sent as frames stay leased until ZMQ has sent them. A peer that asks and never reads (hostile, or
    a stopped worker) used to keep them, and the L1 room they take, for as long as its connection lived: the
    producers' next puts were refused. The store now drops a peer that answers no ping for --lease-timeout-s."""
    srv = start_kvstore("--lease-timeout-s", "6", l1_size_gb=24 / 1024)
    try:
        with KVStoreClient(srv.url, shm=False) as c:
            held = keys(20)
            assert all(c.put(NS, [(0, k, os.urandom(MIB)) for k in held]))
            bad = zmq.Context.instance().socket(zmq.DEALER)
            bad.setsockopt(zmq.LINGER, 0)
            bad.setsockopt(zmq.RCVHWM, 1)
            bad.setsockopt(zmq.RCVBUF, 4096)
            bad.connect(srv.url)
            try:
                for i in range(100):
                    bad.send(p.encode(p.Get(id=i, ns=NS, items=[p.ItemRef(0, k) for k in held])))
                wait_until(lambda: stat(c, "leases") >= 20, "the unread loads to lease their objects")
                wait_until(lambda: stat(c, "leases") == 0, "the unread loads' leases to end", timeout=60)
                fresh = keys(16)
                assert all(c.put(NS, [(0, k, os.urandom(MIB)) for k in fresh]))
                assert all(g is not None for g in c.get(NS, [(0, k) for k in fresh]))
            finally:
                bad.close()
    finally:
        srv.stop()


def test_bare_tcp_connections_are_closed_and_the_file_limit_is_raised() -> None:
    """A flood of connections that never speak ZMQ: each is closed after the handshake interval (libzmq's
    default held them 30 s), and the store lifts its soft open-file limit to the hard one (at the limit
    libzmq's accept spun a core). A client keeps being served meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        srv = start_kvstore(l1_size_gb=24 / 1024)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        limits = Path(f"/proc/{srv.proc.popen.pid}/limits").read_text()
        assert re.search(rf"Max open files\s+{hard}\s+{hard}", limits), limits
        bare = [socket.create_connection(("127.0.0.1", srv.port), timeout=20) for _ in range(50)]
        try:
            with KVStoreClient(srv.url, shm=False) as c:
                key = keys(1)[0]
                assert c.put(NS, [(0, key, b"v" * 1024)]) == [True]
                for s in bare:  # the store hangs up: recv sees the end of the stream (or a reset)
                    try:
                        while s.recv(4096):
                            pass
                    except ConnectionResetError:
                        pass
                assert bytes(c.get(NS, [(0, key)])[0]) == b"v" * 1024
        finally:
            for s in bare:
                s.close()
    finally:
        srv.stop()


def test_timeout_names_the_url_and_recovers() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    with KVStoreClient(url, timeout_s=0.3) as c:
        for _ in range(2):  # the socket is reset after a timeout: the next call times out cleanly too
            with pytest.raises(KVStoreError, match=url.replace(".", r"\.")):
                c.info()
    with pytest.raises(KVStoreError, match="tcp://host:port"):
        KVStoreClient("127.0.0.1:5556")


async def test_async_client(server: KVStoreProc) -> None:
    async with AsyncKVStoreClient(server.url) as c:
        assert (await c.info()).chunk_size == 256
        ns = await c.register_layout(LAYOUT)
        k = keys(8)
        payloads = [os.urandom(1000 * (i + 1)) for i in range(8)]
        # concurrent coroutines on one client are serialised, not interleaved
        results = await asyncio.gather(*(c.put(ns, [(0, k[i], payloads[i])]) for i in range(8)))
        assert results == [[True]] * 8
        assert await c.lookup(ns, k, [0]) == 8
        got = await c.get(ns, [(0, key) for key in k])
        assert [bytes(g) for g in got] == payloads
        await c.put_tail(ns, "async-req", [(1, b"t")])
        tail = await c.get_tail(ns, "async-req")
        assert tail is not None and bytes(tail[1]) == b"t"
        await c.drop_tail(ns, "async-req")
        assert "requests_total{op=put}" in await c.stats()
    async with AsyncKVStoreClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3) as dead:
        with pytest.raises(KVStoreError, match="no reply"):
            await dead.info()


# ------------------------------------------------------------------ corruption in shared memory


def test_scribbled_shared_memory_is_a_miss_and_counted(server: KVStoreProc) -> None:
    with KVStoreClient(server.url, shm=False) as c:
        info = c.info()
        assert info.shm_path is not None and info.shm_nonce is not None
        k = keys(1)[0]
        assert c.put(NS, [(0, k, os.urandom(50_000))]) == [True]
        before = stat(c, "checksum_mismatches_total{tier=l1}")
        arena = Arena.attach(info.shm_path, info.shm_nonce, info.shm_size)
        try:
            view = np.frombuffer(arena.view, dtype=np.uint8)
            view ^= 0x5A  # a rogue same-host process flips every byte of the arena
            del view
        finally:
            arena.close()
        assert c.get(NS, [(0, k)]) == [None]
        wait_until(lambda: stat(c, "checksum_mismatches_total{tier=l1}") > before, "the mismatch to be counted")
        assert c.lookup(NS, [k], [0]) == 0  # the corrupt object was dropped


# ------------------------------------------------------------------ auth and start-up checks


def test_auth_token_required_and_private_l1() -> None:
    srv = start_kvstore("--auth-token", "s3cret", "--no-shm")
    try:
        with KVStoreClient(srv.url, auth_token="s3cret", shm=True) as needs_shm:
            with pytest.raises(KVStoreError, match="keeps L1 private"):
                needs_shm.info()
        with KVStoreClient(srv.url) as anon:
            with pytest.raises(KVStoreError, match="auth token") as err:
                anon.info()
            assert err.value.code == "unauthorized"
        with KVStoreClient(srv.url, auth_token="wrong") as bad:
            with pytest.raises(KVStoreError, match="unauthorized"):
                bad.lookup(NS, [b"k"], [0])
        with KVStoreClient(srv.url, auth_token="s3cret") as good:
            assert good.put(NS, [(0, b"key", b"v")]) == [True]
            assert bytes(good.get(NS, [(0, b"key")])[0]) == b"v"
            assert not good.uses_shm  # --no-shm: frames over TCP
            assert good.stats()["errors_total{code=unauthorized}"] == 2
    finally:
        srv.stop()


def test_start_up_errors_are_clear_and_leave_nothing(server: KVStoreProc, capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main(["--host", "0.0.0.0", "--port", str(free_port()), "--http-port", "0"]) == 2
    assert "--auth-token is required" in capsys.readouterr().err
    assert server_main(["--port", str(server.port), "--http-port", "0", "--l1-size-gb", "0.01"]) == 1
    assert "in use" in capsys.readouterr().err
    assert not list(Path("/dev/shm").glob(f"pdserve-kv-{os.getpid()}-*"))  # the arena was unlinked


# ------------------------------------------------------------------ L2


def test_l2_spill_restart_and_corrupt_file(tmp_path: Path) -> None:
    """Spilled chunks, and on a clean stop the rest of L1, survive a restart; a damaged file is a counted miss;
    a shm client follows the restart."""
    flags = ("--l2-path", str(tmp_path), "--l2-size-gb", "0.5")
    srv = start_kvstore(*flags, l1_size_gb=8 / 1024)
    payloads = {k: os.urandom(MIB) for k in keys(20)}  # 20 MiB through an 8 MiB L1
    with KVStoreClient(srv.url, shm=True, timeout_s=30) as c:
        try:
            assert all(c.put(NS, [(0, k, d) for k, d in payloads.items()]))
            assert stat(c, "evictions_total{tier=l1}") >= 12
            assert c.lookup(NS, list(payloads), [0]) == 20  # L1 + L2 together
        finally:
            assert srv.stop() == 0  # SIGTERM: a clean exit
        spilled = list(tmp_path.rglob("*.kv"))
        assert len(spilled) == len(payloads)  # evicted ones, then what L1 held at the stop
        victim = spilled[0]
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0xFF
        victim.write_bytes(bytes(raw))

        srv = start_kvstore(*flags, port=srv.port, l1_size_gb=8 / 1024)  # same port: `c` reconnects
        try:
            assert stat(c, "tier_objects{tier=l2}") == len(spilled)
            got = c.get(NS, [(0, k) for k in payloads])  # maps the new server's arena on the way
            good = [bytes(g) == payloads[k] for k, g in zip(payloads, got) if g is not None]
            assert all(good) and len(good) == len(spilled) - 1  # every spilled chunk but the damaged one
            assert stat(c, "checksum_mismatches_total{tier=l2}") == 1
            assert stat(c, "hits_total{tier=l2}") == len(spilled) - 1
            assert not victim.exists()
            assert stat(c, "errors_total{code=stale_shm}") == 1  # the old arena was refused once, then remapped
        finally:
            srv.stop()


def test_l2_on_a_disk_smaller_than_its_budget_keeps_the_most_recent_spills(tmp_path: Path) -> None:
    """A full disk (a 2 MiB tmpfs under a 512 MiB budget) evicts the least recent files and goes on
    spilling, and a refused write leaves no temporary holding space; chunks served are the ones stored."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    # its own mount namespace (util-linux unshare); without root, inside a user namespace of its own
    user_ns = ("--map-root-user",) if os.geteuid() != 0 else ()
    small_disk = ("unshare", *user_ns, "--mount", "--propagation", "private", "sh", "-c",
                  'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$@"', str(l2))
    srv = start_kvstore("--l2-path", str(l2), "--l2-size-gb", "0.5", l1_size_gb=4 / 1024, wrapper=small_disk)
    seen = Path(f"/proc/{srv.proc.pid}/root") / l2.relative_to("/")  # the disk as the store sees it
    payloads = {k: os.urandom(MIB // 2) for k in keys(40)}  # 20 MiB through a 4 MiB L1 onto a 2 MiB disk
    try:
        with KVStoreClient(srv.url, timeout_s=30) as c:
            order = list(payloads)
            for i in range(0, len(order), 4):
                assert all(c.put(NS, [(0, k, payloads[k]) for k in order[i : i + 4]]))
            assert stat(c, "evictions_total{tier=l1}") >= 28
            on_disk = {bytes.fromhex(f.name.removesuffix(".kv")) for f in seen.rglob("*.kv")}
            assert not [f for f in seen.rglob("*") if ".tmp" in f.name]
            assert 2 <= len(on_disk) == stat(c, "tier_objects{tier=l2}") <= 3
            assert stat(c, "evictions_total{tier=l2}") >= 25
            assert stat(c, "errors_total{code=l2_write}") == 0
            newest = [k for k in order if k in on_disk][-1]  # its promotion spills one more, evicting the oldest
            assert [bytes(g) for g in c.get(NS, [(0, newest)]) if g is not None] == [payloads[newest]]
            assert stat(c, "hits_total{tier=l2}") == 1
            assert not on_disk & set(order[:20])  # the least recent went, not the newest
    finally:
        assert srv.stop() == 0
    assert not l2.exists() or not any(l2.iterdir())  # the store's disk was its own


# ------------------------------------------------------------------ bench


def test_bench_runs_and_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--total-mib", "4", "--object-mib", "1", "2", "--repeat", "1"]) == 0
    table = capsys.readouterr().out
    for row in ("| 1 MiB | shm |", "| 1 MiB | tcp |", "| 2 MiB | memcpy |", "| 2 MiB | zmq tcp alone |",
                "| 2 MiB | socket tcp alone |"):
        assert row in table
