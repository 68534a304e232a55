"""`pdserve bench serve`: TTFT, TPOT, ITL and throughput of any OpenAI-compatible endpoint.

Random prompts of an exact input length (checked with the served model's tokenizer)
go to /v1/completions with `ignore_eos` so every answer has exactly the output length;
answers are streamed and timed chunk by chunk. Requests arrive at `--request-rate`
(Poisson; default all at once) with at most `--max-concurrency` in flight; several
concurrency levels can be given and each is one run. Results go to a JSON file and a
PNG plot.

`--compare` answers the P/D question on this machine: it brings up a P/D stack
(store, prefill and decode worker, router), benchmarks it, stops it, then brings up a
colocated single engine behind the router (decode-only, every prompt prefilled
locally) and benchmarks it through the router and directly. The handoff overhead is
P/D TTFT minus colocated TTFT (both through the router); the router overhead is the
colocated engine through the router minus the same engine addressed directly. The
stacks run one after the other so neither competes with the other for the CPU. Before
each concurrency level, the engine that decodes in each stack gets a few unmeasured
closed-loop rounds at that concurrency (`warm_engines`), so no label pays for kernels
built on first sight of a batch shape.

`--compare --paired --max-concurrency 1` brings all the stacks up at once instead and
sends one request at a time, round by round: one to each label (the P/D routers, the
colocated engine through its router and directly), the order rotated every round. On a
noisy machine the runs one after the other are minutes apart, and its drift between
them is larger than the few ms of a handoff; two requests of one round are seconds
apart. Besides the usual per-label figures it prints each round's P/D TTFT minus the
colocated TTFT of the same round, their median (the paired handoff) and the median of
the rounds' TPOT ratios.

`--kv-backend pdserve lmcache` runs one P/D stack per KV backend, side by side in one
run (pdserve's store, then an `lmcache server` with LMCache's connector; its legs run in
sequence, as the LMCache backend always does): TTFT, handoff and TPOT per backend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import signal
import sys
import time
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.worker.config import split_passthrough
from pdserve.deploy.ports import free_port
from pdserve.bench import processes
from pdserve.bench.engine_counters import (delta, describe_load_phases, describe_saves, engine_time_means,
                                           load_phase_means, read_counters, save_means)
from pdserve.router.prefill_estimate import RECENT_LEGS

if TYPE_CHECKING:
    from pdserve.deploy.local import StackConfig

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
KV_BACKENDS = ("pdserve", "lmcache")
# The run label of each backend's P/D stack (pdserve's keeps the label it always had).
PD_LABELS = {"pdserve": "pd", "lmcache": "pd-lmcache"}
# --compare's engine floors: a short prompt's TTFT straight at the P/D decode engine and at the colocated one.
FLOOR_LABELS = {"pd": "pd-decode-floor", "colocated": "colocated-floor"}
FLOOR_PROMPT_TOKENS = 16
FLOOR_PROMPTS = 10
# And the decode engine's TTFT for a prompt of the benchmark's length whose KV it already holds (vLLM's
# prefix cache: the prompt sent once before, unmeasured): what a decode leg in sequence costs with nothing
# to load (its API server tokenizing the text, the last token's step over the whole context). Its gap to
# the short-prompt floor is no connector's doing.
CACHED_FLOOR_LABEL = "pd-decode-cached-floor"
# With --paired, fresh prompts of the benchmark's length also go straight to the P/D decode engine, which
# prefills them itself: the same engine and connector as a P/D request's decode, without the P/D setting
# (the router, a loaded context, the prefill engine beside it). P/D over it is what that setting costs,
# it over colocated-direct what the connector costs its engine.
DECODE_DIRECT_LABEL = "pd-decode-direct"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark invocation, filled from the CLI."""

    base_url: str
    model: str | None = None
    tokenizer: str | None = None
    input_len: int = 1024
    output_len: int = 128
    num_prompts: int = 100
    max_concurrency: tuple[int | None, ...] = (None,)
    request_rate: float = math.inf
    num_warmups: int = 1
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    api_key: str | None = None
    request_timeout: float = 600.0
    result_dir: Path = Path(".")
    result_filename: str | None = None
    disable_tqdm: bool = False
    compare: bool = False
    kv_backends: tuple[str, ...] = ("pdserve",)  # with --compare: one P/D stack per KV backend
    paired: bool = False  # with --compare at c=1: every stack up at once, requests alternating between labels
    pd_runs: tuple[str, ...] = ()  # with --compare: the P/D routers (PD_ROUTERS labels) that run, in this order; (): all
    gpus: tuple[str, ...] = ()  # with --compare: each stack's workers take these GPUs in turn (StackConfig.gpus)
    vllm_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.num_prompts < 1:
            raise ValueError("--input-len, --output-len and --num-prompts must be at least 1")
        if any(c is not None and c < 1 for c in self.max_concurrency):
            raise ValueError("--max-concurrency values must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (inf: all at once)")
        if not self.kv_backends or set(self.kv_backends) - set(KV_BACKENDS):
            raise ValueError(f"--kv-backend must be among {KV_BACKENDS}, got {list(self.kv_backends)}")
        unknown = set(self.goodput) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"--goodput metrics must be among {SLO_METRICS}, got {sorted(unknown)}")
        if set(self.pd_runs) - set(PD_ROUTERS) or len(set(self.pd_runs)) != len(self.pd_runs):
            raise ValueError(f"--pd-runs takes distinct labels among {list(PD_ROUTERS)}, got {list(self.pd_runs)}")
        if self.pd_runs and not self.compare:
            raise ValueError("--pd-runs picks among the P/D routers --compare starts: add --compare")
        if self.paired and not self.compare:
            raise ValueError("--paired pairs the stacks --compare starts: add --compare")
        if self.gpus and not self.compare:
            raise ValueError("--gpus places the engines --compare starts: add --compare")
        # Rounds pair one request per label, so one is in flight at a time and each goes out when the last ends.
        if self.paired and (self.max_concurrency != (1,) or math.isfinite(self.request_rate)):
            raise ValueError("--paired sends one request at a time: give --max-concurrency 1 and no --request-rate")


@dataclass
class RequestResult:
    """Timings of one streamed request, in seconds."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token answers)."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


# ------------------------------------------------------------------ prompts


def load_tokenizer(name: str):
    """The served model's tokenizer (a local folder or a name already in the HF cache)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def exact_length_prompt(tokenizer, pool: np.ndarray, rng: np.random.Generator, length: int,
                        max_tries: int = 50) -> str:
    """Text that the server's tokenizer turns into exactly `length` prompt tokens.

    Random ids do not survive decode+encode unchanged (byte-level merges, special
    tokens the server adds), so grow or cut the id list until the re-encoded length,
    counted as the server counts it (with special tokens), matches.
    """
    ids = list(rng.choice(pool, size=length))
    for _ in range(max_tries):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        got = len(tokenizer(text).input_ids)
        if got == length:
            return text
        if got < length:
            ids += list(rng.choice(pool, size=length - got))
        else:
            ids = ids[: len(ids) - (got - length)] or list(rng.choice(pool, size=1))
    raise ValueError(f"could not build a prompt of exactly {length} tokens with this tokenizer")


class PromptSource:
    """A stream of fresh exact-length prompts: no two requests of a benchmark share one.

    Fresh prompts matter: a second run over the same prompts would be served from the
    KV store or a prefix cache and measure cache hits, not prefill.
    """

    def __init__(self, tokenizer, length: int, seed: int) -> None:
        special = set(tokenizer.all_special_ids)
        self._pool = np.array([i for i in range(len(tokenizer)) if i not in special])
        self._rng = np.random.default_rng(seed)
        self._tokenizer = tokenizer
        self.length = length

    def take(self, count: int) -> list[str]:
        return [exact_length_prompt(self._tokenizer, self._pool, self._rng, self.length) for _ in range(count)]


