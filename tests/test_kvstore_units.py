"""Unit tests of the KV store's parts: protocol, chunk keys, allocator, L1 LRU and leases, L2 files, config."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import msgspec
import pytest
from kvstore_fixtures import LAYOUT

from pdserve.kvstore.client import protocol as p
from pdserve.kvstore.client import checksum as checksum_module
from pdserve.kvstore.client.checksum import checksum, copy_all
from pdserve.kvstore.server.config import KVStoreConfig, build_parser, from_args
from pdserve.kvstore.client.keys import chunk_keys
from pdserve.kvstore.server.l1 import ALIGN, MIN_SPAN, L1, Allocator, ChunkId, Obj
from pdserve.kvstore.server.l2 import L2, L2Corrupt
from pdserve.kvstore.server.metrics import Metrics
from pdserve.kvstore.server.store import Conflict, Store
from pdserve.kvstore.client.shm import Arena

K = MIN_SPAN  # the object size these L1 tests count in

# ------------------------------------------------------------------ protocol

REQUESTS = [
    p.Info(),
    p.RegisterLayout(layout=LAYOUT, namespace="abc"),
    p.Lookup(ns="n", groups=[0, 1], keys=[b"k1", b"k2"]),
    p.Put(ns="n", items=[p.ItemMeta(0, b"k", 10)], shm="nonce"),
    p.PutTail(ns="n", request_id="r", items=[p.TailItem(1, 5)], ttl_s=2.5),
    p.Commit(leases=[1, 2], checksums=[3, 2**64 - 1]),
    p.Get(ns="n", items=[p.ItemRef(0, b"k")]),
    p.GetTail(ns="n", request_id="r", shm="nonce"),
    p.DropTail(ns="n", request_id="r"),
    p.Release(leases=[7], corrupt=[p.Corrupt("n", 0, b"k", 9)]),
    p.Stats(),
]
REPLIES = [
    p.ServerInfo(version="v", protocol=1, chunk_size=256, l1_bytes=1, max_object_bytes=1, shm_path="/dev/shm/x"),
    p.Error(code="bad_request", message="m"),
    p.Ok(),
    p.Registered(namespace="n"),
    p.LookupResult(count=3),
    p.Stored(stored=[True, False], errors=[None, "too big"]),
    p.Reserved(slots=[p.Slot(1, 64, 10), None], stored=[True, True], errors=[None, None]),
    p.Loaded(items=[p.Found(1, 10, 99, 2, 128), None]),
    p.TailLoaded(groups=[0], items=[p.Found(1, 10, 99)]),
    p.StatsReply(stats={"hits": 1.0}),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg: msgspec.Struct) -> None:
    msg.id, msg.token = 42, "secret"
    assert p.decode_request(p.encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg: msgspec.Struct) -> None:
    msg.id = 7
    assert p.decode_reply(p.encode(msg)) == msg


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\x00garbage", msgspec.msgpack.encode({"op": "format_disk"}), msgspec.msgpack.encode({"op": "get"}),
     msgspec.msgpack.encode({"op": "lookup", "ns": "n", "groups": "x", "keys": []}), msgspec.msgpack.encode([1, 2])],
    ids=["empty", "garbage", "unknown-op", "missing-fields", "wrong-type", "not-a-map"],
)
def test_bad_requests_do_not_decode(data: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        p.decode_request(data)


def test_validators() -> None:
    p.check_namespace(LAYOUT.namespace())
    for bad in ("", "../etc", "a/b", "x" * 200, ".hidden"):
        with pytest.raises(p.BadRequest):
            p.check_namespace(bad)
    with pytest.raises(p.BadRequest):
        p.check_key(b"")
    with pytest.raises(p.BadRequest):
        p.check_group(-1)
    with pytest.raises(p.BadRequest):
        p.check_request_id("has space")


# ------------------------------------------------------------------ chunk keys


def test_chunk_keys_prefix_property() -> None:
    ns = LAYOUT.namespace()
    tokens = list(range(1000, 1000 + 4 * 16 + 7))
    keys = chunk_keys(ns, tokens, 16)
    assert len(keys) == 4  # the trailing 7 tokens form no key
    assert chunk_keys(ns, tokens[: 2 * 16], 16) == keys[:2]  # same prefix, same keys
    assert chunk_keys(ns, tokens + [5, 6, 7], 16)[:4] == keys
    changed = list(tokens)
    changed[2 * 16 + 3] += 1  # one token in chunk 2
    other = chunk_keys(ns, changed, 16)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:]))  # that chunk and every later one change
    assert not set(chunk_keys(ns, tokens, 16, salt="user-a")) & set(keys)
    assert not set(chunk_keys("0" * 32, tokens, 16)) & set(keys)
    assert len(set(keys)) == len(keys)
    # A LoRA adapter's KV is another: keys apart from the base model's, other adapters' and any salt's,
    # also a salt that spells what an adapter adds to the seed.
    lora = chunk_keys(ns, tokens, 16, adapter="a")
    assert lora == chunk_keys(ns, tokens, 16, adapter="a")
    for other_keys in (keys, chunk_keys(ns, tokens, 16, adapter="b"), chunk_keys(ns, tokens, 16, salt="a"),
                       chunk_keys(ns, tokens, 16, salt="\x01\x00\x00\x00a"),
                       chunk_keys(ns, tokens, 16, salt="x", adapter="a")):
        assert not set(other_keys) & set(lora)
    with pytest.raises(ValueError):
        chunk_keys(ns, tokens, 0)


# ------------------------------------------------------------------ checksum


@pytest.mark.parametrize("on_helper", [True, False], ids=["hash-on-helper", "one-thread"])
def test_copy_all_copies_and_hashes_small_and_large(on_helper: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum_module, "HASH_ON_HELPER", on_helper)  # both ways, whatever this machine picks
    for size in (10, 3 << 20, (3 << 20) + 5):  # the last ends in a partial block
        srcs = [memoryview(os.urandom(size)) for _ in range(3)]
        dsts = [memoryview(bytearray(size)) for _ in range(3)]
        assert copy_all(dsts, srcs) == [checksum(s) for s in srcs]
        assert [bytes(d) for d in dsts] == [bytes(s) for s in srcs]
    with pytest.raises(ValueError):
        copy_all([memoryview(bytearray(3))], [memoryview(b"four")])


@pytest.mark.parametrize("on_helper", [True, False], ids=["hash-on-helper", "one-thread"])
def test_checksums_keep_order_when_shared_out(on_helper: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large in-place read is hashed in shares on the helper threads: each sum stays with its view."""
    monkeypatch.setattr(checksum_module, "HASH_ON_HELPER", on_helper)
    sizes = [1 << 20] * 9 + [7, 5 << 20, 3] + [1 << 19] * 5  # uneven, so the shares differ in count
    views = [memoryview(os.urandom(n)) for n in sizes]
    assert checksum_module.checksums(views) == [checksum(v) for v in views]
    assert checksum_module.checksums(views[:1]) == [checksum(views[0])]
    assert checksum_module.checksums([]) == []


