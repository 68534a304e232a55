"""Paged KV gather/scatter between vLLM's per-layer caches and one contiguous chunk buffer.

The connector ships KV in chunks: for one KV cache group it copies the listed blocks of every
layer into a contiguous buffer (gather, on save) and back (scatter, on load). On a GPU this must
run at memory speed in one launch (`*_triton`); on the CPU engine the same calls go through torch
(`*_torch`). `gather` and `scatter` pick Triton for CUDA tensors and torch otherwise.

Cache layout (vLLM's, one tensor per layer of the group): `[num_blocks, block_size, width]` of
any dtype (bf16, fp8, uint8 pages such as fp8_ds_mla). Rows must be contiguous inside a block;
the block stride may be larger than `block_size * width` (vLLM pads DeepSeek-V4 pages to a
multiple of 576 bytes, and that padding is not copied).

Buffer layout: contiguous uint8 `[num_layers, num_tokens, row_bytes]`, layer-major, with
`row_bytes = width * itemsize`. Layer l's rows are its blocks' rows in list order: buffer rows
`[i * block_size, (i + 1) * block_size)` are block `block_ids[i]`. `num_tokens` (default: all
rows of all listed blocks) may stop inside the last block; then only that block's first rows
move. That is exact for row-major layouts (bf16, V3.2 fp8_ds_mla); DeepSeek-V4 pages keep their
scales after all rows, so move those as whole blocks.

Block ids may repeat for gather; for scatter they must be distinct (the copies race otherwise).
Ids given as a list or CPU tensor are range-checked; ids already on the GPU are trusted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence, TypeAlias

import torch

BlockIds: TypeAlias = Sequence[int] | torch.Tensor

TILE_BYTES = 16384  # bytes per program: several 16-byte loads in flight per thread
NUM_WARPS = 4
_MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension (one program row per block)


@dataclass(frozen=True)
class _Layout:
    num_layers: int
    num_blocks: int  # blocks listed
    block_size: int
    row_bytes: int
    block_stride_bytes: int
    num_tokens: int

    @property
    def buffer_shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.num_tokens, self.row_bytes)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 [num_blocks, block_size, row_bytes] (a view)."""
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def _layout(caches: Sequence[torch.Tensor], num_listed: int, num_tokens: int | None) -> _Layout:
    first = caches[0]
    if first.dim() != 3:
        raise ValueError(f"caches must be [num_blocks, block_size, width], got {tuple(first.shape)}")
    for cache in caches:
        if (cache.shape, cache.stride(), cache.dtype, cache.device) != (
                first.shape, first.stride(), first.dtype, first.device):
            raise ValueError("all caches of a group need the same shape, strides, dtype and device")
    _, block_size, width = first.shape
    if first.stride(2) != 1 or first.stride(1) != width or first.stride(0) < block_size * width:
        raise ValueError(f"cache rows must be contiguous within a block, strides {first.stride()}")
    capacity = num_listed * block_size
    if num_tokens is None:
        num_tokens = capacity
    if not (capacity - block_size < num_tokens <= capacity or num_tokens == capacity == 0):
        raise ValueError(f"num_tokens {num_tokens} does not end in the last of {num_listed} "
                         f"blocks of {block_size}")
    itemsize = first.element_size()
    return _Layout(len(caches), num_listed, block_size, width * itemsize,
                   first.stride(0) * itemsize, num_tokens)


def _block_ids(block_ids: BlockIds, num_cache_blocks: int, device: torch.device) -> torch.Tensor:
    """Block ids as an integer tensor on the caches' device, range-checked if on the host."""
    ids = block_ids if isinstance(block_ids, torch.Tensor) else torch.tensor(
        list(block_ids), dtype=torch.int64)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_ids must be a 1-D list or int32/int64 tensor")
    if ids.device.type == "cpu" and ids.numel() and (
            int(ids.min()) < 0 or int(ids.max()) >= num_cache_blocks):
        raise IndexError(f"block ids outside [0, {num_cache_blocks})")
    return ids.to(device)


def _prepare(caches: Sequence[torch.Tensor], block_ids: BlockIds,
             num_tokens: int | None) -> tuple[torch.Tensor, _Layout]:
    if not caches:
        raise ValueError("no caches given")
    ids = _block_ids(block_ids, caches[0].shape[0], caches[0].device)
    return ids, _layout(caches, len(ids), num_tokens)