# ------------------------------------------------------------------ requests


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> dict[str, Any]:
    """The first model card at base_url (its id, and its `root` path when it is vLLM)."""
    resp = await client.get(f"{base_url}/v1/models", headers=_headers(api_key))
    resp.raise_for_status()
    cards = resp.json().get("data") or []
    if not cards:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return cards[0]


async def send_request(client: httpx.AsyncClient, cfg: BenchConfig, base_url: str, model: str,
                       prompt: str) -> RequestResult:
    """One streamed completion; every chunk that carries a choice counts as a token arrival."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": cfg.output_len, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=_headers(cfg.api_key),
                                 timeout=cfg.request_timeout) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2el = time.perf_counter() - start
    result.success = result.ttft > 0.0 and result.output_tokens > 0
    if not result.success:
        result.error = "stream ended without tokens or usage"
    return result


_ROUTER_SERIES = {"handoff": "pdserve_router_handoff_seconds", "router_overhead": "pdserve_router_overhead_seconds"}
_PHASE_SERIES = "pdserve_router_phase_seconds"
_PLAN_SERIES = "pdserve_router_plan_seconds"
OVERLAP_AT = "overlap_at_"  # router_paths' keys of the overlapped decode legs by when they went out
TTFT_BY_PATH = "ttft_"  # router_paths' keys of the router's TTFT seconds by path: ttft_sum_<path>, ttft_count_<path>
# The phases of a P/D request's way to its first token as the router times them (router/flow/decode_leg.py:
# pd_phases), in the order they happen; together they are the router's TTFT of the request.
PHASES = {"before_first_call": "router before the first call", "prefill_leg": "prefill leg",
          "between_legs": "between the legs", "decode_first_token": "decode leg to first token",
          "relay": "relaying the first token"}
# Two steps inside `before_first_call` (router/flow/paths.py), timed over every request the router planned.
PLAN_STEPS = {"tokenize": "  of which tokenizing", "store_lookup": "  of which the store lookup"}


def router_sums(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the router's handoff and overhead histograms, of each phase (`phase_<name>`) and of
    each planning step (`plan_<step>`) in a /metrics page; empty when the page is no pdserve router's."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"{name}_{part}": (key, i) for key, name in _ROUTER_SERIES.items()
              for i, part in enumerate(("sum", "count"))}
    sums: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in wanted:
                key, i = wanted[sample.name]
            elif sample.name in (f"{_PHASE_SERIES}_sum", f"{_PHASE_SERIES}_count"):
                key, i = f"phase_{sample.labels.get('phase', '')}", int(sample.name.endswith("_count"))
            elif sample.name in (f"{_PLAN_SERIES}_sum", f"{_PLAN_SERIES}_count"):
                key, i = f"plan_{sample.labels.get('step', '')}", int(sample.name.endswith("_count"))
            else:
                continue
            sums.setdefault(key, [0.0, 0.0])[i] += sample.value
    return {key: (total, count) for key, (total, count) in sums.items()}


async def router_totals(client: httpx.AsyncClient, base_url: str) -> dict[str, tuple[float, float]] | None:
    """`router_sums` of base_url's /metrics now; None when base_url is no pdserve router."""
    try:
        resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200 or "pdserve_router_" not in resp.text:
        return None
    return router_sums(resp.text)


def path_counts(text: str) -> dict[str, float]:
    """A router's requests by path (pd, pd_overlap, decode_only_<why>) in a /metrics page, its overlapped
    ones by when their decode leg went out (`OVERLAP_AT` + start, estimate or answer: router/metrics.py),
    and the sum and count of its streamed requests' TTFT by path (`TTFT_BY_PATH` keys, all routes)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.name == "pdserve_router_paths" and s.name.endswith("_total"):
                counts[s.labels["path"]] = s.value
            elif fam.name == "pdserve_router_overlap_sends" and s.name.endswith("_total"):
                counts[OVERLAP_AT + s.labels["at"]] = s.value
            elif fam.name == "pdserve_router_ttft_seconds" and s.name.endswith(("_sum", "_count")) and "path" in s.labels:
                key = f"{TTFT_BY_PATH}{s.name.rsplit('_', 1)[1]}_{s.labels['path']}"
                counts[key] = counts.get(key, 0.0) + s.value
    return counts


def ttft_by_path(paths: dict[str, float]) -> dict[str, tuple[float, float]]:
    """(mean TTFT ms, streamed requests) per path, from a run's `path_counts` deltas."""
    out = {}
    for key, count in paths.items():
        if key.startswith(f"{TTFT_BY_PATH}count_") and count:
            path = key.removeprefix(f"{TTFT_BY_PATH}count_")
            out[path] = (paths.get(f"{TTFT_BY_PATH}sum_{path}", 0.0) / count * 1e3, count)
    return out


def router_paths(base_url: str) -> dict[str, float]:
    """`path_counts` of base_url's /metrics now."""
    return path_counts(httpx.get(f"{base_url}/metrics", timeout=30).text)


def router_means(before: dict | None, after: dict | None) -> dict[str, float]:
    """Mean ms per request over a run, from the router's histograms: the handoff measured where it
    happens (prefill response to first decode token), free of the prefill-time noise in a TTFT
    difference, the router's own time, each phase of the P/D requests (`phase_<name>_mean_ms`) and each
    step of its path decisions (`plan_<step>_mean_ms`)."""
    if before is None or after is None:
        return {}
    out = {}
    for key, (total_after, count_after) in after.items():
        total_before, count_before = before.get(key, (0.0, 0.0))
        if count_after - count_before > 0:
            out[f"{key}_mean_ms"] = 1000.0 * (total_after - total_before) / (count_after - count_before)
    return out


def check_warm_up(results: Sequence[RequestResult], base_url: str) -> None:
    """A failed warm-up stops the benchmark: the measured requests would fail the same way."""
    failed = next((r for r in results if not r.success), None)
    if failed is not None:
        raise RuntimeError(f"warm-up request to {base_url} failed: {failed.error}")


async def run_load(cfg: BenchConfig, base_url: str, model: str, prompts: list[str], warmup: list[str],
                   concurrency: int | None, label: str) -> tuple[list[RequestResult], float, dict[str, float]]:
    """Warm up, then send every prompt at the configured rate and concurrency; also the router's own
    figures over the run (`router_means`) when base_url is a pdserve router. The warm-up prompts go
    out together, so the engines have run a batch of this concurrency before the measured run
    (on the GPU host a first batch of 8 found kernels not yet built for its shapes: 0.6-1 s)."""
    limits = httpx.Limits(max_connections=concurrency or len(prompts), max_keepalive_connections=concurrency or 100)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def limited(prompt: str) -> RequestResult:
            async with gate or nullcontext():
                return await send_request(client, cfg, base_url, model, prompt)

        check_warm_up(await asyncio.gather(*(limited(p) for p in warmup)), base_url)
        rng = np.random.default_rng(cfg.seed + 1)
        bar = tqdm(total=len(prompts), desc=label, disable=cfg.disable_tqdm, file=sys.stderr, leave=False)

        async def one(prompt: str) -> RequestResult:
            result = await limited(prompt)
            bar.update(1)
            return result

        before = await router_totals(client, base_url)
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        router = router_means(before, await router_totals(client, base_url))
    return list(results), duration, router