def test_shares_cover_every_view_once_in_order() -> None:
    views = [memoryview(bytes(n)) for n in (5, 1, 1, 1, 9, 2, 2)]
    for parts in (1, 2, 3, 5, 20):
        runs = checksum_module._shares(views, parts)
        assert 1 <= len(runs) <= parts
        assert [id(v) for run in runs for v in run] == [id(v) for v in views]


# ------------------------------------------------------------------ allocator and L1


def test_allocator_best_fit_and_coalescing() -> None:
    a = Allocator(1000)
    x, y, z = a.alloc(100), a.alloc(200), a.alloc(300)
    assert (x, y, z) == (0, 100, 300) and a.free_bytes == 400
    assert a.alloc(500) is None
    a.free(100, 200)
    assert a.alloc(150) == 100  # best fit: the 200-byte hole, not the 400-byte tail
    a.free(100, 150)
    a.free(0, 100)
    a.free(300, 300)  # every hole merges back into one extent
    assert a.free_bytes == 1000 and a.alloc(1000) == 0


class _Spills:
    def __init__(self) -> None:
        self.spilled: list[ChunkId] = []

    def __call__(self, cid: ChunkId, obj: Obj) -> None:
        self.spilled.append(cid)


def _fill(l1: L1, cid: ChunkId, size: int, byte: int) -> Obj | None:
    obj = l1.allocate(size)
    if obj is None:
        return None
    l1.view(obj)[:] = bytes([byte]) * size
    l1.unlease(obj)
    return l1.insert(cid, obj)


def test_l1_evicts_least_recently_used_and_spills() -> None:
    spills = _Spills()
    l1 = L1(Arena.create(4 * K, shared=False), spill=spills)
    for i in range(4):
        assert _fill(l1, ("n", 0, bytes([i])), K, i) is not None
    assert l1.get(("n", 0, b"\x00")) is not None  # touch chunk 0: chunk 1 is now the oldest
    _fill(l1, ("n", 0, b"\x04"), K, 4)
    assert spills.spilled == [("n", 0, b"\x01")]
    assert l1.get(("n", 0, b"\x01")) is None and l1.get(("n", 0, b"\x00")) is not None
    assert l1.used_bytes == 4 * K and l1.live_objects == 4


