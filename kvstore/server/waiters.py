"""Await requests the store holds until what they wait for is stored, or their time is up.

A decode worker can ask for a handoff while its producer is still uploading it. Instead
of the client polling, the server parks the request (`Await`) and answers it from its
one loop thread: after any message that may have stored something, and when the wait
runs out. The number parked is capped, so a flood of awaits costs memory in proportion
to the cap, not to the flood: past it, an await is answered at once with what is there.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from pdserve.kvstore.client import protocol as p

MAX_PARKED = 4096


@dataclass(order=True)
class Parked:
    deadline: float
    seq: int
    ident: zmq.Frame = field(compare=False)
    req: p.Await = field(compare=False)
    answered: bool = field(default=False, compare=False)


Check = Callable[[p.Await], p.Ready]


class Waiters:
    """Parked awaits, by deadline. Single-threaded: the server's loop owns it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, cap: int = MAX_PARKED) -> None:
        self.clock = clock
        self.cap = cap
        self._heap: list[Parked] = []
        self._live = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._live

    def park(self, ident: zmq.Frame, req: p.Await) -> bool:
        """Hold `req` until ready or its wait ends; False when the cap is reached (answer it now)."""
        if self._live >= self.cap:
            return False
        heapq.heappush(self._heap, Parked(self.clock() + req.wait_ms / 1000, next(self._seq), ident, req))
        self._live += 1
        return True

    def next_deadline_ms(self, default_ms: int) -> int:
        """How long the loop may sleep before a parked await is due."""
        self._drop_answered()
        if not self._heap:
            return default_ms
        return max(0, min(default_ms, int((self._heap[0].deadline - self.clock()) * 1000) + 1))

    def ready(self, check: Check) -> list[tuple[Parked, p.Ready]]:
        """Parked awaits whose items are all there now (taken out), with their answers."""
        out = []
        for parked in self._heap:
            if parked.answered:
                continue
            reply = check(parked.req)
            if reply.settled(parked.req.tail_id):
                out.append((self._take(parked), reply))
        return out

    def due(self, check: Check) -> list[tuple[Parked, p.Ready]]:
        """Parked awaits whose wait has ended (taken out), answered with what is there."""
        now, out = self.clock(), []
        self._drop_answered()
        while self._heap and self._heap[0].deadline <= now:
            parked = heapq.heappop(self._heap)
            if not parked.answered:
                self._live -= 1
                out.append((parked, check(parked.req)))
        return out

    def _take(self, parked: Parked) -> Parked:
        parked.answered = True  # removed lazily from the heap
        self._live -= 1
        return parked

    def _drop_answered(self) -> None:
        while self._heap and self._heap[0].answered:
            heapq.heappop(self._heap)
