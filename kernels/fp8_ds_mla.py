"""Codecs for DeepSeek's `fp8_ds_mla` KV rows: Triton kernels with pure-torch references.

The connector stores KV in whatever layout the engine's cache uses and moves fp8_ds_mla pages
byte for byte, so it calls none of this. These codecs are a verified library for engines and
tools: they turn bf16 latents into those bytes and back, e.g. to re-quantize, to read what a
cache holds or to check a transfer, with the same bits as vLLM's own writers and decoders.

**V3.2 rows (656 bytes a token)**, as documented in the installed vLLM,
`vllm/v1/attention/backends/mla/flashmla_sparse.py` (module docstring "FlashMLA Sparse uses an fp8
cache with the following format"): bytes [0, 512) are 512 fp8 e4m3 NoPE values, [512, 528) four
float32 scales (one per 128 values), [528, 656) 64 bf16 RoPE values. The scale is
max(amax / 448, FLT_MIN) and values are stored as e4m3(x / scale), saturating, the rule of vLLM's
CUDA writer `concat_and_cache_ds_mla` (csrc/cache_kernels.cu, not shipped in the wheel; the
fused writer in `vllm/models/deepseek_v32/common/kernels.py::_fused_norm_rope_kernel` cites it,
though that one rounds the scale up to a power of two; both decode the same way).

**V4 pages (584 bytes a token)**, from `vllm/models/deepseek_v4/common/ops/cache_utils.py`,
`quantize_and_insert_k_kernel` (encode) and `DequantizeAndGatherKCacheKernel` (decode and the page
stride): a page of `block_size` tokens holds all token rows first (448 e4m3 NoPE + 64 bf16 RoPE =
576 bytes each), then all scale rows (7 UE8M0 bytes, one per 64 values, + 1 zero pad byte), and
is padded to a multiple of 576 bytes. The scale is 2^ceil(log2(max(amax, 1e-4) / 448)), stored as
the byte e + 127. A zero scale byte decodes as 2^-127, as in
`vllm/v1/attention/ops/rocm_aiter_mla_sparse.py::_decode_e8m0_scales_triton`.

**Edge cases, defined for both codecs and both implementations** (the tests pin each one):
- zeros: +0 and -0 encode to 0x00 and 0x80 and decode back with their sign; an all-zero group gets
  the smallest scale (FLT_MIN for V3.2, 2^-22 for V4).
- the largest values: V3.2 maps a group's amax to 448 and decodes bf16's largest finite value
  to itself. V4 rounds the scale up to a power of two, so the amax maps into (224, 448], and e4m3
  then rounds anything from 248 * 2^120 (3.30e38) up to 256 * 2^120, which decodes to +-Inf:
  vLLM's V4 decoder does the same with these bytes, and the encoder writes what vLLM writes.
- subnormals (bf16 inputs, e4m3 codes and float32 products) are rounded exactly, never flushed.
- NaN is ignored by the group's amax (like vLLM's fmaxf reduction) and is stored as 0x7F; it
  decodes to the bf16 NaN 0x7FC0. The other values of its group are unaffected.
- +-Inf makes its group's scale Inf (V3.2: float32 Inf; V4: byte 255), so the whole group decodes
  to NaN: that is what vLLM's arithmetic does, and it flags the damage instead of hiding it.
- RoPE values are copied bit for bit, NaN payloads included.
"""

from __future__ import annotations

import os

import torch

FLT_MIN = torch.finfo(torch.float32).tiny
E4M3_MAX = 448.0

V32_ROW_BYTES = 656
V32_NOPE, V32_GROUP = 512, 128
V4_ROW_BYTES = 584  # 576 data bytes + 8 scale bytes a token
V4_DATA_BYTES = 576
V4_SCALE_BYTES = 8
V4_NOPE, V4_GROUP = 448, 64
V4_PAGE_ALIGN = 576
V4_MIN_AMAX = 1e-4
ROPE = 64

