"""`pdserve bench faults`: break the stack under load, count what clients got, check nothing leaked.

One stack (bench/fault_stack.py: store, 1 prefill + 2 decode workers through Redis,
router) serves a small concurrent load (a few client streams of mixed short and long
prompts, chat and completions, streamed and not) while each scenario in turn does one
thing to it: kill -9 of a prefill engine, of a decode engine, of a decode worker's
own process (its vLLM then shuts down on its own), of the KV store, of Redis, of the router; a prefill and a
decode engine whose core stops while its API server answers (SIGSTOP); clients that hang up
mid-stream; bad inputs. For every request a scenario saw, the outcome is one of: a full answer; a clean OpenAI error (status >= 400 with a
JSON `error` body, or an error event ending a stream); a hang (nothing within HANG_S);
a 5xx without a JSON body; broken (cut stream, short answer, transport error); or an
abort the client made on purpose. After the load stops, the scenario waits out the
store's tail TTL and reads the leaks: live request tails on the store's /stats,
vLLM's running + waiting requests on every engine, and the router's slots (requests it
counts in flight on a worker, or queued for one). A scenario has recovered when every
part is back (restarted ones included) and a normal request gets a full answer.

`tests/test_faults_suite.py` runs `run_scenarios` and asserts on the rows it returns.
`--soak-minutes N` then keeps the load on for N minutes and prints, each minute, the
RSS of every process of the stack and the TTFT p50/p99 of the streamed requests;
`--rss-detail` splits each vLLM tree's RSS into private memory and shared memory (the
store's arena, whose pages count in a process's RSS as they are first touched).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from pdserve.bench.fault_stack import TAIL_TTL_S, FaultStack

HANG_S = 300.0  # per request: only a request that really hangs gets near it
RECOVERY_S = 900.0  # a restarted vLLM takes 35-170 s to start on 2 shared cores
# Whole load on a stack missing a part, from the fault's return; then one stream until the part is back. With
# every prompt new (real P/D traffic), a vLLM restarting beside four streams' engine work on 2 cores took
# 129-142 s to start; the first seconds are the ones that test how the stack serves without it, and one
# stream still tests its return under traffic.
DEGRADED_S = 20.0
SETTLE_S = 3 * TAIL_TTL_S + 60.0  # leaks are read once this has passed or everything is at 0
STALL_SEEN_S = 180.0  # the router's stall windows under this load: 10-40 s (prefill), 30-60 s (decode) on 2 cores
RECONNECT_S = 0.2  # a load stream's pause after a refused connection
KINDS = ("full", "error", "aborted", "hang", "5xx_nojson", "broken")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
WORDS = "the river runs past the old stone bridge where the miller counts his sacks of grain".split()
# Each Load (and each recovery probe) draws a block of salts of its own: prompts repeated from an earlier
# scenario are in the store, go decode-only, and never reach a prefill worker. With every scenario's
# load starting again from the same prompts, the "hung prefill engine" row waited 140-180+ s for a
# prompt new enough to take a prefill leg to the stopped engine (the suite's 180 s bound failed once).
_SALT_BLOCKS = itertools.count(1)
SALT_BLOCK = 1_000_000


def fresh_salts() -> int:
    """The first salt of a block no other caller gets (SALT_BLOCK salts from it on are its own)."""
    return next(_SALT_BLOCKS) * SALT_BLOCK


@dataclass(frozen=True)
class Shape:
    """One kind of request in the mix."""

    route: str
    stream: bool
    words: int
    max_tokens: int


# Short prompts fit in one store chunk; long ones (about 5 tokens a word here) span several.
SHAPES: tuple[Shape, ...] = (
    Shape("chat", True, 12, 16),
    Shape("completions", False, 160, 8),
    Shape("completions", True, 160, 24),
    Shape("chat", False, 12, 16),
    Shape("chat", True, 220, 12),
    Shape("completions", False, 20, 32),
)


@dataclass
class Outcome:
    kind: str
    started: float
    ttft: float | None = None  # streamed answers only
    detail: str = ""


def _prompt(words: int, salt: int) -> str:
    return f"{salt}: " + " ".join(WORDS[(salt + i) % len(WORDS)] for i in range(words))


def request_body(model: str, shape: Shape, salt: int, **extra: Any) -> dict[str, Any]:
    text = _prompt(shape.words, salt)
    prompt = {"messages": [{"role": "user", "content": text}]} if shape.route == "chat" else {"prompt": text}
    body = {"model": model, "max_tokens": shape.max_tokens, "ignore_eos": True, "temperature": 0, **prompt, **extra}
    if shape.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def classify_reply(status: int, body: bytes) -> tuple[str, str]:
    """A whole (non-streamed) reply that is not a 200: its kind, and a detail (status and error message)
    so that a row with unexpected errors says which."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if status >= 400 and isinstance(error, dict):
        return "error", f"{status} {str(error.get('message'))[:120]}"
    return ("5xx_nojson" if status >= 500 else "broken"), f"{status} {body[:120]!r}"


