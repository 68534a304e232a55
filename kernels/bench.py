"""`pdserve bench kernels`: paged gather/scatter and fp8_ds_mla codecs against memory speed.

Shapes are DeepSeek-V4-Flash's: 43 layers, 584-byte (V4) or 656-byte (V3.2) rows, blocks of 64
and 256 tokens, at least 1 GiB of KV per measurement. Every row of the table reports GB/s
counting bytes read plus bytes written, next to two baselines measured in the same run:
- copy: a device-to-device `copy_` moving the same number of bytes (the ceiling);
- naive: the torch path, i.e. index_select and copy in a Python loop over layers for the paged
  ops, and the pure-torch reference for the codecs.
Before timing, each kernel's output is compared bit for bit with the torch result.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

GIB = 1 << 30


@dataclass
class Row:
    op: str
    shape: str
    config: str
    mib: float  # bytes read + written, MiB
    us: float
    gbps: float
    copy_gbps: float
    naive_gbps: float | None

    @property
    def vs_copy(self) -> float:
        return self.gbps / self.copy_gbps

    def line(self) -> str:
        naive = f"{self.naive_gbps:9.0f} {self.gbps / self.naive_gbps:6.1f}x" if self.naive_gbps else f"{'-':>9} {'-':>7}"
        return (f"{self.op:<20} {self.shape:<30} {self.config:<16} {self.mib:8.0f} {self.us:9.1f} "
                f"{self.gbps:8.0f} {self.copy_gbps:8.0f} {self.vs_copy:6.2f} {naive}")


HEADER = (f"{'op':<20} {'shape':<30} {'config':<16} {'MiB r+w':>8} {'us':>9} {'GB/s':>8} "
          f"{'copyGB/s':>8} {'vsCopy':>6} {'naiveGB/s':>9} {'vsNaive':>7}")


class Bench:
    """The device, timing settings, failed checks and a cache of copy baselines by size.

    On a CPU device (the tests' smoke run under the Triton interpreter) timing is a plain
    wall-clock median; the numbers mean nothing there, the code paths are what is exercised.
    """

    def __init__(self, device: str, warmup_ms: int, rep_ms: int) -> None:
        self.device = torch.device(device)
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self._copy: dict[int, float] = {}
        self.failures: list[str] = []

    def check(self, what: str, ok: bool) -> None:
        """Record a kernel/torch mismatch and go on: one bad check should not void the run."""
        if not ok:
            print(f"CHECK FAILED: {what}", flush=True)
            self.failures.append(what)

    def time(self, fn: Callable[[], object]) -> float:
        """Median microseconds of one call."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") * 1e3
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return sorted(samples)[1]

    def copy_gbps(self, moved_bytes: int) -> float:
        """GB/s of a device-to-device copy moving `moved_bytes` (half read, half written)."""
        size = moved_bytes // 2
        if size not in self._copy:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            self._copy[size] = 2 * size / self.time(lambda: dst.copy_(src)) / 1e3
            del src, dst
        return self._copy[size]

    def row(self, op: str, shape: str, config: str, moved: int, fn: Callable[[], object],
            naive: Callable[[], object] | None) -> Row:
        us = self.time(fn)
        naive_gbps = moved / self.time(naive) / 1e3 if naive else None
        return Row(op, shape, config, moved / 2**20, us, moved / us / 1e3, self.copy_gbps(moved),
                   naive_gbps)


# ---------------------------------------------------------------- paged


def _caches(layers: int, blocks: int, block_size: int, row_bytes: int,
            device: torch.device) -> list[torch.Tensor]:
    """Per-layer uint8 caches in vLLM's layout; V4 rows get vLLM's padded page stride."""
    from pdserve.kernels.fp8_ds_mla import V4_ROW_BYTES, v4_page_bytes

    page = v4_page_bytes(block_size) if row_bytes == V4_ROW_BYTES else block_size * row_bytes
    out = []
    for _ in range(layers):
        raw = torch.randint(0, 256, (blocks * page,), dtype=torch.uint8, device=device)
        out.append(raw.as_strided((blocks, block_size, row_bytes), (page, row_bytes, 1)))
    return out