# Tokens and warps per program of the portable kernels and the decoders: the fastest for all four
# codecs of the configurations measured on an H200 (`pdserve bench kernels --codec-configs ...`,
# kernels/README.md).
BLOCK_T, NUM_WARPS = 4, 2
# The native (sm89+) encoders: kernel variant, tokens and warps per program. Variants (all give the
# same bits; the GPU tests and `pdserve bench kernels --exhaustive` check each): "legacy" is the
# portable kernel with hardware conversions; "float" and "float-nofix" use a float amax and an
# FMA-corrected quotient ("nofix" leaves NaN to the conversion, which gives 0x7F on the H200);
# "words" does that on int64/int32 words with packed conversions (falls back to "float" when the
# tensors are not aligned for it). Defaults: the fastest of the H200 sweep in kernels/README.md
# (words at 1.01-1.02 of copy bandwidth there, against 0.72 and 0.86 for legacy).
ENCODE_VARIANTS = ("legacy", "float", "float-nofix", "words")
NATIVE_ENCODE = {"v32": ("words", 4, 2), "v4": ("words", 2, 1)}


def v4_page_bytes(block_size: int) -> int:
    """Bytes of one V4 page: rows and scales, padded to 576 (vLLM's FlashMLA page stride)."""
    return -(-block_size * V4_ROW_BYTES // V4_PAGE_ALIGN) * V4_PAGE_ALIGN


# ---------------------------------------------------------------- shared torch helpers


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3 bits: nearest even, saturating, NaN -> 0x7F (torch's cast rounds the same)."""
    q = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(v.isnan(), torch.full_like(q, 0x7F), q)


def _bf16(v: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16, nearest even, every NaN as 0x7FC0."""
    bits = v.to(torch.bfloat16).view(torch.int16)
    return bits.masked_fill(v.isnan(), 0x7FC0).view(torch.bfloat16)


def _nan_free_amax(x: torch.Tensor) -> torch.Tensor:
    mag = x.abs()
    return torch.where(mag.isnan(), torch.zeros_like(mag), mag).amax(dim=-1, keepdim=True)


def _check_inputs(latent: torch.Tensor, rope: torch.Tensor, nope: int) -> int:
    tokens = latent.shape[0]
    if latent.dtype != torch.bfloat16 or rope.dtype != torch.bfloat16:
        raise TypeError("latent and rope must be bfloat16")
    if latent.shape != (tokens, nope) or rope.shape != (tokens, ROPE):
        raise ValueError(f"expected latent [T,{nope}] and rope [T,{ROPE}], got "
                         f"{tuple(latent.shape)} and {tuple(rope.shape)}")
    if latent.stride(1) != 1 or rope.stride(1) != 1:
        raise ValueError("latent and rope need contiguous rows")
    return tokens


def _check_rows(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype != torch.uint8 or rows.shape[-1] != V32_ROW_BYTES or not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous uint8 [..., {V32_ROW_BYTES}]")
    return rows.reshape(-1, V32_ROW_BYTES)


def _pages(pages: torch.Tensor, block_size: int | None) -> tuple[int, int]:
    """(block_size, page stride in bytes) of a V4 page array.

    Takes [num_pages, page_bytes] with an explicit block_size, or vLLM's per-layer view
    [num_blocks, block_size, 584] whose block stride is the padded page.
    """
    if pages.dtype != torch.uint8:
        raise TypeError("V4 pages must be uint8")
    if pages.dim() == 3:
        if pages.shape[2] != V4_ROW_BYTES or pages.stride(2) != 1 or pages.stride(1) != V4_ROW_BYTES:
            raise ValueError(f"3-D V4 pages must be [num_blocks, block_size, {V4_ROW_BYTES}] rows")
        if block_size not in (None, pages.shape[1]):
            raise ValueError(f"block_size {block_size} does not match pages {tuple(pages.shape)}")
        block_size = pages.shape[1]
    elif pages.dim() == 2:
        if block_size is None:
            raise ValueError("2-D V4 pages need an explicit block_size")
        if pages.stride(1) != 1 or pages.shape[1] < block_size * V4_ROW_BYTES:
            raise ValueError(f"2-D V4 pages need rows of at least {block_size * V4_ROW_BYTES} bytes")
    else:
        raise ValueError("V4 pages must be 2-D or 3-D")
    if pages.stride(0) < block_size * V4_ROW_BYTES or pages.stride(0) % 2:
        raise ValueError(f"V4 page stride {pages.stride(0)} too small or odd")
    return block_size, pages.stride(0)


def _page_regions(pages: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views [P, block_size, 576] (token rows) and [P, block_size, 8] (scale rows) of the pages."""
    flat = torch.as_strided(pages, (pages.shape[0], block_size * V4_ROW_BYTES), (pages.stride(0), 1),
                            pages.storage_offset())
    data = flat[:, : block_size * V4_DATA_BYTES].unflatten(1, (block_size, V4_DATA_BYTES))
    scales = flat[:, block_size * V4_DATA_BYTES:].unflatten(1, (block_size, V4_SCALE_BYTES))
    return data, scales


# ---------------------------------------------------------------- torch references


def encode_v32_torch(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    tokens = _check_inputs(latent, rope, V32_NOPE)
    x = latent.float().reshape(tokens, V32_NOPE // V32_GROUP, V32_GROUP)
    # Divide by a tensor, not a Python number: on CUDA torch turns division by a host scalar into
    # a multiplication by its reciprocal, which is not the IEEE quotient the format defines.
    scale = (_nan_free_amax(x) / x.new_full((), E4M3_MAX)).clamp_min(FLT_MIN)
    rows = torch.empty(tokens, V32_ROW_BYTES, dtype=torch.uint8, device=latent.device)
    rows[:, :V32_NOPE] = _e4m3(x / scale).reshape(tokens, V32_NOPE)
    rows[:, V32_NOPE:V32_NOPE + 16] = scale.reshape(tokens, 4).view(torch.uint8)
    rows[:, V32_NOPE + 16:] = rope.contiguous().view(torch.uint8)
    return rows


def decode_v32_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _check_rows(rows)
    tokens = rows.shape[0]
    q = rows[:, :V32_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, V32_NOPE:V32_NOPE + 16].contiguous().view(torch.float32)
    x = q.reshape(tokens, 4, V32_GROUP) * scale.unsqueeze(-1)
    rope = rows[:, V32_NOPE + 16:].contiguous().view(torch.bfloat16)
    return _bf16(x).reshape(tokens, V32_NOPE), rope


def encode_v4_torch(latent: torch.Tensor, rope: torch.Tensor, block_size: int = 64,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    tokens = _check_inputs(latent, rope, V4_NOPE)
    pages = _v4_out(out, tokens, block_size, latent.device)
    block_size, _ = _pages(pages, block_size)
    x = latent.float().reshape(tokens, V4_NOPE // V4_GROUP, V4_GROUP)
    exp = torch.ceil(torch.log2(_nan_free_amax(x).clamp_min(V4_MIN_AMAX) / E4M3_MAX))
    q = _e4m3(x / torch.exp2(exp))
    row = torch.cat([q.reshape(tokens, V4_NOPE), rope.contiguous().view(torch.uint8)], dim=1)
    scale_row = torch.zeros(tokens, V4_SCALE_BYTES, dtype=torch.uint8, device=latent.device)
    scale_row[:, :7] = (exp.reshape(tokens, 7) + 127).clamp(0, 255).to(torch.uint8)
    data, scales = _page_regions(pages, block_size)
    t = torch.arange(tokens, device=latent.device)
    data[t // block_size, t % block_size] = row
    scales[t // block_size, t % block_size] = scale_row
    return pages


def decode_v4_torch(pages: torch.Tensor, num_tokens: int | None = None,
                    block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    block_size, _ = _pages(pages, block_size)
    tokens = _v4_tokens(pages, block_size, num_tokens)
    data, scales = _page_regions(pages, block_size)
    t = torch.arange(tokens, device=pages.device)
    row, scale_row = data[t // block_size, t % block_size], scales[t // block_size, t % block_size]
    q = row[:, :V4_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = torch.exp2(scale_row[:, :7].float() - 127)
    x = q.reshape(tokens, 7, V4_GROUP) * scale.unsqueeze(-1)
    rope = row[:, V4_NOPE:].contiguous().view(torch.bfloat16)
    return _bf16(x).reshape(tokens, V4_NOPE), rope


def _v4_out(out: torch.Tensor | None, tokens: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Fresh zeroed pages for `tokens`, or the caller's pages after a size check."""
    num_pages = -(-tokens // block_size)
    if out is None:
        return torch.zeros(num_pages, v4_page_bytes(block_size), dtype=torch.uint8, device=device)
    if out.shape[0] < num_pages:
        raise ValueError(f"{tokens} tokens need {num_pages} pages, out has {out.shape[0]}")
    return out


def _v4_tokens(pages: torch.Tensor, block_size: int, num_tokens: int | None) -> int:
    capacity = pages.shape[0] * block_size
    if num_tokens is None:
        return capacity
    if not 0 <= num_tokens <= capacity:
        raise ValueError(f"num_tokens {num_tokens} outside [0, {capacity}]")
    return num_tokens


# ---------------------------------------------------------------- Triton launchers


def _use_native(native: bool | None, device: torch.device) -> bool:
    """Hardware fp8 conversions need sm89+ and a compiled (not interpreted) kernel."""
    capable = (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
               and torch.cuda.get_device_capability(device) >= (8, 9))
    if native and not capable:
        raise ValueError("native fp8 conversions need a CUDA device of compute capability 8.9+")
    return capable if native is None else native


def _launch(tokens: int, block_t: int | None, num_warps: int | None) -> dict:
    """Grid and launch options: the caller's, or the measured defaults."""
    block_t = block_t or BLOCK_T
    return {"grid": (-(-tokens // block_t),), "BLOCK_T": block_t, "num_warps": num_warps or NUM_WARPS}


def _encode_launch(codec: str, native: bool, variant: str | None, block_t: int | None,
                   num_warps: int | None) -> tuple[str, int, int]:
    """(variant, tokens, warps) of an encoder launch: the caller's, or the measured defaults."""
    if not native:
        if variant not in (None, "legacy"):
            raise ValueError(f"encoder variant {variant!r} needs the native (sm89+) conversions")
        return "legacy", block_t or BLOCK_T, num_warps or NUM_WARPS
    default, bt, warps = NATIVE_ENCODE[codec]
    variant = variant or default
    if variant not in ENCODE_VARIANTS:
        raise ValueError(f"unknown encoder variant {variant!r}; one of {ENCODE_VARIANTS}")
    if variant != default:
        bt, warps = BLOCK_T, NUM_WARPS
    return variant, block_t or bt, num_warps or warps


def _words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`t` viewed as `dtype` words, or None where its strides or offset do not allow it."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def encode_v32_triton(latent: torch.Tensor, rope: torch.Tensor, out: torch.Tensor | None = None, *,
                      native: bool | None = None, block_t: int | None = None,
                      num_warps: int | None = None, variant: str | None = None) -> torch.Tensor:
    from pdserve.kernels import fp8_ds_mla_triton as k

    tokens = _check_inputs(latent, rope, V32_NOPE)
    if out is None:
        out = torch.empty(tokens, V32_ROW_BYTES, dtype=torch.uint8, device=latent.device)
    rows = _check_rows(out)
    if not tokens:
        return out
    is_native = _use_native(native, latent.device)
    variant, block_t, num_warps = _encode_launch("v32", is_native, variant, block_t, num_warps)
    launch = _launch(tokens, block_t, num_warps)
    grid = launch.pop("grid")
    if variant == "words":
        lat64, rope32 = _words(latent, torch.int64), _words(rope, torch.int32)
        if lat64 is not None and rope32 is not None:
            k.encode_v32_words_kernel[grid](
                lat64, rope32, rows.view(torch.int32), tokens, lat64.stride(0), rope32.stride(0),
                **launch)
            return out
        variant = "float"
    args = (latent.view(torch.int16), rope.view(torch.int16), rows, rows.view(torch.int32),
            rows.view(torch.int16), tokens, latent.stride(0), rope.stride(0))
    if variant == "legacy":
        k.encode_v32_kernel[grid](*args, NATIVE=is_native, **launch)
    else:
        k.encode_v32_float_kernel[grid](*args, NAN_FIX=variant == "float", **launch)
    return out


def decode_v32_triton(rows: torch.Tensor, *, native: bool | None = None, block_t: int | None = None,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from pdserve.kernels import fp8_ds_mla_triton as k

    rows = _check_rows(rows)
    tokens = rows.shape[0]
    latent = torch.empty(tokens, V32_NOPE, dtype=torch.bfloat16, device=rows.device)
    rope = torch.empty(tokens, ROPE, dtype=torch.bfloat16, device=rows.device)
    if tokens:
        launch = _launch(tokens, block_t, num_warps)
        k.decode_v32_kernel[launch.pop("grid")](
            rows, rows.view(torch.int32), rows.view(torch.int16), latent.view(torch.int16),
            rope.view(torch.int16), tokens,
            NATIVE=_use_native(native, rows.device), **launch)
    return latent, rope


def encode_v4_triton(latent: torch.Tensor, rope: torch.Tensor, block_size: int = 64,
                     out: torch.Tensor | None = None, *, native: bool | None = None,
                     block_t: int | None = None, num_warps: int | None = None,
                     variant: str | None = None) -> torch.Tensor:
    from pdserve.kernels import fp8_ds_mla_triton as k

    tokens = _check_inputs(latent, rope, V4_NOPE)
    pages = _v4_out(out, tokens, block_size, latent.device)
    block_size, page_stride = _pages(pages, block_size)
    if not tokens:
        return pages
    is_native = _use_native(native, latent.device)
    variant, block_t, num_warps = _encode_launch("v4", is_native, variant, block_t, num_warps)
    launch = _launch(tokens, block_t, num_warps)
    grid = launch.pop("grid")
    if variant == "words":
        lat64, rope32 = _words(latent, torch.int64), _words(rope, torch.int32)
        pages32 = _words(pages, torch.int32) if page_stride % 4 == 0 else None
        if lat64 is not None and rope32 is not None and pages32 is not None:
            k.encode_v4_words_kernel[grid](
                lat64, rope32, pages, pages32, tokens, lat64.stride(0), rope32.stride(0), page_stride,
                BLOCK_SIZE=block_size, **launch)
            return pages
        variant = "float"
    args = (latent.view(torch.int16), rope.view(torch.int16), pages, pages.view(torch.int16),
            tokens, latent.stride(0), rope.stride(0), page_stride)
    if variant == "legacy":
        k.encode_v4_kernel[grid](*args, BLOCK_SIZE=block_size, NATIVE=is_native, **launch)
    else:
        k.encode_v4_float_kernel[grid](*args, BLOCK_SIZE=block_size, NAN_FIX=variant == "float",
                                       **launch)
    return pages


def decode_v4_triton(pages: torch.Tensor, num_tokens: int | None = None,
                     block_size: int | None = None, *, native: bool | None = None,
                     block_t: int | None = None, num_warps: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    from pdserve.kernels import fp8_ds_mla_triton as k

    block_size, page_stride = _pages(pages, block_size)
    tokens = _v4_tokens(pages, block_size, num_tokens)
    latent = torch.empty(tokens, V4_NOPE, dtype=torch.bfloat16, device=pages.device)
    rope = torch.empty(tokens, ROPE, dtype=torch.bfloat16, device=pages.device)
    if tokens:
        launch = _launch(tokens, block_t, num_warps)
        k.decode_v4_kernel[launch.pop("grid")](
            pages, pages.view(torch.int16), latent.view(torch.int16), rope.view(torch.int16),
            tokens, page_stride,
            BLOCK_SIZE=block_size, NATIVE=_use_native(native, pages.device), **launch)
    return latent, rope


# ---------------------------------------------------------------- dispatch: Triton on CUDA


def encode_v32(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """bf16 latent [T,512] + RoPE [T,64] -> uint8 rows [T,656]."""
    if latent.is_cuda:
        return encode_v32_triton(latent, rope)
    return encode_v32_torch(latent, rope)


def decode_v32(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows [..., 656] -> (bf16 latent [T,512], bf16 RoPE [T,64])."""
    if rows.is_cuda:
        return decode_v32_triton(rows)
    return decode_v32_torch(rows)


def encode_v4(latent: torch.Tensor, rope: torch.Tensor, block_size: int = 64,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 latent [T,448] + RoPE [T,64] -> V4 pages [ceil(T/block_size), v4_page_bytes].

    Fresh pages are zeroed, so unused token slots and padding read as zeros; with `out`, only the
    T tokens' rows and scale rows are written.
    """
    if latent.is_cuda:
        return encode_v4_triton(latent, rope, block_size, out)
    return encode_v4_torch(latent, rope, block_size, out)


def decode_v4(pages: torch.Tensor, num_tokens: int | None = None,
              block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 pages -> (bf16 latent [T,448], bf16 RoPE [T,64]) for the first num_tokens tokens."""
    if pages.is_cuda:
        return decode_v4_triton(pages, num_tokens, block_size)
    return decode_v4_torch(pages, num_tokens, block_size)
