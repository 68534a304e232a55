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
import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, TypedDict

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
    variant: str | None = None  # native encoders: the kernel variant, tokens and warps timed
    block_t: int | None = None
    num_warps: int | None = None

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
        self.failed_variants: set[tuple[str, str]] = set()  # (op, native encoder variant)

    def check(self, what: str, ok: bool, op_variant: tuple[str, str] | None = None) -> None:
        """Record a kernel/torch mismatch and go on: one bad check should not void the run."""
        if not ok:
            print(f"CHECK FAILED: {what}", flush=True)
            self.failures.append(what)
            if op_variant:
                self.failed_variants.add(op_variant)

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
            naive: Callable[[], object] | None, **launch: object) -> Row:
        us = self.time(fn)
        naive_gbps = moved / self.time(naive) / 1e3 if naive else None
        return Row(op, shape, config, moved / 2**20, us, moved / us / 1e3, self.copy_gbps(moved),
                   naive_gbps, **launch)  # type: ignore[arg-type]


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
                configs: list[tuple[int | None, int | None]]) -> list[Row]:
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
    for i, (tile_or_default, warps_or_default) in enumerate(configs):
        tile = paged.TILE_BYTES if tile_or_default is None else tile_or_default  # 'default': the kernel's own
        warps = paged.NUM_WARPS if warps_or_default is None else warps_or_default
        config = f"tile={tile // 1024}K w={warps}"
        first = i == 0
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


CODEC_OPS = ("encode_v32", "decode_v32", "encode_v4", "decode_v4")


class _Launch(TypedDict, total=False):
    """Keyword arguments of a codec's Triton launch that the bench varies."""

    native: bool | None
    block_t: int | None
    num_warps: int | None


class _EncodeLaunch(_Launch, total=False):
    variant: str | None  # encoders only


def _variant_spec(spec: str | None) -> tuple[str | None, list[tuple[int | None, int | None]] | None]:
    """An --encode-variants item, 'name' or 'name@AxB/CxD' -> (name, [(A, B), (C, D)]): that
    variant, at those launches only (None: at every one); a name of None is the default variant."""
    name, _, launches = (spec or "").partition("@")
    return name or None, _pairs(launches.replace("/", ",")) if launches else None