# ------------------------------------------------------------------ metrics


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float]) -> dict[str, Any]:
    """Aggregate metrics of one run (times in ms, throughputs per second)."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "mean_input_tokens": in_tokens / len(ok) if ok else math.nan,
        "mean_output_tokens": out_tokens / len(ok) if ok else math.nan,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": out_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else math.nan,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2el_ms": _stats_ms([r.e2el for r in ok]),
    }
    if goodput:
        good = [r for r in ok if all(getattr(r, m) * 1000.0 <= slo for m, slo in goodput.items())]
        metrics["goodput"] = {
            "slo_ms": dict(goodput),
            "good_requests": len(good),
            "fraction": len(good) / len(results),
            "request_throughput": len(good) / duration if duration > 0 else math.nan,
        }
    return metrics


@dataclass
class Run:
    """One measured run: where it went, how, and what came out."""

    label: str
    base_url: str
    max_concurrency: int | None
    metrics: dict[str, Any]
    results: list[RequestResult] = field(repr=False, default_factory=list)


def _stat(m: dict[str, Any] | None, key: str, stat: str) -> float:
    return float((m or {}).get(key, {}).get(stat, math.nan))


def phase_means(m: dict[str, Any] | None) -> dict[str, float]:
    """Mean ms of each router phase over a P/D run (NaN where the router timed none), the overlapped
    decode legs' wait for their prefill, and the planning steps (PLAN_STEPS)."""
    router = (m or {}).get("router", {})
    means = {name: float(router.get(f"phase_{name}_mean_ms", math.nan)) for name in (*PHASES, "overlap_wait")}
    return means | {name: float(router.get(f"plan_{name}_mean_ms", math.nan)) for name in PLAN_STEPS}


def comparison(runs: list[Run], paired: bool = False) -> list[dict[str, Any]]:
    """Per concurrency: P/D vs colocated TTFT (handoff overhead) and router vs direct (router overhead),
    the handoff against the decode engine's floor, the P/D TPOT against an engine without a connector,
    and where P/D TTFT goes by the router's phases beside the colocated figures they compare to; with
    `paired` (runs from `run_paired`), the c=1 row also gets `paired_differences`."""
    by = {(r.label, r.max_concurrency): r.metrics for r in runs}
    floors = {r.label: r.metrics for r in runs if r.label in (*FLOOR_LABELS.values(), CACHED_FLOOR_LABEL)}
    pd_floor, coloc_floor = floors.get(FLOOR_LABELS["pd"]), floors.get(FLOOR_LABELS["colocated"])
    cached_floor_run = floors.get(CACHED_FLOOR_LABEL)
    rows = []
    for conc in sorted({r.max_concurrency for r in runs}, key=lambda c: math.inf if c is None else c):
        pd, coloc, direct = (by.get((name, conc)) for name in ("pd", "colocated-router", "colocated-direct"))
        if not (coloc and direct):
            continue
        coloc_ttft, direct_ttft = (m["ttft_ms"]["p50"] for m in (coloc, direct))
        pd = pd or {}  # --kv-backend without pdserve: its columns stay empty
        pd_ttft = _stat(pd, "ttft_ms", "p50")
        seq = by.get(("pd-sequential", conc))
        ov = by.get(("pd-overlapped", conc))
        modes = {"pd": pd, "overlap": ov, "sequential": seq}  # the P/D flows compared phase by phase
        floor_p50 = _stat(pd_floor, "ttft_ms", "p50")
        coloc_tpot = coloc["tpot_ms"]["p50"]
        rows.append({
            "max_concurrency": conc,
            "pd_ttft_p50_ms": pd_ttft,
            "colocated_ttft_p50_ms": coloc_ttft,
            "direct_ttft_p50_ms": direct_ttft,
            "handoff_overhead_p50_ms": pd_ttft - coloc_ttft,
            "handoff_ttft_ratio": pd_ttft / coloc_ttft if coloc_ttft else math.nan,
            "router_overhead_p50_ms": coloc_ttft - direct_ttft,
            "pd_tpot_p50_ms": _stat(pd, "tpot_ms", "p50"),
            "colocated_tpot_p50_ms": coloc_tpot,
            "tpot_connector_ratio": _stat(pd, "tpot_ms", "p50") / coloc_tpot if coloc_tpot else math.nan,
            "pd_floor_ttft_p50_ms": floor_p50,
            "pd_floor_ttft_mean_ms": _stat(pd_floor, "ttft_ms", "mean"),
            "colocated_floor_ttft_p50_ms": _stat(coloc_floor, "ttft_ms", "p50"),
            "pd_cached_floor_ttft_p50_ms": _stat(cached_floor_run, "ttft_ms", "p50"),
            "handoff_over_floor_ms": pd_ttft - coloc_ttft - floor_p50,
            "pd_itl_p99_ms": _stat(pd, "itl_ms", "p99"),
            "router_handoff_mean_ms": pd.get("router", {}).get("handoff_mean_ms", math.nan),
            "router_own_mean_ms": coloc.get("router", {}).get("router_overhead_mean_ms", math.nan),
            "router_own_pd_mean_ms": pd.get("router", {}).get("router_overhead_mean_ms", math.nan),
            "decode_loads": pd.get("decode_loads", {}),
            "prefill_saves": pd.get("prefill_saves", {}),
            "sequential_handoff_p50_ms": _stat(seq, "ttft_ms", "p50") - coloc_ttft,
            "sequential_handoff_over_floor_ms": _stat(seq, "ttft_ms", "p50") - coloc_ttft - floor_p50,
            "sequential_tpot_p50_ms": _stat(seq, "tpot_ms", "p50"),
            "sequential_router_handoff_mean_ms": (seq or {}).get("router", {}).get("handoff_mean_ms", math.nan),
            "sequential_decode_loads": (seq or {}).get("decode_loads", {}),
            "overlapped_handoff_p50_ms": _stat(ov, "ttft_ms", "p50") - coloc_ttft,
            "overlapped_handoff_over_floor_ms": _stat(ov, "ttft_ms", "p50") - coloc_ttft - floor_p50,
            "overlapped_tpot_p50_ms": _stat(ov, "tpot_ms", "p50"),
            "overlapped_itl_p99_ms": _stat(ov, "itl_ms", "p99"),
            "overlapped_router_handoff_mean_ms": (ov or {}).get("router", {}).get("handoff_mean_ms", math.nan),
            "overlapped_decode_loads": (ov or {}).get("decode_loads", {}),
            "at_start_handoff_p50_ms": _stat(by.get(("pd-overlap-start", conc)), "ttft_ms", "p50") - coloc_ttft,
            "ttft_mean_ms": {"pd": _stat(pd, "ttft_ms", "mean"), "overlap": _stat(ov, "ttft_ms", "mean"),
                             "sequential": _stat(seq, "ttft_ms", "mean"),
                             "colocated": coloc["ttft_ms"]["mean"], "direct": direct["ttft_ms"]["mean"]},
            "phases": {mode: phase_means(m) for mode, m in modes.items()},
            "decode_engine": {mode: (m or {}).get("decode_engine", {}) for mode, m in modes.items()},
            "backends": backend_rows(by, conc, coloc_ttft),
        })
        if paired and conc == 1:
            rows[-1]["paired"] = paired_differences([r for r in runs if r.max_concurrency == 1])
    return rows


def _median(values: Sequence[float]) -> float:
    """Median of the values that are not NaN (NaN when none is)."""
    kept = [v for v in values if not math.isnan(v)]
    return float(np.median(kept)) if kept else math.nan