def send(client: httpx.Client, base: str, body: dict[str, Any], route: str,
         abort_after_chunks: int | None = None) -> Outcome:
    """One request through the router, classified. With abort_after_chunks, a streamed request is
    closed by the client after that many data chunks (counted 'aborted' if it got that far)."""
    started = time.monotonic()
    out = Outcome("broken", started)
    try:
        with client.stream("POST", base + PATHS[route], json=body, timeout=HANG_S) as resp:
            if resp.status_code != 200:
                out.kind, out.detail = classify_reply(resp.status_code, resp.read())
                return out
            if not body.get("stream"):
                reply = json.loads(resp.read())
                full = reply.get("usage", {}).get("completion_tokens") == body["max_tokens"]
                out.kind = "full" if full and reply.get("choices") else "broken"
                return out
            out.kind, out.ttft, out.detail = _read_stream(resp, body["max_tokens"], started, abort_after_chunks)
    except httpx.TimeoutException:
        out.kind = "hang"
    except (httpx.HTTPError, ValueError) as exc:
        out.kind, out.detail = "broken", repr(exc)
    return out


def _read_stream(resp: httpx.Response, max_tokens: int, started: float,
                 abort_after: int | None) -> tuple[str, float | None, str]:
    """The stream's kind, its time to first token, and a detail (an error event's message)."""
    ttft, chunks, tokens, done = None, 0, None, False
    for line in resp.iter_lines():
        if time.monotonic() - started > HANG_S:
            return "hang", ttft, ""
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        event = json.loads(line[len("data: "):])
        if "error" in event:
            error = event["error"]
            return "error", ttft, f"stream {str(error.get('message') if isinstance(error, dict) else error)[:120]}"
        chunks += 1
        if ttft is None and event.get("choices"):
            ttft = time.monotonic() - started
        if event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
        if abort_after is not None and chunks >= abort_after:
            return "aborted", ttft, ""  # leaving the `with` closes the connection mid-stream
    return ("full" if done and tokens == max_tokens else "broken"), ttft, f"done={done} tokens={tokens}"


class Load:
    """`streams` client threads sending the SHAPES mix back to back until stopped."""

    def __init__(self, fs: FaultStack, streams: int = 4) -> None:
        self.fs = fs
        self.streams = streams
        self.outcomes: list[Outcome] = []
        self._active = streams  # streams with an index below this send; the others wait
        self._salts = fresh_salts()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def _run(self, index: int) -> None:
        n = 0
        with httpx.Client() as client:
            while not self._stop.is_set():
                if index >= self._active:
                    self._stop.wait(0.2)
                    continue
                shape = SHAPES[(index + n) % len(SHAPES)]
                body = request_body(self.fs.model, shape, salt=self._salts + n * self.streams + index)
                out = send(client, self.fs.url, body, shape.route)
                self.outcomes.append(out)
                n += 1
                if out.kind == "broken" and out.detail.startswith("ConnectError"):
                    self._stop.wait(RECONNECT_S)  # nothing listens (the router is restarting): a client backs off

    def ease(self, streams: int) -> None:
        """Let only `streams` of the streams send from their next request on (the others finish the one they hold)."""
        self._active = streams

    def full_since(self, t: float) -> int:
        return sum(1 for o in list(self.outcomes) if o.started >= t and o.kind == "full")

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(HANG_S + 30)


