"""Triton kernels for the fp8_ds_mla codecs; `pdserve.kernels.fp8_ds_mla` launches them.

Every kernel takes a `NATIVE` flag: False does every fp8/bf16 conversion with integer bit
operations (runs on sm80/sm86 and under the interpreter), True uses the sm89+ conversion
instructions. Both give the same bits. Tensors arrive as integer views (bf16 as int16, fp32
scales as int32) so that no float cast of the interpreter or the compiler touches the data.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.kernels.fp8_bits import bf16_bits_to_f32, from_e4m3, to_bf16, to_e4m3


@triton.jit
def _nan_free_abs_bits(bf16_bits):
    """|x| as bf16 bits with NaN mapped to 0, so an integer max is the amax that ignores NaN
    (CUDA's fmaxf reduction in vLLM does the same)."""
    mag = bf16_bits.to(tl.int32) & 0x7FFF
    return tl.where(mag > 0x7F80, 0, mag)


@triton.jit
def encode_v32_kernel(
    lat_ptr, rope_ptr, rows_u8_ptr, rows_i32_ptr, rows_i16_ptr,
    num_tokens, lat_stride, rope_stride,
    BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    """[T,512] + [T,64] bf16 -> [T,656] rows: 512 e4m3, 4 fp32 scales, 64 bf16."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    t = t.to(tl.int64)
    g = tl.arange(0, 4)
    col = g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    m3 = t_ok[:, None, None]
    xb = tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0)
    amax_bits = tl.max(_nan_free_abs_bits(xb), axis=2) << 16
    scale = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), 448.0)
    scale_bits = scale.to(tl.int32, bitcast=True)
    scale_bits = tl.where(scale_bits < 0x00800000, 0x00800000, scale_bits)  # max(., FLT_MIN)
    scale = scale_bits.to(tl.float32, bitcast=True)
    q = to_e4m3(tl.math.div_rn(bf16_bits_to_f32(xb), scale[:, :, None]), NATIVE)
    tl.store(rows_u8_ptr + t[:, None, None] * 656 + col, q.to(tl.uint8), mask=m3)
    tl.store(rows_i32_ptr + t[:, None] * 164 + 128 + g[None, :], scale_bits, mask=t_ok[:, None])
    r = tl.arange(0, 64)
    rb = tl.load(rope_ptr + t[:, None] * rope_stride + r[None, :], mask=t_ok[:, None])
    tl.store(rows_i16_ptr + t[:, None] * 328 + 264 + r[None, :], rb, mask=t_ok[:, None])


@triton.jit
def decode_v32_kernel(
    rows_u8_ptr, rows_i32_ptr, rows_i16_ptr, lat_ptr, rope_ptr,
    num_tokens,
    BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    """[T,656] rows -> [T,512] + [T,64] bf16 (contiguous outputs)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    t = t.to(tl.int64)
    g = tl.arange(0, 4)
    col = g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    m3 = t_ok[:, None, None]
    q = tl.load(rows_u8_ptr + t[:, None, None] * 656 + col, mask=m3, other=0).to(tl.int32)
    scale_bits = tl.load(rows_i32_ptr + t[:, None] * 164 + 128 + g[None, :], mask=t_ok[:, None])
    scale = scale_bits.to(tl.float32, bitcast=True)
    x = to_bf16(from_e4m3(q, NATIVE) * scale[:, :, None], NATIVE)
    tl.store(lat_ptr + t[:, None, None] * 512 + col, x.to(tl.int16), mask=m3)
    r = tl.arange(0, 64)
    rb = tl.load(rows_i16_ptr + t[:, None] * 328 + 264 + r[None, :], mask=t_ok[:, None])
    tl.store(rope_ptr + t[:, None] * 64 + r[None, :], rb, mask=t_ok[:, None])


@triton.jit
def _v4_offsets(t, page_stride, BLOCK_SIZE: tl.constexpr):
    """Byte offsets of token t's data row and scale row inside the page array."""
    page = t // BLOCK_SIZE
    slot = t % BLOCK_SIZE
    data = page * page_stride + slot * 576
    scales = page * page_stride + BLOCK_SIZE * 576 + slot * 8
    return data, scales


@triton.jit
def encode_v4_kernel(
    lat_ptr, rope_ptr, pages_u8_ptr, pages_i16_ptr,
    num_tokens, lat_stride, rope_stride, page_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    """[T,448] + [T,64] bf16 -> DeepSeek-V4 pages (576-byte data rows, then 8-byte scale rows)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    t = t.to(tl.int64)
    g = tl.arange(0, 8)  # 7 groups of 64 and the pad byte; power-of-two shapes for Triton
    col = g[None, :, None] * 64 + tl.arange(0, 64)[None, None, :]
    m3 = t_ok[:, None, None] & (g < 7)[None, :, None]
    xb = tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0)
    # amax floored at 1e-4 (float32 bits 0x38D1B717); a max of non-negative float bits as ints.
    amax = tl.maximum(tl.max(_nan_free_abs_bits(xb), axis=2) << 16, 0x38D1B717)
    # e = ceil(log2(amax / 448)) exactly: amax = m * 2^E, and amax <= 1.75 * 2^(E' + 8) holds
    # for E' = E - 8 exactly when m <= 1.75 (mantissa bits <= 0x600000).
    exp = (amax >> 23) - 127 - 8 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    is_inf = amax == 0x7F800000
    scale_byte = tl.where(is_inf, 255, exp + 127)
    inv_scale = tl.where(is_inf, 0, (127 - exp) << 23).to(tl.float32, bitcast=True)  # 2^-e
    q = to_e4m3(bf16_bits_to_f32(xb) * inv_scale[:, :, None], NATIVE)
    data, scales = _v4_offsets(t, page_stride, BLOCK_SIZE)
    tl.store(pages_u8_ptr + data[:, None, None] + col, q.to(tl.uint8), mask=m3)
    scale_byte = tl.where((g < 7)[None, :], scale_byte, 0)
    tl.store(pages_u8_ptr + scales[:, None] + g[None, :], scale_byte.to(tl.uint8), mask=t_ok[:, None])
    r = tl.arange(0, 64)
    rb = tl.load(rope_ptr + t[:, None] * rope_stride + r[None, :], mask=t_ok[:, None])
    tl.store(pages_i16_ptr + (data[:, None] + 448) // 2 + r[None, :], rb, mask=t_ok[:, None])


@triton.jit
def decode_v4_kernel(
    pages_u8_ptr, pages_i16_ptr, lat_ptr, rope_ptr,
    num_tokens, page_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    """DeepSeek-V4 pages -> [T,448] + [T,64] bf16 (contiguous outputs)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    t = t.to(tl.int64)
    g = tl.arange(0, 8)
    col = g[None, :, None] * 64 + tl.arange(0, 64)[None, None, :]
    g_ok = (g < 7)[None, :]
    m3 = t_ok[:, None, None] & g_ok[:, :, None]
    data, scales = _v4_offsets(t, page_stride, BLOCK_SIZE)
    q = tl.load(pages_u8_ptr + data[:, None, None] + col, mask=m3, other=0).to(tl.int32)
    sb = tl.load(pages_u8_ptr + scales[:, None] + g[None, :], mask=t_ok[:, None] & g_ok, other=127)
    sb = sb.to(tl.int32)
    scale = tl.where(sb == 0, 1 << 22, sb << 23).to(tl.float32, bitcast=True)  # 2^(sb - 127)
    x = to_bf16(from_e4m3(q, NATIVE) * scale[:, :, None], NATIVE)
    tl.store(lat_ptr + t[:, None, None] * 448 + col, x.to(tl.int16), mask=m3)
    r = tl.arange(0, 64)
    rb = tl.load(pages_i16_ptr + (data[:, None] + 448) // 2 + r[None, :], mask=t_ok[:, None])
    tl.store(rope_ptr + t[:, None] * 64 + r[None, :], rb, mask=t_ok[:, None])
