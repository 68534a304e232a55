"""`pdserve bench connector`: time to first token, recomputed vs loaded, in one run.

For each prompt length it measures on a tiny DeepSeek (CPU, or GPU where vLLM has CUDA):
  recompute  - the engine computes the whole prompt (first sight of it);
  pdserve    - the same prompt again, its KV loaded from our store by PDServeConnector;
  example    - the same prompt loaded through vLLM's own ExampleConnector (files on disk),
               the baseline a vLLM user already has.
Engines run one at a time so they never compete. MLA on the CPU has no local prefix
cache; on a GPU the engines run with --no-enable-prefix-caching, so there too a repeated
prompt is either recomputed or loaded, never cached; a third GPU engine with prefix caching on and no
connector gives the floor (the repeat answered from device memory). It also prints the connector's copy
throughput inside the engine (its vllm:pdserve_gather/scatter counters) beside a
device-to-device copy measured in the same run.

Flags after `--` go to both engines (e.g. `-- --kv-cache-dtype fp8_ds_mla` with
`--arch deepseek_v32`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import httpx

from pdserve.worker.config import split_passthrough
from pdserve.deploy.ports import free_port
from pdserve.deploy.tiny_model import CONFIGS
from pdserve.deploy.tiny_model import main as tiny_main
from pdserve.bench.engine_counters import describe_load_phases, load_phase_means, read_counters

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "HF_HUB_OFFLINE": "1"}


@contextmanager
def engine_process(argv: list[str], health: str, log: Path, timeout_s: float = 600,
                   env_extra: Mapping[str, str] | None = None) -> Iterator[None]:
    env = {**os.environ, **ENGINE_ENV, **(env_extra or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}; log: {log}")
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[:4]} not ready after {timeout_s:.0f} s; log: {log}")
            time.sleep(1)
        yield
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it after 30 s. A group already gone (its leader died while starting)
    is left alone, so the error that said why is the one raised."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def start_engine(model: Path, kv_config: dict | None, max_len: int, logdir: Path, name: str, extra: Sequence[str],
                 env_extra: Mapping[str, str] | None = None):
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_len), "--max-num-seqs", "4", "--enforce-eager",
        *(["--kv-transfer-config", json.dumps(kv_config)] if kv_config else []), *extra,
    ]
    return port, engine_process(argv, f"http://127.0.0.1:{port}/health", logdir / f"{name}.log", env_extra=env_extra)


def _ttft(port: int, prompt: list[int]) -> float:
    """Latency of a one-token completion: the prefill (or load) and one sampling step."""
    body = {"model": served_model(port), "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed


def served_model(port: int, _cache: dict[int, str] = {}) -> str:
    if port not in _cache:
        _cache[port] = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    return _cache[port]


def _measure(port: int, prompts: dict[int, list[int]], repeats: int,
             phases: dict[int, dict[str, float]] | None = None) -> dict[int, tuple[float, float]]:
    """Per length: (first-sight TTFT, median TTFT of the repeats of the same prompt); with `phases`,
    also where the connector's loads of the repeats spent their time (its counters, per length)."""
    _ttft(port, [7] * 32)  # warm-up
    out = {}
    for n, prompt in prompts.items():
        first = _ttft(port, prompt)
        before = read_counters(f"http://127.0.0.1:{port}") if phases is not None else None
        again = statistics.median(_ttft(port, prompt) for _ in range(repeats))
        out[n] = (first, again)
        if phases is not None:
            phases[n] = _settled_phases(port, before, repeats)
    return out


def _settled_phases(port: int, before: dict[str, float] | None, loads: int) -> dict[str, float]:
    """The load phases once vLLM has shipped the counters of `loads` more loads to /metrics
    (it does so on its logging interval); bounded, then whatever has arrived."""
    deadline = time.monotonic() + 15
    while True:
        after = read_counters(f"http://127.0.0.1:{port}")
        done = (after or {}).get("loads", 0.0) - (before or {}).get("loads", 0.0) >= loads
        if done or time.monotonic() > deadline:
            return load_phase_means(before, after)
        time.sleep(0.5)


def _copy_rates(port: int) -> dict[str, float]:
    """GB/s of the connector's copies out of (gather) and into (scatter) the paged cache: over the
    copies' GPU time (`gather_gpu`, `scatter_gpu`; CUDA only) and over their wall time (`gather`,
    `scatter`: a save's wall time includes waiting for the step's forward the engine queued before it)."""
    totals = read_counters(f"http://127.0.0.1:{port}") or {}
    return {f"{kind}{clock}": totals.get(f"{kind}_bytes", 0.0) / totals[f"{kind}{clock}_seconds"] / 1e9
            for kind in ("gather", "scatter") for clock in ("", "_gpu") if totals.get(f"{kind}{clock}_seconds")}


