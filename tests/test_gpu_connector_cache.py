"""GroupCache on CUDA: the copy path (pdserve.kernels, one launch per part) and its stream order.

Each ordering test delays one stream with a GPU spin (torch.cuda._sleep) so that a missing
wait shows up as wrong bytes, not as a rare race:
- a load must not be reported before its copy into the paged cache is complete;
- a load must not land before work the engine queued on its stream before start_load_kv
  (the blocks may have been another request's);
- a save must read what the engine's stream wrote before wait_for_save.
Needs CUDA (skipped without it); no vLLM.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPIN_CYCLES = 2_000_000_000  # about a second of one SM's clock: far longer than any copy here


def _layers(widths: list[int], num_blocks: int = 32, block_size: int = 64) -> list[torch.Tensor]:
    """Block-major uint8 caches like vLLM's fp8_ds_mla (656 B rows) and indexer (132 B rows) layers."""
    return [torch.zeros(num_blocks, block_size, w, dtype=torch.uint8, device="cuda") for w in widths]


def _fill(cache, block_ids: list[int], seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for view in cache.views:
        for b in block_ids:
            view[b] = torch.randint(0, 256, (view.shape[1],), dtype=torch.uint8, device="cuda", generator=gen)


def _kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_mixed_width_group_round_trips_through_one_kernel_per_part() -> None:
    from pdserve.kvstore.connector.cache import GroupCache

    widths = [656, 132, 656, 132]  # V3.2: latent and indexer layers in one group
    src, dst = GroupCache(_layers(widths)), GroupCache(_layers(widths))
    assert len(src.parts) == 2
    blocks = [3, 17, 5, 9]
    _fill(src, blocks, seed=1)
    obj = src.gather(blocks)
    assert obj.device.type == "cpu" and obj.numel() == src.object_bytes(len(blocks))
    kernels = _kernel_names(lambda: dst.scatter(memoryview(obj.numpy()), blocks, skip=0))
    # one Triton launch per part, no per-layer torch indexing kernels
    assert sum("paged_copy_kernel" in k for k in kernels) == 2, kernels
    assert not any("index" in k.lower() for k in kernels), kernels
    gather_kernels = _kernel_names(lambda: src.gather(blocks))
    assert sum("paged_copy_kernel" in k for k in gather_kernels) == 2, gather_kernels
    for a, b in zip(src.views, dst.views):
        assert torch.equal(a[blocks], b[blocks])


def test_a_load_of_many_objects_is_one_launch_per_part() -> None:
    """A 32k-token load is ~128 objects: their rows go to the paged kernel side by side, one launch
    per part (not one per object and part), leading blocks kept and holes skipped as before."""
    from pdserve.kvstore.connector.cache import GroupCache
    from pdserve.kvstore.connector.plan import UNALLOCATED

    widths = [656, 132, 656, 132]
    src, dst = GroupCache(_layers(widths)), GroupCache(_layers(widths))
    lists = [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13]]
    _fill(src, [b for ids in lists for b in ids], seed=3)
    payloads = [memoryview(src.gather(ids).numpy()) for ids in lists]
    loads = [(payloads[0], lists[0], 1), (payloads[1], [4, UNALLOCATED], 0)] + [
        (data, ids, 0) for data, ids in zip(payloads[2:], lists[2:])]
    kernels = _kernel_names(lambda: dst.scatter_objects(loads))
    assert sum("paged_copy_kernel" in k for k in kernels) == 2, kernels
    written = [3, 4] + [b for ids in lists[2:] for b in ids]
    untouched = [2, 5]
    for a, b in zip(src.views, dst.views):
        assert torch.equal(a[written], b[written])
        assert not b[untouched].any()


def _store_with(objects: dict[bytes, torch.Tensor]):
    from kvstore_fixtures import LAYOUT, start_kvstore

    from pdserve.kvstore.client.client import KVStoreClient

    store = start_kvstore(l1_size_gb=0.25)
    with KVStoreClient(store.url) as client:
        ns = client.register_layout(LAYOUT)
        client.put(ns, [(0, key, obj.numpy()) for key, obj in objects.items()])
    return store, ns


