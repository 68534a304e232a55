"""GroupCache: the connector's gather/scatter between vLLM's paged KV cache and store objects (CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvstore.connector.plan import UNALLOCATED
from pdserve.kvstore.connector.cache import GroupCache


def _cache(row_bytes: int, num_blocks: int = 12, layers: int = 3) -> list[torch.Tensor]:
    # block-major like vLLM's caches; bf16 rows of row_bytes bytes
    return [torch.randn(num_blocks, row_bytes // 2).to(torch.bfloat16) for _ in range(layers)]


@pytest.mark.parametrize("row_bytes", [4608, 6], ids=["word-rows", "byte-rows"])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "misaligned"])
def test_gather_then_scatter_restores_blocks(row_bytes: int, offset: int) -> None:
    src = GroupCache(_cache(row_bytes))
    dst_layers = [torch.zeros_like(t) for t in src.views]
    dst = GroupCache([t.view(torch.bfloat16) for t in dst_layers])
    blocks = [5, 2, 9, 7]
    obj = src.gather(blocks).numpy().tobytes()
    assert len(obj) == src.object_bytes(len(blocks))
    buf = bytearray(offset + len(obj))  # a payload need not start on a word boundary
    buf[offset:] = obj
    dst.scatter(memoryview(buf)[offset:], blocks, skip=0)
    for a, b in zip(src.views, dst.views):
        assert torch.equal(a[blocks], b[blocks])
        others = [i for i in range(a.shape[0]) if i not in blocks]
        assert not b[others].any()


def test_scatter_skips_leading_blocks_and_holes() -> None:
    src = GroupCache(_cache(4608))
    dst = GroupCache([torch.zeros_like(t).view(torch.bfloat16) for t in src.views])
    blocks = [1, 4, 6, 8]
    obj = memoryview(src.gather(blocks).numpy().tobytes())
    dst.scatter(obj, [1, 4, UNALLOCATED, 8], skip=1)  # block 1 kept as is, a hole where 6 was
    for a, b in zip(src.views, dst.views):
        assert not b[1].any() and not b[6].any()
        assert torch.equal(a[[4, 8]], b[[4, 8]])


@pytest.mark.parametrize("batch_bytes", [64 << 20, 3 * 4608 * 2], ids=["one-launch", "capped"])
def test_batched_scatter_writes_what_object_by_object_does(batch_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path (several objects' rows side by side, one kernel call per part and run),
    driven here with pdserve.kernels' torch reference in place of its Triton kernels."""
    from pdserve.kernels import paged
    from pdserve.kvstore.connector import cache as cache_module

    monkeypatch.setattr(cache_module, "SCATTER_BATCH_BYTES", batch_bytes)
    calls: list[int] = []

    def scatter(buffer: torch.Tensor, caches: list[torch.Tensor], ids: torch.Tensor) -> None:
        calls.append(int(ids.numel()))
        paged.scatter_torch(buffer, caches, ids)

    src = GroupCache(_cache(4608, num_blocks=16) + _cache(132, num_blocks=16, layers=2))  # two parts
    lists = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    payloads = [memoryview(src.gather(ids).numpy().tobytes()) for ids in lists]
    loads = [(payloads[0], lists[0], 1), (payloads[1], [3, UNALLOCATED], 0)] + [
        (data, ids, 0) for data, ids in zip(payloads[2:], lists[2:])]
    dst = GroupCache([torch.zeros_like(t).view(torch.bfloat16) for t in src.views])
    dst._ops = (paged.gather_torch, scatter)
    dst.scatter_objects(loads)
    written, untouched = [2, 3, 5, 6, 7, 8, 9, 10], [1, 4]
    for a, b in zip(src.views, dst.views):
        assert torch.equal(a[written], b[written])
        assert not b[untouched].any()
    assert sum(calls) == 2 * len(written)  # every written block once per part
    assert len(calls) == (2 if batch_bytes > 1 << 20 else 5)  # capped: the wide part in 4 runs, the narrow in 1