def bench_codecs(bench: Bench, min_bytes: int, block_size: int, natives: list[bool],
                 configs: list[tuple[int | None, int | None]],
                 encode_variants: list[str | None] | None = None,
                 ops: tuple[str, ...] = CODEC_OPS) -> list[Row]:
    """Every codec in `ops` for each fp8 path and launch configuration; on the native path the
    encoders once for each of `encode_variants` (None: the launcher's default variant)."""
    from pdserve.kernels import fp8_ds_mla as f

    specs = [_variant_spec(v) for v in encode_variants or [None]]  # (native variant, launches)
    rows = []
    tokens = math.ceil(min_bytes / f.V4_ROW_BYTES / block_size) * block_size
    lat32, lat4, rope = (_bf16(tokens, width, bench.device) for width in (f.V32_NOPE, f.V4_NOPE, f.ROPE))
    v32 = f.encode_v32_triton(lat32, rope, native=False)
    pages = f.encode_v4_triton(lat4, rope, block_size, native=False)
    # Checked against the torch references on the CPU (the definition), on a slice of the data,
    # and on a slice whose length is no multiple of any launch's tokens per program.
    n = min(tokens, 1 << 15)
    cpu32, cpu4, cpu_rope = lat32[:n].cpu(), lat4[:n].cpu(), rope[:n].cpu()
    rows32, pages4 = f.encode_v32_torch(cpu32, cpu_rope), f.encode_v4_torch(cpu4, cpu_rope, block_size)
    odd = n - 3
    rows32_odd = f.encode_v32_torch(cpu32[:odd], cpu_rope[:odd])
    pages4_odd = f.encode_v4_torch(cpu4[:odd], cpu_rope[:odd], block_size)
    for native in natives:
        for variant, _ in specs if native else [(None, None)]:
            tag = f"native={native}" + (f" variant={variant}" if variant else "")
            kw: _EncodeLaunch = {"native": native, "variant": variant}
            ok = _same(f.encode_v32_triton(lat32[:n], rope[:n], **kw).cpu(), rows32) and _same(
                f.encode_v32_triton(lat32[:odd], rope[:odd], **kw).cpu(), rows32_odd)
            bench.check(f"encode_v32 {tag} equals torch", ok, ("encode_v32", variant or "default"))
            ok = _same(f.encode_v4_triton(lat4[:n], rope[:n], block_size, **kw).cpu(), pages4) and _same(
                f.encode_v4_triton(lat4[:odd], rope[:odd], block_size, **kw).cpu(), pages4_odd)
            bench.check(f"encode_v4 {tag} equals torch", ok, ("encode_v4", variant or "default"))
        tag = f"native={native}"
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
    timed: dict[str, tuple[str, int, Callable[[dict], object], Callable[[], object]]] = {
        # op: shape, bytes moved, the kernel (launch keywords in), its torch reference
        "encode_v32": (shape32, bf16_32 + kv32, lambda kw: f.encode_v32_triton(lat32, rope, out32, **kw),
                       lambda: f.encode_v32_torch(lat32, rope)),
        "decode_v32": (shape32, bf16_32 + kv32, lambda kw: f.decode_v32_triton(v32, **kw),
                       lambda: f.decode_v32_torch(v32)),
        "encode_v4": (shape4, bf16_4 + kv4,
                      lambda kw: f.encode_v4_triton(lat4, rope, block_size, out4, **kw),
                      lambda: f.encode_v4_torch(lat4, rope, block_size, out4)),
        "decode_v4": (shape4, bf16_4 + kv4, lambda kw: f.decode_v4_triton(pages, tokens, block_size, **kw),
                      lambda: f.decode_v4_torch(pages, tokens, block_size)),
    }
    first_seen: set[str] = set()  # ops timed once already: only their first row gets the baseline
    for native in natives:
        for block_t, warps in configs:
            shape_of = f"bt={block_t} w={warps}" if block_t else "default"
            path = "native" if native else "portable"
            for op in ops:
                shape, moved, kernel, reference = timed[op]
                encode = op.startswith("encode")
                for variant, launches in specs if native and encode else [(None, None)]:
                    if launches and (block_t, warps) not in launches:
                        continue
                    launch_args: _EncodeLaunch = {"native": native, "block_t": block_t, "num_warps": warps}
                    config = f"{path} {shape_of}" if variant is None else (
                        f"{variant} {block_t}x{warps}" if block_t else f"{variant} default")
                    if encode:
                        launch_args["variant"] = variant
                    call = dict(launch_args)
                    launch = (dict(variant=variant or "default", block_t=block_t, num_warps=warps)
                              if native and encode else {})
                    naive = None if op in first_seen else reference
                    first_seen.add(op)
                    rows.append(bench.row(op, shape, config, moved, lambda: kernel(call), naive, **launch))
    return rows


def _all_pairs(group: int, device: torch.device, top: int = 0x7F81) -> torch.Tensor:
    """int16 bf16 patterns [G, group]: every pair of a magnitude `a` (0 to Inf) and a value x with
    |x| <= a, a first in each group; then groups mixing NaN patterns (all 254) with values under
    their amax; then groups of NaN only. The encoders treat a group as its amax and its values,
    so this covers every input a group can present to the quotient and the scale."""
    per = group - 1
    a = torch.arange(top, device=device, dtype=torch.int64)  # magnitudes; 0x7F80 is Inf
    count = 2 * (a + 1)  # both signs of every magnitude <= a
    ng = (count + per - 1) // per
    ga = torch.repeat_interleave(a, ng)
    first = torch.repeat_interleave(torch.cumsum(ng, 0) - ng, ng)
    j = (torch.arange(ga.numel(), device=device) - first).to(torch.int32)
    idx = j[:, None] * per + torch.arange(per, device=device, dtype=torch.int32)[None, :]
    idx %= torch.repeat_interleave(count, ng).to(torch.int32)[:, None]
    pairs = torch.cat([ga[:, None].to(torch.int32), (idx >> 1) | ((idx & 1) << 15)], 1)
    del idx, j, first
    nan = torch.arange(0x7F81, 0x8000, device=device, dtype=torch.int32)
    nan = torch.cat([nan, nan | 0x8000])  # all 254 NaN patterns
    gen = torch.Generator(device=device).manual_seed(5)
    k = group // 2
    mixed_x = torch.rand(a.numel(), group - 1 - k, device=device, generator=gen) * (a + 1)[:, None]
    mixed_x = mixed_x.to(torch.int32)  # magnitudes <= a
    mixed_x |= torch.randint(0, 2, mixed_x.shape, device=device, generator=gen, dtype=torch.int32) << 15
    mixed_nan = nan[torch.arange(a.numel() * k, device=device) % nan.numel()].view(a.numel(), k)
    mixed = torch.cat([a[:, None].to(torch.int32), mixed_nan, mixed_x], 1)
    only_nan = nan[torch.arange(4 * group, device=device) % nan.numel()].view(4, group)
    return torch.cat([pairs, mixed, only_nan]).to(torch.int16)