def _load(cache, store, ns: str, key: bytes, blocks: list[int], before_load=None, shm: bool | None = None) -> None:
    """One load through the connector's worker IO (over shared memory unless `shm` is False);
    returns once it is reported finished."""
    from pdserve.kvstore.connector.plan import ObjectSpec, TransferJob
    from pdserve.kvstore.connector.worker_side import WorkerIO

    io = WorkerIO({"url": store.url, "shm": shm}, ns, [cache], writes=False)
    try:
        if before_load is not None:
            before_load()
        cache.fence()  # what start_load_kv does before handing loads over
        io.load(TransferJob("r", [ObjectSpec(0, key, blocks)]))
        done: list = []
        for _ in range(600):
            done += io.finished_loads(wait_s=0.1)
            if done:
                break
        assert done and done[0].ok
    finally:
        io.close()


def test_a_load_is_reported_only_once_its_copy_is_complete() -> None:
    from pdserve.kvstore.connector.cache import GroupCache

    src = GroupCache(_layers([656, 656]))
    blocks = [2, 4, 6]
    _fill(src, blocks, seed=2)
    store, ns = _store_with({b"a" * 16: src.gather(blocks)})
    try:
        dst = GroupCache(_layers([656, 656]))

        def delay_load_stream() -> None:  # the copy queues behind a second of GPU spin
            with torch.cuda.stream(dst._stream):
                torch.cuda._sleep(SPIN_CYCLES)

        _load(dst, store, ns, b"a" * 16, blocks, delay_load_stream)
        # Read at once, on another stream than the load's: right only if the load waited.
        for a, b in zip(src.views, dst.views):
            assert torch.equal(a[blocks].cpu(), b[blocks].cpu())
    finally:
        store.stop()


def test_a_load_lands_after_what_the_engine_queued_before_it() -> None:
    from pdserve.kvstore.connector.cache import GroupCache

    src = GroupCache(_layers([656]))
    blocks = [1, 7]
    _fill(src, blocks, seed=3)
    store, ns = _store_with({b"b" * 16: src.gather(blocks)})
    try:
        dst = GroupCache(_layers([656]))

        def engine_still_writes_old_kv() -> None:  # an earlier request's write, still queued
            torch.cuda._sleep(SPIN_CYCLES)
            for view in dst.views:
                view[blocks] = 0x11

        _load(dst, store, ns, b"b" * 16, blocks, engine_still_writes_old_kv)
        torch.cuda.synchronize()
        for a, b in zip(src.views, dst.views):
            assert torch.equal(a[blocks], b[blocks]), "the load landed before the engine's earlier write"
    finally:
        store.stop()


def test_a_save_reads_what_the_engine_wrote_before_it() -> None:
    from pdserve.kvstore.connector.cache import GroupCache

    cache = GroupCache(_layers([656, 132]))
    blocks = [8, 9]
    torch.cuda._sleep(SPIN_CYCLES)  # the engine's step is still running...
    for view in cache.views:
        view[blocks] = 0x5A  # ...and writes this step's KV last
    saved = cache.gather(blocks)  # wait_for_save, on the engine's stream
    assert bool((saved == 0x5A).all()), "the save read the blocks before the step's writes"
    for view in cache.views:
        view[blocks] = 0x33  # the next step reuses the blocks
    torch.cuda.synchronize()
    assert bool((saved == 0x5A).all()), "the saved bytes changed after wait_for_save returned"


