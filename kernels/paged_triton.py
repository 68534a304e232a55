"""The Triton kernel behind `pdserve.kernels.paged`: one launch copies every layer's blocks.

Grid: (tile within a block, position in the block list, layer). Each program moves one tile of
one block's contiguous span with 16-byte accesses. The layers' caches are separate allocations;
the kernel reaches them as word offsets from the first layer's cache, read from a small table,
so one typed pointer argument covers all of them and the compiler can still be told (VEC) that
every address is 16-byte aligned, which is what keeps the copy at memory speed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_copy_kernel(
    cache_ptr, layer_offsets_ptr, block_ids_ptr, buf_ptr,
    block_stride, block_words, last_words, layer_words, num_blocks,
    VEC: tl.constexpr, TILE: tl.constexpr, SCATTER: tl.constexpr,
):
    """Copy between cache blocks and the layer-major buffer, in words of the pointers' type.

    block_stride: words between consecutive blocks of one cache; block_words: words copied from
    each block; last_words: words copied from the last listed block (a partial block when the
    buffer ends mid-block); layer_words: words of one layer in the buffer; VEC: words in 16
    bytes if every cache is 16-byte aligned, else 1.
    """
    start = tl.program_id(0) * TILE
    j = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    block = tl.load(block_ids_ptr + j).to(tl.int64)
    layer_offset = tl.multiple_of(tl.load(layer_offsets_ptr + layer), VEC)
    cache_base = cache_ptr + layer_offset + block * block_stride
    buf_base = buf_ptr + layer * layer_words + j.to(tl.int64) * block_words
    is_last = j == num_blocks - 1
    # The bulk moves whole 16-byte vectors: its mask bound must be a multiple of VEC that the
    # compiler can see, or it splits every access (an if/else on is_last loses that too). The
    # last block's final words (fewer than VEC) go separately.
    vec_words = (last_words // VEC) * VEC
    offs = start + tl.arange(0, TILE)
    _move(cache_base + offs, buf_base + offs, offs < tl.where(is_last, vec_words, block_words),
          SCATTER)
    tail = vec_words + tl.arange(0, VEC)
    tail_mask = (tail < tl.where(is_last, last_words, 0)) & (tail >= start) & (tail < start + TILE)
    _move(cache_base + tail, buf_base + tail, tail_mask, SCATTER)


@triton.jit
def _move(cache_ptrs, buf_ptrs, mask, SCATTER: tl.constexpr):
    if SCATTER:
        tl.store(cache_ptrs, tl.load(buf_ptrs, mask=mask), mask=mask)
    else:
        tl.store(buf_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
