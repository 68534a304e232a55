"""KV store clients: `KVStoreClient` (blocking) and `AsyncKVStoreClient` (asyncio).

Both run the same operations, written once as generators that yield the messages
to send and receive the replies (`_Ops`); the two classes only drive them over a
ZMQ DEALER socket, blocking or awaiting. A client is for one thread (or one event
loop) at a time; the async client serialises its calls with a lock.

Payloads move without extra copies: over TCP they leave as zero-copy frames and
`get` returns views of the received frames; on the same host the client maps the
server's L1 arena and copies each payload straight into the slot the server leased
to it (or out of it), hashing each piece while it is still in cache. Every payload
read is verified against the checksum its writer stored; a mismatch is reported
to the server (which counts and drops the object) and answered as a miss.

A timeout closes the socket (so a late reply can never be taken for the next
one's) and raises KVStoreUnavailable naming the URL: the timeout is a per-reply
deadline (a large transfer arrives as several replies), so it can be short enough
to notice a dead or wedged store within about a second (see health.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence, TypeVar

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from pdserve.kvstore.client import protocol as p
from pdserve.kvstore.client.checksum import byte_view, checksums, copy_all
from pdserve.kvstore.client.layout import KVLayout
from pdserve.kvstore.client.protocol import ServerInfo
from pdserve.kvstore.client.shm import Arena, ArenaError

__all__ = ["KVStoreClient", "AsyncKVStoreClient", "KVStoreError", "KVStoreUnavailable", "ServerInfo"]

log = logging.getLogger(__name__)

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything exporting a contiguous buffer
T = TypeVar("T")
# A blocking or an asyncio socket: _new_socket makes either from its own kind of context.
_Sock = TypeVar("_Sock", bound=zmq.Socket)
# Reads payloads in place: called with positions and verified views, valid only during the call.
Visitor = Callable[[list[int], list[memoryview]], None]


class KVStoreError(RuntimeError):
    """Connection failure, timeout, or an error reply from the KV store."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class KVStoreUnavailable(KVStoreError):
    """The store did not answer within the deadline or could not be reached (no reply at all,
    as opposed to an error reply): the store, not the request, is at fault."""


@dataclass
class _Send:
    """A message for the driver to send. The driver answers with its reply (default), with
    nothing (`reply=False`: one-way), or with its request id (`defer=True`: collect the
    reply later with `_Recv`, so several requests can be in flight)."""

    msg: p._Req
    frames: list[memoryview] = field(default_factory=list)
    reply: bool = True
    defer: bool = False
    grace_s: float = 0.0  # the server may hold the reply this long on purpose (Await), beyond the deadline


@dataclass
class _Recv:
    """Wait for the next reply to an earlier deferred request."""

    req_id: int


_Reply = tuple[p.Reply, list[zmq.Frame]]
_Op = Generator[_Send | _Recv, Any, T]
WINDOW = 4  # pipelined TCP put messages in flight


def _expect(got: _Reply | None, kind: type[T], url: str) -> T:
    assert got is not None
    rep = got[0]
    if isinstance(rep, p.Error):
        raise KVStoreError(f"kvstore {url}: {rep.code}: {rep.message}", code=rep.code)
    if not isinstance(rep, kind):
        raise KVStoreError(f"kvstore {url}: expected a {kind.__name__} reply, got {type(rep).__name__}")
    return rep


def _indexed(visit: Visitor | None, names: Sequence[int]) -> Visitor | None:
    """`visit` called with `names[i]` for a reply part's position i (item indexes, tail groups)."""
    if visit is None:
        return None
    return lambda positions, views: visit([names[i] for i in positions], views)


def _fresh(size: int) -> memoryview:
    """An uninitialised byte buffer (np.empty skips the zero fill a bytearray would pay)."""
    return np.empty(size, dtype=np.uint8).data