def test_l1_leased_objects_are_never_evicted_or_reused() -> None:
    l1 = L1(Arena.create(2 * K, shared=False), spill=_Spills())
    a = _fill(l1, ("n", 0, b"a"), K, 0xAA)
    b = _fill(l1, ("n", 0, b"b"), K, 0xBB)
    assert a is not None and b is not None
    a.leases += 1  # a reader holds a
    assert _fill(l1, ("n", 0, b"c"), K, 0xCC) is not None  # evicts b, not a
    assert l1.get(("n", 0, b"b")) is None and l1.get(("n", 0, b"a")) is a
    b2 = l1.allocate(K)  # a and c fill L1; c is evictable, a is not
    assert b2 is not None
    assert l1.allocate(K) is None  # only leased objects left: refused, not evicted
    l1.remove(("n", 0, b"a"))  # removed while leased: its bytes stay until the lease ends
    assert bytes(l1.view(a)) == b"\xaa" * K
    assert l1.allocate(K) is None
    l1.unlease(a)
    assert l1.allocate(K) is not None
    assert l1.allocate(3 * K) is None  # larger than L1


def test_l1_concurrent_insert_keeps_first() -> None:
    l1 = L1(Arena.create(2 * K, shared=False), spill=_Spills())
    first = _fill(l1, ("n", 0, b"k"), 100, 1)
    second = l1.allocate(100)
    assert second is not None
    l1.unlease(second)
    assert l1.insert(("n", 0, b"k"), second) is first
    assert l1.live_objects == 1 and second.dead
    assert l1._alloc.free_bytes == 2 * K - MIN_SPAN  # a small object takes a page of the budget


def test_l1_small_objects_are_charged_a_page_each() -> None:
    """Tiny objects cannot grow the index past a page per object (about a tenth of the budget in RSS)."""
    l1 = L1(Arena.create(16 * K, shared=False), spill=_Spills())
    for i in range(64):
        assert _fill(l1, ("n", 0, i.to_bytes(2, "big")), ALIGN, i) is not None
    assert l1.live_objects == 16 * K // MIN_SPAN and l1.evictions == 64 - l1.live_objects


def test_a_write_reserved_before_a_clear_is_not_committed() -> None:
    """The shared-memory put is two messages: a clear between them leaves nothing of the old generation."""
    store = Store(KVStoreConfig(l1_size_gb=1 / 1024, shm=False), Metrics())
    ns = LAYOUT.namespace()
    try:
        before = store.generation(ns)
        chunk, tail = store.reserve(ns, [p.ItemMeta(0, b"k", 10)], before), store.reserve_tail(
            ns, "req-1", [p.TailItem(0, 10)], None, before)
        leases = [slot.lease for slot in (*chunk.slots, *tail.slots) if slot is not None]
        assert len(leases) == 2
        store.clear(ns)
        assert store.generation(ns) != before
        assert store.commit(leases, [0, 0]) == ([False, False], ["lease expired or unknown"] * 2)
        assert not store.lookup(ns, [0], [b"k"]) and store.get_tail(ns, "req-1", shm=False) is None
        assert store.l1.live_objects == 0
        refused = store.reserve(ns, [p.ItemMeta(0, b"k", 10)], before)  # planned before the clear
        assert refused.slots == [None] and refused.stored == [False] and "was cleared" in (refused.errors[0] or "")
        with pytest.raises(Conflict, match="was cleared"):
            store.reserve_tail(ns, "req-2", [p.TailItem(0, 10)], None, before)
        assert store.reserve(ns, [p.ItemMeta(0, b"k", 10)], store.generation(ns)).slots[0] is not None
    finally:
        store.close()


# ------------------------------------------------------------------ shared-memory arena


def _mappings(path: Path | None) -> int:
    """How many times this process maps `path` (each mapping counts its touched pages in RSS again)."""
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(f" {path}"))


def test_clients_of_a_process_share_one_mapping_of_the_arena() -> None:
    server = Arena.create(1 << 20)
    try:
        assert server.path is not None and _mappings(server.path) == 1
        first = Arena.attach(str(server.path), server.nonce, server.size)
        second = Arena.attach(str(server.path), server.nonce, server.size)
        assert _mappings(server.path) == 2  # the server's and the clients' one
        first.close()
        second.slice(4096, 3)[:] = b"abc"  # still mapped for the client that has not closed
        assert bytes(server.slice(4096, 3)) == b"abc"
        second.close()
        assert _mappings(server.path) == 1
        again = Arena.attach(str(server.path), server.nonce, server.size)
        assert bytes(again.slice(4096, 3)) == b"abc" and _mappings(server.path) == 2
        again.close()
        assert _mappings(server.path) == 1
    finally:
        server.close()
    assert not server.path.exists()


# ------------------------------------------------------------------ L2


