"""How long a prompt would wait for a prefill worker, and what recomputing it on a decode worker costs.

Both come from per-token costs the router learns from its own finished requests
(`TokenCost`, an EWMA):
- prefill: each prefill leg's service time over its prompt tokens. A leg's service
  begins when it was sent or when the previous leg on that worker ended, whichever
  is later, so a leg that queued behind others counts only its own share. The sums
  telescope to a worker's busy time over the tokens it served, which stays right
  when an engine batches several prompts into one step or chunks them over several.
- recompute: a decode-only request's time to first token over its prompt tokens,
  counted the same way per decode worker (the decode side's prefill speed, with
  the streams it decodes meanwhile).
Before any prefill leg has finished there is no estimate, and the planner keeps
P/D; until a decode-only recompute has been measured it is assumed to cost what a
prefill does (same model, same kind of engine).

A prefill worker's backlog is counted in tokens, not requests: what delays a new
prompt is the prompt tokens ahead of it, and vLLM's running count says nothing of how
far each prompt is (with chunked prefill a running request may be 5% or 95% done).
The backlog is the router's own in-flight prompt tokens on the worker (exact and
current between scrapes), less what the worker has served of them since its current
busy stretch began, plus the requests of others its last queue scrape saw
(queue_view.py), at the mean prompt length.

The same backlog says when the prompt just placed on a prefill worker should be done,
which times an overlapped decode leg (`QueueEstimate.overlap_delay`): a leg held in its
decode engine while the prefill runs is not free there. vLLM's engine keeps stepping for a
request that waits for its remote KV, and on a CPU host that busy loop (about one core,
measured on the 2-core VM) slows the very prefill it waits for; on one GPU shared by both
engines the overlapped prefill legs took 46.6 ms at c=4 against 34.5 in sequence (H200). So
the leg goes out just early enough to be in the decode engine when the KV lands: the
prefill's predicted end less the decode leg's ingest (learned from the decode legs' response
headers). Timing one leg takes the median of the last few legs (`RecentMedian`), not the EWMA
above: on a loaded machine one prefill of 5.6 s among ones of 1.9-2.0 s kept the EWMA's
prediction 0.2-1.9 s late for the next ten legs (measured here), and a late leg loses what
overlapping gains. Each of those samples is a leg's whole latency over the backlog it was
sent behind (its own tokens included): the quantity the prediction multiplies. A leg's
service share (above) would not do for a median: when an engine batches several prompts
into one step they end together, the first takes the step's whole time and the others
nothing, so the median was 0 and every leg went out at once (H200, c=4 and c=8: legs held
for the whole prefill leg).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from pdserve.router.pool import Worker
from pdserve.router.queue_view import QueueView

ALPHA = 0.2  # weight of the newest leg: about the last ten legs count
# Shorter prompts' times are mostly fixed costs (HTTP, scheduling, one step), not per-token work.
LEARN_MIN_TOKENS = 64
# Legs a RecentMedian keeps: two slow ones of five do not move it, a lasting change shows in three.
RECENT_LEGS = 5
# Legs `TokenCost.longest` looks back over: enough that a run of prefix-cached prompts leaves an uncached one in.
BOUND_LEGS = 32


class RecentMedian:
    """The median of the last RECENT_LEGS samples (None before the first)."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=RECENT_LEGS)

    def observe(self, value: float) -> None:
        self._samples.append(value)

    @property
    def value(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None


class TokenCost:
    """Seconds per prompt token of one pool, learned from finished legs (see the module docstring)."""

    def __init__(self, prior: "TokenCost | None" = None) -> None:
        self.prior = prior  # what to assume until this pool has a sample of its own
        self.samples = 0
        self._seconds = 0.0  # EWMA of a leg's service seconds
        self._tokens = 0.0  # EWMA of a leg's prompt tokens (so _seconds / _tokens is per token)
        self.recent = RecentMedian()  # the last legs' latency per token of backlog at their send, for timing one leg
        self._last_end: weakref.WeakKeyDictionary[Worker, float] = weakref.WeakKeyDictionary()
        self._open: weakref.WeakKeyDictionary[Worker, list[int]] = weakref.WeakKeyDictionary()  # open legs' tokens
        self._busy_since: weakref.WeakKeyDictionary[Worker, float] = weakref.WeakKeyDictionary()
        self._legs: deque[tuple[float, float]] = deque(maxlen=BOUND_LEGS)  # (prompt tokens, service seconds)

    def longest(self, tokens: int) -> float | None:
        """What `tokens` prompt tokens could take at most, going by the recent legs (None before any, nor a
        prior's). Not the mean speed: prompts served from a prefix cache take a fraction of what an uncached
        one of the same length does, so the slowest of the recent legs at least as long, scaled down to
        `tokens` (a prompt's time per token only grows with its length: its attention part does). Longer
        than every recent leg, the longest one's time scaled up by the square of the ratio: n times the
        tokens take at most n² times as long, where the mean speed of 2k-token prompts would leave a
        64k-token prompt a fraction of its time. (Only the longest: a short leg's time is mostly fixed costs,
        which the square would blow up.)"""
        if not self._legs:
            return self.prior.longest(tokens) if self.prior is not None else None
        covering = [service * tokens / legs for legs, service in self._legs if legs >= tokens]
        if covering:
            return max(covering)
        legs, service = max(self._legs)
        return service * (tokens / legs) ** 2

    @property
    def per_token(self) -> float | None:
        if self.samples:
            return self._seconds / self._tokens
        return self.prior.per_token if self.prior is not None else None

    @property
    def mean_tokens(self) -> float | None:
        """The recent legs' mean prompt length."""
        return self._tokens if self.samples else None

    def observe(self, w: Worker, tokens: int, t_sent: float, t_end: float, learn: bool = True,
                backlog: float | None = None) -> None:
        """A leg on `w` sent at `t_sent` behind `backlog` prompt tokens (its own included; default: its own)
        ended at `t_end` (learn=False: it failed, nothing to learn)."""
        last = self._last_end.get(w, t_sent)
        self._last_end[w] = max(last, t_end)
        if not learn or tokens < LEARN_MIN_TOKENS:
            return
        service = max(0.0, t_end - max(t_sent, last))
        self.recent.observe((t_end - t_sent) / max(float(tokens), backlog or 0.0))
        self._legs.append((float(tokens), service))
        if self.samples == 0:
            self._seconds, self._tokens = service, float(tokens)
        else:
            self._seconds += ALPHA * (service - self._seconds)
            self._tokens += ALPHA * (tokens - self._tokens)
        self.samples += 1

    @contextmanager
    def leg(self, w: Worker, tokens: int) -> Iterator["LegTiming"]:
        """Time one leg on `w`; it is learned from when the caller sets `ok` (an answer worth learning from)."""
        t_sent = time.perf_counter()
        legs = self._open.setdefault(w, [])
        timing = LegTiming(t_sent, backlog=max(0.0, sum(legs) - self.served_since_busy(w, t_sent)) + tokens)
        if not legs:
            self._busy_since[w] = t_sent
        legs.append(tokens)
        try:
            yield timing
        finally:
            legs.remove(tokens)
            self.observe(w, tokens, t_sent, time.perf_counter(), timing.ok, timing.backlog)

    def served_since_busy(self, w: Worker, now: float) -> float:
        """Prompt tokens `w` has served of its open legs: its time since the current busy stretch began
        (or its last leg ended, if later) at this pool's speed. No open leg has ended since, so at most
        the largest of them is done: a worker that stalls is not taken to have served its queue."""
        per_token, legs = self.per_token, self._open.get(w)
        if not legs or not per_token:
            return 0.0
        began = self._busy_since[w]
        began = max(began, self._last_end.get(w, began))
        return min(float(max(legs)), max(0.0, now - began) / per_token)


@dataclass
class LegTiming:
    t_sent: float
    backlog: float  # prompt tokens ahead of the leg's end when it was sent, its own included
    ok: bool = False


class Recompute:
    """A prompt sent decode-only to be recomputed, until its first token: part of the decode side's backlog.

    Held by the request; once it is released, or the request is gone, it no longer counts."""

    def __init__(self, estimate: "QueueEstimate", tokens: int) -> None:
        self.estimate = estimate
        self.tokens = tokens
        estimate._recomputing.add(self)

    def first_token(self, w: Worker, t_sent: float, t_first: float) -> None:
        """The decode worker `w`, sent the request at `t_sent`, streamed its first token at `t_first`."""
        if self in self.estimate._recomputing:
            self.estimate.recompute.observe(w, self.tokens, t_sent, t_first)
        self.release()

    def release(self) -> None:
        self.estimate._recomputing.discard(self)


class QueueEstimate:
    """The figures the path planner weighs: a prefill worker's wait and a decode worker's recompute, in seconds;
    and when an overlapped decode leg should go out."""

    def __init__(self, view: QueueView | None) -> None:
        self.view = view  # None: no scrapes (queue-aware paths are off), own accounting only
        self.prefill = TokenCost()
        self.recompute = TokenCost(prior=self.prefill)
        # Seconds from sending a streamed decode leg to its response headers. vLLM sends a stream's
        # headers once it has rendered the prompt and built the request, just before the request enters
        # its engine, so this is how long a decode leg takes to get there. Unary legs teach nothing:
        # their headers come with the whole answer.
        self.decode_ingest = RecentMedian()
        self._recomputing: weakref.WeakSet[Recompute] = weakref.WeakSet()

    def backlog_tokens(self, w: Worker, now: float) -> float:
        """Prompt tokens ahead of a new prompt on prefill worker `w`."""
        own = max(0.0, w.inflight_tokens - self.prefill.served_since_busy(w, now))
        snap = self.view.snapshot(w) if self.view is not None else None
        if snap is None or not snap.foreign:
            return own
        return own + snap.foreign * (self.prefill.mean_tokens or 0.0)

    def prefill_wait(self, workers: Sequence[Worker], now: float | None = None) -> float | None:
        """Seconds before the least backlogged of `workers` would start a new prompt; None while unknown.
        Asking keeps the queue scrapes going (the router has traffic)."""
        if self.view is not None:
            self.view.touch()
        per_token = self.prefill.per_token
        if per_token is None or not workers:
            return None
        now = time.perf_counter() if now is None else now
        return min(self.backlog_tokens(w, now) for w in workers) * per_token

    def overlap_delay(self, w: Worker, now: float | None = None) -> float | None:
        """Seconds from now until the overlapped decode leg of the prompt just placed on prefill worker `w`
        should go out (0 or less: at once): when `w` should have served its backlog, that prompt the last of
        it, less one decode ingest, so the leg reaches its engine as the prefill ends (both the recent legs'
        medians). None while either figure is unknown (no prefill leg timed, no streamed decode leg seen):
        then nothing says how late is still early enough.

        Aimed at the predicted end, not ahead of it, because the two errors cost alike: each ms a leg
        waits in its engine slowed the prefill by about 0.5 ms on the 2-core VM (the overlapped legs of
        `bench serve --compare` before this timing: held 3.8-5.1 s, prefill 1.8-2.8 s slower), and a
        leg that comes late costs at most its own ingest, or, once the prefill has answered first, the
        sequential flow's decode leg (tens of ms over a held leg's)."""
        per_token, ingest = self.prefill.recent.value, self.decode_ingest.value
        if per_token is None or ingest is None:
            return None
        now = time.perf_counter() if now is None else now
        return self.backlog_tokens(w, now) * per_token - ingest

    def recompute_cost(self, tokens: int, workers: Sequence[Worker]) -> float | None:
        """Seconds for a decode worker to recompute `tokens` behind the recomputes already under way;
        None while unknown or when every decode worker has requests waiting for a batch slot."""
        per_token = self.recompute.per_token
        free = [w for w in workers if not self._capacity_queued(w)]
        if per_token is None or not free:
            return None
        ahead = sum(r.tokens for r in self._recomputing) / len(free)
        return (ahead + tokens) * per_token

    def _capacity_queued(self, w: Worker) -> bool:
        snap = self.view.snapshot(w) if self.view is not None else None
        return snap is not None and bool(snap.counts.capacity_waiting)

    def start_recompute(self, tokens: int) -> Recompute:
        return Recompute(self, tokens)