def _buffer(out: torch.Tensor | None, layout: _Layout, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(layout.buffer_shape, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.shape != layout.buffer_shape or not out.is_contiguous():
        raise ValueError(f"buffer must be contiguous uint8 {layout.buffer_shape}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"buffer on {out.device}, caches on {device}")
    return out


def _scatter_tokens(buffer: torch.Tensor, num_tokens: int | None) -> int | None:
    """A scatter's token count is the buffer's; an explicit num_tokens must agree with it."""
    if buffer.dim() != 3:
        raise ValueError(f"buffer must be [num_layers, num_tokens, row_bytes], got {tuple(buffer.shape)}")
    if num_tokens not in (None, buffer.shape[1]):
        raise ValueError(f"num_tokens {num_tokens} but the buffer holds {buffer.shape[1]} rows")
    return buffer.shape[1]


# ---------------------------------------------------------------- torch


def gather_torch(caches: Sequence[torch.Tensor], block_ids: BlockIds,
                 out: torch.Tensor | None = None, num_tokens: int | None = None) -> torch.Tensor:
    """Reference and CPU path: index_select and copy, one layer at a time."""
    ids, layout = _prepare(caches, block_ids, num_tokens)
    out = _buffer(out, layout, caches[0].device)
    for layer, cache in enumerate(caches):
        rows = _bytes(cache).index_select(0, ids).flatten(0, 1)
        out[layer].copy_(rows[: layout.num_tokens])
    return out


def scatter_torch(buffer: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: BlockIds,
                  num_tokens: int | None = None) -> None:
    """Reference and CPU path: index_copy_ of the whole blocks, then the partial block's rows."""
    ids, layout = _prepare(caches, block_ids, _scatter_tokens(buffer, num_tokens))
    buffer = _buffer(buffer, layout, caches[0].device)
    full, rest = divmod(layout.num_tokens, layout.block_size)
    for layer, cache in enumerate(caches):
        dst, rows = _bytes(cache), buffer[layer]
        if full:
            dst.index_copy_(0, ids[:full], rows[: full * layout.block_size].unflatten(
                0, (full, layout.block_size)))
        if rest:
            dst[int(ids[full]), :rest].copy_(rows[full * layout.block_size:])


# ---------------------------------------------------------------- Triton


def _word_bytes(layout: _Layout, pointers: Sequence[int]) -> int:
    """Widest word (4, 2 or 1 bytes) that divides every row, stride and base address."""
    for word in (4, 2, 1):
        if all(v % word == 0 for v in (layout.row_bytes, layout.block_stride_bytes, *pointers)):
            return word
    raise AssertionError("unreachable: 1 divides everything")


@functools.lru_cache(maxsize=64)
def _layer_offsets(pointers: tuple[int, ...], word: int, device: torch.device) -> torch.Tensor:
    """Word offsets of each layer's cache from the first: built once per set of caches."""
    return torch.tensor([(p - pointers[0]) // word for p in pointers], dtype=torch.int64,
                        device=device)


def _launch(caches: Sequence[torch.Tensor], ids: torch.Tensor, buffer: torch.Tensor,
            layout: _Layout, scatter: bool, tile_bytes: int, num_warps: int) -> None:
    from pdserve.kernels.paged_triton import paged_copy_kernel

    if layout.num_tokens == 0:
        return
    if layout.num_blocks > _MAX_GRID_Y:
        raise ValueError(f"at most {_MAX_GRID_Y} blocks per launch, got {layout.num_blocks}")
    cache_ptrs = tuple(c.data_ptr() for c in caches)
    word = _word_bytes(layout, (*cache_ptrs, buffer.data_ptr()))
    dtype = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    aligned = all(p % 16 == 0 for p in cache_ptrs)
    row_words = layout.row_bytes // word
    block_words = layout.block_size * row_words
    last_words = (layout.num_tokens - (layout.num_blocks - 1) * layout.block_size) * row_words
    tile = max(tile_bytes // word, 16)
    grid = (-(-block_words // tile), layout.num_blocks, layout.num_layers)
    paged_copy_kernel[grid](
        _bytes(caches[0]).view(dtype), _layer_offsets(cache_ptrs, word, buffer.device), ids,
        buffer.view(dtype), layout.block_stride_bytes // word, block_words, last_words,
        layout.num_tokens * row_words, layout.num_blocks,
        VEC=16 // word if aligned else 1, TILE=tile, SCATTER=scatter, num_warps=num_warps)


def gather_triton(caches: Sequence[torch.Tensor], block_ids: BlockIds,
                  out: torch.Tensor | None = None, num_tokens: int | None = None, *,
                  tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """All layers' blocks into the buffer in one launch."""
    ids, layout = _prepare(caches, block_ids, num_tokens)
    out = _buffer(out, layout, caches[0].device)
    _launch(caches, ids, out, layout, False, tile_bytes, num_warps)
    return out


def scatter_triton(buffer: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: BlockIds,
                   num_tokens: int | None = None, *, tile_bytes: int = TILE_BYTES,
                   num_warps: int = NUM_WARPS) -> None:
    """The buffer back into all layers' blocks in one launch."""
    ids, layout = _prepare(caches, block_ids, _scatter_tokens(buffer, num_tokens))
    buffer = _buffer(buffer, layout, caches[0].device)
    _launch(caches, ids, buffer, layout, True, tile_bytes, num_warps)


# ---------------------------------------------------------------- dispatch


def gather(caches: Sequence[torch.Tensor], block_ids: BlockIds, out: torch.Tensor | None = None,
           num_tokens: int | None = None) -> torch.Tensor:
    """Copy `block_ids` of every cache into a uint8 [num_layers, num_tokens, row_bytes] buffer.

    Triton (one launch) for CUDA caches, torch elsewhere. See the module docstring for layouts.
    """
    if caches and caches[0].is_cuda:
        return gather_triton(caches, block_ids, out, num_tokens)
    return gather_torch(caches, block_ids, out, num_tokens)


def scatter(buffer: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: BlockIds,
            num_tokens: int | None = None) -> None:
    """Inverse of `gather`: write the buffer's rows back into `block_ids` of every cache."""
    if caches and caches[0].is_cuda:
        scatter_triton(buffer, caches, block_ids, num_tokens)
    else:
        scatter_torch(buffer, caches, block_ids, num_tokens)
