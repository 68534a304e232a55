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
def _token_block(num_tokens, BLOCK_T: tl.constexpr):
    """This program's token indices (int64, for byte offsets past 2 GiB) and which are in range."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    return t.to(tl.int64), t < num_tokens


@triton.jit
def _copy_rows(src, dst, t_ok, N: tl.constexpr):
    """Copy N elements per token: src and dst are [T, 1] pointers to each token's first one."""
    r = tl.arange(0, N)[None, :]
    tl.store(dst + r, tl.load(src + r, mask=t_ok[:, None]), mask=t_ok[:, None])


@triton.jit
def _v32_scale_bits(amax_bits):
    """A V3.2 group's scale from its amax bits: amax / 448, floored at FLT_MIN; (bits, value)."""
    scale = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), 448.0)
    scale_bits = scale.to(tl.int32, bitcast=True)
    scale_bits = tl.where(scale_bits < 0x00800000, 0x00800000, scale_bits)  # max(., FLT_MIN)
    return scale_bits, scale_bits.to(tl.float32, bitcast=True)


@triton.jit
def _v4_scale(amax_bits):
    """(scale byte, 2^-e) from a V4 group's amax bits: amax floored at 1e-4 (float32 bits
    0x38D1B717), e = ceil(log2(amax / 448)) exactly: amax = m * 2^E, and amax <= 1.75 * 2^(E' + 8)
    holds for E' = E - 8 exactly when m <= 1.75 (mantissa bits <= 0x600000)."""
    amax = tl.maximum(amax_bits, 0x38D1B717)
    exp = (amax >> 23) - 127 - 8 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    is_inf = amax == 0x7F800000
    scale_byte = tl.where(is_inf, 255, exp + 127)
    inv_scale = tl.where(is_inf, 0, (127 - exp) << 23).to(tl.float32, bitcast=True)
    return scale_byte, inv_scale


@triton.jit
def _store_v4_scale_row(pages_u8_ptr, scales, g, scale_byte, t_ok):
    """A token's 8-byte scale row: 7 scale bytes and a zero pad byte."""
    scale_byte = tl.where((g < 7)[None, :], scale_byte, 0)
    tl.store(pages_u8_ptr + scales[:, None] + g[None, :], scale_byte.to(tl.uint8), mask=t_ok[:, None])


@triton.jit
def encode_v32_kernel(
    lat_ptr, rope_ptr, rows_u8_ptr, rows_i32_ptr, rows_i16_ptr,
    num_tokens, lat_stride, rope_stride,
    BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    """[T,512] + [T,64] bf16 -> [T,656] rows: 512 e4m3, 4 fp32 scales, 64 bf16."""
    t, t_ok = _token_block(num_tokens, BLOCK_T)
    g = tl.arange(0, 4)
    col = g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    m3 = t_ok[:, None, None]
    xb = tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0)
    scale_bits, scale = _v32_scale_bits(tl.max(_nan_free_abs_bits(xb), axis=2) << 16)
    q = to_e4m3(tl.math.div_rn(bf16_bits_to_f32(xb), scale[:, :, None]), NATIVE)
    tl.store(rows_u8_ptr + t[:, None, None] * 656 + col, q.to(tl.uint8), mask=m3)
    tl.store(rows_i32_ptr + t[:, None] * 164 + 128 + g[None, :], scale_bits, mask=t_ok[:, None])
    _copy_rows(rope_ptr + t[:, None] * rope_stride, rows_i16_ptr + t[:, None] * 328 + 264, t_ok, 64)


