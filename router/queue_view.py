"""Each worker's queue as its vLLM reports it, scraped in the background.

vLLM's `/metrics` say how many requests an engine is running and how many wait
(`vllm:num_requests_running`, `vllm:num_requests_waiting`, and since 0.3x the waiting
split by reason: `capacity` ones wait for a batch slot, `deferred` ones for a KV
transfer). The router's own in-flight counts (pool.py) are exact and current for its
own requests; a scrape adds what they cannot see: requests other routers or clients
sent to the same worker. Each snapshot records the router's own in-flight count at
the moment of the answer, so a reader can tell foreign requests from its own.

The poller never sits on a request's path: a request reads the latest snapshot, and a
snapshot older than `max_age` counts as none. It scrapes only while the router has
traffic (`touch`, from each path decision, keeps it going for `IDLE_AFTER_INTERVALS`
intervals): a scrape costs vLLM's API server about 10 ms of CPU (measured on the 2-core
VM), which an idle router need not spend on every worker twice a second. Every scrape is bounded (one at a time
per worker, a deadline, a size cap) and a worker whose `/metrics` hangs, fails or
answers garbage just has no snapshot; the others are scraped on time regardless.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import aiohttp

from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool, Worker
from pdserve.router.upstream import UPSTREAM_ERRORS, describe

log = logging.getLogger("pdserve.router.queue_view")

IDLE_AFTER_INTERVALS = 20
MAX_METRICS_BYTES = 4 << 20  # vLLM's exposition is ~0.1-0.3 MB; more than this is not a vLLM answering

_RUNNING = b"vllm:num_requests_running"
_WAITING = b"vllm:num_requests_waiting"
_BY_REASON = b"vllm:num_requests_waiting_by_reason"
_OURS = (_RUNNING, _WAITING, _BY_REASON)
_PREFIX = b"vllm:num_requests_"
_NAME = re.compile(rb"[a-zA-Z_:][\w:]*")
# name{labels} value [timestamp]; label values are quoted and may hold escaped quotes, braces, spaces
_SAMPLE = re.compile(rb'^([a-zA-Z_:][\w:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*$')
_CAPACITY = re.compile(rb'[{,]\s*reason="capacity"')
# Samples that only the engine core moves (its scheduler's stats reach the API server with every step it
# runs, an empty one included): while any of them changes between scrapes the engine is stepping, even
# when none of its requests has sent a byte for long (one long prompt's chunks). Both names of the KV
# usage gauge (gpu_cache_usage_perc before vLLM 0.11).
_PROGRESS = re.compile(
    rb"^vllm:(?:kv_cache_usage_perc|gpu_cache_usage_perc|iteration_tokens_total_count|prompt_tokens_total"
    rb"|generation_tokens_total)\b.*$", re.MULTILINE)


@dataclass(frozen=True)
class QueueCounts:
    """One scrape's counts, summed over the worker's engines (data-parallel ranks)."""

    running: int
    waiting: int  # every waiting request, those held for a KV transfer included
    capacity_waiting: int | None  # waiting for a batch slot; None when this vLLM does not split them


@dataclass(frozen=True)
class QueueSnapshot:
    counts: QueueCounts
    own_inflight: int  # the router's own requests on the worker when the scrape answered
    at: float  # time.monotonic() of the answer

    @property
    def foreign(self) -> int:
        """Requests in the engine that are not this router's (at the scrape; never negative:
        the router's own count also holds requests still on their way in or out of the engine)."""
        return max(0, self.counts.running + self.counts.waiting - self.own_inflight)


