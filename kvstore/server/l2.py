"""L2: chunks evicted from L1, one file each under --l2-path, bounded and LRU.

A file is written to a temporary name and renamed into place, so a crash leaves
either the old state or a whole file; leftover temporaries are deleted at start-up.
Each file starts with a small header naming the object and its checksum, and the
payload is verified on every read: a torn, truncated or bit-flipped file is deleted
and reported as corrupt, never served. The index is rebuilt at start-up from the
directory tree (names and sizes only; contents are checked when read), oldest
modification time first, so L2 survives a restart. A disk that fills before the
budget does (a smaller volume, other tenants) makes room by evicting, as the budget would.
A namespace's files dropped by a clear are moved aside at once and deleted in the background.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import msgspec

from pdserve.kvstore.client.checksum import checksum
from pdserve.kvstore.server.l1 import ChunkId
from pdserve.kvstore.client.protocol import NAMESPACE_RE

log = logging.getLogger(__name__)

_MAGIC = b"PDKVL2\x00\x01"
_LEN = struct.Struct("<I")
_SUFFIX = ".kv"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_TRASH = ".trash-"  # a dropped namespace's folder, deleted in the background (never a namespace's name)


class L2Meta(msgspec.Struct, array_like=True):
    ns: str
    group: int
    key: bytes
    size: int
    checksum: int


class L2Corrupt(Exception):
    """A file that cannot be served: torn, truncated, mismatched header or checksum."""


class L2:
    def __init__(self, root: Path, capacity: int, on_evict: Callable[[ChunkId], None]) -> None:
        self.root = root
        self.capacity = capacity
        self._on_evict = on_evict
        self.index: OrderedDict[ChunkId, int] = OrderedDict()  # -> bytes on disk
        self.used_bytes = 0
        self._told_full = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(L2Meta)
        root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _path(self, cid: ChunkId) -> Path:
        ns, group, key = cid
        return self.root / ns / str(group) / (key.hex() + _SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[float, ChunkId, int]] = []
        for ns_dir in self.root.iterdir():
            if ns_dir.name.startswith(_TRASH):  # a drop the last stop did not finish deleting
                _delete_in_background(ns_dir)
                continue
            if not ns_dir.is_dir() or not NAMESPACE_RE.match(ns_dir.name):
                continue
            for group_dir in ns_dir.iterdir():
                if not group_dir.is_dir() or not group_dir.name.isdigit():
                    continue
                for entry in os.scandir(group_dir):
                    if not entry.name.endswith(_SUFFIX):
                        os.unlink(entry.path)  # a temporary left by a crash mid-write
                        continue
                    try:
                        key = bytes.fromhex(entry.name[: -len(_SUFFIX)])
                    except ValueError:
                        continue
                    st = entry.stat()
                    found.append((st.st_mtime, (ns_dir.name, int(group_dir.name), key), st.st_size))
        for _, cid, size in sorted(found, key=lambda f: f[0]):
            self.index[cid] = size
            self.used_bytes += size
        self._trim()
        if found:
            log.info("L2 %s: %d objects, %.1f MiB", self.root, len(self.index), self.used_bytes / 2**20)

    def contains(self, cid: ChunkId) -> bool:
        return cid in self.index

    def write(self, cid: ChunkId, payload: memoryview, payload_checksum: int) -> None:
        """Store `payload` under `cid` (atomically); a chunk already on disk is only touched."""
        if cid in self.index:
            self.index.move_to_end(cid)
            return
        header = self._encoder.encode(L2Meta(cid[0], cid[1], cid[2], len(payload), payload_checksum))
        total = len(_MAGIC) + _LEN.size + len(header) + len(payload)
        if total > self.capacity:
            return
        path = self._path(cid)
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                self._write_file(path, _MAGIC + _LEN.pack(len(header)) + header, payload)
                break
            except OSError as exc:
                if exc.errno not in _DISK_FULL or not self.index:
                    raise
                self._disk_full(total)
        self.index[cid] = total
        self.used_bytes += total
        self._trim()

    @staticmethod
    def _write_file(path: Path, head: bytes, payload: memoryview) -> None:
        """Write to a temporary name and rename it into place; a failed write leaves nothing behind
        (a partial temporary would hold disk space no index counts, until the next start)."""
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _disk_full(self, needed: int) -> None:
        """The disk holds less than the budget: evict the least recent objects worth `needed` bytes, so
        L2 goes on keeping the most recent spills in the room there is instead of refusing every new one."""
        if not self._told_full:
            log.warning("L2 %s: the disk is full at %.1f MiB of its %.1f MiB budget; evicting least recent",
                        self.root, self.used_bytes / 2**20, self.capacity / 2**20)
            self._told_full = True
        freed = 0
        while freed < needed and self.index:
            freed += self._evict_oldest()

    def read(self, cid: ChunkId, into: Callable[[int], memoryview | None]) -> int | None:
        """Read `cid` into the buffer `into(size)` returns and answer its checksum; None if `into` had no room.

        Raises L2Corrupt (after deleting the file) when the file cannot be trusted, KeyError if not indexed.
        """
        expected = self.index[cid]
        path = self._path(cid)
        try:
            with open(path, "rb") as f:
                meta = self._read_header(f, cid, expected)
                dst = into(meta.size)
                if dst is None:
                    return None
                if f.readinto(dst) != meta.size or checksum(dst) != meta.checksum:
                    raise L2Corrupt(f"{path}: payload torn or checksum mismatch")
        except (OSError, L2Corrupt) as exc:
            self.remove(cid)
            raise L2Corrupt(str(exc)) from exc
        if cid in self.index:  # making room in L1 for it may have spilled enough to trim it
            self.index.move_to_end(cid)
        return meta.checksum

    def _read_header(self, f, cid: ChunkId, expected: int) -> L2Meta:
        head = f.read(len(_MAGIC) + _LEN.size)
        if len(head) != len(_MAGIC) + _LEN.size or head[: len(_MAGIC)] != _MAGIC:
            raise L2Corrupt(f"{f.name}: bad magic")
        (header_len,) = _LEN.unpack_from(head, len(_MAGIC))
        try:
            meta = self._decoder.decode(f.read(header_len))
        except msgspec.MsgspecError as exc:
            raise L2Corrupt(f"{f.name}: bad header ({exc})") from exc
        if (meta.ns, meta.group, meta.key) != cid or len(head) + header_len + meta.size != expected:
            raise L2Corrupt(f"{f.name}: header does not match name or size")
        return meta

    def remove(self, cid: ChunkId) -> None:
        size = self.index.pop(cid, None)
        if size is not None:
            self.used_bytes -= size
            self._path(cid).unlink(missing_ok=True)

    def drop_namespace(self, ns: str) -> int:
        """Forget every object of `ns` now and delete its files in the background; answer how many.
        Deleting them in place would hold the store's loop about 25 us a file (40k files: 0.93 s), so
        a large L2 would stall every client for long enough to be taken for down."""
        gone = [cid for cid in self.index if cid[0] == ns]
        for cid in gone:
            self.used_bytes -= self.index.pop(cid)
        folder = self.root / ns
        if folder.is_dir():
            trash = self.root / f"{_TRASH}{ns}-{secrets.token_hex(4)}"
            os.rename(folder, trash)  # atomic: writes of the namespace from now on start a new folder
            _delete_in_background(trash)
        return len(gone)

    def _trim(self) -> None:
        while self.used_bytes > self.capacity and self.index:
            self._evict_oldest()

    def _evict_oldest(self) -> int:
        """Evict the least recent object; answer its bytes on disk."""
        cid, size = next(iter(self.index.items()))
        self.remove(cid)
        self._on_evict(cid)
        return size


def _delete_in_background(folder: Path) -> None:
    threading.Thread(target=shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                     name="l2-trash", daemon=True).start()