def test_a_same_host_load_uploads_straight_from_the_store_arena() -> None:
    """Over shared memory the upload reads the store's page-locked arena (no staging buffer is
    ever allocated); over TCP the frames are staged. Both land the same bytes."""
    from pdserve.kvstore.connector import host_pins
    from pdserve.kvstore.connector.cache import GroupCache

    src = GroupCache(_layers([656, 132]))
    blocks = [1, 7, 3, 12]
    _fill(src, blocks, seed=5)
    store, ns = _store_with({b"s" * 16: src.gather(blocks)})
    try:
        for shm in (None, False):
            dst = GroupCache(_layers([656, 132]))
            _load(dst, store, ns, b"s" * 16, blocks, shm=shm)
            for a, b in zip(src.views, dst.views):
                assert torch.equal(a[blocks], b[blocks])
            if shm is None:
                assert dst._pinned is None, "a same-host load was staged"
                assert any(p._granules for p in host_pins._by_arena.values())
            else:
                assert dst._pinned is not None
    finally:
        store.stop()


def test_a_payload_across_granules_uploads_piece_by_piece() -> None:
    """Registrations are per 64 MiB granule; a payload that spans two is uploaded in two pieces."""
    from pdserve.kvstore.client.shm import GRANULE, Arena
    from pdserve.kvstore.connector.cache import GroupCache
    from pdserve.kvstore.connector.host_pins import ArenaPins

    arena = Arena.create(2 * GRANULE, shared=False)
    pins = ArenaPins(arena)
    try:
        data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
        start = GRANULE - (1 << 20)
        arena.view[start : start + data.numel()] = data.numpy().tobytes()
        pieces = pins.pieces(arena.slice(start, data.numel()))
        assert pieces is not None and len(pieces) == 2 and all(p.is_pinned() for p in pieces)
        cache = GroupCache(_layers([656]))
        (on_gpu,) = cache._upload([pieces], [data.numel()])
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), data)
    finally:
        pins.release()
        arena.close()


def test_a_consumer_pins_its_store_arena_before_its_first_load() -> None:
    """A worker that loads maps its same-host store's arena and page-locks it from the start
    (while the engine is still starting), so no request's load pays for the registration."""
    import time

    from pdserve.kvstore.connector import host_pins
    from pdserve.kvstore.connector.cache import GroupCache
    from pdserve.kvstore.connector.worker_side import WorkerIO

    from pdserve.kvstore.client import shm
    from pdserve.kvstore.client.client import KVStoreClient

    store, ns = _store_with({})
    with KVStoreClient(store.url) as client:
        path = client.info().shm_path
    io = WorkerIO({"url": store.url, "shm": None}, ns, [GroupCache(_layers([656]))], writes=False, reads=True)
    try:
        def registered() -> int:  # granules of this store's arena registered in this process
            arenas = [a for key, a in list(shm._attached.items()) if key[0] == path]
            return sum(len(p._granules) for a in arenas if (p := host_pins._by_arena.get(id(a))) is not None)

        for _ in range(300):
            if registered():
                break
            time.sleep(0.1)
        assert registered() > 0, "the arena was not pinned before any load"
    finally:
        io.close()
        store.stop()


def test_copies_count_their_gpu_time_apart_from_their_wall_time() -> None:
    """The engine's /metrics carry each copy's GPU time (CUDA events around our own work) beside
    its wall time, which for a save includes the forward the engine queued before it."""
    from pdserve.kvstore.connector.cache import GroupCache

    src, dst = GroupCache(_layers([656, 132])), GroupCache(_layers([656, 132]))
    blocks = [2, 9, 4]
    _fill(src, blocks, seed=7)
    torch.cuda._sleep(SPIN_CYCLES // 4)  # engine work queued before the save: wall time, not ours
    obj = src.gather(blocks)
    dst.scatter(memoryview(obj.numpy()), blocks, skip=0)
    saved, loaded = src.take_copy_counts(), dst.take_copy_counts()
    assert saved["gather_bytes"] == loaded["scatter_bytes"] == obj.numel()
    assert 0 < saved["gather_gpu_seconds"] < saved["gather_seconds"] / 10, saved
    assert 0 < loaded["scatter_gpu_seconds"] <= loaded["scatter_seconds"], loaded
