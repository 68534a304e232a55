"""Watching the producer of an overlapped decode leg until that leg has its first token.

An overlapped decode leg goes out before its prefill has run, so its connector may wait in
the store for the producer's upload as long as a prefill may take (the router's prefill
timeout, minutes). Once the prefill leg has answered, that wait should be short: the
producer uploads the prompt's KV on a background thread right after answering. A producer
that dies in that window (kill -9 under load) never uploads, and nothing but the wait's
deadline would end the decode leg. So from the prefill's answer until the decode leg's
first token the router watches the producer: after `GRACE_S`, and every `RECHECK_S` after
that, it asks for a health check of that worker; when one finds it down, the watch says
so (`on_lost`) and the flow serves the request decode-only (pd_flow.py). A live producer,
however slow, passes its checks: only a failed check ends a leg, never the time alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from pdserve.router.pool import Worker

log = logging.getLogger("pdserve.router.flow")

# The producer's upload lands tens of ms after its answer, and a decode leg that finds its KV
# has its first token a fraction of a second later, so nearly every leg is done before a check
# is due: checks cost only legs that are already late. Short, because each second of it is a
# second a client may wait on a dead producer.
GRACE_S = 1.5
# Between checks while the producer stays up (a busy decode engine, a long load). Each is one
# GET /health; a dead producer is noticed at most this long (plus the check) after it died.
RECHECK_S = 2.0

Probe = Callable[[Worker], Awaitable[bool]]


class ProducerWatch:
    """Health checks of `worker` until stopped; `on_lost` runs (once) when one finds it down.

    The flow replaces `on_lost` when the leg moves on (from waiting for its headers to being
    relayed). `stop` must come as soon as the leg has its first token or ends: an `on_lost`
    after that would give up a leg the client already reads.
    """

    def __init__(self, worker: Worker, probe: Probe, on_lost: Callable[[], None]) -> None:
        self.worker = worker
        self.on_lost = on_lost
        self._task = asyncio.ensure_future(self._run(probe))

    async def _run(self, probe: Probe) -> None:
        await asyncio.sleep(GRACE_S)
        while True:
            # shielded: a stop while the check runs ends the watch, not the check (it still
            # marks the worker for the pool)
            if not await asyncio.shield(probe(self.worker)):
                log.info("prefill worker %s is down after answering; its decode leg stops waiting for its KV",
                         self.worker.url)
                self.on_lost()
                return
            await asyncio.sleep(RECHECK_S)

    def stop(self) -> None:
        self._task.cancel()
