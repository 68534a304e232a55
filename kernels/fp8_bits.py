"""Bit-level float conversions for Triton kernels that must run on Ampere.

Triton has no fp8 type on sm80/sm86 (a `.to(tl.float8e4nv)` cast fails to compile there), and
the Triton interpreter rounds bf16 and fp8 casts differently from the GPU. These helpers do the
conversions with integer operations on the bit patterns, so one definition gives the same bits
under the interpreter, on sm80, sm86, sm89 and sm90. The `native_*` variants use the hardware
conversions available from sm89 on; they are bit-identical to the integer ones (the GPU tests
check this) and cheaper, which matters on chips with little integer throughput per byte.

All functions take and return int32 tensors holding bit patterns (or float32 values where named).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_bits_to_f32(bits):
    """bf16 bit patterns (int16 or int32) -> float32 values. Exact, keeps NaN payloads."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> bf16 bits as int32 in [0, 0xFFFF]: round to nearest even, NaN -> 0x7FC0.

    Subnormals are rounded like any other value (bf16 shares float32's exponent range).
    """
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    rounded = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    rounded = rounded | ((bits >> 16) & 0x8000)
    return tl.where(mag > 0x7F800000, 0x7FC0, rounded)


@triton.jit
def f32_to_e4m3_bits(x):
    """float32 -> fp8 e4m3fn bits as int32 in [0, 255], the way CUDA's
    `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` converts:

    round to nearest even; finite values above 448 and +-Inf saturate to +-448; NaN -> 0x7F;
    values below 2^-6 become e4m3 subnormals (multiples of 2^-9); the sign of zero is kept.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 range [2^-6, 448]: re-bias the exponent (127 -> 7) and round 23 mantissa
    # bits to 3, ties to even; a carry out of the mantissa bumps the exponent, as it should.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2^-6: adding 2^14 puts the float32 ulp at 2^-9, the e4m3 subnormal step, so the
    # (round-to-nearest-even) float add does the rounding; the mantissa bits are the code.
    small = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    code = tl.where(mag < 0x3C800000, small, normal)
    code = tl.where(mag >= 0x43E00000, 0x7E, code)
    return tl.where(mag > 0x7F800000, 0x7F, code | sign)


@triton.jit
def e4m3_bits_to_f32(code):
    """fp8 e4m3fn bits (int32 in [0, 255]) -> float32 values. Exact; 0x7F/0xFF -> NaN."""
    sign = (code & 0x80) << 24
    mag = code & 0x7F
    normal = (mag << 20) + (120 << 23)
    small = (mag.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2^-9, exact
    bits = tl.where(mag < 8, small, normal)
    bits = tl.where(mag == 0x7F, 0x7FC00000, bits)
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def native_f32_to_e4m3_bits(x):
    """`f32_to_e4m3_bits` through the sm89+ conversion (cvt.rn.satfinite.e4m3x2.f32)."""
    code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return tl.where(x != x, 0x7F, code)


@triton.jit
def native_e4m3_bits_to_f32(code):
    """`e4m3_bits_to_f32` through the sm89+ conversion."""
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def native_f32_to_bf16_bits(x):
    """`f32_to_bf16_bits` through the hardware conversion (cvt.rn.bf16.f32)."""
    bits = x.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return tl.where(x != x, 0x7FC0, bits)


@triton.jit
def to_e4m3(x, NATIVE: tl.constexpr):
    if NATIVE:
        return native_f32_to_e4m3_bits(x)
    else:
        return f32_to_e4m3_bits(x)


@triton.jit
def from_e4m3(code, NATIVE: tl.constexpr):
    if NATIVE:
        return native_e4m3_bits_to_f32(code)
    else:
        return e4m3_bits_to_f32(code)


@triton.jit
def to_bf16(x, NATIVE: tl.constexpr):
    if NATIVE:
        return native_f32_to_bf16_bits(x)
    else:
        return f32_to_bf16_bits(x)
