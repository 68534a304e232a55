"""The store's shared-memory arena, page-locked for the GPU, so loads upload straight from it.

A same-host load finds its objects in the store's arena (kvstore/client/shm.py). Copying
them into a pinned staging buffer before the upload costs a host memcpy of every byte
(measured on the H200 host: 31 ms of a 32k-token load's 108 ms). Registered with the CUDA
driver (cudaHostRegister), the arena itself is pinned memory, and the copy engine reads
the payloads where they lie while the client holds their leases.

Registration is per granule (the arena's 64 MiB mapping unit). Pinning is slow (on the
H200 host the first loads into fresh granules took 15 ms for their copy against 2.3 ms once
registered), so a background thread registers the arena granule by granule from the
moment the process first loads from it, and a load that reaches a granule before that
thread does registers it itself. A payload that spans granules is uploaded in one piece
per granule, since a copy must lie within one registration. Registrations are portable
(every CUDA context of the process sees them: the load threads and a TP worker's device
need not be the thread's current device). If the driver refuses (e.g. a locked-memory
limit), pins are off for this process and loads go through staging as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np
import torch

from pdserve.kvstore.client.shm import GRANULE, Arena

log = logging.getLogger("pdserve.connector")

_lock = threading.Lock()
_by_arena: dict[int, "ArenaPins"] = {}  # id(arena) -> its pins, while the arena is mapped
_refused = False  # the driver refused a registration once: no more tries in this process

Register = Callable[[int, int], bool]  # (address, bytes) -> registered
Unregister = Callable[[int], None]


_PORTABLE = 1  # cudaHostRegisterPortable


def _cuda_register(address: int, size: int) -> bool:
    return int(torch.cuda.cudart().cudaHostRegister(address, size, _PORTABLE)) == 0


def _cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class ArenaPins:
    """One arena's registered granules; `pieces` hands out pinned views of payloads in it."""

    def __init__(self, arena: Arena, register: Register = _cuda_register, unregister: Unregister = _cuda_unregister):
        self.base = arena.address
        self.size = arena.size
        self._register = register
        self._unregister = unregister
        self._granules: set[int] = set()
        self._lock = threading.Lock()
        self._gone = False

    def register_all(self) -> None:
        """Register every granule not yet registered (a background thread's job; stops when released)."""
        for g in range(-(-self.size // GRANULE)):
            with self._lock:
                if not self._pin(g):
                    return

    def pieces(self, view: memoryview) -> list[torch.Tensor] | None:
        """`view` (a payload in the arena) as host tensors the GPU can read asynchronously, one per
        granule it spans; None when it is not in this arena or the granules cannot be registered."""
        n = len(view)
        start = int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data) - self.base if n else -1
        if n == 0 or start < 0 or start + n > self.size:
            return None
        first, last = start // GRANULE, (start + n - 1) // GRANULE
        with self._lock:
            if not all(self._pin(g) for g in range(first, last + 1)):
                return None
        cuts = [start] + [g * GRANULE for g in range(first + 1, last + 1)] + [start + n]
        return [torch.frombuffer(view[a - start : b - start], dtype=torch.uint8) for a, b in zip(cuts, cuts[1:])]

    def _pin(self, g: int) -> bool:
        """Granule `g` registered (now, if it was not); False once pins are off. Call with the lock."""
        global _refused
        if self._gone or _refused:
            return False
        if g not in self._granules:
            length = min(GRANULE, self.size - g * GRANULE)
            if not self._register(self.base + g * GRANULE, length):
                _refused = True
                log.warning("the GPU driver refused to pin the store's shared memory: loads are staged instead")
                return False
            self._granules.add(g)
        return True

    def release(self) -> None:
        """Unregister every granule (the arena is about to be unmapped)."""
        with self._lock:
            self._gone = True
            for g in sorted(self._granules):
                self._unregister(self.base + g * GRANULE)
            self._granules.clear()


def pins_of(arena: Arena) -> ArenaPins:
    """The pins of `arena` in this process (shared by the load threads; released when it is unmapped)."""
    with _lock:
        pins = _by_arena.get(id(arena))
        if pins is None:
            pins = _by_arena[id(arena)] = ArenaPins(arena)

            def forget() -> None:
                pins.release()
                with _lock:
                    _by_arena.pop(id(arena), None)

            arena.before_unmap(forget)
            threading.Thread(target=pins.register_all, name="pdserve-pin-arena", daemon=True).start()
        return pins
