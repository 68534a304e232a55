"""`pdserve bench router`: what the router alone adds to a request, against the same upstream called directly.

The upstream is `router_stub.py`, which answers at once, so the figures are the router's
(and the load generator's, which is the same on both sides). For each concurrency level
the same number of streamed requests goes straight to the stub and through a `pdserve
router` in front of it, alternating round by round so drift in the machine's load lands on
both sides. Printed per level: TTFT p50 and p99 of each side, what the router adds at p50
and p99, requests per second of each side and their ratio, the router's CPU time per
request (from /proc, so a slower router is told apart from a busier machine), and what the
router adds to the first request of a new connection (p50), which the steady-state
figures leave out: each side keeps its connections for the whole level. Before it starts,
it measures how often the machine takes a core away from a running process (cpu_stalls.py)
and prints that under the table with the share of routed requests such stalls would reach:
where that share is near 1%, the p99 is the machine's.

The load generator is aiohttp in this process, the stub and the router are child processes:
three processes share the machine, as client, proxy and engine would.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import aiohttp
import numpy as np

from pdserve.bench import cpu_stalls, processes
from pdserve.bench.router_stub import MODEL
from pdserve.worker.config import split_passthrough


@dataclass(frozen=True)
class RouterBenchConfig:
    levels: tuple[int, ...] = (1, 16, 64)
    requests: int = 2000  # per level and side, over all rounds
    rounds: int = 2
    warmup: int = 200
    tokens: int = 4
    prompt_chars: int = 512
    route: str = "completions"
    stall_probe_s: float = 3.0  # seconds of cpu_stalls.probe before the run (0: none)
    result: Path | None = None
    router_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 1:
            raise ValueError("--concurrency values must be at least 1")
        if self.requests < self.rounds or self.rounds < 1 or self.tokens < 1 or self.warmup < 0:
            raise ValueError("--requests must be at least --rounds (>= 1); --tokens at least 1; --warmup >= 0")
        if self.stall_probe_s < 0:
            raise ValueError("--stall-probe-s must be >= 0")
        if self.route not in ("completions", "chat"):
            raise ValueError("--route must be completions or chat")


@dataclass
class Side:
    """One side's samples at one level, over all rounds."""

    ttft: list[float]
    seconds: float = 0.0  # wall time of its runs
    errors: int = 0
    router_cpu_s: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.ttft) / self.seconds if self.seconds else math.nan

    def pct_ms(self, p: float) -> float:
        return float(np.percentile(np.asarray(self.ttft) * 1000.0, p)) if self.ttft else math.nan


def _body(cfg: RouterBenchConfig) -> bytes:
    text = ("lorem ipsum " * (cfg.prompt_chars // 12 + 1))[: cfg.prompt_chars]
    common = {"model": MODEL, "max_tokens": cfg.tokens, "stream": True, "temperature": 0.0}
    if cfg.route == "chat":
        return json.dumps({**common, "messages": [{"role": "user", "content": text}]}).encode()
    return json.dumps({**common, "prompt": text}).encode()


def _path(cfg: RouterBenchConfig) -> str:
    return "/v1/chat/completions" if cfg.route == "chat" else "/v1/completions"


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, tokens: int, marker: bytes) -> float | None:
    """TTFT of one streamed request (None when it failed or lost tokens)."""
    t0 = time.perf_counter()
    ttft: float | None = None
    seen = b""
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            await resp.read()
            return None
        async for chunk in resp.content.iter_any():
            if ttft is None and marker in chunk:
                ttft = time.perf_counter() - t0
            seen += chunk
    if seen.count(marker) != tokens or not seen.endswith(b"data: [DONE]\n\n"):
        return None
    return ttft


@asynccontextmanager
async def _client(concurrency: int) -> AsyncIterator[aiohttp.ClientSession]:
    """One side's client for a whole level: `concurrency` keep-alive connections, reused by every round."""
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60.0)) as session:
        yield session