@triton.jit
def decode_v32_kernel(
    rows_u8_ptr, rows_i32_ptr, rows_i16_ptr, lat_ptr, rope_ptr,
    num_tokens,
    BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    """[T,656] rows -> [T,512] + [T,64] bf16 (contiguous outputs)."""
    t, t_ok = _token_block(num_tokens, BLOCK_T)
    g = tl.arange(0, 4)
    col = g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    m3 = t_ok[:, None, None]
    q = tl.load(rows_u8_ptr + t[:, None, None] * 656 + col, mask=m3, other=0).to(tl.int32)
    scale_bits = tl.load(rows_i32_ptr + t[:, None] * 164 + 128 + g[None, :], mask=t_ok[:, None])
    scale = scale_bits.to(tl.float32, bitcast=True)
    x = to_bf16(from_e4m3(q, NATIVE) * scale[:, :, None], NATIVE)
    tl.store(lat_ptr + t[:, None, None] * 512 + col, x.to(tl.int16), mask=m3)
    _copy_rows(rows_i16_ptr + t[:, None] * 328 + 264, rope_ptr + t[:, None] * 64, t_ok, 64)


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
    t, t_ok = _token_block(num_tokens, BLOCK_T)
    g = tl.arange(0, 8)  # 7 groups of 64 and the pad byte; power-of-two shapes for Triton
    col = g[None, :, None] * 64 + tl.arange(0, 64)[None, None, :]
    m3 = t_ok[:, None, None] & (g < 7)[None, :, None]
    xb = tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0)
    # a max of non-negative float bits as ints is the float max
    scale_byte, inv_scale = _v4_scale(tl.max(_nan_free_abs_bits(xb), axis=2) << 16)
    q = to_e4m3(bf16_bits_to_f32(xb) * inv_scale[:, :, None], NATIVE)
    data, scales = _v4_offsets(t, page_stride, BLOCK_SIZE)
    tl.store(pages_u8_ptr + data[:, None, None] + col, q.to(tl.uint8), mask=m3)
    _store_v4_scale_row(pages_u8_ptr, scales, g, scale_byte, t_ok)
    _copy_rows(rope_ptr + t[:, None] * rope_stride, pages_i16_ptr + (data[:, None] + 448) // 2, t_ok, 64)


@triton.jit
def decode_v4_kernel(
    pages_u8_ptr, pages_i16_ptr, lat_ptr, rope_ptr,
    num_tokens, page_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    """DeepSeek-V4 pages -> [T,448] + [T,64] bf16 (contiguous outputs)."""
    t, t_ok = _token_block(num_tokens, BLOCK_T)
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
    _copy_rows(pages_i16_ptr + (data[:, None] + 448) // 2, rope_ptr + t[:, None] * 64, t_ok, 64)


# ---------------------------------------------------------------- native (sm89+) encoders
#
# The kernels above run the same arithmetic on every chip; on an H200 their native encodes are
# limited by instruction issue, not memory (about 20 instructions a value, an IEEE division among
# them). The ones below give the same bits with fewer instructions, for sm89+ only:
# - the group amax is a float max of |x| (max.f32 ignores NaN, as the integer version does);
# - V3.2's quotient x / scale is x * r corrected by two FMAs (r = 1/scale, once per group), which
#   is the IEEE quotient for every pair of bf16 x and scale (checked exhaustively: kernels/README.md);
#   for scales under 2^-100 the remainder is formed at 2^64 times its size so it cannot underflow;
# - `*_words` kernels read four bf16 values as one int64 and write four e4m3 codes as one int32,
#   converted and packed by two cvt.rn.satfinite.e4m3x2.f32 in inline PTX.

_TINY_SCALE = tl.constexpr(7.888609052210118e-31)  # 2^-100
_UP = tl.constexpr(18446744073709551616.0)  # 2^64
_DOWN = tl.constexpr(5.421010862427522e-20)  # 2^-64


@triton.jit
def _nan_free_amax(amax):
    """A group's float amax as float32 bits, 0 when every value was NaN (then max.f32 gives NaN)."""
    bits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(bits > 0x7F800000, 0, bits)


@triton.jit
def _v32_scale(amax_bits):
    """(scale bits, then the per-group factors of `_div`: 1/scale, scale * up, -1/(scale * up),
    -up), where up is 2^64 for scales under 2^-100, else 1."""
    scale_bits, scale = _v32_scale_bits(amax_bits)
    recip = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)  # 0 for an Inf scale
    tiny = scale < _TINY_SCALE
    neg_up = tl.where(tiny, -_UP, -1.0)
    # An Inf scale (an Inf in the group) must give x * 0: make the remainder step add x * 0.
    scale_up = tl.where(scale_bits == 0x7F800000, 0.0, scale * -neg_up)
    neg_recip_down = recip * tl.where(tiny, -_DOWN, -1.0)
    return scale_bits, recip, scale_up, neg_recip_down, neg_up


@triton.jit
def _div(x, recip, scale_up, neg_recip_down, neg_up):
    """round(x / scale) in float32, exactly as an IEEE division (see the section comment).

    q = x * (1/scale), then q + (x - q * scale) / scale with the remainder exact in one FMA. The
    remainder is formed as q * scale - x (and its sign undone in the last FMA) so that an exact zero
    comes out +0 and x = -0 keeps its sign: with x - q * scale, -0 would come out +0.
    """
    q = x * recip
    rem = tl.fma(q, scale_up, x * neg_up)
    return tl.fma(rem, neg_recip_down, q)


@triton.jit
def _e4m3x4(q0, q1, q2, q3):
    """Four float32 tensors -> int32 words of four e4m3 codes (q0's in the low byte), rounded like
    `fp8_bits.f32_to_e4m3_bits`; a NaN code (0x7F or 0xFF) becomes 0x7F."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        .reg .b32 m;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        and.b32 m, $0, 0x7F7F7F7F;
        add.u32 m, m, 0x01010101;
        and.b32 m, m, 0x80808080;
        not.b32 m, m;
        and.b32 $0, $0, m;
        }""",
        "=r,r,r,r,r",
        [q0.to(tl.int32, bitcast=True), q1.to(tl.int32, bitcast=True),
         q2.to(tl.int32, bitcast=True), q3.to(tl.int32, bitcast=True)],
        dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16x4(w):
    """int64 words holding four bf16 values -> the four values as float32, in memory order."""
    lo = w.to(tl.int32)
    hi = (w >> 32).to(tl.int32)
    return ((lo << 16).to(tl.float32, bitcast=True), (lo & -65536).to(tl.float32, bitcast=True),
            (hi << 16).to(tl.float32, bitcast=True), (hi & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _abs_max4(x0, x1, x2, x3):
    return tl.max(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                             tl.maximum(tl.abs(x2), tl.abs(x3))), axis=2)


@triton.jit
def encode_v32_float_kernel(
    lat_ptr, rope_ptr, rows_u8_ptr, rows_i32_ptr, rows_i16_ptr,
    num_tokens, lat_stride, rope_stride,
    BLOCK_T: tl.constexpr, NAN_FIX: tl.constexpr,
):
    """`encode_v32_kernel` (sm89+): float amax, FMA-corrected quotient, Triton's fp8 conversion."""
    t, t_ok = _token_block(num_tokens, BLOCK_T)
    g = tl.arange(0, 4)
    col = g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    m3 = t_ok[:, None, None]
    x = bf16_bits_to_f32(tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0))
    amax_bits = _nan_free_amax(tl.max(tl.abs(x), axis=2))
    scale_bits, recip, scale_up, neg_recip_down, neg_up = _v32_scale(amax_bits)
    q = _div(x, recip[:, :, None], scale_up[:, :, None], neg_recip_down[:, :, None],
             neg_up[:, :, None])
    code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if NAN_FIX:
        code = tl.where(q != q, 0x7F, code)
    tl.store(rows_u8_ptr + t[:, None, None] * 656 + col, code, mask=m3)
    tl.store(rows_i32_ptr + t[:, None] * 164 + 128 + g[None, :], scale_bits, mask=t_ok[:, None])
    _copy_rows(rope_ptr + t[:, None] * rope_stride, rows_i16_ptr + t[:, None] * 328 + 264, t_ok, 64)


@triton.jit
def encode_v32_words_kernel(
    lat_ptr, rope_ptr, rows_ptr,
    num_tokens, lat_stride, rope_stride,
    BLOCK_T: tl.constexpr,
):
    """`encode_v32_kernel` (sm89+) on words: latent as int64 (stride in int64s), rope and rows as
    int32 (stride in int32s, rows of 164 words: 128 of codes, 4 scales, 32 of rope)."""
    t, t_ok = _token_block(num_tokens, BLOCK_T)
    g = tl.arange(0, 4)
    col = g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    m3 = t_ok[:, None, None]
    x0, x1, x2, x3 = _bf16x4(tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0))
    amax_bits = _nan_free_amax(_abs_max4(x0, x1, x2, x3))
    scale_bits, recip, scale_up, neg_recip_down, neg_up = _v32_scale(amax_bits)
    rc, su = recip[:, :, None], scale_up[:, :, None]
    nrd, nu = neg_recip_down[:, :, None], neg_up[:, :, None]
    words = _e4m3x4(_div(x0, rc, su, nrd, nu), _div(x1, rc, su, nrd, nu),
                    _div(x2, rc, su, nrd, nu), _div(x3, rc, su, nrd, nu))
    tl.store(rows_ptr + t[:, None, None] * 164 + col, words, mask=m3)
    tl.store(rows_ptr + t[:, None] * 164 + 128 + g[None, :], scale_bits, mask=t_ok[:, None])
    _copy_rows(rope_ptr + t[:, None] * rope_stride, rows_ptr + t[:, None] * 164 + 132, t_ok, 32)


@triton.jit
def encode_v4_float_kernel(
    lat_ptr, rope_ptr, pages_u8_ptr, pages_i16_ptr,
    num_tokens, lat_stride, rope_stride, page_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, NAN_FIX: tl.constexpr,
):
    """`encode_v4_kernel` (sm89+) with a float amax and Triton's fp8 conversion."""
    t, t_ok = _token_block(num_tokens, BLOCK_T)
    g = tl.arange(0, 8)
    col = g[None, :, None] * 64 + tl.arange(0, 64)[None, None, :]
    m3 = t_ok[:, None, None] & (g < 7)[None, :, None]
    x = bf16_bits_to_f32(tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0))
    scale_byte, inv_scale = _v4_scale(_nan_free_amax(tl.max(tl.abs(x), axis=2)))
    q = x * inv_scale[:, :, None]
    code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if NAN_FIX:
        code = tl.where(q != q, 0x7F, code)
    data, scales = _v4_offsets(t, page_stride, BLOCK_SIZE)
    tl.store(pages_u8_ptr + data[:, None, None] + col, code, mask=m3)
    _store_v4_scale_row(pages_u8_ptr, scales, g, scale_byte, t_ok)
    _copy_rows(rope_ptr + t[:, None] * rope_stride, pages_i16_ptr + (data[:, None] + 448) // 2, t_ok, 64)


@triton.jit
def encode_v4_words_kernel(
    lat_ptr, rope_ptr, pages_u8_ptr, pages_i32_ptr,
    num_tokens, lat_stride, rope_stride, page_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """`encode_v4_kernel` (sm89+) on words: latent as int64 (stride in int64s), rope as int32
    (stride in int32s), codes and rope written as int32 (page_stride in bytes, a multiple of 4)."""
    t, t_ok = _token_block(num_tokens, BLOCK_T)
    g = tl.arange(0, 8)  # 7 groups of 16 words and a masked eighth
    col = g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    m3 = t_ok[:, None, None] & (g < 7)[None, :, None]
    x0, x1, x2, x3 = _bf16x4(tl.load(lat_ptr + t[:, None, None] * lat_stride + col, mask=m3, other=0))
    scale_byte, inv_scale = _v4_scale(_nan_free_amax(_abs_max4(x0, x1, x2, x3)))
    inv_scale = inv_scale[:, :, None]
    words = _e4m3x4(x0 * inv_scale, x1 * inv_scale, x2 * inv_scale, x3 * inv_scale)
    data, scales = _v4_offsets(t, page_stride, BLOCK_SIZE)
    data = data // 4
    tl.store(pages_i32_ptr + data[:, None, None] + col, words, mask=m3)
    _store_v4_scale_row(pages_u8_ptr, scales, g, scale_byte, t_ok)
    _copy_rows(rope_ptr + t[:, None] * rope_stride, pages_i32_ptr + data[:, None] + 112, t_ok, 32)