def paired_differences(runs: list[Run]) -> dict[str, dict[str, dict[str, Any]]]:
    """For each P/D run against each colocated run of one paired run (`run_paired`: request i of every
    label went out in round i), and against the P/D decode engine's own (DECODE_DIRECT_LABEL, which is
    also set against the colocated runs): the TTFT difference (ms) and the TPOT ratio of each round's two
    requests (NaN where either failed), and their medians. Pairing within a round leaves out the machine's
    drift between rounds, which the difference of two runs' p50s keeps."""
    by = {r.label: r.results for r in runs}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for pd in dict.fromkeys((*PD_ROUTERS, *PD_LABELS.values(), DECODE_DIRECT_LABEL)):
        for ref in (*COLOCATED_LABELS, DECODE_DIRECT_LABEL):
            if pd not in by or ref not in by or pd == ref:
                continue
            pairs = [(a, b) if a.success and b.success else None for a, b in zip(by[pd], by[ref], strict=True)]
            diffs = [1000.0 * (p[0].ttft - p[1].ttft) if p else math.nan for p in pairs]
            ratios = [p[0].tpot / p[1].tpot if p and p[0].tpot > 0 and p[1].tpot > 0 else math.nan for p in pairs]
            out.setdefault(pd, {})[ref] = {
                "rounds": sum(not math.isnan(d) for d in diffs), "handoff_p50_ms": _median(diffs),
                "tpot_ratio_p50": _median(ratios), "handoff_ms_by_round": diffs, "tpot_ratio_by_round": ratios}
    return out