def test_a_load_that_breaks_is_reported_failed_not_lost() -> None:
    """A scatter that raises (here: a block id past the cache) ends as a failed load, so vLLM recomputes
    instead of waiting forever; the load thread lives on and serves the next job."""
    from kvstore_fixtures import LAYOUT, start_kvstore

    from pdserve.kvstore.client.client import KVStoreClient
    from pdserve.kvstore.connector.plan import ObjectSpec, TransferJob
    from pdserve.kvstore.connector.worker_side import WorkerIO

    store = start_kvstore()
    try:
        cache = GroupCache(_cache(4608, num_blocks=8))
        with KVStoreClient(store.url) as client:
            ns = client.register_layout(LAYOUT)
            client.put(ns, [(0, b"k" * 16, cache.gather([1, 2]).numpy())])
        io = WorkerIO({"url": store.url}, ns, [cache], writes=False)
        try:
            io.load(TransferJob("bad", [ObjectSpec(0, b"k" * 16, [1, 99])]))
            io.load(TransferJob("good", [ObjectSpec(0, b"k" * 16, [3, 4])]))
            done: list = []
            for _ in range(600):  # up to a minute: both outcomes must come back
                done += io.finished_loads(wait_s=0.1)
                if len(done) == 2:
                    break
            outcomes = {o.req_id: o for o in done}
            assert not outcomes["bad"].ok and outcomes["bad"].failed_block_ids == {1, 99}
            assert outcomes["good"].ok
            for view in cache.views:
                assert torch.equal(view[[3, 4]], view[[1, 2]])
        finally:
            io.close()
    finally:
        store.stop()


def test_a_loading_worker_maps_its_store_arena_at_start() -> None:
    """A worker that loads maps its same-host store's arena and faults every page in when it starts
    (before any load, so the first requests do not pay for it); one that only saves does not."""
    from kvstore_fixtures import LAYOUT, start_kvstore

    from pdserve.kvstore.client import shm
    from pdserve.kvstore.client.client import KVStoreClient
    from pdserve.kvstore.connector.worker_side import WorkerIO

    def mapped(path: str) -> list[bool]:
        return [all(a._mapped) for key, a in list(shm._attached.items()) if key[0] == path]

    store = start_kvstore(l1_size_gb=0.25)
    try:
        with KVStoreClient(store.url) as client:
            ns = client.register_layout(LAYOUT)
            path = client.info().shm_path
        cache = GroupCache(_cache(4608, num_blocks=8))
        saver = WorkerIO({"url": store.url}, ns, [cache], writes=True)
        try:
            time.sleep(0.5)
            assert mapped(path) == [], "a worker that only saves mapped the arena"
            loader = WorkerIO({"url": store.url}, ns, [cache], writes=False, reads=True)
            try:
                for _ in range(300):
                    if mapped(path) == [True]:
                        break
                    time.sleep(0.1)
                assert mapped(path) == [True], "the loader's arena was not mapped at start"
            finally:
                loader.close()
        finally:
            saver.close()
    finally:
        store.stop()


def test_arena_pins_register_granules_on_first_use_and_split_payloads_at_their_edges() -> None:
    """A payload is pinned where it lies in the store's arena: only the granules it touches are
    registered (once), a payload across a granule edge comes as one piece per granule, and the
    registrations go when the arena is unmapped. The driver calls are recorded here (no GPU)."""
    from pdserve.kvstore.client.shm import GRANULE, Arena
    from pdserve.kvstore.connector import host_pins

    arena = Arena.create(3 * GRANULE, shared=False)
    calls: list[tuple[str, int, int]] = []
    pins = host_pins.ArenaPins(
        arena, lambda a, n: calls.append(("reg", a - arena.address, n)) is None,
        lambda a: calls.append(("unreg", a - arena.address, 0)),
    )
    arena.view[GRANULE - 10 : GRANULE + 10] = bytes(range(20))
    pieces = pins.pieces(arena.slice(GRANULE - 10, 20))
    assert pieces is not None and [p.numel() for p in pieces] == [10, 10]
    assert bytes(torch.cat(pieces).numpy()) == bytes(range(20))
    assert calls == [("reg", 0, GRANULE), ("reg", GRANULE, GRANULE)]
    assert pins.pieces(arena.slice(10, 100)) is not None and len(calls) == 2  # already registered
    assert pins.pieces(memoryview(bytearray(100))) is None  # not in the arena: staged by the caller
    pins.register_all()  # the background thread's pass: only the granule not yet registered
    assert calls[2:] == [("reg", 2 * GRANULE, GRANULE)]
    pins.release()
    assert calls[3:] == [("unreg", 0, 0), ("unreg", GRANULE, 0), ("unreg", 2 * GRANULE, 0)]
    assert pins.pieces(arena.slice(10, 100)) is None  # released: nothing is pinned any more
    arena.close()


def test_arena_pins_step_aside_when_the_driver_refuses() -> None:
    """A refused registration (e.g. a locked-memory limit) turns pins off for the process; loads
    are then staged, never failed."""
    from pdserve.kvstore.client.shm import GRANULE, Arena
    from pdserve.kvstore.connector import host_pins

    arena = Arena.create(GRANULE, shared=False)
    try:
        pins = host_pins.ArenaPins(arena, lambda a, n: False, lambda a: None)
        assert pins.pieces(arena.slice(0, 64)) is None
        assert host_pins._refused
    finally:
        host_pins._refused = False
        arena.close()
