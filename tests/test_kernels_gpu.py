"""The compiled Triton kernels on a CUDA device, bit-exact against the torch references run on
the CPU. Both fp8 paths run where the device has them: the portable integer one (what sm80 and
sm86 execute) everywhere, the native conversions on sm89+. Skipped where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import fp8_ds_mla as f
from pdserve.kernels import paged
from test_kernels_cases import (caches, edge_latent, random_bytes, random_rope, same_bits,
                                special_groups)

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
NATIVE = [False, True] if HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9) else [False]


def _cuda(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """GPU copies with the same strides and the same offset into their allocation."""
    out = []
    for t in ts:
        whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).cuda()
        out.append(whole.as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


@pytest.mark.parametrize("dtype,width,pad,offset", [
    (torch.uint8, 584, 64, 0), (torch.uint8, 656, 0, 4), (torch.bfloat16, 576, 0, 0),
    (torch.float32, 3, 4, 0), (torch.uint8, 13, 3, 1)])
@pytest.mark.parametrize("num_tokens", [None, 8 * 64 - 63, 8 * 64 - 1])
@pytest.mark.parametrize("tile_bytes", [1024, 16384])
def test_paged_matches_torch(dtype: torch.dtype, width: int, pad: int, offset: int,
                             num_tokens: int | None, tile_bytes: int) -> None:
    cpu = caches(5, 40, 64, width, dtype, pad_bytes=pad, offset_bytes=offset)
    gpu = _cuda(cpu)
    ids = [7, 3, 39, 0, 21, 3, 8, 12] if num_tokens is None else [7, 3, 39, 0, 21, 2, 8, 12]
    want = paged.gather_torch(cpu, ids, num_tokens=num_tokens)
    got = paged.gather_triton(gpu, torch.tensor(ids, device="cuda"), num_tokens=num_tokens,
                              tile_bytes=tile_bytes)
    assert torch.equal(got.cpu(), want)
    ids = [7, 3, 39, 0, 21, 2, 8, 12]
    buf = torch.randint(0, 256, want.shape, dtype=torch.uint8)
    paged.scatter_torch(buf, cpu, ids)
    paged.scatter_triton(buf.cuda(), gpu, ids, tile_bytes=tile_bytes)
    assert all(same_bits(a, b.cpu()) for a, b in zip(cpu, gpu))
    assert torch.equal(paged.gather(gpu, ids, num_tokens=num_tokens).cpu(),
                       paged.gather_torch(cpu, ids, num_tokens=num_tokens))


def test_paged_flash_shape() -> None:
    """43 layers of V4 pages (padded stride), 64 random blocks of 256 out of 200."""
    gpu = _cuda(caches(43, 200, 256, 584, torch.uint8, pad_bytes=f.v4_page_bytes(256) - 256 * 584))
    ids = torch.randperm(200, device="cuda")[:64]
    buf = paged.gather(gpu, ids)
    assert torch.equal(buf, paged.gather_torch(gpu, ids))
    buf.random_(0, 256)
    paged.scatter(buf, gpu, ids)
    assert torch.equal(paged.gather_torch(gpu, ids), buf)


def _latent(width: int, group: int) -> torch.Tensor:
    big = torch.randn(4096, width) * torch.logspace(-20, 20, 4096)[:, None]
    return torch.cat([edge_latent(width, group), special_groups(width, group), big.to(torch.bfloat16)])


# (native, encoder variant): the portable kernel, then every native variant where the GPU has them
ENCODERS = [(False, None)] + ([(True, v) for v in f.ENCODE_VARIANTS] if True in NATIVE else [])


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` one element off its allocation's 8-byte alignment (no int64/int32 views)."""
    raw = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = raw[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("native,variant", ENCODERS)
def test_encode_v32_matches_torch(native: bool, variant: str | None) -> None:
    latent = _latent(512, 128)
    rope = random_rope(latent.shape[0])
    rows = f.encode_v32_torch(latent, rope)
    lat, rp = latent.cuda(), rope.cuda()
    for block_t, warps in [(None, None), (2, 1), (16, 4)]:
        got = f.encode_v32_triton(lat, rp, native=native, variant=variant, block_t=block_t,
                                  num_warps=warps)
        assert same_bits(got.cpu(), rows), (block_t, warps)
    strided = torch.cat([lat, lat], 1)[:, :512]  # a row stride other than 512
    assert same_bits(f.encode_v32_triton(strided[:13], rp[:13], native=native, variant=variant).cpu(),
                     rows[:13])
    # no word views possible: "words" falls back to the "float" kernel
    got = f.encode_v32_triton(_misaligned(lat[:37]), _misaligned(rp[:37]), native=native, variant=variant)
    assert same_bits(got.cpu(), rows[:37])


@pytest.mark.parametrize("native,variant", ENCODERS)
@pytest.mark.parametrize("block_size", [64, 256])
def test_encode_v4_matches_torch(native: bool, variant: str | None, block_size: int) -> None:
    latent = _latent(448, 64)
    rope = random_rope(latent.shape[0])
    pages = f.encode_v4_torch(latent, rope, block_size)
    lat, rp = latent.cuda(), rope.cuda()
    for block_t, warps in [(None, None), (2, 1), (16, 4)]:
        got = f.encode_v4_triton(lat, rp, block_size, native=native, variant=variant,
                                 block_t=block_t, num_warps=warps)
        assert same_bits(got.cpu(), pages), (block_t, warps)
    # vLLM's 3-D per-layer view with the padded page stride, pages full of garbage first
    out = torch.randint(0, 256, pages.shape, dtype=torch.uint8, device="cuda")
    view = out.as_strided((pages.shape[0], block_size, 584), (pages.shape[1], 584, 1))
    want = pages.clone()
    want.view(-1)[:] = out.cpu().view(-1)  # untouched bytes stay
    want = f.encode_v4_torch(latent[:300], rope[:300], block_size, out=want)
    f.encode_v4_triton(lat[:300], rp[:300], block_size, out=view, native=native, variant=variant)
    assert same_bits(out.cpu(), want)
    got = f.encode_v4_triton(_misaligned(lat[:37]), _misaligned(rp[:37]), block_size,
                             native=native, variant=variant)
    assert same_bits(got.cpu(), f.encode_v4_torch(latent[:37], rope[:37], block_size))


@pytest.mark.parametrize("native", NATIVE)
def test_decode_v32_matches_torch(native: bool) -> None:
    latent = _latent(512, 128)
    rows = torch.cat([f.encode_v32_torch(latent, random_rope(latent.shape[0])), random_bytes(512, 656)])
    got, want = f.decode_v32_triton(rows.cuda(), native=native), f.decode_v32_torch(rows)
    assert all(same_bits(g.cpu(), w) for g, w in zip(got, want))


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("block_size", [64, 256])
def test_decode_v4_matches_torch(native: bool, block_size: int) -> None:
    latent = _latent(448, 64)
    pages = f.encode_v4_torch(latent, random_rope(latent.shape[0]), block_size)
    pages = torch.cat([pages, random_bytes(3, pages.shape[1])])
    tokens = pages.shape[0] * block_size
    got = f.decode_v4_triton(pages.cuda(), tokens, block_size, native=native)
    want = f.decode_v4_torch(pages, tokens, block_size)
    assert all(same_bits(g.cpu(), w) for g, w in zip(got, want))


def test_codec_dispatch_on_cuda_uses_triton() -> None:
    latent, rope = edge_latent(512, 128), random_rope(16)
    assert same_bits(f.encode_v32(latent.cuda(), rope.cuda()).cpu(), f.encode_v32_torch(latent, rope))
