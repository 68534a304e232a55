"""Unit tests of the connector's pure parts: object extents and start-up checks."""

from __future__ import annotations

import pytest

from pdserve.kvstore.client.layout import KVGroupLayout, KVLayout
from pdserve.kvstore.connector.plan import UNALLOCATED, ConnectorConfigError, GroupGeometry, check_geometry, plan_objects

KEYS = [bytes([i]) * 16 for i in range(8)]


def test_full_group_objects_cover_their_own_chunk() -> None:
    geo = [GroupGeometry(block_size=16)]
    table = [list(range(100, 140))]  # 40 blocks = 640 tokens
    specs = plan_objects(geo, table, KEYS, 256, first_chunk=0, num_chunks=2, tail_end=600)
    assert [s.key for s in specs] == [KEYS[0], KEYS[1], None]
    assert specs[0].block_ids == list(range(100, 116))
    assert specs[1].block_ids == list(range(116, 132))
    assert specs[2].block_ids == list(range(132, 138))  # tokens 512..600: a partial last block


def test_sliding_group_keeps_only_the_window_before_each_boundary() -> None:
    geo = [GroupGeometry(block_size=128), GroupGeometry(block_size=128, sliding_window=64)]
    table = [list(range(1, 9)), list(range(11, 19))]
    specs = plan_objects(geo, table, KEYS, 256, first_chunk=0, num_chunks=3, tail_end=None)
    sliding = [s for s in specs if s.group == 1]
    # window of 64 (+1 slack) before token 256, 512, 768: one block each, the chunk's last
    assert [s.block_ids for s in sliding] == [[12], [14], [16]]


def test_sliding_window_reaching_into_the_previous_chunk() -> None:
    geo = [GroupGeometry(block_size=16, sliding_window=64)]
    table = [list(range(64))]
    (spec,) = plan_objects(geo, table, KEYS, 256, first_chunk=1, num_chunks=1, tail_end=260)
    assert spec.key is None
    # tail ends at 260: tokens 195..260 -> blocks 12..16
    assert spec.block_ids == list(range(12, 17))


def test_loads_take_only_the_last_sliding_object_and_skip_computed_blocks() -> None:
    geo = [GroupGeometry(block_size=16), GroupGeometry(block_size=16, sliding_window=32)]
    table = [list(range(64)), list(range(100, 164))]
    specs = plan_objects(
        geo, table, KEYS, 256, first_chunk=0, num_chunks=3, tail_end=None,
        computed_tokens=256, last_only_for_sliding=True,
    )
    assert len([s for s in specs if s.group == 0]) == 3
    assert specs[0].skip_blocks == 16  # chunk 0 is already computed locally
    assert specs[1].skip_blocks == 0
    (sliding,) = [s for s in specs if s.group == 1]
    assert sliding.key == KEYS[2]


def test_loads_mark_tail_blocks_past_the_block_table() -> None:
    """A load stops one token short of the prompt: the tail's last block may not be allocated."""
    geo = [GroupGeometry(block_size=16)]
    (spec,) = plan_objects(geo, [list(range(16))], KEYS, 256, first_chunk=1, num_chunks=1, tail_end=257,
                           allow_short_table=True)
    assert spec.key is None and spec.block_ids == [UNALLOCATED]


def test_plan_refuses_a_block_table_too_short() -> None:
    with pytest.raises(ValueError):
        plan_objects([GroupGeometry(16)], [[1, 2]], KEYS, 256, first_chunk=0, num_chunks=1, tail_end=None)


def _layout(block_size: int, window: int | None = None) -> KVLayout:
    return KVLayout(
        model="m",
        groups=(KVGroupLayout("0:full", "bfloat16", 1152, block_size, 4, window),),
    )


def test_chunk_size_must_be_a_multiple_of_every_block_size() -> None:
    check_geometry(_layout(16), 256, 0)
    with pytest.raises(ConnectorConfigError, match="--chunk-size"):
        check_geometry(_layout(256), 1000, 0)


def test_sliding_window_models_need_a_retention_interval_dividing_the_chunk() -> None:
    check_geometry(_layout(128, window=64), 256, 256)
    check_geometry(_layout(128, window=64), 256, 128)
    check_geometry(_layout(128, window=64), 256, None)  # dense retention divides everything
    for bad in (0, 384):
        with pytest.raises(ConnectorConfigError, match="--prefix-cache-retention-interval"):
            check_geometry(_layout(128, window=64), 256, bad)
