"""The connector's transfer counters, counted by its threads and taken once per engine step.

vLLM-free, so the worker side that counts is too; stats.py hands the counts to vLLM's
metrics (`vllm:pdserve_<name>` on the engine's /metrics).
"""

from __future__ import annotations

import threading

COUNTERS: dict[str, str] = {
    "loads": "KV loads from the pdserve store",
    "failed_loads": "KV loads that failed (missing, corrupt or store unreachable); vLLM recomputed them",
    "loaded_bytes": "KV bytes loaded from the pdserve store",
    "saved_bytes": "KV bytes saved to the pdserve store",
    "saves_retried": "P/D handoff saves that failed and were uploaded again once the store answered",
    "saves_lost": "P/D handoff saves that could not be uploaded in time (their decode recomputes)",
    "store_timeouts": "KV loads that got no answer from their store within the deadline (it was marked down)",
    "loads_store_down": "KV loads failed at once because their store was marked down (vLLM recomputed them)",
    "load_seconds": "seconds from a load's start (start_load_kv) until vLLM is told it finished, summed over loads",
    "load_queue_seconds": "seconds loads waited for a free load thread, summed over loads",
    "load_fetch_seconds": "seconds loads spent fetching from the store (waits for a producer's upload included)",
    "load_fetch_waits": "times a load waited in the store for a producer's upload to land",
    "gathers": "copies out of the paged cache for saves (one per KV group and engine step that saves)",
    "gather_bytes": "KV bytes copied out of the paged cache for saves (device to host included)",
    "gather_seconds": "seconds spent copying KV out of the paged cache for saves",
    "gather_gpu_seconds": "GPU time of those copies (kernels and device-to-host transfer, by CUDA events)",
    "scatter_bytes": "KV bytes copied into the paged cache by loads (host to device included)",
    "scatter_seconds": "seconds spent copying KV into the paged cache for loads",
    "scatter_gpu_seconds": "GPU time of those copies (host-to-device transfer and kernels, by CUDA events)",
}


class StatsCounter:
    """Thread-safe counts from the transfer threads, taken once per engine step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] += value

    def take(self) -> dict[str, float] | None:
        """The counts since the last take, or None when nothing was counted."""
        with self._lock:
            if not any(self._counts.values()):
                return None
            counts = self._counts
            self._counts = dict.fromkeys(COUNTERS, 0)
            return counts