def check_exhaustive(bench: Bench, variants: list[str | None]) -> None:
    """Every native encoder variant against the portable kernel (integer arithmetic, the bits of
    the torch reference) on `_all_pairs`: bit-exact rows and pages, or a failed check."""
    from pdserve.kernels import fp8_ds_mla as f

    for codec, group, groups_per_token in (("v32", 128, 4), ("v4", 64, 7)):
        op = f"encode_{codec}"
        pairs = _all_pairs(group, bench.device)
        pad = -pairs.shape[0] % groups_per_token
        pairs = torch.cat([pairs, pairs.new_zeros(pad, group)])
        latent = pairs.view(-1, group * groups_per_token).view(torch.bfloat16)
        tokens = latent.shape[0]
        rope = torch.randint(-32768, 32768, (tokens, f.ROPE), device=bench.device,
                             dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        enc = (functools.partial(f.encode_v32_triton, latent, rope) if codec == "v32"
               else functools.partial(f.encode_v4_triton, latent, rope, 64))
        want = enc(native=False)
        for variant in variants:
            variant = variant or f.NATIVE_ENCODE[codec][0]
            got = enc(native=True, variant=variant)
            bad = int((got != want).any(dim=-1).sum())
            print(f"exhaustive {op} variant={variant}: {pairs.shape[0]} groups, {tokens} tokens, "
                  f"{bad} differing rows", flush=True)
            bench.check(f"exhaustive {op} variant={variant}", bad == 0, (op, variant))
            del got
        del pairs, latent, rope, want, enc
        torch.cuda.empty_cache()


def _compile_one(job: tuple[str, str | None, int | None, int | None, int]) -> str:
    """Launch one native encoder on a few tokens so its kernel lands in Triton's cache."""
    from pdserve.kernels import fp8_ds_mla as f

    op, variant, block_t, warps, block_size = job
    start = time.perf_counter()
    tokens, width = 64, f.V32_NOPE if op == "encode_v32" else f.V4_NOPE
    latent = torch.zeros(tokens, width, dtype=torch.bfloat16, device="cuda")
    rope = torch.zeros(tokens, f.ROPE, dtype=torch.bfloat16, device="cuda")
    kw: _EncodeLaunch = {"native": True, "variant": variant, "block_t": block_t, "num_warps": warps}
    if op == "encode_v32":
        f.encode_v32_triton(latent, rope, **kw)
    else:
        f.encode_v4_triton(latent, rope, block_size, **kw)
    torch.cuda.synchronize()
    return f"{op} {variant} {block_t}x{warps} {time.perf_counter() - start:.1f}s"


def precompile(variants: list[str | None], configs: list[tuple[int | None, int | None]],
               block_size: int, jobs: int) -> None:
    """Fill Triton's on-disk cache with every native encoder launch of the run, `jobs` at a time
    (a cache miss costs about a second of compiling, serially, otherwise)."""
    import concurrent.futures
    import multiprocessing

    work = []
    for name, launches in map(_variant_spec, variants):
        for block_t, warps in [(None, None)] + (launches or configs):
            for op in ("encode_v32", "encode_v4"):
                work.append((op, name, block_t, warps, block_size))
    start = time.perf_counter()
    try:
        with concurrent.futures.ProcessPoolExecutor(
                jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(_compile_one, work))
        print(f"precompiled {len(done)} launches in {time.perf_counter() - start:.1f}s", flush=True)
    except Exception as exc:  # noqa: BLE001 - only a head start; the run compiles what is missing
        print(f"precompile failed ({exc!r}); going on", flush=True)


def best_native_encode(path: str) -> str:
    """From a `--json` file of a sweep: the fastest variant and launch of each native encoder that
    passed every check, as a `--native-encode` value."""
    with open(path) as fh:
        data = json.load(fh)
    failed = {tuple(x) for x in data.get("failed_variants", [])}
    picks = []
    for op, key in (("encode_v32", "v32"), ("encode_v4", "v4")):
        rows = [r for r in data["rows"] if r["op"] == op and r.get("variant") and r.get("block_t")
                and (op, r["variant"]) not in failed]
        if rows:
            best = max(rows, key=lambda r: r["gbps"])
            picks.append(f"{key}={best['variant']}:{best['block_t']}x{best['num_warps']}")
    return ",".join(picks)


def _set_native_encode(text: str) -> None:
    """'v32=words:8x2,v4=float:4x2' -> fp8_ds_mla.NATIVE_ENCODE for this run."""
    from pdserve.kernels import fp8_ds_mla as f

    for item in filter(None, text.split(",")):
        key, _, spec = item.partition("=")
        variant, _, launch = spec.partition(":")
        block_t, warps = (int(v) for v in launch.split("x"))
        if key not in f.NATIVE_ENCODE or variant not in f.ENCODE_VARIANTS:
            raise SystemExit(f"bad --native-encode item {item!r}")
        f.NATIVE_ENCODE[key] = (variant, block_t, warps)


# ---------------------------------------------------------------- CLI


def _pairs(text: str) -> list[tuple[int | None, int | None]]:
    """'AxB,default,...' -> [(A, B), (None, None), ...]; None picks the kernel's own default."""
    pairs: list[tuple[int | None, int | None]] = []
    for item in text.split(","):
        if item == "default":
            pairs.append((None, None))
        else:
            first, second = (int(v) for v in item.split("x"))
            pairs.append((first, second))
    return pairs


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
    parser.add_argument("--codec-ops", default=",".join(CODEC_OPS), help="codecs to time (default: all)")
    parser.add_argument("--encode-variants", default="default",
                        help="native encoder variants to time and check, from "
                             "fp8_ds_mla.ENCODE_VARIANTS; 'default' is the launcher's (default: %(default)s)")
    parser.add_argument("--native-encode", default="",
                        help="override the native encoders' defaults for this run, e.g. "
                             "'v32=words:8x2,v4=words:8x2' (variant:TOKENSxWARPS)")
    parser.add_argument("--native-only", action="store_true",
                        help="time only the native (sm89+) codec path")
    parser.add_argument("--exhaustive", action="store_true",
                        help="check every native encoder variant against the portable kernel on all "
                             "(amax, value) pairs of bf16 magnitudes (about 2 GiB a codec)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="compile the native encoders' launches in this many processes first")
    parser.add_argument("--best-from", metavar="JSON",
                        help="print the fastest checked native encoders of a sweep's --json file as a "
                             "--native-encode value, and exit")
    parser.add_argument("--skip-paged", action="store_true")
    parser.add_argument("--skip-codecs", action="store_true")
    parser.add_argument("--warmup-ms", type=int, default=50)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--json", help="also write every row to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.best_from:
        print(best_native_encode(args.best_from))
        return 0
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
    _set_native_encode(args.native_encode)
    from pdserve.kernels import fp8_ds_mla

    print("native encoder defaults: " + ", ".join(
        f"{k}={v}:{bt}x{w}" for k, (v, bt, w) in fp8_ds_mla.NATIVE_ENCODE.items())
        + f"; portable and decoders: {fp8_ds_mla.BLOCK_T}x{fp8_ds_mla.NUM_WARPS} (tokens x warps)")
    variants = [None if v == "default" else v for v in args.encode_variants.split(",")]
    native_ok = cc >= (8, 9)
    if args.jobs > 1 and native_ok and not args.skip_codecs:
        precompile(variants, _pairs(args.codec_configs), args.codec_block_size, args.jobs)
    if args.exhaustive and native_ok:
        check_exhaustive(bench, [_variant_spec(v)[0] for v in variants])
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
        natives = ([] if args.native_only else [False]) + ([True] if native_ok else [])
        emit(bench_codecs(bench, min_bytes, args.codec_block_size, natives,
                          _pairs(args.codec_configs), variants, tuple(args.codec_ops.split(","))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [dict(asdict(r), vs_copy=r.vs_copy) for r in rows],
                       "failures": bench.failures,
                       "failed_variants": sorted(bench.failed_variants)}, f, indent=1)
    print("all checks passed" if not bench.failures else f"{len(bench.failures)} checks FAILED")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
