"""Prometheus metrics of one router, in a private registry.

A private registry (not prometheus_client's global one) so two routers in one
process, as tests run them, never collide, and /metrics shows only router series.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

M = TypeVar("M", Counter, Gauge, Histogram)

# Latency buckets from sub-millisecond (router overhead, ITL) to minutes (CPU prefill).
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests", "Requests answered, by route and HTTP status", ["route", "status"], registry=r
        )
        self.paths = Counter(
            "pdserve_router_paths",
            "How requests were served: pd (two legs in sequence), pd_overlap (two legs under one handoff id, "
            "the decode leg timed to the prefill: see pdserve_router_overlap_sends) or decode-only and why",
            ["path"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds", "Time to first token seen by the router, by route and by path (as in "
            "pdserve_router_paths): how long each path makes a client wait is what the path planner trades",
            ["route", "path"], buckets=_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdserve_router_itl_seconds", "Time between streamed chunks after the first token", buckets=_BUCKETS, registry=r
        )
        self.leg = Histogram(
            "pdserve_router_leg_seconds",
            "Leg latency: prefill until its response, decode until its first token",
            ["leg"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.handoff = Histogram(
            "pdserve_router_handoff_seconds",
            "From the prefill response to the decode leg's first token (KV load plus one decode step)",
            buckets=_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "pdserve_router_phase_seconds",
            "Where a P/D request's time to first token goes (decode_leg.pd_phases): the router before its "
            "first upstream call, the prefill leg, between the legs, the decode leg to its first token, relaying "
            "that token; overlap_wait, not a share of the whole, is how long an overlapped decode leg was out "
            "before the prefill answered",
            ["phase"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.plan = Histogram(
            "pdserve_router_plan_seconds",
            "Two steps of the router's path decision, part of its time before the first upstream call: "
            "step=tokenize (the prompt's token ids: local tokenizer, a worker's /tokenize, or none needed) "
            "and step=store_lookup (how much of the prompt the KV stores hold)",
            ["step"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.overlap_sends = Counter(
            "pdserve_router_overlap_sends",
            "When the decode legs of overlapped (pd_overlap) requests went out: at=start with the prefill leg "
            "(no prefill or decode timing learned yet), at=estimate at the prefill's predicted end less the "
            "decode leg's ingest, at=answer after the prefill answered first (then built from its answer, as "
            "in sequence)",
            ["at"],
            registry=r,
        )
        self.overlap_timing = Gauge(
            "pdserve_router_overlap_timing_seconds",
            "The figures that time an overlapped decode leg, medians of the recent legs (0 while unknown): "
            "figure=prefill_per_token, a prefill leg's seconds per prompt token; figure=decode_ingest, a "
            "streamed decode leg's seconds from its send to its response headers",
            ["figure"],
            registry=r,
        )
        self.overhead = Histogram(
            "pdserve_router_overhead_seconds",
            "The router's own time on a streamed request's way to its first token: before the first "
            "upstream call, between the legs, and relaying the first token (worker time excluded)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.queue_scrapes = Counter(
            "pdserve_router_queue_scrapes", "Scrapes of workers' /metrics for their queue, by outcome (ok, bad, failed)",
            ["role", "outcome"], registry=r,
        )
        self.token_seconds = Gauge(
            "pdserve_router_token_seconds",
            "Learned seconds per prompt token: prefill legs (pool=prefill), decode-only recomputes (pool=decode)",
            ["pool"], registry=r,
        )
        self.retries = Counter("pdserve_router_retries", "Legs retried on another worker", ["leg"], registry=r)
        self.send_timeouts = Counter(
            "pdserve_router_send_timeouts",
            "Client connections aborted because they took no byte of their answer for --send-timeout "
            "(the request ended as for a client that hung up)",
            registry=r,
        )
        self.producer_lost = Counter(
            "pdserve_router_producer_lost",
            "Overlapped decode legs given up before their first token because their prefill worker was found "
            "down after answering (its KV would never land); each request was served decode-only instead",
            registry=r,
        )
        self.stalls = Counter(
            "pdserve_router_stalls",
            "Times a worker held requests past its stall window without sending a byte on any: it left the "
            "pool until a canary request was answered, and its requests moved on (stall_watch.py)",
            ["role", "worker"], registry=r,
        )
        self.queue_depth = Gauge(
            "pdserve_router_queue_depth", "Requests waiting for a free worker", ["role"], registry=r
        )
        self.inflight = Gauge("pdserve_router_inflight", "Requests in flight per worker", ["role", "worker"], registry=r)
        self.worker_healthy = Gauge(
            "pdserve_router_worker_healthy", "1 when the worker takes requests (healthy, not stalled, breaker closed)",
            ["role", "worker"], registry=r,
        )
        self._series: dict[tuple[object, tuple[str, ...]], object] = {}

    def series(self, metric: M, *values: str) -> M:
        """`metric.labels(*values)`, looked up once. For the series every request touches (by route,
        status, path, leg, phase): a handful, never removed, and each labels() call takes a lock and
        builds a tuple of strings. Not for per-worker series, which forget_worker removes."""
        key = (metric, values)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*values)
        return child  # type: ignore[return-value]

    def observe_phases(self, phases: dict[str, float]) -> None:
        """One P/D request's phases, so a benchmark can say who owns each millisecond of its TTFT."""
        for phase, seconds in phases.items():
            self.series(self.phase, phase).observe(seconds)

    def follow_token_cost(self, pool: str, per_token: Callable[[], float | None]) -> None:
        """Show a learned per-token cost (0 while unknown), read when /metrics is asked."""
        self.token_seconds.labels(pool).set_function(lambda: per_token() or 0.0)

    def forget_worker(self, role: str, worker: str) -> None:
        """Drop a departed worker's series so /metrics does not report ghosts."""
        for gauge in (self.inflight, self.worker_healthy):
            try:
                gauge.remove(role, worker)
            except KeyError:
                pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
