"""The kernels' command-line tools: the compile check (it needs no GPU) and the benchmark's
entry points."""

from __future__ import annotations

import pytest
import torch

from pdserve.deploy.cli import resolve
from pdserve.bench import kernels as bench
from pdserve.kernels import compile_check


def _variant(name: str) -> compile_check.Variant:
    return next(v for v in compile_check.variants() if v.name == name)


def test_portable_kernels_build_for_sm80_without_fp8_instructions() -> None:
    for name in ("paged_gather_i32", "encode_v32_portable"):
        variant = _variant(name)
        facts = compile_check._compile(variant, 80)
        assert facts["cubin_bytes"] > 0 and not compile_check._problems(variant, facts)
        assert facts["v4_loads"] > 0  # 16-byte accesses
        assert facts["fp8_cvt"] == 0


def test_native_codec_needs_sm89() -> None:
    with pytest.raises(Exception):
        compile_check._compile(_variant("decode_v32_native"), 80)


def test_bench_entry_points() -> None:
    assert resolve(["bench", "kernels", "--layers", "2"]) == ("pdserve.bench.kernels", ["--layers", "2"])
    args = bench.build_parser().parse_args([])
    assert (args.layers, args.block_sizes, args.row_bytes, args.min_gib) == (43, "64,256", "584,656", 1.0)
    if not torch.cuda.is_available():
        assert bench.main([]) == 2
