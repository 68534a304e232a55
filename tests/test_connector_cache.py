"""GroupCache: the connector's gather/scatter between vLLM's paged KV cache and store objects (CPU)."""

from __future__ import annotations

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


def test_staging_pool_reuses_buffers_across_loads_and_stays_bounded() -> None:
    """Loads on any thread reuse one staging buffer (pinning a new one is slow on a GPU host);
    a larger load replaces a smaller free buffer instead of growing the pool."""
    from pdserve.kvstore.connector.worker_side import StagingPool

    pool = StagingPool(pinned=False)
    a = pool.take(100)
    pool.give(a)
    assert pool.take(80) is a  # reused, not reallocated
    b = pool.take(50)  # a is in use: a second buffer
    pool.give(a)
    pool.give(b)
    big = pool.take(1000)  # nothing fits: the smallest free buffer makes room for a new one
    assert big.numel() >= 1000 and big is not a and big is not b
    pool.give(big)
    assert sorted(buf.numel() for buf in pool._free) == [100, 1000]