def wait_until(cond: Callable[[], bool], timeout: float, poll_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


# ---------------------------------------------------------------- faults: each returns its own requests' outcomes


def killing(worker: str, kill: Callable[[FaultStack, str], int]) -> Callable[[FaultStack], list[Outcome]]:
    """A fault that kills part of `worker` (FaultStack.kill_engine, kill_worker) and waits for its new vLLM."""
    def fault(fs: FaultStack) -> list[Outcome]:
        old = fs.vllm_server(worker)
        kill(fs, worker)
        wait_until(lambda: fs.vllm_server(worker) not in (None, old), RECOVERY_S)
        return []

    return fault


def kill_store(fs: FaultStack) -> list[Outcome]:
    old = fs.kill_store()
    wait_until(lambda: fs.component("kvstore").popen.pid != old, RECOVERY_S)
    return []


def kill_router(fs: FaultStack) -> list[Outcome]:
    old = fs.kill_router()
    wait_until(lambda: fs.component("router").popen.pid != old, RECOVERY_S)
    return []


def kill_redis(fs: FaultStack) -> list[Outcome]:
    fs.kill_redis()
    return []


def hanging(worker: str, own: int = 2) -> Callable[[FaultStack], list[Outcome]]:
    """A fault that stops `worker`'s engine core (SIGSTOP), its API server left answering /health: the router's
    stall watch must take the worker out and move its requests on. Once it has, `own` requests are sent one
    after the other with the core still stopped, so each is answered without it or counts as a hang."""
    def fault(fs: FaultStack) -> list[Outcome]:
        stalls = fs.router_metric("pdserve_router_stalls_total") or 0.0
        core = fs.signal_engine(worker, signal.SIGSTOP)
        try:
            started = time.monotonic()
            if not wait_until(lambda: (fs.router_metric("pdserve_router_stalls_total") or 0.0) > stalls,
                              STALL_SEEN_S):
                return [Outcome("hang", started, detail=f"the router saw no stall of {worker} in {STALL_SEEN_S:.0f} s")]
            with httpx.Client() as client:
                shape = SHAPES[1]  # a long prompt: it would get a prefill leg
                return [send(client, fs.url, request_body(fs.model, shape, salt=80_000 + n), shape.route)
                        for n in range(own)]
        finally:
            os.kill(core, signal.SIGCONT)

    return fault


def client_aborts(fs: FaultStack, clients: int = 4, each: int = 3) -> list[Outcome]:
    """Streams closed by their clients after a few chunks, long prompts (a handoff in flight) and short."""
    outcomes: list[Outcome] = []

    def run(index: int) -> None:
        with httpx.Client() as client:
            for n in range(each):
                shape = Shape("chat" if n % 2 else "completions", True, 160 if index % 2 else 12, 200)
                body = request_body(fs.model, shape, salt=90_000 + 100 * index + n)
                outcomes.append(send(client, fs.url, body, shape.route, abort_after_chunks=1 + n))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S * each + 30)
    return outcomes


def _raw(fs: FaultStack, payload: bytes, headers: dict[str, str]) -> Outcome:
    """A hand-made request on its own connection (bodies httpx would refuse to send)."""
    started = time.monotonic()
    host, port = fs.url.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_S)
    try:
        conn.putrequest("POST", PATHS["completions"])
        for key, value in {"Content-Type": "application/json", **headers}.items():
            conn.putheader(key, value)
        conn.endheaders(payload)
        resp = conn.getresponse()
        kind, detail = classify_reply(resp.status, resp.read())
        return Outcome(kind, started, detail=detail)
    except socket.timeout:
        return Outcome("hang", started)
    except (OSError, http.client.HTTPException) as exc:
        return Outcome("broken", started, detail=repr(exc))
    finally:
        conn.close()


