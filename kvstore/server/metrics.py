"""KV store metrics: one private Prometheus registry, read by /metrics and /stats.

Counters are updated by the server thread and read by the HTTP thread;
prometheus_client makes that safe. Tier gauges are refreshed by the server loop
(`Metrics.refresh`) rather than on every change, which keeps the hot path cheap.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

PREFIX = "pdserve_kvstore"
PATHS = ("shm", "tcp")  # how payloads travel: the shared-memory arena or TCP frames


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests handled, by op", ["op"], registry=r)
        self.hits = Counter(f"{PREFIX}_hits", "Objects found by get, by tier", ["tier"], registry=r)
        self.misses = Counter(f"{PREFIX}_misses", "Objects not found by get", registry=r)
        self.lookup_hits = Counter(f"{PREFIX}_lookup_hit_chunks", "Chunks matched by lookups", registry=r)
        # bound per path once: these count every object moved, and labels() costs more than inc()
        bytes_in = Counter(f"{PREFIX}_bytes_in", "Payload bytes stored, by path (shm, tcp)", ["path"], registry=r)
        bytes_out = Counter(f"{PREFIX}_bytes_out", "Payload bytes loaded, by path (shm, tcp)", ["path"], registry=r)
        self.bytes_in = {path: bytes_in.labels(path) for path in PATHS}
        self.bytes_out = {path: bytes_out.labels(path) for path in PATHS}
        self.evictions = Counter(f"{PREFIX}_evictions", "Objects evicted, by tier", ["tier"], registry=r)
        self.refused = Counter(f"{PREFIX}_refused", "Objects refused (too large, no room)", registry=r)
        self.corrupt = Counter(
            f"{PREFIX}_checksum_mismatches", "Payloads that failed verification, by tier", ["tier"], registry=r
        )
        self.errors = Counter(f"{PREFIX}_errors", "Requests answered with an error, by code", ["code"], registry=r)
        self.tier_bytes = Gauge(f"{PREFIX}_tier_bytes", "Payload bytes held, by tier", ["tier"], registry=r)
        self.tier_objects = Gauge(f"{PREFIX}_tier_objects", "Objects held, by tier", ["tier"], registry=r)
        self.tier_capacity = Gauge(f"{PREFIX}_tier_capacity_bytes", "Byte budget, by tier", ["tier"], registry=r)
        self.live_tails = Gauge(f"{PREFIX}_live_tails", "Request tails not yet loaded or expired", registry=r)
        self.leases = Gauge(f"{PREFIX}_leases", "Objects leased to transfers in progress", registry=r)

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, float]:
        """Flat name -> value, e.g. {"hits_total{tier=l1}": 3.0}, for /stats and the stats op."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                name = sample.name[len(PREFIX) + 1 :]
                if sample.labels:
                    name += "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
                out[name] = sample.value
        return out