def bench_paged(bench: Bench, layers: int, block_size: int, row_bytes: int, min_bytes: int,
                configs: list[tuple[int, int]]) -> list[Row]:
    from pdserve.kernels import paged

    listed = math.ceil(min_bytes / (layers * block_size * row_bytes))
    caches = _caches(layers, int(listed * 2.5), block_size, row_bytes, bench.device)
    ids = torch.randperm(caches[0].shape[0], device=bench.device)[:listed]
    buf = torch.empty(layers, listed * block_size, row_bytes, dtype=torch.uint8, device=bench.device)
    bench.check(f"gather {block_size}x{row_bytes} equals torch",
                torch.equal(paged.gather_triton(caches, ids), paged.gather_torch(caches, ids)))
    shape = f"{layers}L x {listed}blk x {block_size} x {row_bytes}B"
    moved = 2 * buf.numel()
    rows = []
    for tile, warps in configs:
        config = f"tile={tile // 1024}K w={warps}"
        first = (tile, warps) == configs[0]
        rows.append(bench.row(
            "gather", shape, config, moved,
            lambda: paged.gather_triton(caches, ids, buf, tile_bytes=tile, num_warps=warps),
            (lambda: paged.gather_torch(caches, ids, buf)) if first else None))
        rows.append(bench.row(
            "scatter", shape, config, moved,
            lambda: paged.scatter_triton(buf, caches, ids, tile_bytes=tile, num_warps=warps),
            (lambda: paged.scatter_torch(buf, caches, ids)) if first else None))
    buf.random_(0, 256)
    paged.scatter_triton(buf, caches, ids)
    bench.check(f"scatter {block_size}x{row_bytes} round-trips",
                torch.equal(paged.gather_torch(caches, ids), buf))
    return rows


# ---------------------------------------------------------------- codecs


