"""Compile every pdserve kernel for sm80, sm86, sm89 and sm90, each target named explicitly.

`python -m pdserve.kernels.compile_check` runs Triton's compile API
(`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`) down to a cubin for each
kernel variant and target, so one machine proves the kernels build for the Ampere and Ada cards
the project serves, whatever GPU it has (none is needed). It also reads each PTX and fails on:
- Hopper-only instructions (wgmma, TMA bulk copies) in any variant;
- any fp8 conversion instruction in a portable variant (Ampere has none; those variants convert
  with integer operations);
- flush-to-zero arithmetic in a codec (subnormals must survive);
and reports whether each copy moves 16 bytes per access (ld/st.global.v4, or .v2 of 64-bit
words), which the paged kernels need to reach memory speed.

The native codec variants (hardware fp8 conversions) are built for sm89 and sm90 only; on sm80
and sm86 the script checks that they fail to build for the expected reason (Triton has no fp8e4nv
type there; ptxas refuses the e4m3x2 conversion of the inline-PTX encoders), which is why the
portable ones exist.
Exit status 1 if anything that must build fails or a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

TARGETS = (80, 86, 89, 90)
NATIVE_MIN_CC = 89
HOPPER_ONLY = ("wgmma", "cp.async.bulk", "setmaxnreg")


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: Callable[[], Any]  # returns the JITFunction (imports lazily)
    signature: dict[str, str]
    constexprs: dict[str, Any]
    aligned: tuple[str, ...]  # arguments compiled as multiples of 16, as Triton specializes them
    num_warps: int
    native: bool = False
    codec: bool = False


def _paged(scatter: bool, word: str) -> Variant:
    from pdserve.kernels.paged import NUM_WARPS, TILE_BYTES

    def kernel():
        from pdserve.kernels.paged_triton import paged_copy_kernel
        return paged_copy_kernel

    sig = {"cache_ptr": f"*{word}", "layer_offsets_ptr": "*i64", "block_ids_ptr": "*i64",
           "buf_ptr": f"*{word}", "block_stride": "i32", "block_words": "i32", "last_words": "i32",
           "layer_words": "i32", "num_blocks": "i32", "VEC": "constexpr", "TILE": "constexpr",
           "SCATTER": "constexpr"}
    word_bytes = {"i32": 4, "u8": 1}[word]
    return Variant(
        f"paged_{'scatter' if scatter else 'gather'}_{word}", kernel, sig,
        {"VEC": 16 // word_bytes, "TILE": TILE_BYTES // word_bytes, "SCATTER": scatter},
        ("cache_ptr", "layer_offsets_ptr", "block_ids_ptr", "buf_ptr", "block_stride",
         "block_words", "layer_words"), NUM_WARPS)


_CODEC_SIGNATURES = {
    "encode_v32": ["lat_ptr:*i16", "rope_ptr:*i16", "rows_u8_ptr:*u8", "rows_i32_ptr:*i32",
                   "rows_i16_ptr:*i16", "num_tokens:i32", "lat_stride:i32", "rope_stride:i32"],
    "decode_v32": ["rows_u8_ptr:*u8", "rows_i32_ptr:*i32", "rows_i16_ptr:*i16",
                   "lat_ptr:*i16", "rope_ptr:*i16", "num_tokens:i32"],
    "encode_v4": ["lat_ptr:*i16", "rope_ptr:*i16", "pages_u8_ptr:*u8", "pages_i16_ptr:*i16",
                  "num_tokens:i32", "lat_stride:i32", "rope_stride:i32", "page_stride:i32"],
    "decode_v4": ["pages_u8_ptr:*u8", "pages_i16_ptr:*i16", "lat_ptr:*i16", "rope_ptr:*i16",
                  "num_tokens:i32", "page_stride:i32"],
    "encode_v32_words": ["lat_ptr:*i64", "rope_ptr:*i32", "rows_ptr:*i32", "num_tokens:i32",
                         "lat_stride:i32", "rope_stride:i32"],
    "encode_v4_words": ["lat_ptr:*i64", "rope_ptr:*i32", "pages_u8_ptr:*u8", "pages_i32_ptr:*i32",
                        "num_tokens:i32", "lat_stride:i32", "rope_stride:i32", "page_stride:i32"],
}
_CODEC_SIGNATURES["encode_v32_float"] = _CODEC_SIGNATURES["encode_v32"]
_CODEC_SIGNATURES["encode_v4_float"] = _CODEC_SIGNATURES["encode_v4"]


def _codec(name: str, native: bool) -> Variant:
    """`name` is a kernel of fp8_ds_mla_triton without `_kernel`; the *_float and *_words encoders
    exist only as native variants, built with the launch configuration the launchers default to."""
    from pdserve.kernels.fp8_ds_mla import BLOCK_T, NUM_WARPS, _encode_launch

    def kernel():
        from pdserve.kernels import fp8_ds_mla_triton
        return getattr(fp8_ds_mla_triton, f"{name}_kernel")

    sig = dict(item.split(":") for item in _CODEC_SIGNATURES[name])
    block_t, warps = BLOCK_T, NUM_WARPS
    if name.startswith("encode"):  # the launch encode_*_triton picks for this kernel's variant
        _, codec, *kind = name.split("_")
        _, block_t, warps = _encode_launch(codec, native, (kind or ["legacy"])[0], None, None)
    constexprs: dict[str, Any] = {"BLOCK_T": block_t}
    if name.endswith("float"):
        constexprs["NAN_FIX"] = True
    elif not name.endswith("words"):
        constexprs["NATIVE"] = native
    if "v4" in name:
        constexprs = {"BLOCK_SIZE": 64, **constexprs}
    sig.update({k: "constexpr" for k in constexprs})
    aligned = tuple(k for k, v in sig.items() if v.startswith("*") or k.endswith("stride"))
    return Variant(f"{name}_{'native' if native else 'portable'}", kernel, sig, constexprs,
                   aligned, warps, native=native, codec=True)


def variants() -> list[Variant]:
    out = [_paged(s, w) for s in (False, True) for w in ("i32", "u8")]
    out += [_codec(n, nat) for n in ("encode_v32", "decode_v32", "encode_v4", "decode_v4")
            for nat in (False, True)]
    out += [_codec(f"encode_{c}_{v}", True) for c in ("v32", "v4") for v in ("float", "words")]
    return out


def _compile(variant: Variant, cc: int) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = variant.kernel()
    index = {name: i for i, name in enumerate(variant.signature)}
    attrs = {(index[name],): [["tt.divisibility", 16]] for name in variant.aligned}
    src = ASTSource(fn, signature=dict(variant.signature), constexprs=dict(variant.constexprs),
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": variant.num_warps})
    ptx = compiled.asm["ptx"]
    return {"cubin_bytes": len(compiled.asm["cubin"]),
            # 16-byte accesses: v4 of 32-bit words or v2 of 64-bit ones
            "v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.(?:v4|v2\.[bsu]64)", ptx)),
            "v4_stores": len(re.findall(r"st\.global(?:\.\w+)*\.(?:v4|v2\.[bsu]64)", ptx)),
            "fp8_cvt": len(re.findall(r"cvt[.\w]*e4m3", ptx)),
            "ftz": len(re.findall(r"\.ftz", ptx)),
            "hopper_only": [op for op in HOPPER_ONLY if op in ptx]}


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then each error it was raised from or while handling."""
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _root_cause(exc: BaseException, width: int | None = 200) -> str:
    """The innermost error's last line: Triton wraps the reason in source excerpts."""
    *_, exc = _chain(exc)
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return lines[-1][:width]


