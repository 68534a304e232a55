"""Read PDServeConnector's counters off an engine's /metrics, without importing vLLM.

The connector exports `vllm:pdserve_<name>_total` (connector_stats.COUNTERS) on the engine's
own Prometheus endpoint; benchmarks and tests read them from outside the engine. Counters
are summed over their labels (one series per engine of a data-parallel server).
"""

from __future__ import annotations

import httpx

PREFIX = "vllm:pdserve_"


def parse_counters(text: str) -> dict[str, float]:
    """{name: value} of every vllm:pdserve_* sample in a Prometheus text page, labels summed."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
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
