"""PDServeConnector's transfer counters, exported on the engine's own /metrics.

The workers count loads, failed loads (recomputed by vLLM) and bytes moved (counters.py);
vLLM ships each step's counts to its logger process, where they become Prometheus
counters named `vllm:pdserve_*` beside vLLM's own metrics. These are vLLM's classes for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pdserve.kvstore.connector.counters import COUNTERS


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