def bad_inputs(fs: FaultStack) -> list[Outcome]:
    """Inputs a client may send by mistake or on purpose; each must get a clean OpenAI error."""
    outcomes = []
    with httpx.Client() as client:
        for route, stream, extra in (
            ("completions", False, {"structured_outputs": "x"}),
            ("chat", True, {"structured_outputs": ["x"]}),
            # top_k only matters when sampling (greedy requests ignore it)
            ("chat", False, {"top_k": 10**30, "temperature": 1.0}),
            ("completions", True, {"top_k": 10**30, "temperature": 1.0}),
        ):
            body = request_body(fs.model, Shape(route, stream, 12, 8), salt=7, **extra)
            outcomes.append(send(client, fs.url, body, route))
    depth = 5000
    nested = b'{"model": "%s", "prompt": "x", "metadata": %s}' % (fs.model.encode(), b"[" * depth + b"]" * depth)
    outcomes.append(_raw(fs, nested, {"Content-Length": str(len(nested))}))
    # A body that stops half-way: the router answers 408 after its --body-timeout.
    partial = json.dumps(request_body(fs.model, Shape("completions", False, 12, 8), salt=8)).encode()
    outcomes.append(_raw(fs, partial[: len(partial) // 2], {"Content-Length": str(len(partial))}))
    return outcomes


def no_fault(_fs: FaultStack) -> list[Outcome]:
    return []


SCENARIOS: tuple[tuple[str, Callable[[FaultStack], list[Outcome]]], ...] = (
    ("no fault", no_fault),
    ("bad inputs", bad_inputs),
    ("client aborts", client_aborts),
    ("kill -9 redis", kill_redis),
    ("kill -9 kvstore", kill_store),
    ("kill -9 decode engine", killing("decode-1", FaultStack.kill_engine)),
    ("kill -9 prefill engine", killing("prefill-0", FaultStack.kill_engine)),
    ("hung prefill engine", hanging("prefill-0")),
    ("hung decode engine", hanging("decode-1")),
    ("kill -9 decode worker", killing("decode-0", FaultStack.kill_worker)),
    ("kill -9 router", kill_router),
)


# ---------------------------------------------------------------- one scenario


@dataclass
class Row:
    scenario: str
    counts: Counter = field(default_factory=Counter)  # the load's and the fault's own requests
    own: list[Outcome] = field(default_factory=list)  # the fault's own requests (bad inputs, aborts), in order
    details: Counter = field(default_factory=Counter)  # "kind: detail" of every answer that was not full
    live_tails: float | None = None  # after the tail TTL; None: the store did not answer
    engine_requests: float | None = None  # running + waiting, all engines; None: one did not answer
    router_slots: float | None = None  # requests the router counts in flight on workers or queued; None: no answer
    recovered: bool = False
    seconds: float = 0.0

    @property
    def leaked(self) -> bool:
        return self.live_tails != 0 or self.engine_requests != 0 or self.router_slots != 0


def _leaks(fs: FaultStack) -> tuple[float | None, float | None, float | None]:
    """(live tails on the store, requests in the engines, the router's slots held or queued for)."""
    tails = fs.live_tails()
    per_engine = fs.engine_requests().values()
    engines = None if None in per_engine else sum(per_engine)  # type: ignore[arg-type]
    inflight, queued = fs.router_metric("pdserve_router_inflight"), fs.router_metric("pdserve_router_queue_depth")
    slots = None if inflight is None or queued is None else inflight + queued
    return tails, engines, slots


def run_scenario(fs: FaultStack, name: str, fault: Callable[[FaultStack], list[Outcome]], streams: int = 4) -> Row:
    """Under load: the fault, DEGRADED_S of load on what is left, one stream until every part is back, then the
    whole load until it answers again; load off; leaks after the TTL."""
    row, started = Row(name), time.monotonic()
    with Load(fs, streams) as load:
        wait_until(lambda: load.full_since(started) >= streams, HANG_S)
        own = fault(fs)
        wait_until(fs.all_back, DEGRADED_S)
        load.ease(1)
        back = wait_until(fs.all_back, RECOVERY_S)
        load.ease(load.streams)
        back_at = time.monotonic()
        answering = wait_until(lambda: load.full_since(back_at) >= 2, HANG_S)
    stopped = time.monotonic()
    wait_until(lambda: time.monotonic() - stopped > TAIL_TTL_S + 2 and _leaks(fs) == (0, 0, 0), SETTLE_S)
    row.live_tails, row.engine_requests, row.router_slots = _leaks(fs)
    row.own = own
    row.counts = Counter(o.kind for o in load.outcomes + own)
    row.details = Counter(f"{o.kind}: {o.detail}" for o in load.outcomes + own if o.kind != "full")
    with httpx.Client() as client:
        shape = SHAPES[2]
        after = send(client, fs.url, request_body(fs.model, shape, salt=fresh_salts()), shape.route)
    row.recovered = back and answering and after.kind == "full" and fs.all_back()
    row.seconds = time.monotonic() - started
    return row


def run_scenarios(fs: FaultStack, names: Sequence[str] | None = None, streams: int = 4,
                  on_row: Callable[[Row], None] | None = None) -> list[Row]:
    rows = []
    for name, fault in SCENARIOS:
        if names is None or name in names:
            rows.append(run_scenario(fs, name, fault, streams))
            if on_row is not None:
                on_row(rows[-1])
    return rows


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def format_table(rows: Sequence[Row]) -> str:
    head = ["scenario", *KINDS, "tails", "engine_reqs", "router_slots", "recovered", "s"]
    lines = [[r.scenario, *(str(r.counts.get(k, 0)) for k in KINDS), _fmt(r.live_tails), _fmt(r.engine_requests),
              _fmt(r.router_slots), "yes" if r.recovered else "NO", f"{r.seconds:.0f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    out = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
           for line in [head, *lines]]
    for r in rows:  # what the answers that were not full said, most common first
        out += [f"  {r.scenario}: {n} x {detail}" for detail, n in r.details.most_common(5)]
    return "\n".join(out)


# ---------------------------------------------------------------- soak


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def soak(fs: FaultStack, minutes: int, streams: int = 4, out=sys.stdout, rss_detail: bool = False) -> list[list[str]]:
    """The load for `minutes`; one line a minute: requests, outcomes, TTFT p50/p99 (ms), RSS (MiB)."""
    rows: list[list[str]] = []
    names = list(fs.rss_mib(rss_detail))
    head = ["min", "reqs", "full", "other", "ttft_p50", "ttft_p99", *names]
    arena_mib = fs.cfg.kvstore_l1_size_gb * 1024
    print("soak: RSS in MiB (x/vllm: a worker's vLLM server, engine core and worker), TTFT in ms", file=out)
    print(f"  the store's shared L1 arena ({arena_mib:.0f} MiB) counts in the RSS of each process that maps it as its "
          f"pages are first touched: a vLLM tree may grow by up to {arena_mib:.0f} MiB that way (shared, not a leak; "
          "--rss-detail splits :anon from :shm)", file=out)
    print("  ".join(f"{h:>9}" for h in head), file=out, flush=True)
    with Load(fs, streams) as load:
        seen = 0
        for minute in range(1, minutes + 1):
            time.sleep(60.0)
            done = list(load.outcomes)
            batch, seen = done[seen:], len(done)
            ttfts = [o.ttft * 1000 for o in batch if o.ttft is not None and o.kind == "full"]
            rss = fs.rss_mib(rss_detail)
            full = sum(o.kind == "full" for o in batch)
            row = [str(minute), str(len(batch)), str(full), str(len(batch) - full),
                   _fmt_ms(_pct(ttfts, 50)), _fmt_ms(_pct(ttfts, 99)),
                   *(f"{rss[n]:.0f}" if n in rss else "-" for n in names)]
            rows.append(row)
            print("  ".join(f"{x:>9}" for x in row), file=out, flush=True)
    return rows


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench faults",
        description=("Start a local stack (KV store, 1 prefill + 2 decode workers on the tiny model, Redis, router), "
                     "break it under load scenario by scenario and print what clients got and what leaked."),
    )
    p.add_argument("--streams", type=int, default=4, help="concurrent client streams")
    p.add_argument("--scenario", action="append", choices=[n for n, _ in SCENARIOS],
                   help="run only this scenario (repeatable; default: all)")
    p.add_argument("--soak-minutes", type=int, default=0,
                   help="after the scenarios, keep the load on this long, printing RSS and TTFT each minute")
    p.add_argument("--skip-scenarios", action="store_true", help="soak only")
    p.add_argument("--rss-detail", action="store_true",
                   help="soak: also split each vLLM tree's RSS into private (:anon) and shared (:shm) memory")
    p.add_argument("--log-dir", default=None, help="children's logs (default: a temp folder)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    with FaultStack(log_dir=Path(a.log_dir) if a.log_dir else None) as fs:
        print(f"pdserve bench faults: logs in {fs.stack.log_dir}", file=sys.stderr, flush=True)
        fs.start()
        rows: list[Row] = []
        if not a.skip_scenarios:
            rows = run_scenarios(fs, a.scenario, a.streams,
                                 on_row=lambda r: print(f"  done: {r.scenario} ({r.seconds:.0f} s)", file=sys.stderr,
                                                        flush=True))
            print(format_table(rows), flush=True)
        if a.soak_minutes:
            soak(fs, a.soak_minutes, a.streams, rss_detail=a.rss_detail)
    bad = [r.scenario for r in rows if r.counts["hang"] or r.counts["5xx_nojson"] or r.leaked or not r.recovered]
    if bad:
        print(f"failed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
