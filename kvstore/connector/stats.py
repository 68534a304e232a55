"""PDServeConnector's transfer counters, exported on the engine's own /metrics.

The workers count loads, failed loads (recomputed by vLLM) and bytes moved; vLLM
ships each step's counts to its logger process, where they become Prometheus
counters named `vllm:pdserve_*` beside vLLM's own metrics.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS: dict[str, str] = {
    "loads": "KV loads from the pdserve store",
    "failed_loads": "KV loads that failed (missing, corrupt or store unreachable); vLLM recomputed them",
    "loaded_bytes": "KV bytes loaded from the pdserve store",
    "saved_bytes": "KV bytes saved to the pdserve store",
    "store_timeouts": "KV loads that got no answer from their store within the deadline (it was marked down)",
    "loads_store_down": "KV loads failed at once because their store was marked down (vLLM recomputed them)",
    "load_seconds": "seconds from a load's start (start_load_kv) until vLLM is told it finished, summed over loads",
    "load_queue_seconds": "seconds loads waited for a free load thread, summed over loads",
    "load_fetch_seconds": "seconds loads spent fetching from the store (waits for a producer's upload included)",
    "load_fetch_waits": "times a load waited in the store for a producer's upload to land",
    "gather_bytes": "KV bytes copied out of the paged cache for saves (device to host included)",
    "gather_seconds": "seconds spent copying KV out of the paged cache for saves",
    "scatter_bytes": "KV bytes copied into the paged cache by loads (host to device included)",
    "scatter_seconds": "seconds spent copying KV into the paged cache for loads",
}


@dataclass
class PDServeStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> "PDServeStats":
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)


class StatsCounter:
    """Thread-safe counts from the transfer threads, taken once per engine step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = PDServeStats()

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._stats.data[name] += value

    def take(self) -> PDServeStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, PDServeStats()
            return stats


class PDServePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:pdserve_{name}", documentation=doc, labelnames=labelnames)
            self.counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self.counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                per_engine[engine_idx].inc(value)
