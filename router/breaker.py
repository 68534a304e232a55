"""One worker's circuit breaker: consecutive transport failures take it out for a while.

Only transport failures count (a timeout, a connection cut while the reply was read):
they say something about the worker. A well-formed HTTP error reply says something
about the request, so it is never fed to a breaker; otherwise a client repeating one
bad request could take every worker out of service. A refused or reset connection
is a transport failure too, and the pool also marks that worker unhealthy until a
health check passes.

After `threshold` failures in a row the breaker is open for `cooldown` seconds.
Once the cooldown is over, the next passing health check closes it; until then the
failure count is kept, so a worker that fails again at once reopens it.

`Breaker.judge` turns how a request's slot on the worker ended (a `Verdict`) into a
`Ruling`: whether the breaker just opened, and whether the worker must be checked
or taken out. The pool only carries the ruling out (its bookkeeping, logs, health).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How a slot ended, for the worker's health: it answered over HTTP (any status); its transport failed
# (unreachable: refused, reset or cut off); or no verdict (the client left, or the router gave up first).
Verdict = Literal["answered", "failed", "unreachable", "abandoned"]


@dataclass(frozen=True)
class Ruling:
    """What a verdict means for the worker, for the pool to carry out."""

    opened: bool = False  # this failure opened the breaker
    recheck: bool = False  # ask for a health check now: it decides whether the worker is down
    take_out: bool = False  # out until a health check passes (no check to ask for)


class Breaker:
    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.failures = 0  # consecutive transport failures
        self.open_until = 0.0  # monotonic time; closed when now >= open_until

    def closed(self, now: float) -> bool:
        return now >= self.open_until

    def succeeded(self) -> None:
        """The worker answered over HTTP (any status): its transport works."""
        self.failures = 0

    def failed(self, now: float) -> bool:
        """Count one transport failure; True when this one opens the breaker."""
        self.failures += 1
        if self.failures < self.threshold or not self.closed(now):
            return False
        self.open_until = now + self.cooldown
        return True

    def judge(self, verdict: Verdict, now: float, can_recheck: bool) -> Ruling:
        """Count `verdict` and say what follows. An unreachable worker is rechecked when the pool can
        ask for a check (a reset alone does not prove it dead: vLLM also resets the stream of one
        request it cannot serve, so the check counts the failure if it is down); otherwise the
        failure counts here and the worker is taken out at once."""
        if verdict == "answered":
            self.succeeded()
            return Ruling()
        if verdict == "abandoned":
            return Ruling()
        if verdict == "unreachable" and can_recheck:
            return Ruling(recheck=True)
        return Ruling(opened=self.failed(now), take_out=verdict == "unreachable")

    def health_passed(self, now: float) -> bool:
        """A passing health check closes the breaker once its cooldown is over; True when it is closed."""
        if not self.closed(now):
            return False
        self.failures = 0
        return True
