"""Worker pools: who is there, who may take a request, and how loaded each one is.

One `Pool` per role. The router's own accounting (requests and prompt tokens it has
in flight on each worker) is the load signal, because it is exact and free; the
load a worker advertises through Redis only breaks ties. Admission is bounded
twice: at most `max_inflight_per_worker` on a worker, and at most `max_queue`
requests waiting for a slot; beyond that the caller gets 429 with Retry-After
instead of an unbounded wait.

A worker takes requests only while it is healthy and its circuit breaker is
closed. A slot ends with a verdict on the worker's transport; the worker's breaker
rules on it (breaker.py: which failures count, when the breaker opens, when a
refused or reset connection asks for a health check or takes the worker out) and
the pool carries the ruling out. An HTTP error reply is an answer, not a failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Literal, Protocol, Sequence

from prometheus_client import Gauge

from pdserve.kvstore.client.keys import adapter_identity
from pdserve.kvstore.client.lmcache_mp import LMCacheKey
from pdserve.router.breaker import Breaker, Verdict
from pdserve.router.config import RouterConfig
from pdserve.worker.registration import Role, WorkerRecord
from pdserve.router.errors import RouterError, no_worker, overloaded
from pdserve.router.metrics import RouterMetrics
from pdserve.router.upstream import is_hard_failure

log = logging.getLogger("pdserve.router.pool")

Source = Literal["static", "redis"]


@dataclass(eq=False)
class Worker:
    id: str
    role: Role
    url: str
    source: Source
    kvstore_url: str | None = None  # its KV backend's URL: a pdserve store or an LMCache server
    kv_backend: str = "pdserve"  # "lmcache": LMCache's connector (from its Redis record)
    lmcache_key: LMCacheKey | None = None  # what its LMCache server keys the model's chunks by
    # (advertised URL, id) of the store its last prefill wrote to: where an overlapped decode waits
    produces_to: tuple[str, str | None] | None = None
    reported_load: int = 0  # running + waiting, from the worker's Redis heartbeat
    started_at: float | None = None  # its Redis registration's: which vLLM of the worker a stall report is about
    model_cards: list[dict[str, Any]] | None = None  # its /v1/models entries, once fetched
    inflight: int = 0
    inflight_tokens: int = 0
    served: int = 0
    healthy: bool = False  # no request before the first health check passes
    stalled: bool = False  # sent nothing its legs owed for too long (stall_watch.py): out until a canary answers
    breaker: Breaker = field(
        default_factory=lambda: Breaker(RouterConfig.breaker_failures, RouterConfig.breaker_cooldown)
    )
    # `models` of the cards list it was built from: asked for several times a request, the cards change rarely
    _models: tuple[list[dict[str, Any]], set[str]] | None = field(default=None, init=False, repr=False)

    @property
    def models(self) -> set[str] | None:
        cards = self.model_cards
        if cards is None:
            return None
        if self._models is None or self._models[0] is not cards:
            self._models = (cards, {str(card.get("id")) for card in cards})
        return self._models[1]

    def available(self, now: float) -> bool:
        return self.healthy and not self.stalled and self.breaker.closed(now)

    def serves(self, model: str | None) -> bool:
        models = self.models
        return model is None or models is None or model in models


@dataclass
class RouteContext:
    """Per-request facts a policy may use."""

    model: str | None
    prompt_tokens: int
    prefix_tokens: dict[str, int] = field(default_factory=dict)  # kvstore_url -> prompt tokens already stored


class Policy(Protocol):
    def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker: ...


class WorkerSlot:
    """A slot held on one worker; the first of answered/failed/abandon releases it, later calls do nothing."""

    def __init__(self, pool: "Pool", worker: Worker, tokens: int) -> None:
        self.pool = pool
        self.worker = worker
        self.tokens = tokens
        self._released = False

    def answered(self) -> None:
        """The worker replied over HTTP, whatever the status: an error reply is the request's, not the worker's."""
        self._release("answered")

    def failed(self, exc: BaseException) -> None:
        """A transport failure talking to the worker (`exc` as raised by the HTTP client)."""
        self._release("unreachable" if is_hard_failure(exc) else "failed")

    def abandon(self) -> None:
        """No verdict on the worker: the request ended for reasons of its own."""
        self._release("abandoned")

    def _release(self, verdict: Verdict) -> None:
        if not self._released:
            self._released = True
            self.pool._release(self, verdict)

    def __enter__(self) -> "WorkerSlot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.abandon()


class Pool:
    def __init__(self, role: Role, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self.role = role
        self.cfg = cfg
        self.metrics = metrics
        self.workers: dict[str, Worker] = {}
        self._series: dict[str, tuple[Gauge, Gauge]] = {}  # worker id -> (inflight, healthy): see _gauges
        self.waiting = 0
        self._waiters: list[asyncio.Future[None]] = []
        # Asks for a health check of a worker now (set by the app). A reset connection alone does
        # not take a worker out: vLLM also resets the stream of one request it cannot serve (seen
        # with a malformed structured_outputs), and a client repeating that request must not take
        # every worker out. The check decides; without one the worker is taken out at once. It runs
        # whether or not its result (True: the worker answered) is awaited.
        self.recheck: Callable[[Worker], Awaitable[bool]] | None = None

    # ------------------------------------------------------------ membership

    def add_static(self, urls: Iterable[str]) -> None:
        for url in urls:
            if url not in self.workers:
                self.workers[url] = self._new_worker(url, url, "static")

    def _new_worker(self, wid: str, url: str, source: Source) -> Worker:
        breaker = Breaker(self.cfg.breaker_failures, self.cfg.breaker_cooldown)
        return Worker(id=wid, role=self.role, url=url, source=source, breaker=breaker)

    def sync_redis(self, records: Iterable[WorkerRecord]) -> list[Worker]:
        """Make this pool's Redis-sourced workers equal `records`; returns the workers that are new."""
        wanted = {r.id: r for r in records if r.role == self.role}
        for wid, known in list(self.workers.items()):
            if known.source == "redis" and wid not in wanted:
                self._remove(wid)
        new: list[Worker] = []
        for wid, rec in wanted.items():
            w = self.workers.get(wid)
            if w is None or w.url != rec.url.rstrip("/"):
                if w is not None:
                    self._remove(wid)
                w = self._new_worker(wid, rec.url.rstrip("/"), "redis")
                self.workers[wid] = w
                new.append(w)
            w.kvstore_url = rec.kvstore_url or w.kvstore_url
            w.kv_backend, w.lmcache_key = rec.kv_backend, rec.lmcache_key
            w.reported_load = sum(rec.load.get(k, 0) for k in ("running", "waiting"))
            w.started_at = rec.started_at
        return new

    def _remove(self, wid: str) -> None:
        w = self.workers.pop(wid)
        w.healthy = False  # in-flight slots of a departed worker must not bring it back
        self._series.pop(wid, None)
        self.metrics.forget_worker(self.role, wid)
        log.info("%s worker removed: %s", self.role, wid)
        self._wake()

    # ------------------------------------------------------------ health

    def set_health(self, w: Worker, ok: bool) -> None:
        """Apply a health check; a passing check after the cooldown closes the breaker."""
        now = time.monotonic()
        was = w.available(now)
        if not ok:
            if w.healthy:
                w.breaker.failed(now)
            w.healthy = False
        elif w.breaker.health_passed(now):
            w.healthy = True
        self._publish(w)
        if w.available(now) != was:
            log.info("%s worker %s is %s", self.role, w.id, "up" if w.available(now) else "down")
            if w.available(now):
                self._wake()

    def set_stalled(self, w: Worker, stalled: bool) -> None:
        """Take a worker that makes no progress out of the pool, or put it back (stall_watch.py)."""
        w.stalled = stalled
        self._publish(w)
        if w.available(time.monotonic()):
            self._wake()

    def _gauges(self, w: Worker) -> tuple[Gauge, Gauge]:
        """`w`'s (inflight, healthy) series, looked up once: they are set on every slot taken and released,
        and each labels() call is a lock and a tuple of strings."""
        series = self._series.get(w.id)
        if series is None:
            series = (self.metrics.inflight.labels(self.role, w.id), self.metrics.worker_healthy.labels(self.role, w.id))
            self._series[w.id] = series
        return series

    def _publish(self, w: Worker) -> None:
        if w.id in self.workers:
            inflight, healthy = self._gauges(w)
            healthy.set(1 if w.available(time.monotonic()) else 0)
            inflight.set(w.inflight)

    # ------------------------------------------------------------ selection

    def candidates(self, model: str | None, exclude: Iterable[str] = ()) -> list[Worker]:
        now = time.monotonic()
        skip = set(exclude)
        return [w for w in self.workers.values() if w.id not in skip and w.available(now) and w.serves(model)]

    def known_models(self) -> set[str] | None:
        """Model names served by the available workers, or None while any of them is not known yet."""
        names: set[str] = set()
        for w in self.candidates(None):
            if w.models is None:
                return None
            names |= w.models
        return names

    def check_model(self, model: str | None) -> None:
        """404 for a model that no available worker serves (decided only when all their models are known)."""
        known = self.known_models()
        if model is not None and known and model not in known:
            raise RouterError(404, f"The model `{model}` does not exist.", param="model")

    def max_model_len(self, model: str | None) -> int | None:
        """The smallest `max_model_len` the available workers serving `model` report on /v1/models (vLLM's
        cards carry it), or None while any of them has not said: a request that fits it is one no engine
        of the pool refuses for its length."""
        lens = []
        for w in self.candidates(model):
            card = next((c for c in w.model_cards or () if model is None or str(c.get("id")) == model), None)
            value = card.get("max_model_len") if card is not None else None
            if type(value) is not int:
                return None
            lens.append(value)
        return min(lens, default=None)

    def adapter(self, model: str | None) -> str | None:
        """`model`'s identity as a LoRA adapter when the workers serve it as one (vLLM's card names the base
        model as its `parent`, the adapter's path as its `root`): the KV store keys an adapter's KV apart
        (kvstore/client/keys.py)."""
        for w in self.candidates(model):
            for card in w.model_cards or ():
                if model is not None and str(card.get("id")) == model and card.get("parent") is not None:
                    root = card.get("root")
                    return adapter_identity(model, root if isinstance(root, str) else None)
        return None

    def model_cards(self) -> list[dict[str, Any]]:
        """/v1/models entries of the available workers, one per model id."""
        cards: dict[str, dict[str, Any]] = {}
        for w in self.candidates(None):
            for card in w.model_cards or ():
                cards.setdefault(str(card.get("id")), card)
        return list(cards.values())

    async def acquire(self, policy: Policy, ctx: RouteContext, exclude: Iterable[str] = ()) -> WorkerSlot:
        """A slot on the worker `policy` picks; waits in the bounded queue while all are full."""
        exclude = set(exclude)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.queue_timeout
        queued = False
        try:
            while True:
                workers = self.candidates(ctx.model, exclude)
                if not workers:
                    raise no_worker(self.role, ctx.model)
                free = [w for w in workers if w.inflight < self.cfg.max_inflight_per_worker]
                if free:
                    return self._take(policy.choose(free, ctx), ctx.prompt_tokens)
                if not queued:
                    if self.waiting >= self.cfg.max_queue:
                        raise overloaded(self.cfg.retry_after_s, f"all {self.role} workers are busy and the queue is full")
                    queued = True
                    self.waiting += 1
                    self.metrics.queue_depth.labels(self.role).set(self.waiting)
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append(fut)
                try:
                    async with asyncio.timeout_at(deadline):  # unlike wait_for, never swallows a client's cancel
                        await fut
                except TimeoutError:
                    raise overloaded(self.cfg.retry_after_s, f"no {self.role} worker freed up in {self.cfg.queue_timeout:g} s")
        finally:
            if queued:
                self.waiting -= 1
                self.metrics.queue_depth.labels(self.role).set(self.waiting)

    def _take(self, w: Worker, tokens: int) -> WorkerSlot:
        w.inflight += 1
        w.inflight_tokens += tokens
        w.served += 1
        self._gauges(w)[0].set(w.inflight)
        return WorkerSlot(self, w, tokens)

    def _release(self, slot: WorkerSlot, verdict: Verdict) -> None:
        w = slot.worker
        w.inflight -= 1
        w.inflight_tokens -= slot.tokens
        ruling = w.breaker.judge(verdict, time.monotonic(), can_recheck=self.recheck is not None)
        if ruling.recheck and self.recheck is not None:
            self.recheck(w)  # the health check takes it out (and counts the failure) if it is down
        if ruling.opened:
            log.warning("%s worker %s failed %d times in a row; breaker open for %g s",
                        self.role, w.id, w.breaker.failures, w.breaker.cooldown)
        if ruling.take_out and w.healthy:
            w.healthy = False
            log.warning("%s worker %s unreachable; out until a health check passes", self.role, w.id)
        self._publish(w)
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