async def _run(session: aiohttp.ClientSession, url: str, body: bytes, cfg: RouterBenchConfig, concurrency: int,
               count: int, side: Side) -> None:
    """`count` requests at `concurrency` in flight, added to `side`.

    The load generator's own garbage collection is off while they run and done after: a
    full collection of this process took 25-38 ms on the 2-core VM and landed on whichever
    side was running, as a tail that was neither side's.
    """
    marker = b'"content":" t' if cfg.route == "chat" else b'"text":" t'
    todo = iter(range(count))

    async def worker() -> None:
        for _ in todo:
            try:
                ttft = await _one(session, url, body, cfg.tokens, marker)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ttft = None
            if ttft is None:
                side.errors += 1
            else:
                side.ttft.append(ttft)

    gc.disable()
    try:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        side.seconds += time.perf_counter() - start
    finally:
        gc.enable()
        gc.collect()


async def _measure(cfg: RouterBenchConfig, stub_url: str, router_url: str, router_pid: int) -> list[dict[str, Any]]:
    """Every level, each side on its own keep-alive connections.

    A level's first `concurrency` requests of each side open its connections: they are kept
    apart (the new-connection column), because how often a client reconnects is the
    client's choice, and mixing them in would make the tail a count of reconnections.
    """
    body, path = _body(cfg), _path(cfg)
    for url in (stub_url, router_url):  # both processes' first requests (lazy imports, caches) out of the figures
        async with _client(4) as session:
            await _run(session, url + path, body, cfg, 4, cfg.warmup, Side([]))
    rows = []
    for conc in cfg.levels:
        direct, routed = Side([]), Side([])
        direct_new, routed_new = Side([]), Side([])
        async with _client(conc) as to_stub, _client(conc) as to_router:
            await _run(to_stub, stub_url + path, body, cfg, conc, conc, direct_new)
            await _run(to_router, router_url + path, body, cfg, conc, conc, routed_new)
            per_round = cfg.requests // cfg.rounds
            for _ in range(cfg.rounds):
                await _run(to_stub, stub_url + path, body, cfg, conc, per_round, direct)
                cpu = processes.cpu_seconds(router_pid)
                await _run(to_router, router_url + path, body, cfg, conc, per_round, routed)
                routed.router_cpu_s += processes.cpu_seconds(router_pid) - cpu
        rows.append(_row(conc, direct, routed, direct_new, routed_new))
    return rows


def _row(conc: int, direct: Side, routed: Side, direct_new: Side, routed_new: Side) -> dict[str, Any]:
    added50 = routed.pct_ms(50) - direct.pct_ms(50)
    added99 = routed.pct_ms(99) - direct.pct_ms(99)
    return {
        "concurrency": conc,
        "direct_ttft_p50_ms": direct.pct_ms(50), "direct_ttft_p99_ms": direct.pct_ms(99),
        "router_ttft_p50_ms": routed.pct_ms(50), "router_ttft_p99_ms": routed.pct_ms(99),
        "added_p50_ms": added50, "added_p99_ms": added99,
        "added_p99_over_p50": added99 / added50 if added50 > 0 else math.nan,
        "direct_rps": direct.rps, "router_rps": routed.rps,
        "rps_ratio": routed.rps / direct.rps if direct.rps else math.nan,
        "router_cpu_ms_per_request": 1000.0 * routed.router_cpu_s / max(1, len(routed.ttft)),
        "new_connection_added_p50_ms": routed_new.pct_ms(50) - direct_new.pct_ms(50),
        "errors": direct.errors + routed.errors + direct_new.errors + routed_new.errors,
    }


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'conc':>5}{'direct p50':>12}{'p99':>8}{'router p50':>12}{'p99':>8}{'added p50':>11}{'p99':>8}"
          f"{'p99/p50':>9}{'direct rps':>12}{'router rps':>12}{'ratio':>7}{'router CPU ms/req':>19}{'new conn added p50':>20}"
          f"{'errors':>8}")
    for r in rows:
        print(f"{r['concurrency']:>5}{r['direct_ttft_p50_ms']:>12.2f}{r['direct_ttft_p99_ms']:>8.2f}"
              f"{r['router_ttft_p50_ms']:>12.2f}{r['router_ttft_p99_ms']:>8.2f}{r['added_p50_ms']:>11.2f}"
              f"{r['added_p99_ms']:>8.2f}{r['added_p99_over_p50']:>9.2f}{r['direct_rps']:>12.0f}"
              f"{r['router_rps']:>12.0f}{r['rps_ratio']:>7.2f}{r['router_cpu_ms_per_request']:>19.3f}"
              f"{r['new_connection_added_p50_ms']:>20.2f}{r['errors']:>8}")