def paired_lines(paired: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The paired figures of one c=1 row: per P/D label and colocated label, the median of the rounds'
    differences and ratios, then each round's difference; none for a row without them."""
    if not paired:
        return []
    lines = ["  paired rounds (a P/D request's TTFT minus the colocated one's of the same round; "
             "TPOT ratio P/D / colocated; medians over rounds):"]
    for pd, refs in paired.items():
        for ref, p in refs.items():
            lines.append(f"    {pd} - {ref}: paired handoff p50 {p['handoff_p50_ms']:.1f} ms, paired TPOT ratio "
                         f"x{p['tpot_ratio_p50']:.3f} ({p['rounds']} rounds); by round (ms): "
                         + " ".join(f"{d:.1f}" for d in p["handoff_ms_by_round"]))
    return lines


def backend_rows(by: dict[tuple[str, int | None], dict[str, Any]], conc: int | None,
                 coloc_ttft: float) -> dict[str, dict[str, float]]:
    """TTFT, handoff and TPOT of each KV backend's P/D run at one concurrency."""
    out = {}
    for backend, label in PD_LABELS.items():
        m = by.get((label, conc))
        if m:
            out[backend] = {
                "ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
                "handoff_overhead_p50_ms": m["ttft_ms"]["p50"] - coloc_ttft,
                "router_handoff_mean_ms": m.get("router", {}).get("handoff_mean_ms", math.nan),
                "tpot_p50_ms": m["tpot_ms"]["p50"], "itl_p99_ms": m["itl_ms"]["p99"],
            }
    return out


# ------------------------------------------------------------------ output


def plot(runs: list[Run], path: Path) -> None:
    """TTFT and ITL distributions (CDFs) and p50 TPOT per run, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for run in runs:
        name = f"{run.label} c={run.max_concurrency or 'inf'}"
        ok = [r for r in run.results if r.success]
        for ax, values in ((axes[0], [r.ttft for r in ok]), (axes[1], [x for r in ok for x in r.itl])):
            if values:
                xs = np.sort(np.asarray(values) * 1000.0)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
        axes[2].bar(name, run.metrics["tpot_ms"]["p50"])
    for ax, title in zip(axes[:2], ("TTFT", "inter-token latency")):
        # Log scale: one prefill stalling a colocated decode makes ITL spikes 100x the median.
        ax.set(title=f"{title} CDF", xlabel="ms (log scale)", xscale="log",
               ylabel="fraction of requests" if title == "TTFT" else "fraction of token gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].set(title="TPOT p50", ylabel="ms")
    axes[2].tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(runs: list[Run], rows: list[dict[str, Any]]) -> None:
    header = f"{'run':<20}{'conc':>6}{'ok':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>10}" \
             f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'TPOT p50':>10}{'ITL p50':>9}{'p99':>9}"
    print(header)
    for run in runs:
        m = run.metrics
        print(f"{run.label:<20}{run.max_concurrency or 'inf':>6}{m['completed']:>5}{m['failed']:>5}"
              f"{m['request_throughput']:>8.2f}{m['output_throughput']:>10.1f}"
              f"{m['ttft_ms']['p50']:>10.1f}{m['ttft_ms']['p90']:>9.1f}{m['ttft_ms']['p99']:>9.1f}"
              f"{m['tpot_ms']['p50']:>10.2f}{m['itl_ms']['p50']:>9.2f}{m['itl_ms']['p99']:>9.2f}")
        if m.get("paths"):  # the warm-up request counts too
            paths = sorted((k, v) for k, v in m["paths"].items() if not k.startswith((OVERLAP_AT, TTFT_BY_PATH)))
            sends = sorted((k.removeprefix(OVERLAP_AT), v) for k, v in m["paths"].items() if k.startswith(OVERLAP_AT))
            print(f"{'':<20}paths: " + ", ".join(f"{k} {v:g}" for k, v in paths)
                  + ("; overlapped decode legs sent at: " + ", ".join(f"{k} {v:g}" for k, v in sends) if sends else ""))
            if ttfts := ttft_by_path(m["paths"]):
                print(f"{'':<20}router TTFT mean by path: "
                      + ", ".join(f"{k} {ms:.1f} ms ({n:g})" for k, (ms, n) in sorted(ttfts.items())))
        if "goodput" in m:
            g = m["goodput"]
            print(f"{'':<20}goodput {g['request_throughput']:.2f} req/s ({g['fraction']:.0%} within {g['slo_ms']})")
    for row in rows:
        print(f"concurrency {row['max_concurrency'] or 'inf'}: handoff overhead (P/D - colocated TTFT p50) "
              f"{row['handoff_overhead_p50_ms']:.1f} ms (x{row['handoff_ttft_ratio']:.2f}); "
              f"router overhead {row['router_overhead_p50_ms']:.2f} ms")
        print(f"  as the router measures it (mean): handoff {row['router_handoff_mean_ms']:.1f} ms "
              f"(prefill response to first decode token); router's own time "
              f"{row['router_own_mean_ms']:.2f} ms colocated, {row['router_own_pd_mean_ms']:.2f} ms P/D; "
              f"decode engine's KV load {row['decode_loads'].get('load_ms', math.nan):.1f} ms")
        print(f"  decode engine's KV loads: {describe_load_phases(row['decode_loads'])}")
        print(f"  prefill engine's saves: {describe_saves(row.get('prefill_saves', {}))}")
        if not math.isnan(row["overlapped_handoff_p50_ms"]):
            print(f"  overlapped legs for every request (--no-pd-first-token): handoff overhead "
                  f"{row['overlapped_handoff_p50_ms']:.1f} ms, router-measured handoff "
                  f"{row['overlapped_router_handoff_mean_ms']:.1f} ms; TPOT p50 {row['overlapped_tpot_p50_ms']:.2f} ms, "
                  f"ITL p99 {row['overlapped_itl_p99_ms']:.2f} ms (by default {row['pd_tpot_p50_ms']:.2f} and "
                  f"{row['pd_itl_p99_ms']:.2f}: there the decode leg is the second token's wait); KV loads: "
                  f"{describe_load_phases(row['overlapped_decode_loads'])}")
        if not math.isnan(row["sequential_handoff_p50_ms"]):
            print(f"  legs in sequence (--no-pd-overlap): handoff overhead {row['sequential_handoff_p50_ms']:.1f} ms, "
                  f"router-measured handoff {row['sequential_router_handoff_mean_ms']:.1f} ms; KV loads: "
                  f"{describe_load_phases(row['sequential_decode_loads'])}")
        if not math.isnan(row["at_start_handoff_p50_ms"]):
            print(f"  decode leg sent with the prefill leg (--pd-overlap-send start): handoff overhead "
                  f"{row['at_start_handoff_p50_ms']:.1f} ms")
        for line in floor_and_phase_lines(row) + paired_lines(row.get("paired", {})):
            print(line)
    backends = [(row["max_concurrency"], name, b) for row in rows for name, b in row["backends"].items()]
    if len({name for _, name, _ in backends}) > 1:
        print(f"\n{'KV backend':<12}{'conc':>6}{'TTFT p50':>10}{'p99':>9}{'handoff p50':>13}"
              f"{'router handoff':>16}{'TPOT p50':>10}{'ITL p99':>9}   (ms; handoff = P/D - colocated TTFT)")
        for conc, name, b in backends:
            print(f"{name:<12}{conc or 'inf':>6}{b['ttft_p50_ms']:>10.1f}{b['ttft_p99_ms']:>9.1f}"
                  f"{b['handoff_overhead_p50_ms']:>13.1f}{b['router_handoff_mean_ms']:>16.1f}"
                  f"{b['tpot_p50_ms']:>10.2f}{b['itl_p99_ms']:>9.2f}")


def floor_and_phase_lines(row: dict[str, Any]) -> list[str]:
    """The rows that give a comparison's handoff a yardstick and an owner for each millisecond: the
    engines' floors, the handoff over the decode engine's floor, the connector's cost to TPOT, and the
    router's phases of P/D TTFT (by default, overlapped, in sequence) beside what a colocated request
    spends on each."""
    conc = row["max_concurrency"]
    lines = [
        f"  floor (TTFT p50 of a {FLOOR_PROMPT_TOKENS}-token prompt straight at the engine, c=1): "
        f"P/D decode engine {row['pd_floor_ttft_p50_ms']:.1f} ms, colocated engine "
        f"{row['colocated_floor_ttft_p50_ms']:.1f} ms; handoff p50 minus the decode engine's floor: "
        f"{row['handoff_over_floor_ms']:.1f} ms by default, {row['overlapped_handoff_over_floor_ms']:.1f} ms "
        f"overlapped, {row['sequential_handoff_over_floor_ms']:.1f} ms in sequence",
        f"  the P/D decode engine's TTFT p50 for a prompt of this length whose KV it already holds (its own prefix "
        f"cache, c=1): {row['pd_cached_floor_ttft_p50_ms']:.1f} ms (the text tokenized, the last token's step over "
        f"the whole context: a decode leg in sequence with nothing to load)",
        f"  connector's cost to decode: TPOT p50 {row['pd_tpot_p50_ms']:.2f} ms P/D "
        f"({row['overlapped_tpot_p50_ms']:.2f} overlapped, {row['sequential_tpot_p50_ms']:.2f} in sequence) vs "
        f"{row['colocated_tpot_p50_ms']:.2f} ms on the colocated engine, which runs without a connector: "
        f"x{row['tpot_connector_ratio']:.3f}"
        + ("" if conc == 1 else " (above c=1 the colocated TPOT also carries other requests' prefills)"),
    ]
    phases, ttft = row["phases"], row["ttft_mean_ms"]
    modes = {"pd": "by default", "overlap": "overlapped", "sequential": "in sequence"}
    if all(math.isnan(v) for mode in modes for v in phases[mode].values()):
        return lines + ["  router phases: none timed (a router without pdserve_router_phase_seconds)"]
    beside = {
        "before_first_call": f"colocated: the router's own time {row['router_own_mean_ms']:.2f} "
                             "(before its call and relaying)",
        "prefill_leg": f"colocated prefill of the same prompt (TTFT straight at the engine) {ttft['direct']:.1f}",
        "decode_first_token": f"the decode engine's floor {row['pd_floor_ttft_mean_ms']:.1f}, "
                              f"with the prompt's KV in its cache {row['pd_cached_floor_ttft_p50_ms']:.1f} (p50)",
    }

    def columns(values: Callable[[str], float]) -> str:
        return " ".join(f"{values(mode):>12.2f}" for mode in modes)

    lines.append("  where P/D TTFT goes (router's phases, mean ms): " + " ".join(f"{t:>12}" for t in modes.values()))
    for name, title in PHASES.items():
        lines.append(f"    {title:<30}{columns(lambda m: phases[m][name])}   {beside.get(name, '')}".rstrip())
        if name == "before_first_call":
            lines += [f"    {step_title:<30}{columns(lambda m: phases[m][step])}"
                      for step, step_title in PLAN_STEPS.items()]
    lines.append(f"    {'sum: the router sees the token':<30}{columns(lambda m: sum(phases[m][n] for n in PHASES))}"
                 f"   colocated TTFT through the router {ttft['colocated']:.1f}")
    lines.append(f"    {'TTFT the client sees':<30}{columns(lambda m: ttft[m])}")
    lines.append(f"    overlapped decode leg out before the prefill answered (inside the prefill leg): "
                 f"{phases['overlap']['overlap_wait']:.1f}")
    for mode, engine in row["decode_engine"].items():
        if engine:
            lines.append(f"    decode engine's own view ({modes[mode]}, "
                         f"vLLM's histograms, warm-up included): arrival to first token {engine.get('engine_ttft_ms', math.nan):.1f}, "
                         f"of which queued {engine.get('engine_queue_ms', math.nan):.1f} (KV load wait included) "
                         f"and first scheduled to first token {engine.get('engine_prefill_ms', math.nan):.1f}")
    return lines


def write_results(cfg: BenchConfig, runs: list[Run], rows: list[dict[str, Any]]) -> tuple[Path, Path]:
    stem = cfg.result_filename or f"bench-serve-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    json_path = cfg.result_dir / stem
    json_path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    doc = {
        "config": config,
        "runs": [{"label": r.label, "base_url": r.base_url, "max_concurrency": r.max_concurrency,
                  "metrics": r.metrics} for r in runs],
        "comparison": rows,
    }
    json_path.write_text(json.dumps(doc, indent=2, allow_nan=True) + "\n")
    png_path = json_path.with_suffix(".png")
    plot(runs, png_path)
    return json_path, png_path


# ------------------------------------------------------------------ orchestration


def warmups(cfg: BenchConfig, concurrency: int | None, at_least: int = 0) -> int:
    """Unmeasured requests before a level: --num-warmups, at least one batch of the level's
    concurrency and `at_least` (0 warm-ups stay 0)."""
    return max(cfg.num_warmups, concurrency or 1, at_least) if cfg.num_warmups else 0


# A P/D router's first level warms up with this many requests at least: its first P/D request per
# prefill worker runs in sequence (it learns the worker's store), and an overlapped decode leg is
# timed by the median of the last RECENT_LEGS legs. With one warm-up, the first measured run paid
# for that learning (H200, 2k tokens, c=1: TTFT p50 62.4 ms on the first P/D router against 51.8
# on the third, which differs only in skipping queue-awareness, idle at c=1).
PD_ROUTER_WARMUPS = RECENT_LEGS + 1


def report(label: str, conc: int | None, metrics: dict[str, Any]) -> None:
    """One line per run as it ends, so a benchmark cut short by a time limit still shows what it measured."""
    print(f"{label} c={conc or 'inf'}: {metrics['completed']} ok, {metrics['failed']} failed, TTFT p50 "
          f"{metrics['ttft_ms']['p50']:.1f} ms, TPOT p50 {metrics['tpot_ms']['p50']:.2f} ms", file=sys.stderr, flush=True)


async def bench_endpoint(cfg: BenchConfig, base_url: str, label: str, prompts: PromptSource | None = None,
                         levels: Sequence[int | None] | None = None, first_warmups: int = 0) -> list[Run]:
    """Each concurrency level against one base URL, with fresh prompts; one Run per level. The first
    level warms up with `first_warmups` requests at least."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        card = await served_model(client, base_url, cfg.api_key)
    model = cfg.model or str(card["id"])
    if prompts is None:
        root = card.get("root")
        name = cfg.tokenizer or (str(root) if root is not None and Path(str(root)).is_dir() else model)
        prompts = PromptSource(load_tokenizer(name), cfg.input_len, cfg.seed)
    runs = []
    for i, conc in enumerate(cfg.max_concurrency if levels is None else levels):
        results, duration, router = await run_load(cfg, base_url, model, prompts.take(cfg.num_prompts),
                                                   prompts.take(warmups(cfg, conc, 0 if i else first_warmups)), conc,
                                                   f"{label} c={conc or 'inf'}")
        metrics = summarize(results, duration, cfg.goodput)
        report(label, conc, metrics)
        if router:
            metrics["router"] = router
        runs.append(Run(label, base_url, conc, metrics, results))
    return runs


@contextmanager
def second_router(stack: Any, *flags: str) -> Iterator[str]:
    """Another router over `stack`'s workers with extra flags (e.g. --no-pd-overlap); yields its URL."""
    argv = ["--prefill", *stack.worker_urls("prefill"), "--decode", *stack.worker_urls("decode"),
            "--pd-min-prompt-tokens", "0", *flags]
    if stack.tokenizer:
        argv += ["--tokenizer", stack.tokenizer]
    if stack.api_key:
        argv += ["--api-key", stack.api_key]
    with processes.router(*argv) as (url, _proc):
        yield url


# The P/D stack's routers by run label, with their flags: the stack's own runs the defaults (the prefill's
# token streamed first, the decode leg after it; a long prefill queue skipped); the second overlaps the legs of
# every request instead, the third sends them in sequence, the fourth always disaggregates (the defaults
# otherwise), the fifth sends an overlapped decode leg with its prefill leg instead of at the predicted end, the
# sixth sends a long prompt's prefill leg before counting it (the defaults otherwise).
PD_ROUTERS: dict[str, tuple[str, ...]] = {
    "pd": (), "pd-overlapped": ("--no-pd-first-token",), "pd-sequential": ("--no-pd-overlap", "--no-pd-first-token"),
    "pd-queue-blind": ("--no-pd-queue-aware",), "pd-overlap-start": ("--pd-overlap-send", "start", "--no-pd-first-token"),
    "pd-early-prefill": ("--pd-early-prefill",)}
# The colocated engine's runs, the yardsticks of the P/D ones.
COLOCATED_LABELS = ("colocated-router", "colocated-direct")
# An engine's connector counters by its role in a P/D stack ("decode", "prefill"); None where it did not answer.
Readings = dict[str, dict[str, float] | None]


@dataclass(frozen=True)
class Target:
    """Where one run label of --compare sends its requests, the warm-ups its first level needs at least,
    and, for a P/D router, its stack's engines by role: their counters and the router's paths go into
    its runs (`pd_metrics`)."""

    label: str
    url: str
    first_warmups: int = 0
    engines: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StackUp:
    """A stack brought up for --compare: its targets, the floor runs measured as it came up, and where
    `warm_engines` sends its closed-loop warm-up before each level, in order: the engines that decode in it
    and, in a P/D stack, a router of its own (both legs, so the prefill engine's batches and the KV moves
    are warm too)."""

    targets: list[Target]
    floors: list[Run]
    warm_urls: list[str]


def read_engines(engines: dict[str, str]) -> Readings:
    """Each engine's connector counters now."""
    return {role: read_counters(url) for role, url in engines.items()}


def add_readings(total: Readings, before: Readings, after: Readings) -> Readings:
    """`total` plus what each engine's counters gained from `before` to `after` (None once a reading is
    missing): in paired mode the P/D labels share one stack's engines and their requests interleave, so a
    label's counters are summed from readings around each of its own requests."""
    out: Readings = {}
    for role, counts in total.items():
        b, a = before.get(role), after.get(role)
        out[role] = None if counts is None or b is None or a is None else {
            **counts, **{name: counts.get(name, 0.0) + gained for name, gained in delta(b, a).items()}}
    return out


def pd_metrics(before: Readings, after: Readings, paths_before: dict[str, float],
               paths_after: dict[str, float]) -> dict[str, Any]:
    """What a P/D label's run adds to its metrics between two readings: its prefill engine's saves, its decode
    engine's loads and own timing, and its router's requests by path (those that moved)."""
    paths = {k: v - paths_before.get(k, 0.0) for k, v in paths_after.items()}
    return {"prefill_saves": save_means(before.get("prefill"), after.get("prefill")),
            "decode_loads": load_phase_means(before.get("decode"), after.get("decode")),
            "decode_engine": engine_time_means(before.get("decode"), after.get("decode")),
            "paths": {k: v for k, v in paths.items() if v}}


def measure_level(cfg: BenchConfig, target: Target, prompts: PromptSource, conc: int | None,
                  first: bool) -> list[Run]:
    """One concurrency level of one label on its own; a P/D label's run gets `pd_metrics` from readings
    taken around it (its warm-up included)."""
    before = read_engines(target.engines)
    paths_before = router_paths(target.url) if target.engines else {}
    level = asyncio.run(bench_endpoint(cfg, target.url, target.label, prompts, [conc],
                                       target.first_warmups if first else 0))
    if target.engines:
        level[0].metrics.update(pd_metrics(before, read_engines(target.engines), paths_before,
                                           router_paths(target.url)))
    return level


def paired_schedule(labels: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round's requests in paired mode: one per label, rotated by one every round, so no
    label always goes first or last (over a multiple of len(labels) rounds each takes every place equally
    often), and what a place costs (the engine just used, the machine's state) does not land on one label."""
    n = len(labels)
    return [[labels[(r + i) % n] for i in range(n)] for r in range(rounds)]


async def run_paired(cfg: BenchConfig, targets: Sequence[Target], prompts: PromptSource) -> list[Run]:
    """--paired: every label warmed up as its first level would be, then cfg.num_prompts rounds of one fresh
    prompt per label (`paired_schedule`), one request at a time. One Run per label at c=1, its results in
    round order so `paired_differences` lines up each round's requests. A label's duration is the time its
    own requests took (at c=1, what its run alone would have lasted); the engines and routers are read
    between requests, outside the timing."""
    model = str(cfg.model)
    by_label = {t.label: t for t in targets}
    firsts = {t.label: read_engines(t.engines) for t in targets}
    totals = dict(firsts)
    paths_before = {t.label: router_paths(t.url) for t in targets if t.engines}
    results: dict[str, list[RequestResult]] = {label: [] for label in by_label}
    busy = dict.fromkeys(by_label, 0.0)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(targets)),
                                 timeout=cfg.request_timeout) as client:

        async def one(target: Target, prompt: str) -> tuple[RequestResult, float]:
            before = read_engines(target.engines)  # blocking, but nothing else is in flight
            start = time.perf_counter()
            result = await send_request(client, cfg, target.url, model, prompt)
            took = time.perf_counter() - start
            totals[target.label] = add_readings(totals[target.label], before, read_engines(target.engines))
            return result, took

        for t in targets:
            check_warm_up([(await one(t, p))[0] for p in prompts.take(warmups(cfg, 1, t.first_warmups))], t.url)
        router_before = {t.label: await router_totals(client, t.url) for t in targets}
        bar = tqdm(total=cfg.num_prompts * len(targets), desc="paired c=1", disable=cfg.disable_tqdm,
                   file=sys.stderr, leave=False)
        for order in paired_schedule(list(by_label), cfg.num_prompts):
            for label, prompt in zip(order, prompts.take(len(order))):
                result, took = await one(by_label[label], prompt)
                results[label].append(result)
                busy[label] += took
                bar.update(1)
        bar.close()
        runs = []
        for t in targets:
            metrics = summarize(results[t.label], busy[t.label], cfg.goodput)
            report(t.label, 1, metrics)
            router = router_means(router_before[t.label], await router_totals(client, t.url))
            if router:
                metrics["router"] = router
            if t.engines:
                metrics.update(pd_metrics(firsts[t.label], totals[t.label], paths_before[t.label],
                                          router_paths(t.url)))
            runs.append(Run(t.label, t.url, 1, metrics, results[t.label]))
    return runs


def compare_stacks(cfg: BenchConfig) -> list[Run]:
    """P/D stack (one per KV backend), then a colocated engine (through the router and direct), one after
    the other; with --paired all of them up at once and their requests interleaved (`run_paired`)."""
    from pdserve.deploy.local import StackConfig
    from pdserve.deploy.tiny_model import TINY_ENGINE_ENV, TINY_SERVED_NAME, TINY_VLLM_ARGS, tiny_model_dir

    if cfg.model:
        model, served, vllm_args, env = cfg.model, cfg.model, cfg.vllm_args, {}
    else:
        model, served = str(tiny_model_dir()), TINY_SERVED_NAME
        vllm_args, env = (*TINY_VLLM_ARGS, *cfg.vllm_args), dict(TINY_ENGINE_ENV)
    tokenizer = load_tokenizer(cfg.tokenizer or model)
    prompts = PromptSource(tokenizer, cfg.input_len, cfg.seed)
    floor_prompts = PromptSource(tokenizer, FLOOR_PROMPT_TOKENS, cfg.seed + 1)
    bench = BenchConfig(**{**asdict(cfg), "model": served})

    def stack(**kw: Any) -> StackConfig:
        # Ports are picked as each stack comes up, so a stack already up holds its own.
        return StackConfig(model=model, served_model_name=served, tokenizer=model if Path(model).is_dir() else None,
                           vllm_args=tuple(vllm_args), engine_env=env, port=free_port(),
                           prefill_port=free_port(), decode_port=free_port(), kvstore_port=free_port(),
                           kvstore_http_port=free_port(), api_key=cfg.api_key, gpus=cfg.gpus, **kw)

    stacks: list[Callable[[], AbstractContextManager[StackUp]]] = []
    if "pdserve" in cfg.kv_backends:
        stacks.append(lambda: pd_stack(bench, stack, tokenizer, floor_prompts))
    if "lmcache" in cfg.kv_backends:
        stacks.append(lambda: lmcache_stack(bench, stack))
    stacks.append(lambda: colocated_stack(bench, stack, floor_prompts))
    runs: list[Run] = []
    if cfg.paired:
        with ExitStack() as up:
            targets: list[Target] = []
            for start in stacks:
                s = up.enter_context(start())
                targets += s.targets
                runs += s.floors
            return runs + asyncio.run(run_paired(bench, targets, prompts))
    for start in stacks:
        with start() as s:
            runs += s.floors
            # Every label of the stack runs a level before the next level starts, so slow drift in the machine's
            # load does not land on one side of a difference between two labels (colocated router vs direct).
            for n, conc in enumerate(cfg.max_concurrency):
                asyncio.run(warm_engines(bench, s.warm_urls, prompts, conc))
                runs += [run for t in s.targets for run in measure_level(bench, t, prompts, conc, first=n == 0)]
    return runs


# Unmeasured closed-loop requests per slot of a level's concurrency, straight to each engine that decodes,
# before a stack's labels run that level. A label's own warm-ups are one batch sent together; the first label
# of each stack still paid about 1 s on a few requests, later ones not (H200, 2k tokens, c=8, 48 prompts, two
# runs: p90 0.8-1.1 s on the first P/D router and on the colocated router, 0.07-0.13 s after). The engines
# build kernels for batch shapes the first time they see them, and the shapes of a steady closed loop (prefills
# mixed into decode steps, a decode-only prompt recomputed beside running streams) differ from one burst's.
# Sent straight to the engines alone, the first P/D label of a level still paid: on an H100 (2k tokens, one
# router with the early prefill leg, one without, each order once) whichever ran first at c=8 had a TTFT p50
# 11-21 ms above its run in second place, and at c=4 6-10 ms. Its prefill engine and the KV moves had seen
# that level's load only as the first label's own burst of warm-ups, so a P/D stack also warms through a
# router of its own.
ENGINE_WARMUP_ROUNDS = 3


async def warm_engines(cfg: BenchConfig, engines: Sequence[str], prompts: PromptSource, conc: int | None) -> None:
    """ENGINE_WARMUP_ROUNDS * conc requests at `conc` to each of `engines` (an engine or a stack's router) in
    turn (none without warm-ups)."""
    if not cfg.num_warmups:
        return
    for url in engines:
        warm = prompts.take(ENGINE_WARMUP_ROUNDS * (conc or 1))
        await run_load(cfg, url, str(cfg.model), [], warm, conc, f"engine warm-up c={conc or 'inf'}")


@contextmanager
def pd_stack(cfg: BenchConfig, stack: Callable[..., StackConfig], tokenizer: Any,
             floor_prompts: PromptSource) -> Iterator[StackUp]:
    """The P/D stack on pdserve's store with one router per PD_ROUTERS entry (those of --pd-runs, in its
    order); its decode engine's floors measured as it comes up."""
    from pdserve.deploy.local import LocalStack

    pd = stack(num_prefill=1, num_decode=1, connector=True, pd_min_prompt_tokens=0)
    with LocalStack(pd, label="P/D stack").start(show_progress=not cfg.disable_tqdm), ExitStack() as routers:
        flags = {label: PD_ROUTERS[label] for label in cfg.pd_runs or PD_ROUTERS}
        urls = {label: routers.enter_context(second_router(pd, *f)) if f else pd.router_url for label, f in flags.items()}
        engines = {"decode": pd.worker_urls("decode")[0], "prefill": pd.worker_urls("prefill")[0]}
        floors = (engine_floor(cfg, engines["decode"], FLOOR_LABELS["pd"], floor_prompts)
                  + cached_floor(cfg, engines["decode"], tokenizer))
        targets = [Target(label, url, PD_ROUTER_WARMUPS, engines) for label, url in urls.items()]
        if cfg.paired:
            targets.append(Target(DECODE_DIRECT_LABEL, engines["decode"]))
        yield StackUp(targets, floors, [engines["decode"], pd.router_url])


@contextmanager
def colocated_stack(cfg: BenchConfig, stack: Callable[..., StackConfig],
                    floor_prompts: PromptSource) -> Iterator[StackUp]:
    """One engine without a connector behind a router that never disaggregates, benchmarked through the
    router and directly; its floor measured as it comes up."""
    from pdserve.deploy.local import LocalStack

    coloc = stack(num_prefill=0, num_decode=1, connector=False, pd_min_prompt_tokens=10**9)
    with LocalStack(coloc, label="colocated stack").start(show_progress=not cfg.disable_tqdm):
        direct = coloc.worker_urls("decode")[0]
        floors = engine_floor(cfg, direct, FLOOR_LABELS["colocated"], floor_prompts)
        yield StackUp([Target(label, url) for label, url in zip(COLOCATED_LABELS, (coloc.router_url, direct))],
                      floors, [direct])


def engine_floor(cfg: BenchConfig, engine_url: str, label: str, prompts: PromptSource) -> list[Run]:
    """TTFT of short prompts sent one at a time straight to an engine: what a first token costs there
    when there is next to nothing to prefill, the least a decode leg can cost (its KV loaded, one step)."""
    floor = BenchConfig(**{**asdict(cfg), "input_len": FLOOR_PROMPT_TOKENS, "output_len": 1,
                           "num_prompts": FLOOR_PROMPTS, "num_warmups": 2, "goodput": {}})
    return asyncio.run(bench_endpoint(floor, engine_url, label, prompts, [1]))


def cached_floor(cfg: BenchConfig, engine_url: str, tokenizer: Any) -> list[Run]:
    """TTFT of full-length prompts straight at an engine that computed each of them just before: two passes
    over the same prompts (one seed), the first unmeasured. Sequential, so a prompt's second pass finds its
    blocks still cached."""
    floor = BenchConfig(**{**asdict(cfg), "output_len": 1, "num_prompts": FLOOR_PROMPTS, "num_warmups": 0,
                           "goodput": {}})
    def one_pass(label: str) -> list[Run]:
        return asyncio.run(bench_endpoint(floor, engine_url, label, PromptSource(tokenizer, cfg.input_len, cfg.seed + 2),
                                          [1]))

    one_pass("cached-floor-warm")
    return one_pass(CACHED_FLOOR_LABEL)


@contextmanager
def lmcache_stack(cfg: BenchConfig, stack: Callable[..., StackConfig]) -> Iterator[StackUp]:
    """The P/D stack on LMCache. Its workers register in Redis when there is a redis-server, so
    the router reads LMCache's lookup and waits for the prefill's chunks (lmcache_view.py), as a
    deployment on this backend runs; without one they are static and the router does neither."""
    from pdserve.bench.fault_stack import start_redis
    from pdserve.deploy.local import LocalStack

    redis = start_redis() if shutil.which("redis-server") else None
    if redis is None:
        print("no redis-server on PATH: the LMCache stack's workers are static (no LMCache lookups by the router)",
              file=sys.stderr)
    try:
        lm = stack(num_prefill=1, num_decode=1, connector=True, pd_min_prompt_tokens=0, kv_backend="lmcache",
                   redis_url=f"redis://127.0.0.1:{redis.port}/0" if redis else None)
        with LocalStack(lm, label="P/D stack on LMCache").start(show_progress=not cfg.disable_tqdm):
            yield StackUp([Target(PD_LABELS["lmcache"], lm.router_url)], [], [*lm.worker_urls("decode")[:1], lm.router_url])
    finally:
        if redis is not None:
            redis.stop()


def _concurrency(value: str) -> int | None:
    return None if value in ("inf", "0", "none") else int(value)


def _slo(value: str) -> tuple[str, float]:
    metric, sep, ms = value.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS (e.g. ttft:500), got {value!r}")
    return metric, float(ms)


def build_parser() -> argparse.ArgumentParser:
    from pdserve.deploy.local import gpu_list

    d = BenchConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="pdserve bench serve",
        description="Benchmark an OpenAI-compatible endpoint: TTFT, TPOT, ITL, throughput, goodput. "
                    "With --compare, arguments after `--` go to the vLLM workers it starts.",
        allow_abbrev=False,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to benchmark (without /v1)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models); "
                   "with --compare, the model the stacks serve (default: the tiny DeepSeek-V3)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for exact prompt lengths (default: the model's folder)")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=d["input_len"].default)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=d["output_len"].default)
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"].default)
    p.add_argument("--max-concurrency", type=_concurrency, nargs="+", default=[None],
                   help="requests in flight at most; several values give one run each (inf: unlimited)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, Poisson (inf: all at once)")
    p.add_argument("--num-warmups", type=int, default=d["num_warmups"].default, help="unmeasured requests first (at least one batch of each --max-concurrency)")
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--goodput", type=_slo, nargs="+", default=[], metavar="METRIC:MS",
                   help=f"SLOs for goodput, metrics among {SLO_METRICS}, e.g. ttft:500 tpot:50")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout", type=float, default=d["request_timeout"].default)
    p.add_argument("--result-dir", type=Path, default=Path("."))
    p.add_argument("--result-filename", default=None, help="JSON file name (the PNG takes the same stem)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--compare", action="store_true",
                   help="start a P/D stack and a colocated single-engine stack here and benchmark both")
    p.add_argument("--kv-backend", dest="kv_backends", nargs="+", choices=KV_BACKENDS, default=["pdserve"],
                   help="with --compare: one P/D stack per KV backend, side by side (lmcache needs lmcache "
                        "installed and redis-server on PATH)")
    p.add_argument("--pd-runs", nargs="+", choices=tuple(PD_ROUTERS), default=[], metavar="LABEL",
                   help="with --compare: the P/D runs to make, in this order (default: all of "
                        f"{', '.join(PD_ROUTERS)}); every label of a stack runs a level in turn, so the order "
                        "says which goes first")
    p.add_argument("--paired", action="store_true",
                   help="with --compare and --max-concurrency 1: every stack up at once, one request at a time "
                        "to each run label in turn (order rotated every round); adds each round's P/D minus "
                        "colocated TTFT and their median, free of the machine's drift between runs")
    p.add_argument("--gpus", type=gpu_list, default=(),
                   help="with --compare: each stack's engines take these GPUs in turn, prefill first (as `pdserve up "
                        "--gpus`): 0,1 runs P/D's prefill engine on GPU 0 and its decode engine on GPU 1, and the "
                        "colocated engine on GPU 0. Default: every engine where CUDA_VISIBLE_DEVICES says")
    return p


