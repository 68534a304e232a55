"""`pdserve bench connector-tpot`: what running with a KV connector costs an engine's decode steps.

Three engines of one tiny model, up at once: `none` (no connector), `noop` (a connector that
moves nothing, noop_connector.py: what vLLM costs an engine that has any connector) and
`pdserve` (PDServeConnector, kv_both, with a store, as a decode worker runs it). Each round
sends one streamed, decode-heavy request (a fresh short prompt, --output-len tokens, EOS
ignored) to every engine in turn, one at a time, the order rotated every round, and takes each
request's TPOT and TTFT (a short prompt's TTFT is the engine's floor, which a P/D decode leg pays on
top of its KV load). Rounds are paired because the machine's speed drifts more between runs than
the cost measured here: each ratio is the median over rounds of two engines' TPOT in the same
round. pdserve/none is the connector's cost to decode (what a P/D decode engine pays per step),
noop/none the part any connector costs in vLLM, pdserve/noop the part that is pdserve's own.

The engines run with the tiny model's engine settings of `pdserve up` (one unpinned OpenMP thread
each, TINY_ENGINE_ENV), so three fit on a small CPU machine as a P/D stack's engines do. Flags after
`--` go to all three.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

import httpx

from pdserve.bench.connector_ttft import engine_process, served_model, start_engine
from pdserve.bench.serve import paired_schedule
from pdserve.deploy.ports import free_port
from pdserve.deploy.tiny_model import CONFIGS, TINY_ENGINE_ENV
from pdserve.deploy.tiny_model import main as tiny_main
from pdserve.worker.config import split_passthrough

ENGINES = ("none", "noop", "pdserve")
RATIOS = (("pdserve", "none"), ("noop", "none"), ("pdserve", "noop"))


def timed_stream(port: int, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT, TPOT) in ms. TPOT is the mean per generated token after the first (as vLLM's benchmarks count
    it): EOS is ignored, so the stream holds exactly `output_len` tokens."""
    body = {"model": served_model(port), "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True}
    arrivals = []
    sent = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    if len(arrivals) < 2:
        raise RuntimeError(f"engine on port {port} streamed {output_len} tokens in {len(arrivals)} chunk(s)")
    # Per token, not per chunk: an API server that falls behind its engine sends several tokens in one chunk.
    return 1000.0 * (arrivals[0] - sent), 1000.0 * (arrivals[-1] - arrivals[0]) / (output_len - 1)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of a[i] / b[i]: one round's two requests ran seconds apart."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench connector-tpot", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="requests per engine (one per round)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (fresh ones every request)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument("--model", type=Path, default=None, help="model dir (default: a fresh tiny model of --arch)")
    p.add_argument("--arch", choices=sorted(a for a in CONFIGS if a.startswith("deepseek")), default="deepseek_v3")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv, engine_extra = split_passthrough(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.output_len < 2 or args.input_len < 1:
        build_parser().error("--rounds and --input-len must be at least 1, --output-len at least 2")
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-connector-tpot-"))
    model = args.model or work / "model"
    if args.model is None:
        tiny_main(["--arch", args.arch, "--out", str(model)])
    max_len = args.input_len + args.output_len + 16
    store_port, store_http = free_port(), free_port()
    store_argv = [sys.executable, "-m", "pdserve.deploy.cli", "kvstore", "--port", str(store_port),
                  "--http-port", str(store_http), "--l1-size-gb", "1"]
    configs = {
        "none": None,
        "noop": {"kv_connector": "NoopConnector", "kv_connector_module_path": "pdserve.bench.noop_connector",
                 "kv_role": "kv_both"},
        "pdserve": {"kv_connector": "PDServeConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"kvstore_url": f"tcp://127.0.0.1:{store_port}"}},
    }
    rng = random.Random(0)
    tpots: dict[str, list[float]] = {name: [] for name in ENGINES}
    ttfts: dict[str, list[float]] = {name: [] for name in ENGINES}
    with ExitStack() as up:
        up.enter_context(engine_process(store_argv, f"http://127.0.0.1:{store_http}/health", work / "kvstore.log"))
        ports = {}
        for name in ENGINES:
            ports[name], ctx = start_engine(model, configs[name], max_len, work, name, engine_extra, TINY_ENGINE_ENV)
            up.enter_context(ctx)
        def fresh() -> list[int]:
            return [rng.randrange(3, 1000) for _ in range(args.input_len)]

        for name in ENGINES:  # warm-up: each engine's first steps are slower
            timed_stream(ports[name], fresh(), args.output_len)
        for order in paired_schedule(ENGINES, args.rounds):
            for name in order:
                ttft, tpot = timed_stream(ports[name], fresh(), args.output_len)
                ttfts[name].append(ttft)
                tpots[name].append(tpot)
    p50 = {n: statistics.median(v) for n, v in tpots.items()}
    ttft_p50 = {n: statistics.median(v) for n, v in ttfts.items()}
    ratios = {f"{a}/{b}": paired_ratio(tpots[a], tpots[b]) for a, b in RATIOS}
    print(f"TPOT p50 over {args.rounds} rounds ({args.input_len}-token prompts, {args.output_len} tokens each): "
          + ", ".join(f"{n} {v:.2f} ms" for n, v in p50.items()))
    print("paired ratios (median over rounds): " + ", ".join(f"{k} x{v:.3f}" for k, v in ratios.items()))
    print(f"TTFT p50 (the engine's floor at {args.input_len} tokens): "
          + ", ".join(f"{n} {v:.2f} ms" for n, v in ttft_p50.items()))
    print("  pdserve/none: the connector's cost to decode; noop/none: vLLM's cost of having any connector; "
          "pdserve/noop: pdserve's own part")
    if args.json:
        args.json.write_text(json.dumps({"tpot_p50_ms": p50, "paired_ratio": ratios, "tpot_ms_by_round": tpots,
                                            "ttft_p50_ms": ttft_p50, "ttft_ms_by_round": ttfts},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
