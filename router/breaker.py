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
"""

from __future__ import annotations


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

    def health_passed(self, now: float) -> bool:
        """A passing health check closes the breaker once its cooldown is over; True when it is closed."""
        if not self.closed(now):
            return False
        self.failures = 0
        return True