def _d2d_copy_gbps(nbytes: int = 1 << 30) -> float | None:
    """Device-to-device copy on this GPU, bytes read plus written per second (None without CUDA)."""
    if not _cuda():
        return None
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    gbps = 10 * 2 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench connector", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192], help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3, help="loads measured per length (median reported)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--model", type=Path, default=None, help="model dir (default: a fresh tiny model of --arch)")
    p.add_argument("--arch", choices=sorted(a for a in CONFIGS if a.startswith("deepseek")), default="deepseek_v3",
                   help="architecture of the tiny model")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv, engine_extra = split_passthrough(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if _cuda():  # a GPU engine's own prefix cache would answer the repeats
        engine_extra = ["--no-enable-prefix-caching", *engine_extra]
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-connector-"))
    model = args.model or work / "model"
    if args.model is None:
        tiny_main(["--arch", args.arch, "--out", str(model)])
    rng = random.Random(0)
    prompts = {n: [rng.randrange(3, 1000) for _ in range(n)] for n in args.lengths}
    max_len = max(args.lengths) + 64

    store_port, store_http = free_port(), free_port()
    store_argv = [sys.executable, "-m", "pdserve.deploy.cli", "kvstore", "--port", str(store_port),
                  "--http-port", str(store_http), "--chunk-size", str(args.chunk_size), "--l1-size-gb", "2"]
    ours_cfg = {"kv_connector": "PDServeConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"kvstore_url": f"tcp://127.0.0.1:{store_port}"}}
    with engine_process(store_argv, f"http://127.0.0.1:{store_http}/health", work / "kvstore.log"):
        port, ctx = start_engine(model, ours_cfg, max_len, work, "pdserve", engine_extra)
        with ctx:
            phases: dict[int, dict[str, float]] = {}
            ours = _measure(port, prompts, args.repeats, phases)
            rates = _copy_rates(port)
    example_cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": str(work / "example")}}
    port, ctx = start_engine(model, example_cfg, max_len, work, "example", engine_extra)
    with ctx:
        example = _measure(port, prompts, args.repeats)
    # The floor no connector can beat: vLLM's own prefix cache in device memory (GPU only; the CPU
    # engine has no prefix cache for MLA), no connector at all.
    hbm: dict[int, tuple[float, float]] = {}
    if _cuda():
        plain = [a for a in engine_extra if a != "--no-enable-prefix-caching"]
        port, ctx = start_engine(model, None, max_len, work, "prefix-cache", plain)
        with ctx:
            hbm = _measure(port, prompts, args.repeats)

    rows = []
    print(f"{'tokens':>7} {'recompute s':>12} {'pdserve s':>10} {'example s':>10} {'pdserve/example':>16} "
          f"{'recompute/pdserve':>18} {'vLLM prefix cache s':>20}")
    for n in args.lengths:
        recompute, loaded = ours[n]
        ex = example[n][1]
        floor = hbm[n][1] if n in hbm else math.nan
        rows.append({"tokens": n, "recompute_s": recompute, "pdserve_s": loaded, "example_s": ex,
                     "example_recompute_s": example[n][0], "prefix_cache_s": floor, "pdserve_loads": phases.get(n, {})})
        print(f"{n:>7} {recompute:>12.3f} {loaded:>10.3f} {ex:>10.3f} {loaded / ex:>16.2f} {recompute / loaded:>18.1f} "
              f"{floor:>20.3f}")
    for n in args.lengths:
        print(f"pdserve loads at {n} tokens: {describe_load_phases(phases.get(n, {}))}")
    if hbm:
        print("vLLM prefix cache: the same prompt again on an engine with prefix caching and no connector "
              "(its KV never leaves the GPU): the floor for any connector")
    print("target: pdserve/example <= 0.50 at every length")
    d2d = _d2d_copy_gbps()
    for kind, what in (("gather", "save: paged cache -> host"), ("scatter", "load: host -> paged cache")):
        if kind not in rates:
            continue
        gpu = rates.get(f"{kind}_gpu")
        on_gpu = f"{gpu:.1f} GB/s of GPU time" + (f" ({gpu / d2d:.3g}x of a {d2d:.0f} GB/s device-to-device copy)"
                                                   if d2d else "") + ", " if gpu else ""
        print(f"connector copy in the engine, {what}: {on_gpu}{rates[kind]:.2f} GB/s of wall time")
    rows.append({"copy_gbps": rates, "d2d_copy_gbps": d2d})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