class _Ops:
    """The protocol, as generators; shared by both clients."""

    def __init__(self, url: str, auth_token: str | None, shm: bool | None, prefault: bool) -> None:
        if not url.startswith(("tcp://", "ipc://")):
            raise KVStoreError(f"kvstore url must be tcp://host:port or ipc://path, got {url!r}")
        self.url = url
        self.token = auth_token
        self.shm_mode = shm
        self.prefault = prefault
        self.server: ServerInfo | None = None
        self.arena: Arena | None = None
        self._ids = itertools.count(1)
        self._awaited: set[int] = set()  # ids of this operation's requests that expect replies
        self._early: dict[int, deque[_Reply]] = {}  # replies that came before they were asked for

    def stamp(self, msg: p._Req, awaited: bool) -> int:
        msg.id = next(self._ids)
        msg.token = self.token
        if awaited:
            self._awaited.add(msg.id)
        return msg.id

    def route(self, want: int, got: _Reply) -> _Reply | None:
        """Return a received reply if it is `want`'s; keep it if another request of this operation
        awaits it; drop it otherwise (a late reply to a request that timed out)."""
        rid = got[0].id
        if rid == want:
            return got
        if rid in self._awaited:
            self._early.setdefault(rid, deque()).append(got)
        return None

    def early(self, want: int) -> _Reply | None:
        queue = self._early.get(want)
        return queue.popleft() if queue else None

    def end_op(self) -> None:
        self._awaited.clear()
        self._early.clear()

    @property
    def nonce(self) -> str:
        """What shared-memory requests carry: the mapped arena's nonce, or "" for TCP frames."""
        return self.arena.nonce if self.arena is not None else ""

    def forget_server(self) -> None:
        """Drop what this client knows of the server (e.g. after it restarted with a new arena)."""
        self.server = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def close(self) -> None:
        self.forget_server()

    # ------------------------------------------------------------ setup

    def info(self) -> _Op[ServerInfo]:
        if self.server is None:
            self.server = _expect((yield _Send(p.Info())), ServerInfo, self.url)
            self._attach(self.server)
        return self.server

    def _attach(self, info: ServerInfo) -> None:
        if self.shm_mode is False:
            return
        if not info.shm_path or not info.shm_nonce:
            if self.shm_mode:
                raise KVStoreError(f"kvstore {self.url}: shared memory requested but the server keeps L1 private")
            return
        try:
            self.arena = Arena.attach(info.shm_path, info.shm_nonce, info.shm_size)
            if self.prefault:
                self.arena.populate()
        except ArenaError as exc:
            if self.shm_mode:
                raise KVStoreError(f"kvstore {self.url}: shared memory requested but unusable: {exc}") from exc
            log.debug("kvstore %s: using TCP frames (%s)", self.url, exc)

    def register_layout(self, layout: KVLayout, namespace: str | None = None) -> _Op[str]:
        rep = _expect((yield _Send(p.RegisterLayout(layout=layout, namespace=namespace))), p.Registered, self.url)
        return rep.namespace

    def lookup(self, ns: str, keys: Sequence[bytes], groups: Sequence[int]) -> _Op[p.LookupResult]:
        msg = p.Lookup(ns=ns, groups=list(groups), keys=list(keys))
        return _expect((yield _Send(msg)), p.LookupResult, self.url)

    def stats(self) -> _Op[dict]:
        return _expect((yield _Send(p.Stats())), p.StatsReply, self.url).stats

    def drop_tail(self, ns: str, request_id: str) -> _Op[None]:
        _expect((yield _Send(p.DropTail(ns=ns, request_id=request_id))), p.Ok, self.url)

    def clear(self, ns: str) -> _Op[p.Cleared]:
        return _expect((yield _Send(p.Clear(ns=ns))), p.Cleared, self.url)

    # ------------------------------------------------------------ put

    def put(
        self, ns: str, items: Sequence[tuple[int, bytes, Buffer]], generation: int | None = None
    ) -> _Op[list[bool]]:
        info = yield from self.info()
        views = [byte_view(buf) for _, _, buf in items]
        stored = [False] * len(items)
        send = [i for i, v in enumerate(views) if len(v) <= info.max_object_bytes]
        if len(send) < len(items):
            log.warning(
                "kvstore %s: %d objects larger than L1 (%d bytes) not sent",
                self.url, len(items) - len(send), info.max_object_bytes,
            )
        if not send:
            return stored
        sizes = [len(views[i]) for i in send]
        if self.arena is not None:
            for part in p.split_by_bytes(sizes, info.l1_bytes // 4):
                idx = [send[j] for j in part]
                metas = [p.ItemMeta(items[i][0], items[i][1], len(views[i])) for i in idx]
                msg = p.Put(ns=ns, items=metas, shm=self.nonce, generation=generation)
                reserved = _expect((yield _Send(msg)), p.Reserved, self.url)
                _check_len(reserved.slots, metas, self.url)
                outcome = yield from self._fill([views[i] for i in idx], reserved)
                for i, ok in zip(idx, outcome):
                    stored[i] = ok
            return stored
        # TCP: a window of smaller messages, so the server stores one while the next is on the wire
        in_flight: deque[tuple[int, list[int]]] = deque()
        for part in p.split_by_bytes(sizes, min(info.l1_bytes // 4, p.PIPELINE_BYTES)):
            idx = [send[j] for j in part]
            metas = [p.ItemMeta(items[i][0], items[i][1], len(views[i])) for i in idx]
            req_id = yield _Send(p.Put(ns=ns, items=metas, generation=generation), [views[i] for i in idx], defer=True)
            in_flight.append((req_id, idx))
            if len(in_flight) == WINDOW:
                yield from self._collect_stored(*in_flight.popleft(), stored)
        while in_flight:
            yield from self._collect_stored(*in_flight.popleft(), stored)
        return stored

    def _collect_stored(self, req_id: int, idx: list[int], stored: list[bool]) -> _Op[None]:
        rep = _expect((yield _Recv(req_id)), p.Stored, self.url)
        _check_len(rep.stored, idx, self.url)
        _log_refusals(self.url, rep.errors)
        for i, ok in zip(idx, rep.stored):
            stored[i] = ok

    def _fill(self, views: list[memoryview], reserved: p.Reserved) -> _Op[list[bool]]:
        """Copy payloads into their reserved arena slots, then commit them with their checksums."""
        assert self.arena is not None
        pairs = [(slot, view) for view, slot in zip(views, reserved.slots) if slot is not None]
        for slot, view in pairs:
            if slot.size != len(view):
                raise KVStoreError(f"kvstore {self.url}: slot of {slot.size} bytes for a {len(view)}-byte payload")
        sums = copy_all([self.arena.slice(slot.offset, slot.size) for slot, _ in pairs], [v for _, v in pairs])
        stored = list(reserved.stored)
        _log_refusals(self.url, reserved.errors)
        if pairs:
            leases = [slot.lease for slot, _ in pairs]
            rep = _expect((yield _Send(p.Commit(leases=leases, checksums=sums))), p.Stored, self.url)
            _check_len(rep.stored, leases, self.url)
            committed = iter(rep.stored)
            stored = [next(committed) if slot is not None else ok for slot, ok in zip(reserved.slots, stored)]
        return stored

    def put_tail(
        self, ns: str, request_id: str, items: Sequence[tuple[int, Buffer]], ttl_s: float | None = None,
        generation: int | None = None,
    ) -> _Op[None]:
        info = yield from self.info()
        views = [byte_view(buf) for _, buf in items]
        too_big = [len(v) for v in views if len(v) > info.max_object_bytes]
        if too_big:
            raise KVStoreError(f"kvstore {self.url}: tail of {max(too_big)} bytes exceeds L1 ({info.max_object_bytes})")
        metas = [p.TailItem(g, len(v)) for (g, _), v in zip(items, views)]
        if self.arena is not None:
            msg = p.PutTail(ns=ns, request_id=request_id, items=metas, ttl_s=ttl_s, shm=self.nonce, generation=generation)
            reserved = _expect((yield _Send(msg)), p.Reserved, self.url)
            _check_len(reserved.slots, metas, self.url)
            if not all((yield from self._fill(views, reserved))):
                raise KVStoreError(f"kvstore {self.url}: tail of request {request_id!r} expired before commit")
            return
        msg = p.PutTail(ns=ns, request_id=request_id, items=metas, ttl_s=ttl_s, generation=generation)
        _expect((yield _Send(msg, views)), p.Ok, self.url)

    # ------------------------------------------------------------ get

    def get(
        self, ns: str, items: Sequence[tuple[int, bytes]], out: Sequence[Buffer] | None = None,
        visit: Visitor | None = None,
    ) -> _Op[list[memoryview | None]]:
        """With `visit`, nothing is copied: each reply part's verified payloads are handed to it in
        place (arena slices or frames) while still leased; the views returned are then not usable."""
        yield from self.info()
        if out is not None and len(out) != len(items):
            raise KVStoreError(f"{len(out)} output buffers for {len(items)} items")
        results: list[memoryview | None] = [None] * len(items)
        pending = list(range(len(items)))
        while pending:
            msg = p.Get(ns=ns, items=[p.ItemRef(*items[i]) for i in pending], shm=self.nonce)
            req_id = yield _Send(msg, defer=True)
            done, progress = 0, False
            while True:  # over TCP the reply comes in parts: verify one while the next arrives
                got = yield _Recv(req_id)
                rep = _expect(got, p.Loaded, self.url)
                if rep.first != done or done + len(rep.items) > len(pending):
                    raise KVStoreError(f"kvstore {self.url}: reply part for items {rep.first}+ out of order")
                part = pending[done : done + len(rep.items)]
                keys = [(ns, *items[i]) for i in part]
                outs = None if out is None else [out[i] for i in part]
                views = yield from self._receive(rep.items, keys, got[1], outs, _indexed(visit, part))
                for i, view in zip(part, views):
                    results[i] = view
                progress = progress or any(f is not None for f in rep.items)
                done += len(rep.items)
                if not rep.more:
                    break
            _check_len(range(done), pending, self.url)
            if not progress:
                break  # what is left stays a miss
            pending = [pending[j] for j in rep.retry if 0 <= j < len(pending)]
        return results

    def await_ready(
        self, ns: str, items: Sequence[tuple[int, bytes]], tail_id: str | None, wait_s: float
    ) -> _Op[p.Ready]:
        wait_ms = max(0, min(p.MAX_WAIT_MS, round(wait_s * 1000)))
        msg = p.Await(ns=ns, items=[p.ItemRef(*it) for it in items], tail_id=tail_id, wait_ms=wait_ms)
        rep = _expect((yield _Send(msg, grace_s=wait_ms / 1000)), p.Ready, self.url)
        _check_len(rep.present, items, self.url)
        return rep

    def get_tail(
        self, ns: str, request_id: str, out: dict[int, Buffer] | None = None, visit: Visitor | None = None
    ) -> _Op[dict[int, memoryview] | None]:
        """`visit` as for `get`, called with the tail's groups (not item indexes)."""
        yield from self.info()
        got = yield _Send(p.GetTail(ns=ns, request_id=request_id, shm=self.nonce))
        rep = _expect(got, p.TailLoaded, self.url)
        if not rep.found:
            return None
        _check_len(rep.items, rep.groups, self.url)
        outs = None if out is None else [out[g] for g in rep.groups]
        keys = [(ns, g, b"") for g in rep.groups]
        views = yield from self._receive(list(rep.items), keys, got[1], outs, _indexed(visit, list(rep.groups)))
        loaded = [v for v in views if v is not None]
        if len(loaded) != len(views):
            return None
        return dict(zip(rep.groups, loaded))

    def _receive(
        self,
        found: Sequence[p.Found | None],
        keys: Sequence[tuple[str, int, bytes]],
        frames: list[zmq.Frame],
        out: Sequence[Buffer] | None,
        visit: Visitor | None = None,
    ) -> _Op[list[memoryview | None]]:
        """Turn found items into verified views (visited in place, when `visit` is given); release
        shm leases and report corrupt payloads."""
        hits = [(i, f) for i, f in enumerate(found) if f is not None]
        shm = any(f.offset >= 0 for _, f in hits)
        if shm:
            assert self.arena is not None
            srcs = [self.arena.slice(f.offset, f.size) for _, f in hits]
        elif len(frames) != len(hits):
            raise KVStoreError(f"kvstore {self.url}: {len(hits)} objects found but {len(frames)} payload frames")
        else:
            srcs = [frame.buffer for frame in frames]
        for (_, f), src in zip(hits, srcs):
            if len(src) != f.size:
                raise KVStoreError(f"kvstore {self.url}: {len(src)} bytes for a {f.size}-byte object")
        dsts: list[memoryview] | None = None
        if visit is not None:
            pass  # read in place: the lease keeps the arena slices ours until the visit returns
        elif out is not None:
            dsts = [_out_view(out[i], f.size, i) for i, f in hits]
        elif shm:
            dsts = [_fresh(f.size) for _, f in hits]  # the arena slice is reused once the lease ends
        sums = copy_all(dsts, srcs) if dsts is not None else checksums(srcs)
        results: list[memoryview | None] = [None] * len(found)
        corrupt: list[p.Corrupt] = []
        for j, (i, f) in enumerate(hits):
            if sums[j] == f.checksum:
                results[i] = dsts[j] if dsts is not None else srcs[j]
            else:
                ns, group, key = keys[i]
                corrupt.append(p.Corrupt(ns, group, key, f.obj))
                log.warning("kvstore %s: checksum mismatch on %s/%d, treated as a miss", self.url, ns, group)
        leases = [f.lease for _, f in hits] if shm else []
        try:
            verified = [(i, v) for i, v in enumerate(results) if v is not None]
            if visit is not None and verified:
                visit([i for i, _ in verified], [v for _, v in verified])
        finally:
            if leases or corrupt:
                yield _Send(p.Release(leases=leases, corrupt=corrupt), reply=False)
        return results



def _log_refusals(url: str, errors: Sequence[str | None]) -> None:
    refused = [e for e in errors if e]
    if refused:
        log.warning("kvstore %s refused %d objects: %s", url, len(refused), refused[0])


_ATTEMPTS = (0, 1)


def _retry_or_raise(ops: _Ops, exc: KVStoreError, attempt: int) -> None:
    """After a server restart the mapped arena is stale: forget it and run the operation once more."""
    if exc.code != p.STALE_SHM or attempt == _ATTEMPTS[-1]:
        raise exc
    log.info("kvstore %s restarted; mapping its new arena", ops.url)
    ops.forget_server()


def _out_view(buf: Buffer, size: int, i: int) -> memoryview:
    view = byte_view(buf)
    if len(view) < size:
        raise KVStoreError(f"output buffer {i} holds {len(view)} bytes, object has {size}")
    if view.readonly:
        raise KVStoreError(f"output buffer {i} is read-only")
    return view[:size]


def _check_len(got: Sequence, want: Sequence, url: str) -> None:
    if len(got) != len(want):
        raise KVStoreError(f"kvstore {url}: reply has {len(got)} items for {len(want)} requested")


def _no_reply(url: str, timeout_s: float) -> KVStoreUnavailable:
    return KVStoreUnavailable(f"kvstore {url}: no reply within {timeout_s:g} s (is the server running?)")


def _new_socket(ctx: zmq.Context[_Sock], url: str, timeout_s: float) -> _Sock:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.connect(url)
    return sock


class KVStoreClient:
    """Blocking client; see the module docstring. Not for concurrent use from several threads."""

    def __init__(
        self, url: str = "tcp://127.0.0.1:5556", auth_token: str | None = None, timeout_s: float = 30.0,
        shm: bool | None = None, prefault: bool = False,
    ) -> None:
        """`shm`: None uses the server's shared memory when it is on this host, False never, True requires it.
        `prefault`: map the whole shared arena at connect time instead of granule by granule on first use."""
        self._ops = _Ops(url, auth_token, shm, prefault)
        self.url = url
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None

    # ---- driver

    def _run(self, make_op: Callable[..., _Op[T]], *args: Any) -> T:
        for attempt in _ATTEMPTS:
            op = make_op(*args)
            try:
                step = next(op)
                while True:
                    step = op.send(self._step(step))
            except StopIteration as done:
                return done.value
            except KVStoreError as exc:
                _retry_or_raise(self._ops, exc, attempt)
            finally:
                self._ops.end_op()
        raise AssertionError("unreachable")

    def _step(self, step: _Send | _Recv) -> _Reply | int | None:
        try:
            if isinstance(step, _Recv):
                return self._wait(step.req_id)
            if self._sock is None:
                self._sock = _new_socket(self._ctx, self.url, self.timeout_s)
            req_id = self._ops.stamp(step.msg, awaited=step.reply)
            self._sock.send_multipart([p.encode(step.msg), *step.frames], copy=False)
            if not step.reply:
                return None
            return req_id if step.defer else self._wait(req_id, step.grace_s)
        except zmq.Again:
            self._reset()
            raise _no_reply(self.url, self.timeout_s) from None
        except zmq.ZMQError as exc:
            self._reset()
            raise KVStoreUnavailable(f"kvstore {self.url}: {exc}") from exc
        except msgspec.MsgspecError as exc:
            self._reset()
            raise KVStoreError(f"kvstore {self.url}: {exc}") from exc

    def _wait(self, req_id: int, grace_s: float = 0.0) -> _Reply:
        got = self._ops.early(req_id)
        while got is None:
            if self._sock is None or not self._sock.poll(int((self.timeout_s + grace_s) * 1000)):
                raise zmq.Again()
            frames = self._sock.recv_multipart(copy=False)
            got = self._ops.route(req_id, (p.decode_reply(frames[0].buffer), frames[1:]))
        return got

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # ---- API

    def info(self) -> ServerInfo:
        return self._run(self._ops.info)

    def register_layout(self, layout: KVLayout, namespace: str | None = None) -> str:
        return self._run(self._ops.register_layout, layout, namespace)

    def lookup(self, ns: str, keys: Sequence[bytes], groups: Sequence[int]) -> int:
        return self.lookup_with_generation(ns, keys, groups).count

    def lookup_with_generation(self, ns: str, keys: Sequence[bytes], groups: Sequence[int]) -> p.LookupResult:
        """The lookup's count and the namespace's generation, which puts of what is planned now name."""
        return self._run(self._ops.lookup, ns, keys, groups)

    def put(self, ns: str, items: Sequence[tuple[int, bytes, Buffer]], generation: int | None = None) -> list[bool]:
        """`generation`: the namespace's, as a lookup reported it when the save was planned; a clear
        since makes the store refuse the items. None: not checked."""
        return self._run(self._ops.put, ns, items, generation)

    def get(
        self, ns: str, items: Sequence[tuple[int, bytes]], out: Sequence[Buffer] | None = None
    ) -> list[memoryview | None]:
        """`out`: optional destination buffers (one per item, at least the object's size) to load into."""
        return self._run(self._ops.get, ns, items, out)

    def read(self, ns: str, items: Sequence[tuple[int, bytes]], visit: Visitor) -> list[bool]:
        """Which items were found and handed to `visit(item indexes, views)` without a copy.

        The views are the payloads where they lie (a same-host store's arena, or the received
        frames), verified against their checksums, and leased to this client only while `visit`
        runs: it must be done with them (e.g. its device copy complete) when it returns. A
        corrupt payload is never visited and counts as not found."""
        return [v is not None for v in self._run(self._ops.get, ns, items, None, visit)]

    def read_tail(self, ns: str, request_id: str, visit: Visitor) -> bool:
        """Whether the tail was found whole and visited (`visit(groups, views)`, as for `read`)."""
        return self._run(self._ops.get_tail, ns, request_id, None, visit) is not None

    def put_tail(
        self, ns: str, request_id: str, items: Sequence[tuple[int, Buffer]], ttl_s: float | None = None,
        generation: int | None = None,
    ) -> None:
        return self._run(self._ops.put_tail, ns, request_id, items, ttl_s, generation)

    def get_tail(
        self, ns: str, request_id: str, out: dict[int, Buffer] | None = None
    ) -> dict[int, memoryview] | None:
        return self._run(self._ops.get_tail, ns, request_id, out)

    def drop_tail(self, ns: str, request_id: str) -> None:
        return self._run(self._ops.drop_tail, ns, request_id)

    def clear(self, ns: str) -> p.Cleared:
        """Drop every object and tail of `ns` in the store: how many there were, and its new generation."""
        return self._run(self._ops.clear, ns)

    def await_ready(
        self, ns: str, items: Sequence[tuple[int, bytes]], tail_id: str | None = None, wait_s: float = 0.0
    ) -> p.Ready:
        """Which items are stored, and whether the tail `tail_id` is complete (or gone for good), once all
        are, once the tail is gone, or after `wait_s` (the server holds the answer; no polling). wait_s=0
        answers at once."""
        return self._run(self._ops.await_ready, ns, items, tail_id, wait_s)

    def stats(self) -> dict:
        return self._run(self._ops.stats)

    @property
    def uses_shm(self) -> bool:
        return self._ops.arena is not None

    @property
    def arena(self) -> Arena | None:
        """The store's shared-memory arena as this process maps it (after the first call), if on this host."""
        return self._ops.arena

    def close(self) -> None:
        self._reset()
        self._ops.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKVStoreClient:
    """asyncio client with the same methods as coroutines; concurrent calls on one client are serialised."""

    def __init__(
        self, url: str = "tcp://127.0.0.1:5556", auth_token: str | None = None, timeout_s: float = 30.0,
        shm: bool | None = None, prefault: bool = False,
    ) -> None:
        """`shm`: None uses the server's shared memory when it is on this host, False never, True requires it.
        `prefault`: map the whole shared arena at connect time instead of granule by granule on first use."""
        self._ops = _Ops(url, auth_token, shm, prefault)
        self.url = url
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()

    async def _run(self, make_op: Callable[..., _Op[T]], *args: Any) -> T:
        async with self._lock:
            for attempt in _ATTEMPTS:
                op = make_op(*args)
                try:
                    step = next(op)
                    while True:
                        step = op.send(await self._step(step))
                except StopIteration as done:
                    return done.value
                except KVStoreError as exc:
                    _retry_or_raise(self._ops, exc, attempt)
                finally:
                    self._ops.end_op()
            raise AssertionError("unreachable")

    async def _step(self, step: _Send | _Recv) -> _Reply | int | None:
        try:
            async with asyncio.timeout(self.timeout_s + (step.grace_s if isinstance(step, _Send) else 0.0)):
                if isinstance(step, _Recv):
                    return await self._wait(step.req_id)
                if self._sock is None:
                    self._sock = _new_socket(self._ctx, self.url, self.timeout_s)
                req_id = self._ops.stamp(step.msg, awaited=step.reply)
                await self._sock.send_multipart([p.encode(step.msg), *step.frames], copy=False)
                if not step.reply:
                    return None
                return req_id if step.defer else await self._wait(req_id)
        except (TimeoutError, zmq.Again):
            self._reset()
            raise _no_reply(self.url, self.timeout_s) from None
        except zmq.ZMQError as exc:
            self._reset()
            raise KVStoreUnavailable(f"kvstore {self.url}: {exc}") from exc
        except msgspec.MsgspecError as exc:
            self._reset()
            raise KVStoreError(f"kvstore {self.url}: {exc}") from exc

    async def _wait(self, req_id: int) -> _Reply:
        got = self._ops.early(req_id)
        while got is None:
            if self._sock is None:
                raise zmq.Again()
            frames = await self._sock.recv_multipart(copy=False)
            got = self._ops.route(req_id, (p.decode_reply(frames[0].buffer), frames[1:]))
        return got

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def info(self) -> ServerInfo:
        return await self._run(self._ops.info)

    async def register_layout(self, layout: KVLayout, namespace: str | None = None) -> str:
        return await self._run(self._ops.register_layout, layout, namespace)

    async def lookup(self, ns: str, keys: Sequence[bytes], groups: Sequence[int]) -> int:
        return (await self._run(self._ops.lookup, ns, keys, groups)).count

    async def put(self, ns: str, items: Sequence[tuple[int, bytes, Buffer]]) -> list[bool]:
        return await self._run(self._ops.put, ns, items)

    async def get(
        self, ns: str, items: Sequence[tuple[int, bytes]], out: Sequence[Buffer] | None = None
    ) -> list[memoryview | None]:
        return await self._run(self._ops.get, ns, items, out)

    async def put_tail(
        self, ns: str, request_id: str, items: Sequence[tuple[int, Buffer]], ttl_s: float | None = None
    ) -> None:
        return await self._run(self._ops.put_tail, ns, request_id, items, ttl_s)

    async def get_tail(
        self, ns: str, request_id: str, out: dict[int, Buffer] | None = None
    ) -> dict[int, memoryview] | None:
        return await self._run(self._ops.get_tail, ns, request_id, out)

    async def drop_tail(self, ns: str, request_id: str) -> None:
        return await self._run(self._ops.drop_tail, ns, request_id)

    async def await_ready(
        self, ns: str, items: Sequence[tuple[int, bytes]], tail_id: str | None = None, wait_s: float = 0.0
    ) -> p.Ready:
        return await self._run(self._ops.await_ready, ns, items, tail_id, wait_s)

    async def stats(self) -> dict:
        return await self._run(self._ops.stats)

    @property
    def uses_shm(self) -> bool:
        return self._ops.arena is not None

    async def close(self) -> None:
        self._reset()
        self._ops.close()

    async def __aenter__(self) -> "AsyncKVStoreClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
