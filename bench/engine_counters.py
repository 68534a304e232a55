"""Read PDServeConnector's counters off an engine's /metrics, without importing vLLM.

The connector exports `vllm:pdserve_<name>_total` (kvstore/connector/counters.py: COUNTERS) on the engine's
own Prometheus endpoint; benchmarks and tests read them from outside the engine. Counters
are summed over their labels (one series per engine of a data-parallel server).
"""

from __future__ import annotations

import httpx

PREFIX = "vllm:pdserve_"


# vLLM's own per-request histograms that split a decode leg's time inside the engine: arrival at its API
# server to first token, then of that, queued in the engine (an async KV load's wait included) and from
# first scheduled to first token. Read as `<key>_sum` and `<key>_count`.
ENGINE_TIMES = {"engine_ttft": "vllm:time_to_first_token_seconds", "engine_queue": "vllm:request_queue_time_seconds",
                "engine_prefill": "vllm:request_prefill_time_seconds"}
_ENGINE_SAMPLES = {f"{name}_{part}": f"{key}_{part}" for key, name in ENGINE_TIMES.items() for part in ("sum", "count")}


def parse_counters(text: str) -> dict[str, float]:
    """{name: value} of every vllm:pdserve_* sample in a Prometheus text page, and the sums and counts of
    ENGINE_TIMES, labels summed."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        engine = _ENGINE_SAMPLES.get(line.split("{", 1)[0].split(" ", 1)[0])
        if engine is not None:
            totals[engine] = totals.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
            continue
        if not line.startswith(PREFIX):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix(PREFIX).removesuffix("_total")
        if name.endswith("_created"):
            continue
        totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def read_counters(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The engine's counters now; None when it does not answer."""
    try:
        resp = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_counters(resp.text) if resp.status_code == 200 else None


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter gained between two readings."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


# Where a load's time goes, per load (ms): from start_load_kv until vLLM hears it finished, the
# wait for a load thread, the store fetch (waits for a producer's upload included) and the copy
# into the paged cache; what the three leave of the whole is the engine noticing the finished load.
# On CUDA the copy's wall time also holds its wait for the work the engine queued before the load
# (its fence); the copy's own GPU time (CUDA events, from after that wait) tells the two apart.
LOAD_PHASES = {"load_ms": "load_seconds", "load_queue_ms": "load_queue_seconds",
               "load_fetch_ms": "load_fetch_seconds", "load_scatter_ms": "scatter_seconds",
               "load_scatter_gpu_ms": "scatter_gpu_seconds"}


def _gained(before: dict[str, float] | None, after: dict[str, float] | None, per: str) -> tuple[dict[str, float], float]:
    """What each counter gained between two readings, and how much of it `per` gained (0 without readings)."""
    if not before or not after:
        return {}, 0.0
    gained = delta(before, after)
    return gained, gained.get(per, 0.0)


def load_phase_means(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """Mean ms per load of each phase between two readings, and the store waits per load; empty without loads."""
    gained, loads = _gained(before, after, "loads")
    if loads <= 0:
        return {}
    out = {key: 1000.0 * gained.get(name, 0.0) / loads for key, name in LOAD_PHASES.items()}
    out["load_waits"] = gained.get("load_fetch_waits", 0.0) / loads
    return out


def _gpu_part(means: dict[str, float]) -> str:
    gpu = means.get("load_scatter_gpu_ms", 0.0)
    return f" (of it {gpu:.1f} on the GPU, after the engine's queued work)" if gpu > 0 else ""


def describe_load_phases(means: dict[str, float]) -> str:
    """One line for a benchmark's output."""
    if not means:
        return "no loads"
    return (f"{means['load_ms']:.1f} ms per load: waiting for a load thread {means['load_queue_ms']:.1f}, "
            f"store fetch {means['load_fetch_ms']:.1f} ({means['load_waits']:.1f} waits for a producer's upload), "
            f"copy into the paged cache {means['load_scatter_ms']:.1f}{_gpu_part(means)}, the engine noticing it "
            f"{means['load_ms'] - means['load_queue_ms'] - means['load_fetch_ms'] - means['load_scatter_ms']:.1f}")


def save_means(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """Mean per copy out of the paged cache for saves between two readings: wall ms (on CUDA it
    holds the wait for the step's forward, queued before it), GPU ms (from the end of that forward)
    and MB; empty without saves."""
    gained, n = _gained(before, after, "gathers")
    if n <= 0:
        return {}
    return {"save_ms": 1000.0 * gained.get("gather_seconds", 0.0) / n,
            "save_gpu_ms": 1000.0 * gained.get("gather_gpu_seconds", 0.0) / n,
            "save_mb": gained.get("gather_bytes", 0.0) / n / 1e6, "saves": n}


def describe_saves(means: dict[str, float]) -> str:
    """One line for a benchmark's output."""
    if not means:
        return "no saves"
    gpu = f" (of it {means['save_gpu_ms']:.1f} on the GPU, after the step's forward)" if means["save_gpu_ms"] > 0 else ""
    return f"{means['saves']:.0f} copies out of the paged cache, {means['save_mb']:.1f} MB and {means['save_ms']:.1f} ms each{gpu}"


def engine_time_means(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """Mean ms per request of each of ENGINE_TIMES between two readings (`<key>_ms`); empty without requests."""
    if not before or not after:
        return {}
    gained = delta(before, after)
    return {f"{key}_ms": 1000.0 * gained.get(f"{key}_sum", 0.0) / gained[f"{key}_count"]
            for key in ENGINE_TIMES if gained.get(f"{key}_count", 0.0) > 0}