def _count(raw: bytes) -> int | None:
    """A gauge's value as a count: a finite, non-negative whole number."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 0 and value == int(value) else None


def parse_queue(text: bytes) -> QueueCounts | None:
    """The counts in a Prometheus exposition, or None when it lacks them or one of their samples is not a count."""
    sums = {_RUNNING: 0, _WAITING: 0}
    capacity: int | None = None
    seen: set[bytes] = set()
    for line in text.splitlines():
        if not line.startswith(_PREFIX):  # a cheap filter before the regexes; comments start with '#'
            continue
        name = _NAME.match(line)
        if name is None or name.group(0) not in _OURS:
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name.group(0) or (value := _count(m.group(3))) is None:
            return None
        if name.group(0) == _BY_REASON:
            if _CAPACITY.search(m.group(2) or b""):
                capacity = (capacity or 0) + value
        else:
            sums[name.group(0)] += value
            seen.add(name.group(0))
    if seen != {_RUNNING, _WAITING}:
        return None
    return QueueCounts(sums[_RUNNING], sums[_WAITING], capacity)


def progress_mark(text: bytes) -> int:
    """A value that changes whenever the engine has stepped since another scrape (see _PROGRESS)."""
    return hash(tuple(_PROGRESS.findall(text)))


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes | None:
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > cap:
            return None
    return bytes(body)


class QueueView:
    """Background scrapes of every worker's `/metrics` each `interval` s; snapshots live `2 * interval` s."""

    def __init__(self, pools: Sequence[Pool], http: aiohttp.ClientSession, headers: dict[str, str],
                 interval: float, metrics: RouterMetrics) -> None:
        self.pools = pools
        self.http = http
        self.headers = headers
        self.interval = interval
        self.max_age = 2 * interval  # one lost scrape is tolerated, two are not
        self.metrics = metrics
        self.timeout = aiohttp.ClientTimeout(total=interval * 2)
        # Keyed by the Worker object: a departed (or re-registered) worker's entries go with it.
        self._snapshots: weakref.WeakKeyDictionary[Worker, QueueSnapshot] = weakref.WeakKeyDictionary()
        self._scrapes: weakref.WeakKeyDictionary[Worker, asyncio.Task] = weakref.WeakKeyDictionary()
        # (progress_mark of the latest scrape, monotonic time it last changed) per worker
        self._progress: weakref.WeakKeyDictionary[Worker, tuple[int, float]] = weakref.WeakKeyDictionary()
        self._task: asyncio.Task | None = None
        self._wanted_until = 0.0  # monotonic; scrapes run until then

    def touch(self) -> None:
        """A request is being routed: keep the snapshots fresh for a while."""
        self._wanted_until = time.monotonic() + IDLE_AFTER_INTERVALS * self.interval

    def snapshot(self, w: Worker, now: float | None = None) -> QueueSnapshot | None:
        """The worker's latest snapshot, or None when there is none fresher than `max_age`."""
        snap = self._snapshots.get(w)
        if snap is None or (time.monotonic() if now is None else now) - snap.at > self.max_age:
            return None
        return snap

    def engine_still_for(self, w: Worker) -> float | None:
        """Seconds since the scrapes last saw `w`'s engine step; None without a fresh scrape to tell."""
        if self.snapshot(w) is None or (progress := self._progress.get(w)) is None:
            return None
        return time.monotonic() - progress[1]

    async def scrape(self, pool: Pool, w: Worker) -> None:
        """One scrape of `w`; its snapshot is replaced on success and dropped on any failure."""
        outcome = "ok"
        try:
            async with self.http.get(w.url + "/metrics", headers=self.headers, timeout=self.timeout) as resp:
                body = await _read_capped(resp, MAX_METRICS_BYTES) if resp.status == 200 else None
            counts = parse_queue(body) if body is not None else None
            if counts is None:
                outcome = "bad"
        except UPSTREAM_ERRORS as exc:
            log.debug("queue scrape of %s failed: %s", w.url, describe(exc))
            outcome, counts = "failed", None
        self.metrics.queue_scrapes.labels(pool.role, outcome).inc()
        if counts is None or body is None:
            self._snapshots.pop(w, None)
        elif pool.workers.get(w.id) is w:  # it may have left while we waited
            now = time.monotonic()
            self._snapshots[w] = QueueSnapshot(counts, w.inflight, now)
            mark, last = progress_mark(body), self._progress.get(w)
            if last is None or last[0] != mark:
                self._progress[w] = (mark, now)

    def scrape_all(self) -> None:
        """Start a scrape of each worker that has none under way (a hung one holds up only itself)."""
        for pool in self.pools:
            for w in list(pool.workers.values()):
                running = self._scrapes.get(w)
                if running is None or running.done():
                    self._scrapes[w] = asyncio.create_task(self.scrape(pool, w), name=f"queue-scrape:{w.id}")

    async def _loop(self) -> None:
        while True:
            if time.monotonic() < self._wanted_until:
                self.scrape_all()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="queue-view")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._scrapes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
