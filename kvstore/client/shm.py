"""The L1 arena: one file in /dev/shm that the server and same-host clients map.

L1 objects live in this arena, so a same-host client moves a payload with one
memcpy each way (straight into or out of the slice the server leased to it) instead
of a copy into a staging buffer plus a copy into the store. The first page holds a
random nonce: a client that can open the path but reads another nonce (another
container's /dev/shm, a stale file) falls back to TCP frames. The file is reserved
up front with posix_fallocate so a full /dev/shm is a clear start-up error rather
than a SIGBUS in the middle of a copy.

The clients of one process share one mapping of an arena (a connector has a client
per load thread, plus one for saves). Each mapping of a shared page counts in the
process's RSS and has its own page tables, so with a mapping per client a decode
engine's RSS grew by four times the arena as its granules were first touched.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096
_MAGIC = b"pdserve-kv-arena\0"
_NAME_RE = re.compile(r"^pdserve-kv-(\d+)-[0-9a-f]+$")
# Mapping a page costs a fault on first touch (tens of microseconds inside a VM), which
# would dominate a copy; clients map the arena in granules of this size ahead of use.
GRANULE = 64 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
# This process's client mappings, by (path, nonce, size); an entry lives while a client uses it.
_attached: dict[tuple[str, str, int], "Arena"] = {}
_attached_lock = threading.Lock()


class ArenaError(RuntimeError):
    pass


class Arena:
    """A shared (or, without /dev/shm, private) mapping whose data area starts after a header page."""

    def __init__(
        self, mm: mmap.mmap, size: int, path: Path | None, nonce: str, owner: bool, mapped: bool = False
    ) -> None:
        self._mm = mm
        self.size = size  # bytes of the data area
        self.path = path
        self.nonce = nonce
        self._owner = owner
        self.view = memoryview(mm)[HEADER_BYTES : HEADER_BYTES + size]
        granules = -(-size // GRANULE)
        self._mapped = bytearray(b"\1" * granules if mapped else granules)  # 1: page tables populated
        self._users = 1  # clients sharing this mapping (see attach); the last close unmaps it
        self._key: tuple[str, str, int] | None = None  # its entry in _attached, for a client mapping
        self._before_unmap: list[Callable[[], None]] = []

    @classmethod
    def create(cls, size: int, shared: bool = True) -> "Arena":
        """Server side: a fresh arena of `size` data bytes; private anonymous memory when not `shared`."""
        nonce = secrets.token_hex(16)
        total = HEADER_BYTES + size
        populate = getattr(mmap, "MAP_POPULATE", 0)
        if not shared or not SHM_DIR.is_dir():
            mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
            return cls(mm, size, None, nonce, owner=True, mapped=True)
        cleanup_stale()
        path = SHM_DIR / f"pdserve-kv-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                path.unlink(missing_ok=True)
                raise ArenaError(
                    f"cannot reserve {total / 2**30:.2f} GiB in {SHM_DIR} ({exc.strerror}); "
                    "lower --l1-size-gb or enlarge /dev/shm (docker: --shm-size)"
                ) from exc
            # the server touches all of it sooner or later: map every page now, not one fault at a time
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        mm[: len(_MAGIC) + 32] = _MAGIC + nonce.encode()
        return cls(mm, size, path, nonce, owner=True, mapped=True)

    @classmethod
    def attach(cls, path: str, nonce: str, size: int) -> "Arena":
        """Client side: the server's arena, mapped once per process (a client that attaches an arena
        another client of this process has mapped shares that mapping); raises ArenaError unless it
        is that server's arena. Each caller closes it once."""
        key = (path, nonce, size)
        with _attached_lock:
            arena = _attached.get(key)
            if arena is not None:
                arena._users += 1
                return arena
            arena = cls._map(path, nonce, size)
            arena._key = key
            _attached[key] = arena
            return arena

    @classmethod
    def _map(cls, path: str, nonce: str, size: int) -> "Arena":
        if not _NAME_RE.match(Path(path).name) or Path(path).parent != SHM_DIR:
            raise ArenaError(f"refusing to map {path!r}: not a pdserve arena under {SHM_DIR}")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ArenaError(f"cannot open {path}: {exc.strerror}") from exc
        try:
            total = os.fstat(fd).st_size
            if total != HEADER_BYTES + size:
                raise ArenaError(f"{path} has {total} bytes, server announced {HEADER_BYTES + size}")
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        if mm[: len(_MAGIC) + 32] != _MAGIC + nonce.encode():
            mm.close()
            raise ArenaError(f"{path} belongs to another server (nonce mismatch)")
        return cls(mm, size, Path(path), nonce, owner=False)

    @property
    def address(self) -> int:
        """Where the data area starts in this process's address space (for device-side registration)."""
        return int(np.frombuffer(self.view, dtype=np.uint8, count=1).ctypes.data) if self.size else 0

    def before_unmap(self, hook: Callable[[], None]) -> None:
        """Run `hook` just before this mapping goes away (e.g. to unregister it from a GPU driver)."""
        self._before_unmap.append(hook)

    def slice(self, offset: int, size: int) -> memoryview:
        """A bounds-checked view of [offset, offset+size) of the data area, its pages mapped."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ArenaError(f"slice [{offset}, {offset + size}) outside the {self.size}-byte arena")
        if size:
            self._populate(offset // GRANULE, (offset + size - 1) // GRANULE)
        return self.view[offset : offset + size]

    def populate(self) -> None:
        """Map every page now (a one-time cost proportional to the arena) instead of on first use."""
        if self.size:
            self._populate(0, (self.size - 1) // GRANULE)

    def _populate(self, first: int, last: int) -> None:
        for g in range(first, last + 1):
            if self._mapped[g]:
                continue
            self._mapped[g] = 1
            start = HEADER_BYTES + g * GRANULE
            try:
                self._mm.madvise(_MADV_POPULATE_WRITE, start, min(GRANULE, HEADER_BYTES + self.size - start))
            except OSError:  # older kernel: pages fault in on first touch instead
                pass

    def close(self) -> None:
        """Unmap (and, for the server, remove) the arena once its last user closes it."""
        with _attached_lock:
            self._users -= 1
            if self._users > 0:
                return
            if self._key is not None:
                _attached.pop(self._key, None)
        for hook in self._before_unmap:
            try:
                hook()
            except Exception:  # an unmap must happen whatever a hook does
                log.exception("arena unmap hook failed")
        try:
            self.view.release()
            self._mm.close()
        except BufferError:  # a view is still exported (e.g. a frame in flight); the OS unmaps at exit
            log.debug("arena still referenced at close")
        if self._owner and self.path is not None:
            self.path.unlink(missing_ok=True)


def cleanup_stale() -> None:
    """Remove arenas left by servers that died without unlinking them (they hold RAM until removed)."""
    for entry in SHM_DIR.iterdir():
        m = _NAME_RE.match(entry.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            log.info("removing stale arena %s", entry)
            entry.unlink(missing_ok=True)
