"""Which worker of a pool takes a leg. Policies are pure and synchronous: the flow
gathers what they need (prompt tokens, store hits) before asking, so choosing is
cheap and a policy can be unit-tested with plain Worker objects.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.router.config import PolicyName
from pdserve.router.pool import Policy, RouteContext, Worker


def _load_key(w: Worker) -> tuple[int, int, int, int]:
    # Requests first (each holds a sequence slot and KV), then prompt tokens (prefill
    # work queued), then what the worker reports, then how many it served (spreads ties).
    return (w.inflight, w.inflight_tokens, w.reported_load, w.served)


class LeastLoaded:
    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        return min(workers, key=_load_key)


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        ordered = sorted(workers, key=lambda w: w.id)
        w = ordered[self._next % len(ordered)]
        self._next += 1
        return w


class PrefixAware:
    """The worker whose KV store holds the longest prefix of the prompt; least-loaded among equals.

    With one shared store every worker ties and this is least-loaded; it pays off
    when prefill workers sit next to different stores (one per host or rack).
    """

    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        def hits(w: Worker) -> int:
            return ctx.prefix_tokens.get(w.kvstore_url or "", 0)

        best = max(hits(w) for w in workers)
        return min((w for w in workers if hits(w) == best), key=_load_key)


def make_policy(name: PolicyName) -> Policy:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    if name == "prefix-aware":
        return PrefixAware()
    raise ValueError(f"unknown policy {name!r}")