def _l2(tmp_path: Path, capacity: int = 1 << 20) -> tuple[L2, list[ChunkId]]:
    evicted: list[ChunkId] = []
    return L2(tmp_path, capacity, on_evict=evicted.append), evicted


def _read(l2: L2, cid: ChunkId) -> bytes:
    buf = bytearray()

    def into(size: int) -> memoryview:
        buf.extend(bytes(size))
        return memoryview(buf)

    l2.read(cid, into)
    return bytes(buf)


def test_l2_survives_reopen_and_trims_lru(tmp_path: Path) -> None:
    l2, evicted = _l2(tmp_path, capacity=3 * 1200)
    payloads = {("ns1", g, bytes([g]) * 16): os.urandom(1000) for g in range(3)}
    for cid, data in payloads.items():
        l2.write(cid, memoryview(data), checksum(data))
    (tmp_path / "ns1" / "0" / "deadbeef.kv.tmp123").write_bytes(b"torn")  # a crash mid-write
    reopened, _ = _l2(tmp_path, capacity=3 * 1200)
    assert set(reopened.index) == set(payloads)
    assert not list(tmp_path.rglob("*.tmp*"))
    for cid, data in payloads.items():
        assert _read(reopened, cid) == data
    extra = ("ns1", 5, b"\x05" * 16)
    reopened.write(extra, memoryview(b"x" * 1000), checksum(b"x" * 1000))
    assert reopened.used_bytes <= 3 * 1200 and extra in reopened.index
    assert len(reopened.index) == 3  # the least recently used one was deleted
    assert evicted == [] and len(list(tmp_path.rglob("*.kv"))) == 3


def _gone(paths: Callable[[], list[Path]]) -> bool:
    """Whether the background deletion has removed `paths()` (polled: a wait, not a timing check)."""
    deadline = time.monotonic() + 30
    while paths() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not paths()


def test_l2_drop_namespace_forgets_at_once_and_deletes_in_the_background(tmp_path: Path) -> None:
    l2, evicted = _l2(tmp_path)
    data = b"x" * 100
    mine, theirs = [("ns1", 0, bytes([i]) * 16) for i in range(3)], ("ns2", 0, b"\x09" * 16)
    for cid in [*mine, theirs]:
        l2.write(cid, memoryview(data), checksum(data))
    assert l2.drop_namespace("ns1") == 3
    assert list(l2.index) == [theirs] and l2.used_bytes == l2.index[theirs] and evicted == []
    assert not (tmp_path / "ns1").exists()  # moved aside at once
    assert _gone(lambda: list(tmp_path.glob(".trash-*")))
    assert _read(l2, theirs) == data
    l2.write(mine[0], memoryview(data), checksum(data))  # the namespace goes on in a new folder
    (tmp_path / ".trash-ns1-0badc0de" / "0").mkdir(parents=True)  # a drop a stop cut short
    (tmp_path / ".trash-ns1-0badc0de" / "0" / ("ab" * 16 + ".kv")).write_bytes(b"old")
    reopened, _ = _l2(tmp_path)
    assert set(reopened.index) == {theirs, mine[0]}
    assert _gone(lambda: list(tmp_path.glob(".trash-*")))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_l2_corrupt_file_is_never_served(tmp_path: Path, damage: str) -> None:
    l2, _ = _l2(tmp_path)
    cid = ("ns1", 0, b"k" * 16)
    data = os.urandom(5000)
    l2.write(cid, memoryview(data), checksum(data))
    path = next(tmp_path.rglob("*.kv"))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-10]
    else:
        raw[12:20] = b"\x00" * 8
    path.write_bytes(bytes(raw))
    with pytest.raises(L2Corrupt):
        _read(l2, cid)
    assert cid not in l2.index and not path.exists()


# ------------------------------------------------------------------ config


def test_config_flags_and_validation(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--port", "1234", "--l1-size-gb", "0.5", "--eviction-policy", "LRU"])
    cfg = from_args(args)
    assert cfg.port == 1234 and cfg.l1_bytes == 1 << 29 and cfg.zmq_url == "tcp://127.0.0.1:1234"
    for flags, message in [
        (["--host", "0.0.0.0"], "--auth-token is required"),
        (["--eviction-policy", "fifo"], "not supported"),
        (["--l2-path", str(tmp_path)], "--l2-size-gb"),
        (["--l1-size-gb", "0"], "at least 1 MiB"),
    ]:
        with pytest.raises(ValueError, match=message):
            from_args(build_parser().parse_args(flags))
    assert from_args(build_parser().parse_args(["--host", "0.0.0.0", "--auth-token", "t"])).auth_token == "t"
    assert KVStoreConfig().port == 5556 and KVStoreConfig().http_port == 18556 and KVStoreConfig().chunk_size == 256
