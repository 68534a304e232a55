"""How often this machine takes a core away from a running process, and for how long.

A latency tail can be the machine's, not the program's: on a virtual machine a vCPU is
descheduled by its host now and then, and a process that is running (not waiting) sees
time pass with no work done. `probe` measures that: one busy loop pinned to each core, all
at once, records every gap between two turns of the loop longer than `GAP_S`. Nothing else
should run meanwhile. `pdserve bench router` prints it beside its figures, because a stall
of the router's core delays every request it holds, and at a few stalls a second that is
enough to set a p99 (measured on the 2-core development VM: each core lost the CPU for more than
1 ms about twice a second, up to 7 ms at a time, with little of it booked as steal time).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass

GAP_S = 0.001  # a loop turn normally takes well under a microsecond: a millisecond is the core taken away


@dataclass(frozen=True)
class CoreStalls:
    cpu: int
    seconds: float
    gaps_s: tuple[float, ...]  # every gap longer than GAP_S

    @property
    def per_second(self) -> float:
        return len(self.gaps_s) / self.seconds

    @property
    def lost_fraction(self) -> float:
        return sum(self.gaps_s) / self.seconds


def _spin(cpu: int, seconds: float, out: "mp.Queue[CoreStalls]") -> None:
    os.sched_setaffinity(0, {cpu})
    gaps: list[float] = []
    clock = time.perf_counter
    start = last = clock()
    end = start + seconds
    while last < end:
        now = clock()
        if now - last > GAP_S:
            gaps.append(now - last)
        last = now
    out.put(CoreStalls(cpu, last - start, tuple(gaps)))


def probe(seconds: float) -> list[CoreStalls]:
    """Spin on every core this process may use, all at once, for `seconds`; the stalls each saw."""
    ctx = mp.get_context("fork")
    out: mp.Queue[CoreStalls] = ctx.Queue()
    cpus = sorted(os.sched_getaffinity(0))
    procs = [ctx.Process(target=_spin, args=(cpu, seconds, out), daemon=True) for cpu in cpus]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=seconds + 30) for _ in procs]
    for proc in procs:
        proc.join()
    return sorted(results, key=lambda r: r.cpu)


def describe(cores: list[CoreStalls]) -> str:
    """One line per core: stalls over GAP_S a second, their longest, and the share of time lost."""
    lines = []
    for c in cores:
        longest = max(c.gaps_s, default=0.0) * 1000
        lines.append(f"cpu {c.cpu}: {c.per_second:.1f} stalls/s over {GAP_S * 1000:.0f} ms, longest {longest:.1f} ms, "
                     f"{100 * c.lost_fraction:.2f}% of the time lost")
    return "\n".join(lines)


def share_met(cores: list[CoreStalls], latency_s: float) -> float:
    """Rough share of requests that meet a stall: one lasting `latency_s` is exposed to the stalls of the
    core it runs on for that long plus the stall's own length (a mean over cores)."""
    if not cores:
        return 0.0
    rate = sum(c.per_second for c in cores) / len(cores)
    gaps = [g for c in cores for g in c.gaps_s]
    mean_gap = sum(gaps) / len(gaps) if gaps else 0.0
    return min(1.0, rate * (latency_s + mean_gap))