def config_from_args(argv: Sequence[str]) -> BenchConfig:
    argv, vllm_args = split_passthrough(argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    if vllm_args and not a.compare:
        parser.error("arguments after `--` are for the engines --compare starts")
    try:
        return BenchConfig(
            base_url=a.base_url.rstrip("/").removesuffix("/v1"), model=a.model, tokenizer=a.tokenizer,
            input_len=a.input_len, output_len=a.output_len, num_prompts=a.num_prompts,
            max_concurrency=tuple(a.max_concurrency), request_rate=a.request_rate, num_warmups=a.num_warmups,
            seed=a.seed, goodput=dict(a.goodput), api_key=a.api_key, request_timeout=a.request_timeout,
            result_dir=a.result_dir, result_filename=a.result_filename, disable_tqdm=a.disable_tqdm,
            compare=a.compare, kv_backends=tuple(a.kv_backends), paired=a.paired, pd_runs=tuple(a.pd_runs),
            gpus=a.gpus, vllm_args=tuple(vllm_args),
        )
    except ValueError as exc:
        parser.error(str(exc))


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    # Explicit, because a shell starts background jobs with SIGINT ignored: Ctrl-C or
    # SIGTERM must unwind through the stacks' context managers so --compare stops them.
    previous = {sig: signal.signal(sig, handler) for sig, handler in
                ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _interrupt))}
    try:
        runs = compare_stacks(cfg) if cfg.compare else asyncio.run(bench_endpoint(cfg, cfg.base_url, "endpoint"))
    except (RuntimeError, httpx.HTTPError, OSError, ValueError) as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    rows = comparison(runs, paired=cfg.paired)
    print_summary(runs, rows)
    json_path, png_path = write_results(cfg, runs, rows)
    print(f"results: {json_path}\nplot: {png_path}")
    return 0 if all(r.metrics["failed"] == 0 for r in runs) else 1