def _bf16(tokens: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.randn(tokens, width, device=device).mul_(4).to(torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def bench_codecs(bench: Bench, min_bytes: int, block_size: int, natives: list[bool],
                 configs: list[tuple[int | None, int | None]]) -> list[Row]:
    from pdserve.kernels import fp8_ds_mla as f

    rows = []
    tokens = math.ceil(min_bytes / f.V4_ROW_BYTES / block_size) * block_size
    lat32, lat4, rope = (_bf16(tokens, width, bench.device) for width in (f.V32_NOPE, f.V4_NOPE, f.ROPE))
    v32 = f.encode_v32_triton(lat32, rope)
    pages = f.encode_v4_triton(lat4, rope, block_size)
    # Checked against the torch references on the CPU (the definition), on a slice of the data.
    n = min(tokens, 1 << 15)
    cpu32, cpu4, cpu_rope = lat32[:n].cpu(), lat4[:n].cpu(), rope[:n].cpu()
    rows32, pages4 = f.encode_v32_torch(cpu32, cpu_rope), f.encode_v4_torch(cpu4, cpu_rope, block_size)
    for native in natives:
        tag = f"native={native}"
        bench.check(f"encode_v32 {tag} equals torch",
                    _same(f.encode_v32_triton(lat32[:n], rope[:n], native=native).cpu(), rows32))
        bench.check(f"encode_v4 {tag} equals torch",
                    _same(f.encode_v4_triton(lat4[:n], rope[:n], block_size, native=native).cpu(), pages4))
        got = f.decode_v32_triton(v32[:n], native=native)
        bench.check(f"decode_v32 {tag} equals torch",
                    all(_same(g.cpu(), w) for g, w in zip(got, f.decode_v32_torch(v32[:n].cpu()))))
        got = f.decode_v4_triton(pages, n, block_size, native=native)
        want = f.decode_v4_torch(pages[: n // block_size].cpu(), n, block_size)
        bench.check(f"decode_v4 {tag} equals torch", all(_same(g.cpu(), w) for g, w in zip(got, want)))
    out32 = torch.empty_like(v32)
    out4 = torch.empty_like(pages)
    bf16_32, bf16_4 = tokens * (f.V32_NOPE + f.ROPE) * 2, tokens * (f.V4_NOPE + f.ROPE) * 2
    kv32, kv4 = tokens * f.V32_ROW_BYTES, tokens * f.V4_ROW_BYTES
    shape32 = f"{tokens} tok x 656B"
    shape4 = f"{tokens} tok x 584B pages of {block_size}"
    for native in natives:
        for block_t, warps in configs:
            shape_of = f"bt={block_t} w={warps}" if block_t else "default"
            config = f"{'native' if native else 'portable'} {shape_of}"
            first = native == natives[0] and (block_t, warps) == configs[0]
            kw = dict(native=native, block_t=block_t, num_warps=warps)
            rows += [
                bench.row("encode_v32", shape32, config, bf16_32 + kv32,
                          lambda: f.encode_v32_triton(lat32, rope, out32, **kw),
                          (lambda: f.encode_v32_torch(lat32, rope)) if first else None),
                bench.row("decode_v32", shape32, config, bf16_32 + kv32,
                          lambda: f.decode_v32_triton(v32, **kw),
                          (lambda: f.decode_v32_torch(v32)) if first else None),
                bench.row("encode_v4", shape4, config, bf16_4 + kv4,
                          lambda: f.encode_v4_triton(lat4, rope, block_size, out4, **kw),
                          (lambda: f.encode_v4_torch(lat4, rope, block_size, out4)) if first else None),
                bench.row("decode_v4", shape4, config, bf16_4 + kv4,
                          lambda: f.decode_v4_triton(pages, tokens, block_size, **kw),
                          (lambda: f.decode_v4_torch(pages, tokens, block_size)) if first else None),
            ]
    return rows


# ---------------------------------------------------------------- CLI


def _pairs(text: str) -> list[tuple[int | None, int | None]]:
    """'AxB,default,...' -> [(A, B), (None, None), ...]; None picks the kernel's own default."""
    return [(None, None) if item == "default" else tuple(int(v) for v in item.split("x"))
            for item in text.split(",")]  # type: ignore[misc]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--block-sizes", default="64,256", help="tokens per block (default: %(default)s)")
    parser.add_argument("--row-bytes", default="584,656", help="KV row sizes (default: %(default)s)")
    parser.add_argument("--min-gib", type=float, default=1.0, help="KV moved per measurement, GiB")
    parser.add_argument("--paged-configs", default="16384x4",
                        help="TILE_BYTESxWARPS list for the paged kernels; the first is the default "
                             "path and gets the naive baseline (default: %(default)s)")
    parser.add_argument("--codec-configs", default="default",
                        help="BLOCK_TxWARPS list for the codecs; 'default' is each codec's own "
                             "launch configuration (default: %(default)s)")
    parser.add_argument("--codec-block-size", type=int, default=256, help="V4 page size for the codecs")
    parser.add_argument("--skip-paged", action="store_true")
    parser.add_argument("--skip-codecs", action="store_true")
    parser.add_argument("--warmup-ms", type=int, default=50)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--json", help="also write every row to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("pdserve bench kernels: needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    bench = Bench("cuda", args.warmup_ms, args.rep_ms)
    min_bytes = int(args.min_gib * GIB)
    cc = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} (sm{cc[0]}{cc[1]}), torch {torch.__version__}, "
          f"triton {triton.__version__}; GB/s = (bytes read + bytes written) / time, median of "
          f"{args.rep_ms} ms of runs")
    print(HEADER)
    rows: list[Row] = []

    def emit(new: list[Row]) -> None:
        for r in new:
            print(r.line(), flush=True)
        rows.extend(new)

    if not args.skip_paged:
        for row_bytes in (int(v) for v in args.row_bytes.split(",")):
            for block_size in (int(v) for v in args.block_sizes.split(",")):
                emit(bench_paged(bench, args.layers, block_size, row_bytes, min_bytes,
                                 _pairs(args.paged_configs)))
                torch.cuda.empty_cache()
    if not args.skip_codecs:
        natives = [False, True] if cc >= (8, 9) else [False]
        emit(bench_codecs(bench, min_bytes, args.codec_block_size, natives,
                          _pairs(args.codec_configs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [dict(asdict(r), vs_copy=r.vs_copy) for r in rows],
                       "failures": bench.failures}, f, indent=1)
    print("all checks passed" if not bench.failures else f"{len(bench.failures)} checks FAILED")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
