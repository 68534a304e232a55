"""Workers that hold legs and send nothing: out of the pool, their legs moved on, back once they answer.

vLLM's API server answers /health (and /metrics) while its engine core makes no progress (a
SIGSTOPped core, a hung kernel or collective): the health checks pass, and every leg sent
there waits for `--prefill-timeout` or the decode leg's read timeout (minutes). Measured on the
2-core VM with a prefill engine's core stopped for 30 s under 12 streams: 7 of 12 requests
waited for the thaw; a real hang has none.

So the router judges progress itself, from the bytes of the legs it has open on a worker
(worker_http.py `silence`). While one of its legs runs (a stream that has shown a token), an
engine that steps sends it more with every step: a worker silent on all its legs for its pool's
stall timeout is stalled. While none runs yet, the oldest leg's prompt comes first: the silence
since it was sent must also outlast STALL_FACTOR times what that prompt could take going by the
pool's recent legs (prefill_estimate.TokenCost.longest: prefill legs, or decode-only recomputes;
before one has finished, it is not judged), so a long or uncached first prompt is not cut for
being long, and legs sent to a worker that is already stuck do not move its clock. Where the
router's /metrics scrapes run (queue_view.py, queue-aware paths on, while there is traffic), a
worker whose engine was seen to step within the window is slow, not stuck. (Those samples move only on steps that give some request an output:
vLLM 0.32's CPU engine showed no change through the 8 chunks of a 1947-token prompt, so they
cannot tell a long prompt from a stuck engine, only spare a stepping one.)

A stalled worker leaves the pool (Worker.stalled), and its open legs are cut as for a worker
found dead: a prefill leg moves to another prefill worker or decode-only, a decode leg before its
first token to another decode worker, a stream that has shown tokens ends with an error event.
Its server sees the clients leave and aborts those requests once its core runs again. A canary
completion (one prompt token, one output token) goes to it every health interval; the first one
answered puts it back. Until then, a worker that registered through Redis has a stall report there
(stall_reports.py), on which its supervisor restarts its vLLM once it lasts.

Silences that are not the worker's do not count (worker_http.py `silent`): an overlapped decode leg
sends nothing while it waits for its prefill's KV, and a stream paused for its slow reader is not
the worker's doing. A non-streamed decode answer (`unary`) sends nothing until its end however long
it generates, so a worker holding only those is judged by its engine's counters alone: stalled when
the scrapes have not seen its engine step for the window of its oldest such leg. Every decode step
gives an output, which moves them; while such legs are open the watch keeps the scrapes going.
Without scrapes (--no-pd-queue-aware) such a worker is not judged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool, Worker
from pdserve.router.prefill_estimate import LEARN_MIN_TOKENS, TokenCost
from pdserve.router.queue_view import QueueView
from pdserve.router.stall_reports import StallReports
from pdserve.router.upstream import SIDE_REQUEST_ERRORS, describe
from pdserve.router.worker_http import WorkerHTTP

log = logging.getLogger("pdserve.router.stall_watch")

# How much longer than the recent legs say a worker may hold its open prompt tokens without a byte on
# any: a batch of prompts ends together, and a loaded engine runs a few times slower than it did
# for them, neither of which is a stall.
STALL_FACTOR = 4.0
CANARY_TIMEOUT_S = 30.0  # a stalled worker's canary: a one-token prompt, alone in its engine once the legs were cut


class StallWatch:
    """The watch over one pool."""

    def __init__(self, pool: Pool, cost: TokenCost, legs: WorkerHTTP, view: QueueView | None,
                 http: aiohttp.ClientSession, headers: dict[str, str], timeout_s: float, interval_s: float,
                 metrics: RouterMetrics, reports: StallReports | None = None) -> None:
        self.pool = pool
        self.cost = cost  # the pool's recent legs: what a prompt could take
        self.legs = legs  # the legs' client: when each worker last sent a byte, and cutting its legs
        self.view = view  # the /metrics scrapes, when queue-aware paths are on: whether each engine still steps
        self.http = http
        self.headers = headers
        self.timeout_s = timeout_s
        self.interval_s = interval_s  # between canaries to a stalled worker
        self.metrics = metrics
        self.reports = reports  # where its supervisor hears of it (only with Redis discovery)
        self._why: dict[Worker, str] = {}  # each stalled worker's verdict, for its report
        self._canaries: dict[Worker, asyncio.Task[bool]] = {}
        self._task: asyncio.Task[None] | None = None

    def window(self, work: int) -> float | None:
        """Seconds a worker may stay silent with `work` prompt tokens to compute first; None when they are
        many and the pool has no leg to judge their time by. A short prompt's time is fixed costs (one
        engine step or a few): the stall timeout covers them, learned or not (a pool that serves only
        short prompts learns nothing: prefill_estimate.LEARN_MIN_TOKENS)."""
        if work < LEARN_MIN_TOKENS:
            return self.timeout_s
        longest = self.cost.longest(work)
        return None if longest is None else max(self.timeout_s, STALL_FACTOR * longest)

    def check(self) -> list[Worker]:
        """Judge every worker of the pool now; returns the ones found stalled (their legs cut)."""
        stalled = []
        for w in list(self.pool.workers.values()):
            if w.stalled:
                continue
            silence, counters_only = self.legs.silence(w.url), False
            if silence is None and self.view is not None and (silence := self.legs.generating(w.url)) is not None:
                counters_only = True  # whole answers being generated: only its engine's counters can tell
                self.view.touch()  # keep the scrapes going while they are all there is to judge by
            if silence is None:
                continue
            quiet, work = silence
            window = self.window(work)
            if window is None or quiet <= window:
                continue
            still = self.view.engine_still_for(w) if self.view is not None else None
            if still is None and counters_only:
                continue
            if still is not None and still <= window:  # its engine stepped meanwhile: slow, not stuck
                continue
            stalled.append(w)
            self.pool.set_stalled(w, True)
            self.metrics.stalls.labels(w.role, w.id).inc()
            why = self._why[w] = f"{w.role} worker {w.url} sent nothing on its requests for {quiet:.1f} s"
            cut = self.legs.cut(w.url, why)
            log.warning("%s worker %s sent nothing it owed for %.1f s (window %.1f s, %d prompt tokens first; its "
                        "engine %s): out of the pool until a canary request is answered; moved %d request(s) on",
                        w.role, w.id, quiet, window, work,
                        "unscraped" if still is None else f"did not step for {still:.1f} s", cut)
        return stalled

    async def canary(self, w: Worker) -> bool:
        """One tiny completion on `w`; True (and `w` back in the pool) when it was answered. Its stall report
        is renewed before, and dropped once it answers."""
        if self.reports is not None:
            await self.reports.refresh(w, self._why.get(w, "stalled"))
        body: dict[str, Any] = {"prompt": [0], "max_tokens": 1, "temperature": 0.0}
        if w.models:
            body["model"] = min(w.models)
        try:
            async with self.http.post(w.url + "/v1/completions", json=body, headers=self.headers,
                                      timeout=aiohttp.ClientTimeout(total=CANARY_TIMEOUT_S)) as resp:
                await resp.read()
                answered = resp.status == 200
        except SIDE_REQUEST_ERRORS as exc:
            log.debug("canary on stalled %s worker %s failed: %s", w.role, w.id, describe(exc))
            return False
        if not answered:  # its server refused the request itself: say why the worker stays out
            log.warning("canary on stalled %s worker %s got HTTP %d; it stays out of the pool", w.role, w.id,
                        resp.status)
        elif self.pool.workers.get(w.id) is w:
            self.pool.set_stalled(w, False)
            self._why.pop(w, None)
            if self.reports is not None:
                await self.reports.clear(w)
            log.warning("%s worker %s answered a canary request: back in the pool", w.role, w.id)
        return answered

    def _send_canaries(self) -> None:
        for w in [w for w in self._why if self.pool.workers.get(w.id) is not w]:  # gone from the pool
            del self._why[w]
        for w in list(self.pool.workers.values()):
            if w.stalled and w not in self._canaries:
                task = self._canaries[w] = asyncio.create_task(self.canary(w))
                task.add_done_callback(self._canary_done)

    def _canary_done(self, task: "asyncio.Task[bool]") -> None:
        for w, t in list(self._canaries.items()):
            if t is task:
                del self._canaries[w]

    async def _loop(self) -> None:
        # Half a second between checks is well inside any window worth judging (at least a few seconds);
        # canaries go out once per health interval.
        next_canaries = 0.0
        while True:
            await asyncio.sleep(min(0.5, self.timeout_s / 4))
            self.check()
            if time.monotonic() >= next_canaries:
                self._send_canaries()
                next_canaries = time.monotonic() + self.interval_s

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"{self.pool.role}-stall-watch")

    async def stop(self) -> None:
        tasks: list[asyncio.Task[Any]] = [t for t in [self._task, *self._canaries.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