def _pre_sm89_reason(exc: BaseException) -> str | None:
    """Why a native variant failed to build, if it is the expected pre-sm89 reason."""
    if "fp8e4nv" in _root_cause(exc, width=None):
        return "no fp8e4nv"
    text = "\n".join(map(str, _chain(exc)))
    if re.search(r"Feature 'cvt with \.e4m3x2[^']*' requires \.target sm_89", text):
        return "ptxas: e4m3x2 cvt"
    return None


def _problems(variant: Variant, facts: dict[str, Any]) -> list[str]:
    problems = []
    if facts["hopper_only"]:
        problems.append(f"Hopper-only instructions {facts['hopper_only']}")
    if not variant.native and facts["fp8_cvt"]:
        problems.append("fp8 conversion instruction in a portable variant")
    if variant.codec and facts["ftz"]:
        problems.append("flush-to-zero arithmetic in a codec")
    return problems


def check(targets: tuple[int, ...] = TARGETS) -> tuple[bool, list[dict[str, Any]]]:
    ok, rows = True, []
    for variant in variants():
        for cc in targets:
            row: dict[str, Any] = {"kernel": variant.name, "target": f"sm{cc}"}
            expect_build = not variant.native or cc >= NATIVE_MIN_CC
            start = time.perf_counter()
            try:
                # ptxas failures make Triton print the whole PTX; the reason is in the exception
                with contextlib.redirect_stdout(io.StringIO()):
                    facts = _compile(variant, cc)
            except Exception as exc:  # noqa: BLE001 - any compiler error is a result to report
                row["seconds"] = round(time.perf_counter() - start, 2)
                row["error"] = _root_cause(exc)
                # A native variant must fail on Ampere for the one expected reason, no other:
                # Triton's missing fp8e4nv type, or (inline PTX) ptxas refusing the e4m3x2 cvt.
                reason = _pre_sm89_reason(exc)
                expected = not expect_build and reason is not None
                row["status"] = f"fails as expected ({reason})" if expected else "FAIL"
                ok &= expected
                rows.append(row)
                continue
            row["seconds"] = round(time.perf_counter() - start, 2)
            row.update(facts)
            problems = _problems(variant, facts)
            if not expect_build:
                row["status"] = "UNEXPECTED BUILD (native on pre-sm89)"
            elif problems:
                row["status"] = "FAIL: " + "; ".join(problems)
                ok = False
            else:
                row["status"] = "ok"
            rows.append(row)
    return ok, rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = f"{'kernel':<24} {'target':<6} {'status':<32} {'cubin':>7} {'16B ld/st':>9} {'fp8cvt':>6} {'s':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        vec = f"{r['v4_loads']}/{r['v4_stores']}" if "v4_loads" in r else "-"
        lines.append(f"{r['kernel']:<24} {r['target']:<6} {r['status'][:32]:<32} "
                     f"{r.get('cubin_bytes', '-'):>7} {vec:>9} {r.get('fp8_cvt', '-'):>6} "
                     f"{r['seconds']:>5}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdserve.kernels.compile_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(map(str, TARGETS)),
                        help="compute capabilities, comma-separated (default: %(default)s)")
    parser.add_argument("--json", help="also write the rows to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import triton

    targets = tuple(int(t) for t in args.targets.split(","))
    ok, rows = check(targets)
    print(f"triton {triton.__version__}; targets {', '.join(f'sm{t}' for t in targets)}")
    print(format_rows(rows))
    print("ALL TARGETS OK" if ok else "COMPILE CHECK FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "ok": ok, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
