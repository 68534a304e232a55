"""The torch paths of pdserve.kernels on the CPU: paged gather/scatter and the fp8_ds_mla
references, pinned to hand-computed bytes so that the Triton kernels (tested against these
references elsewhere) inherit a checked definition."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from pdserve.kernels import fp8_ds_mla as f
from pdserve.kernels import paged
from test_kernels_cases import bits, caches, edge_latent, random_rope, same_bits, special_groups


def _u16(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.view(torch.int16).flatten().tolist()]


# ---------------------------------------------------------------- paged


def _expected_rows(cs: list[torch.Tensor], ids: list[int], num_tokens: int) -> torch.Tensor:
    """The buffer built one row at a time, the slowest possible way."""
    block_size = cs[0].shape[1]
    out = []
    for cache in cs:
        rows = [cache[ids[t // block_size], t % block_size].contiguous().view(torch.uint8)
                for t in range(num_tokens)]
        out.append(torch.stack(rows))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,width,pad", [(torch.uint8, 584, 64), (torch.bfloat16, 576, 0),
                                             (torch.float32, 3, 4)])
@pytest.mark.parametrize("num_tokens", [None, 13, 14])
def test_gather_builds_layer_major_rows(dtype: torch.dtype, width: int, pad: int,
                                        num_tokens: int | None) -> None:
    cs = caches(3, 7, 4, width, dtype, pad_bytes=pad)
    ids = [5, 0, 5, 2]  # a repeat is fine for gather
    out = paged.gather_torch(cs, ids, num_tokens=num_tokens)
    assert out.dtype == torch.uint8
    assert out.shape == (3, num_tokens or 16, width * cs[0].element_size())
    assert torch.equal(out, _expected_rows(cs, ids, num_tokens or 16))
    assert torch.equal(paged.gather(cs, torch.tensor(ids), num_tokens=num_tokens), out)


def test_gather_into_given_buffer_and_empty_list() -> None:
    cs = caches(2, 5, 4, 8, torch.uint8)
    buf = torch.empty(2, 8, 8, dtype=torch.uint8)
    assert paged.gather(cs, [1, 3], out=buf) is buf
    assert torch.equal(buf, _expected_rows(cs, [1, 3], 8))
    assert paged.gather(cs, []).shape == (2, 0, 8)


@pytest.mark.parametrize("num_tokens", [16, 14, 13])
def test_scatter_writes_only_listed_rows(num_tokens: int) -> None:
    cs = caches(2, 6, 4, 584, torch.uint8, pad_bytes=64)
    before = [c.as_strided((6 * (4 * 584 + 64),), (1,)).clone() for c in cs]
    ids = [4, 1, 0, 3]
    buf = paged.gather_torch(caches(2, 6, 4, 584, torch.uint8, seed=9), [0, 1, 2, 3],
                             num_tokens=num_tokens)
    paged.scatter(buf, cs, ids)
    assert torch.equal(paged.gather_torch(cs, ids, num_tokens=num_tokens), buf)
    for cache, old in zip(cs, before):
        flat = cache.as_strided((6 * (4 * 584 + 64),), (1,))
        changed = torch.zeros_like(flat, dtype=torch.bool)
        for t in range(num_tokens):
            start = ids[t // 4] * (4 * 584 + 64) + (t % 4) * 584
            changed[start:start + 584] = True
        assert torch.equal(flat[~changed], old[~changed])  # other blocks, rows and padding


def test_paged_rejects_bad_arguments() -> None:
    cs = caches(2, 5, 4, 8, torch.uint8)
    with pytest.raises(ValueError):
        paged.gather(cs, [1, 2], num_tokens=4)  # ends before the last block
    with pytest.raises(ValueError):
        paged.gather(cs, [1, 2], num_tokens=9)
    with pytest.raises(IndexError):
        paged.gather(cs, [1, 5])
    with pytest.raises(ValueError):
        paged.gather([cs[0], caches(1, 5, 4, 16, torch.uint8)[0]], [1])
    with pytest.raises(ValueError):
        paged.gather(cs, [1], out=torch.empty(2, 4, 9, dtype=torch.uint8))
    with pytest.raises(ValueError):
        paged.scatter(torch.empty(2, 4, 8, dtype=torch.uint8), cs, [1], num_tokens=3)
    with pytest.raises(ValueError):
        paged.gather([], [1])


# ---------------------------------------------------------------- V3.2 rows


def _v32_row(groups: list[list[float]]) -> torch.Tensor:
    latent = torch.zeros(1, 512)
    for g, values in enumerate(groups):
        latent[0, g * 128: g * 128 + len(values)] = torch.tensor(values)
    return latent.to(torch.bfloat16)


def test_v32_layout_and_known_bytes() -> None:
    latent = _v32_row([[448.0, 1.0, -2.0], [], [-0.0], [2.0**-130] * 128])
    rope = random_rope(1)
    row = f.encode_v32_torch(latent, rope)[0]
    assert row.shape == (656,)
    assert row[:3].tolist() == [0x7E, 0x38, 0xC0]  # 448, 1, -2 at scale 1
    scales = struct.unpack("<4f", bytes(row[512:528].tolist()))
    assert scales[0] == 1.0
    assert scales[1] == scales[2] == f.FLT_MIN  # all-zero groups
    assert row[256] == 0x80  # -0 keeps its sign
    # bf16 subnormals: scale FLT_MIN, 2^-130 / 2^-126 = 2^-4 -> exponent 3 -> 0x18
    assert scales[3] == f.FLT_MIN and set(row[384:512].tolist()) == {0x18}
    assert bytes(row[528:].tolist()) == bytes(rope.view(torch.uint8).flatten().tolist())
    lat, rope_back = f.decode_v32_torch(row[None])
    assert same_bits(lat, latent) and same_bits(rope_back, rope)  # all exact in e4m3


def test_v32_rounding_ties_and_e4m3_subnormals() -> None:
    latent = _v32_row([[448.0, 1.0625, 1.1875, 248.0, 432.0, 2**-10, 3 * 2**-10, 2**-9]])
    codes = f.encode_v32_torch(latent, random_rope(1))[0, :8].tolist()
    # ties go to the even code: 1, 1.25, 256, 448, 0, 2^-8 (code 2); 2^-9 is code 1
    assert codes == [0x7E, 0x38, 0x3A, 0x78, 0x7E, 0x00, 0x02, 0x01]


def test_v32_largest_values_do_not_overflow() -> None:
    top = bits([0x7F7F]).float().item()
    latent = _v32_row([[top, -top, 1e38]])
    row = f.encode_v32_torch(latent, random_rope(1))
    assert row[0, :2].tolist() == [0x7E, 0xFE]
    lat, _ = f.decode_v32_torch(row)
    assert torch.isfinite(lat[0, :3].float()).all()
    assert abs(lat[0, 0].float().item() - top) <= top * 2**-7


def test_v32_nan_stays_put_and_inf_poisons_its_group() -> None:
    clean = torch.randn(1, 512).to(torch.bfloat16)
    clean[0, 3] = 0.0  # not its group's largest magnitude, or the NaN (ignored by the scale) would move the scale
    dirty = clean.clone()
    dirty[0, 3] = float("nan")
    dirty[0, 130] = float("inf")
    a, b = f.encode_v32_torch(clean, random_rope(1)), f.encode_v32_torch(dirty, random_rope(1))
    assert b[0, 3] == 0x7F
    mask = torch.ones(656, dtype=torch.bool)
    mask[3] = False
    mask[128:256] = False
    mask[516:520] = False  # group 1's scale
    assert torch.equal(a[0, mask], b[0, mask])  # group 0 keeps its scale despite the NaN
    lat, _ = f.decode_v32_torch(b)
    assert _u16(lat[0, 3:4]) == [0x7FC0]
    assert torch.isnan(lat[0, 128:256].float()).all()
    assert torch.isfinite(lat[0, 256:].float()).all()


def test_v32_round_trip_error_is_e4m3_sized() -> None:
    latent = edge_latent(512, 128)[12:16]  # random magnitudes from 1e-30 to 1e30
    lat, _ = f.decode_v32_torch(f.encode_v32_torch(latent, random_rope(4)))
    x, y = latent.float().view(4, 4, 128), lat.float().view(4, 4, 128)
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert ((y - x).abs() <= x.abs() * 2**-4 + scale * 2**-10 + x.abs() * 2**-8).all()


# ---------------------------------------------------------------- V4 pages


def test_v4_page_geometry() -> None:
    assert f.v4_page_bytes(64) == 37440 and f.v4_page_bytes(256) == 149760
    latent = torch.randn(70, 448).to(torch.bfloat16)
    rope = random_rope(70)
    pages = f.encode_v4_torch(latent, rope, 64)
    assert pages.shape == (2, 37440)
    row65 = pages[1, 576:1152]  # token 65: page 1, slot 1
    assert bytes(row65[448:].tolist()) == bytes(rope[65].contiguous().view(torch.uint8).tolist())
    scales65 = pages[1, 64 * 576 + 8: 64 * 576 + 16]
    assert scales65[7] == 0  # pad byte
    assert not pages[1, 6 * 576: 64 * 576].any()  # slots 6.. of the last page stay zero
    assert not pages[1, 64 * 576 + 6 * 8:].any()
    lat, rope_back = f.decode_v4_torch(pages, 70, 64)
    assert same_bits(rope_back, rope)
    vllm_view = pages.as_strided((2, 64, 584), (37440, 584, 1))
    lat3, _ = f.decode_v4_torch(vllm_view, 70)
    assert same_bits(lat3, lat)


@pytest.mark.parametrize("amax,byte", [(448.0, 127), (450.0, 128), (224.0, 126), (0.0, 105),
                                       (1e-3, 109), (1e-6, 105), (float("inf"), 255)])
def test_v4_ue8m0_scale_bytes(amax: float, byte: int) -> None:
    latent = torch.zeros(1, 448)
    latent[0, 64 + 9] = amax  # group 1
    pages = f.encode_v4_torch(latent.to(torch.bfloat16), random_rope(1), 64)
    scale_row = pages[0, 64 * 576: 64 * 576 + 8].tolist()
    assert scale_row[1] == byte
    assert scale_row[0] == 105 and scale_row[7] == 0  # an all-zero group; the pad byte
    if math.isfinite(amax) and amax:
        assert byte == math.ceil(math.log2(max(amax, 1e-4) / 448)) + 127


def test_v4_decode_extreme_scale_bytes() -> None:
    pages = torch.zeros(1, f.v4_page_bytes(64), dtype=torch.uint8)
    pages[0, 0:2] = torch.tensor([0x38, 0x00])  # 1.0 and 0 in group 0
    pages[0, 64:66] = torch.tensor([0x38, 0x00])  # the same in group 1
    pages[0, 64 * 576: 64 * 576 + 2] = torch.tensor([0, 255])
    lat, _ = f.decode_v4_torch(pages, 1, 64)
    assert _u16(lat[0, :2]) == [0x0040, 0x0000]  # 2^-127: a bf16 subnormal, not flushed
    assert lat[0, 64].float().item() == math.inf and torch.isnan(lat[0, 65].float())


def test_v4_edge_cases() -> None:
    latent = edge_latent(448, 64)
    pages = f.encode_v4_torch(latent, random_rope(16), 16)
    lat, _ = f.decode_v4_torch(pages, 16, 16)
    x, y = latent.float(), lat.float()
    assert same_bits(lat[0], latent[0]) and _u16(lat[1]) == [0x8000] * 448  # +-0
    assert torch.isnan(y[6, 3]) and torch.isnan(y[6, 64 + 7])
    assert torch.isfinite(y[6, 64 * 2:]).all()
    assert torch.isnan(y[7, 64:128]).all() and torch.isnan(y[7, 384:]).all()
    assert torch.equal(y[9, :5], torch.tensor([448.0, 1.0, 1.25, 256.0, 448.0]))
    # bf16's largest value / 2^120 = 255 rounds to e4m3 256, and 256 * 2^120 overflows: V4's
    # rounded-up power-of-two scale loses the top 1/32 of the range (vLLM's decoder gives the same)
    assert y[3, 0].item() == math.inf and y[3, 1].item() == -math.inf
    assert torch.isfinite(y[3, 2:]).all()
    x[3, :2] = y[3, :2] = 0
    normal = [2, 3, 5, 8, 12, 13, 14, 15]
    scale = torch.exp2(torch.ceil(torch.log2(x[normal].view(8, 7, 64).abs().amax(-1, keepdim=True)
                                             .clamp_min(1e-4) / 448)))
    err = (y[normal] - x[normal]).view(8, 7, 64).abs()
    assert (err <= x[normal].view(8, 7, 64).abs() * (2**-4 + 2**-8) + scale * 2**-10).all()


def test_v4_out_writes_only_token_bytes() -> None:
    out = torch.full((1, f.v4_page_bytes(16)), 0xAB, dtype=torch.uint8)
    f.encode_v4_torch(torch.randn(3, 448).to(torch.bfloat16), random_rope(3), 16, out)
    touched = torch.zeros(out.shape[1], dtype=torch.bool)
    touched[: 3 * 576] = True
    touched[16 * 576: 16 * 576 + 3 * 8] = True
    assert (out[0, ~touched] == 0xAB).all()


def test_codec_dispatch_on_cpu_uses_torch() -> None:
    latent, rope = edge_latent(512, 128), random_rope(16)
    rows = f.encode_v32(latent, rope)
    assert same_bits(rows, f.encode_v32_torch(latent, rope))
    assert all(map(same_bits, f.decode_v32(rows), f.decode_v32_torch(rows)))
    pages = f.encode_v4(latent[:, :448].contiguous(), rope, 16)
    assert all(map(same_bits, f.decode_v4(pages, 16, 16), f.decode_v4_torch(pages, 16, 16)))


def test_all_nan_group_gets_the_smallest_scale() -> None:
    """A group of NaNs only (any payload or sign) has no amax: it gets the zero group's scale."""
    rope = random_rope(4)
    rows = f.encode_v32_torch(special_groups(512, 128), rope)
    assert rows[0, :512].eq(0x7F).all()
    assert rows[0, 512:528].view(torch.int32).eq(0x00800000).all()  # FLT_MIN
    pages = f.encode_v4_torch(special_groups(448, 64), rope, 4)
    assert pages[0, :448].eq(0x7F).all()
    assert pages[0, 4 * 576:4 * 576 + 8].tolist() == [105] * 7 + [0]  # 2^-22, from amax 1e-4
