"""The Triton kernels under the Triton interpreter (CPU), bit-exact against the torch references.

Triton reads TRITON_INTERPRET when a kernel is decorated, and setting it inside this pytest
process would also turn every other module's kernels into interpreted ones. So in a normal run
this file holds one test that runs the file again in a child pytest with TRITON_INTERPRET=1; in
that child the real tests below are collected. `TRITON_INTERPRET=1 pytest
tests/test_kernels_interp.py` runs them directly.

Shapes are small (the interpreter runs each program in numpy) and large tiles keep the number of
programs low; the integer fp8 paths exercised here are the ones sm80 and sm86 run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":

    @pytest.mark.slow  # a child pytest interprets every kernel program in numpy
    def test_kernels_under_the_triton_interpreter() -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[1],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

else:
    import torch

    from pdserve.kernels import fp8_ds_mla as f
    from pdserve.kernels import paged
    from test_kernels_cases import (caches, edge_latent, random_bytes, random_rope, same_bits,
                                    special_groups)

    # numpy warns on the NaN/Inf arithmetic the edge cases are made of
    pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
    BIG_TILE = 1 << 16

    @pytest.mark.parametrize("dtype,width,pad,offset", [
        (torch.uint8, 584, 64, 0),  # V4 pages with vLLM's padded stride, 4-byte words
        (torch.uint8, 656, 0, 4),  # V3.2 rows, caches 4 bytes off 16-byte alignment
        (torch.bfloat16, 20, 0, 0),
        (torch.uint8, 13, 3, 1),  # odd row and stride: 1-byte words
    ])
    @pytest.mark.parametrize("num_tokens", [None, 9, 11])
    def test_paged_matches_torch(dtype: torch.dtype, width: int, pad: int, offset: int,
                                 num_tokens: int | None) -> None:
        cs = caches(2, 6, 4, width, dtype, pad_bytes=pad, offset_bytes=offset)
        ids = [4, 0, 4] if num_tokens is None else [5, 1, 3]
        want = paged.gather_torch(cs, ids, num_tokens=num_tokens)
        got = paged.gather_triton(cs, ids, num_tokens=num_tokens, tile_bytes=BIG_TILE)
        assert torch.equal(got, want)
        ids = [5, 1, 3]
        buf = paged.gather_torch(caches(2, 6, 4, width, dtype, seed=11), [0, 2, 4],
                                 num_tokens=num_tokens)
        a = caches(2, 6, 4, width, dtype, pad_bytes=pad, offset_bytes=offset)
        b = caches(2, 6, 4, width, dtype, pad_bytes=pad, offset_bytes=offset)
        paged.scatter_torch(buf, a, ids)
        paged.scatter_triton(buf, b, ids, tile_bytes=BIG_TILE)
        span = 6 * (4 * width * a[0].element_size() + pad)
        assert all(torch.equal(x.view(torch.uint8).as_strided((span,), (1,)),
                               y.view(torch.uint8).as_strided((span,), (1,))) for x, y in zip(a, b))

    def test_paged_small_tiles_cover_a_block() -> None:
        cs = caches(3, 5, 8, 584, torch.uint8, pad_bytes=64)
        want = paged.gather_torch(cs, [3, 1], num_tokens=13)
        assert torch.equal(paged.gather_triton(cs, [3, 1], num_tokens=13, tile_bytes=1024), want)

    def test_encode_v32_matches_torch() -> None:
        latent, rope = edge_latent(512, 128), random_rope(16)
        want = f.encode_v32_torch(latent, rope)
        assert same_bits(f.encode_v32_triton(latent, rope, block_t=16), want)
        strided = torch.cat([latent, latent], 1)[:, :512]  # a row stride other than 512
        assert same_bits(f.encode_v32_triton(strided[:13], rope[:13], block_t=8), want[:13])

    def test_encode_special_groups_match_torch() -> None:
        """All-NaN, Inf and tiny-scale groups (what the native encoders special-case)."""
        rope = random_rope(4)
        latent = special_groups(512, 128)
        assert same_bits(f.encode_v32_triton(latent, rope, block_t=4), f.encode_v32_torch(latent, rope))
        latent = special_groups(448, 64)
        assert same_bits(f.encode_v4_triton(latent, rope, 4, block_t=4),
                         f.encode_v4_torch(latent, rope, 4))

    def test_decode_v32_matches_torch() -> None:
        latent, rope = edge_latent(512, 128), random_rope(16)
        rows = torch.cat([f.encode_v32_torch(latent, rope), random_bytes(16, 656)])
        got, want = f.decode_v32_triton(rows, block_t=32), f.decode_v32_torch(rows)
        assert all(map(same_bits, got, want))

    @pytest.mark.parametrize("block_size", [16, 64])
    def test_encode_v4_matches_torch(block_size: int) -> None:
        latent, rope = edge_latent(448, 64), random_rope(16)
        want = f.encode_v4_torch(latent[:13], rope[:13], block_size)
        assert same_bits(f.encode_v4_triton(latent[:13], rope[:13], block_size, block_t=16), want)

    def test_decode_v4_matches_torch() -> None:
        latent, rope = edge_latent(448, 64), random_rope(16)
        pages = torch.cat([f.encode_v4_torch(latent, rope, 8), random_bytes(2, f.v4_page_bytes(8))])
        got, want = f.decode_v4_triton(pages, 30, 8, block_t=32), f.decode_v4_torch(pages, 30, 8)
        assert all(map(same_bits, got, want))
        view = pages.as_strided((4, 8, 584), (f.v4_page_bytes(8), 584, 1))  # vLLM's 3-D view
        assert all(map(same_bits, f.decode_v4_triton(view, 30, block_t=32), want))

    def test_bench_runs_its_checks() -> None:
        """`pdserve bench kernels` end to end on tiny shapes (the timings mean nothing here)."""
        from pdserve.bench import kernels as bench

        b = bench.Bench("cpu", 1, 1)
        rows = bench.bench_paged(b, 2, 8, 584, 2 * 2 * 8 * 584, [(BIG_TILE, 4)])
        rows += bench.bench_codecs(b, 584 * 16, 16, [False], [(32, 4)])
        assert not b.failures
        assert [r.op for r in rows] == ["gather", "scatter", "encode_v32", "decode_v32",
                                        "encode_v4", "decode_v4"]
        assert all(r.naive_gbps and r.copy_gbps and r.gbps for r in rows)
