"""Inputs shared by the kernel tests (this module holds no tests).

The same cases run against the torch references on the CPU, against the Triton kernels under the
interpreter, and against the compiled kernels on a GPU, so every implementation meets the same
edge cases: zeros of both signs, the largest bf16 values, subnormals, NaN, Inf, rounding ties and
arbitrary bit patterns.
"""

from __future__ import annotations

import torch

BF16_MAX = 0x7F7F


def bits(values: list[int]) -> torch.Tensor:
    """bf16 tensor from 16-bit patterns."""
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values],
                        dtype=torch.int16).view(torch.bfloat16)


def edge_latent(width: int, group: int, seed: int = 0) -> torch.Tensor:
    """bf16 [16, width]: one edge case per token (row)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(16, width, generator=gen)
    rows[0] = 0.0
    rows[1] = -0.0
    rows[2, 5] = 448.0  # group 0's amax is exactly the e4m3 maximum
    rows[3, :group] = torch.linspace(-1, 1, group) * 3e38
    rows[3, 0] = bits([BF16_MAX]).float()
    rows[3, 1] = -bits([BF16_MAX]).float()
    rows[5] *= 1e-6  # under V4's 1e-4 amax floor
    rows[6, 3] = float("nan")
    rows[6, group + 7] = float("-nan")
    rows[7, group] = float("inf")
    rows[7, -1] = float("-inf")
    rows[8, :group] = 1e-3
    rows[8, 0] = 1000.0  # the rest of the group lands on e4m3 subnormals
    # rounding ties at scale 1 (amax 448): 1 + 1/16 -> 1, 1 + 3/16 -> 1.25, 248 -> 256,
    # 432 -> 448, 2^-10 -> 0, 3 * 2^-10 -> 2^-8; 2^-9 is the smallest e4m3 subnormal
    rows[9, :8] = torch.tensor([448.0, 1.0625, 1.1875, 248.0, 432.0, 2**-10, 3 * 2**-10, 2**-9])
    rows[12] *= 1e-30
    rows[13] *= 1e-3
    rows[14] *= 1e3
    rows[15] *= 1e30
    out = rows.to(torch.bfloat16)
    subnormal = torch.randint(1, 0x80, (width,), generator=gen) | (
        torch.randint(0, 2, (width,), generator=gen) << 15)
    out[4] = bits(subnormal.tolist())
    out[10:12] = torch.randint(-32768, 32768, (2, width), generator=gen,
                               dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return out


def random_rope(tokens: int, seed: int = 1) -> torch.Tensor:
    """bf16 [tokens, 64] of arbitrary bit patterns: RoPE must be copied bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, (tokens, 64), generator=gen,
                         dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def random_bytes(*shape: int, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def caches(layers: int, blocks: int, block_size: int, width: int, dtype: torch.dtype,
           pad_bytes: int = 0, offset_bytes: int = 0, seed: int = 3) -> list[torch.Tensor]:
    """Per-layer caches [blocks, block_size, width] of random bytes, each its own allocation.

    pad_bytes adds to the block stride (like vLLM's padded DeepSeek-V4 pages); offset_bytes
    shifts each cache off its allocation's alignment.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    block_bytes = block_size * width * itemsize + pad_bytes
    assert block_bytes % itemsize == 0 and offset_bytes % itemsize == 0
    out = []
    for layer in range(layers):
        raw = random_bytes(blocks * block_bytes + offset_bytes, seed=seed + layer)
        base = raw[offset_bytes:].view(dtype)
        out.append(base.as_strided((blocks, block_size, width),
                                   (block_bytes // itemsize, width, 1)))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


NAN_BITS = [0x7F81, 0xFF81, 0x7FC0, 0xFFC0, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD3]  # quiet, signaling, both signs


def special_groups(width: int, group: int, seed: int = 4) -> torch.Tensor:
    """bf16 [4, width]: groups made of NaN (every group of row 0 is all NaN), Inf, zeros,
    subnormals and values whose scale is far below 2^-100 or just around it, one kind a group."""
    gen = torch.Generator().manual_seed(seed)

    def b16(v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.bfloat16).view(torch.int16)

    nan = torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in NAN_BITS], dtype=torch.int16)
    kinds = [
        nan.repeat(group // len(nan) + 1)[:group],  # all NaN
        torch.cat([nan[:3], b16(torch.tensor([float("inf"), -0.0, 1.5])),
                   b16(torch.randn(group - 6, generator=gen))]),
        b16(torch.tensor([float("inf"), float("-inf")] * (group // 2))),  # all +-Inf
        torch.cat([nan[:1], b16(torch.zeros(group - 1))]),  # NaN and zeros
        b16(torch.randn(group, generator=gen) * 448 * 2.0**-112),  # scale far under 2^-100
        b16(torch.randn(group, generator=gen) * 448 * 2.0**-101.5),  # scale around 2^-100
        b16(torch.randn(group, generator=gen) * 448 * 2.0**-92),
        torch.randint(1, 0x80, (group,), generator=gen).to(torch.int16),  # subnormals only
    ]
    rows = []
    for r in range(4):
        groups = [kinds[0]] * (width // group) if r == 0 else [
            kinds[(r * 3 + g) % len(kinds)] for g in range(width // group)]
        rows.append(torch.cat(groups))
    return torch.stack(rows).view(torch.bfloat16)