def print_stalls(cores: list[cpu_stalls.CoreStalls], rows: list[dict[str, Any]]) -> None:
    """The machine's stalls, and per level the share of routed requests they would reach."""
    print(f"this machine, measured before the run ({cores[0].seconds:.0f} s, a busy loop pinned to each core):")
    print(cpu_stalls.describe(cores))
    for r in rows:
        share = cpu_stalls.share_met(cores, r["router_ttft_p50_ms"] / 1000.0)
        print(f"c={r['concurrency']}: about {100 * share:.1f}% of routed requests meet such a stall")


def run(cfg: RouterBenchConfig) -> list[dict[str, Any]]:
    """Start the stub and a router in front of it, measure every level, stop both."""
    with processes.router_stub(cfg.tokens) as stub_url, \
            processes.router("--decode", stub_url, "--log-level", "warning", *cfg.router_args) as (router_url, proc):
        return asyncio.run(_measure(cfg, stub_url, router_url, proc.pid))


def build_parser() -> argparse.ArgumentParser:
    d = RouterBenchConfig()  # its defaults
    p = argparse.ArgumentParser(
        prog="pdserve bench router",
        description="The router alone in front of a fast stub upstream, against the stub called directly: "
                    "added TTFT p50/p99 and requests/s per concurrency. Arguments after `--` go to the router.",
        allow_abbrev=False,
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=list(d.levels))
    p.add_argument("--requests", type=int, default=d.requests, help="per level and side")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="direct and router runs alternate this many times per level")
    p.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured requests to each side first")
    p.add_argument("--tokens", type=int, default=d.tokens, help="token events per answer")
    p.add_argument("--prompt-chars", type=int, default=d.prompt_chars)
    p.add_argument("--route", choices=("completions", "chat"), default=d.route)
    p.add_argument("--stall-probe-s", type=float, default=d.stall_probe_s,
                   help="seconds spent first measuring how often the machine takes a core away (0: skip)")
    p.add_argument("--result", type=Path, default=None, help="also write the rows to this JSON file")
    return p


def config_from_args(argv: Sequence[str]) -> RouterBenchConfig:
    argv, router_args = split_passthrough(argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return RouterBenchConfig(levels=tuple(a.concurrency), requests=a.requests, rounds=a.rounds, warmup=a.warmup,
                                 tokens=a.tokens, prompt_chars=a.prompt_chars, route=a.route,
                                 stall_probe_s=a.stall_probe_s, result=a.result,
                                 router_args=tuple(router_args))
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    cores = cpu_stalls.probe(cfg.stall_probe_s) if cfg.stall_probe_s else []
    try:
        rows = run(cfg)
    except (RuntimeError, OSError) as exc:
        print(f"pdserve bench router: {exc}", file=sys.stderr)
        return 1
    print_rows(rows)
    if cores:
        print_stalls(cores, rows)
    if cfg.result is not None:
        stalls = [{"cpu": c.cpu, "per_second": c.per_second, "lost_fraction": c.lost_fraction,
                   "longest_ms": 1000 * max(c.gaps_s, default=0.0)} for c in cores]
        cfg.result.write_text(json.dumps({"config": {**asdict(cfg), "result": str(cfg.result)}, "rows": rows,
                                          "cpu_stalls": stalls}, indent=2) + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1
