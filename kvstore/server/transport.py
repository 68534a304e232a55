"""The ZMQ side of the server: one ROUTER socket, one thread, a poll loop.

Each message is [client identity, msgpack header, payload frames...]. Loads are
sent straight from the arena (copy=False) and their objects stay leased until ZMQ
reports the frames sent. A message larger than the largest object plus a header
is cut off by ZMQ itself (MAXMSGSIZE drops the connection); anything else that
cannot be decoded or acted on gets an `Error` reply, and the loop goes on.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import assert_never

import msgspec
import zmq

from pdserve import __version__
from pdserve.kvstore.client import protocol as p
from pdserve.kvstore.server.config import KVStoreConfig
from pdserve.kvstore.server.l1 import Obj
from pdserve.kvstore.server.metrics import Metrics
from pdserve.kvstore.server.store import Conflict, LoadResult, NoRoom, Store
from pdserve.kvstore.server.waiters import Waiters

log = logging.getLogger(__name__)

POLL_MS = 200  # upkeep (tail TTLs, lease deadlines) runs about this often
HEARTBEAT_IVL_MS = 5000  # how often the server pings each peer (more often under a short --lease-timeout-s)
HANDSHAKE_MS = 5000  # a connection must finish ZMQ's greeting within this
_BATCH = 64  # messages handled between checks for sent frames when busy
# Messages after which a parked Await may be answered: something stored, or a tail gone.
_SETTLING = (p.Put, p.PutTail, p.Commit, p.GetTail, p.DropTail)


class StaleArena(Exception):
    """A shared-memory request for an arena this server does not own."""


# what each refusal is called on the wire; anything else is a bug, answered "internal"
_ERROR_CODES: tuple[tuple[type[Exception] | tuple[type[Exception], ...], str], ...] = (
    ((msgspec.DecodeError, msgspec.ValidationError, p.BadRequest), "bad_request"),
    (Conflict, "conflict"),
    (StaleArena, p.STALE_SHM),
    (NoRoom, "no_room"),
)


# A reply and, for a load, the objects it sends (leased until sent).
Answer = tuple[p.Reply, LoadResult | None]


class ZmqServer:
    def __init__(self, cfg: KVStoreConfig, store: Store, metrics: Metrics) -> None:
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, store.max_object_bytes + p.MAX_HEADER_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a reply; leases bound what is in flight
        # A peer that answers no ZMTP ping for a lease's lifetime (stopped, hung, or one that reads none of its
        # replies: libzmq reads no pings while its receive queue is full) is disconnected; its unsent frames are
        # dropped, which ends their leases. Without this it kept them, and their L1 room, for as long as it lived.
        timeout_ms = round(cfg.lease_timeout_s * 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, min(HEARTBEAT_IVL_MS, timeout_ms // 4)))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        # A connection that has not finished ZMQ's greeting within this is closed (libzmq: 30 s): a flood of bare
        # TCP connections otherwise held a descriptor each that long, and at the file limit libzmq's accept spins.
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self.sock.bind(cfg.zmq_url)
        self._in_flight: list[tuple[zmq.MessageTracker, list[Obj]]] = []
        self._token = cfg.auth_token.encode() if cfg.auth_token else None
        self.waiters = Waiters()
        self._settling = False  # a message since the last wake-up may have settled a parked await

    # ------------------------------------------------------------ loop

    def serve(self, stop: threading.Event) -> None:
        log.info("kvstore %s listening on %s (advertised: %s)", self.cfg.identity, self.cfg.zmq_url, self.cfg.advertised_url)
        next_upkeep = 0.0
        while not stop.is_set():
            timeout = self.waiters.next_deadline_ms(5 if self._in_flight else POLL_MS)
            if self.sock.poll(timeout):
                for _ in range(_BATCH):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._wake()
            self._reap_sent()
            if (now := time.monotonic()) >= next_upkeep:
                self.store.expire()
                next_upkeep = now + POLL_MS / 1000

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def _wake(self) -> None:
        """Answer parked awaits that are ready (after a message that may settle one: a store, a tail taken or
        dropped) or whose wait ended."""
        answers = self.waiters.ready(self._ready) if self._settling else []
        self._settling = False
        for parked, reply in answers + self.waiters.due(self._ready):
            reply.id = parked.req.id
            self._send(parked.ident, reply, None)

    def _ready(self, req: p.Await) -> p.Ready:
        return self.store.ready(req.ns, req.items, req.tail_id)

    def _reap_sent(self) -> None:
        if not self._in_flight:
            return
        pending = []
        for tracker, objs in self._in_flight:
            if tracker.done:
                self.store.sent(objs)
            else:
                pending.append((tracker, objs))
        self._in_flight = pending

    # ------------------------------------------------------------ one message

    def _handle(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0]
        req_id = 0
        try:
            if len(frames) < 2:
                raise p.BadRequest("empty message")
            req = p.decode_request(frames[1].buffer)
            req_id = req.id
            self.metrics.requests.labels(req.__struct_config__.tag).inc()
            if self._token is not None and not hmac.compare_digest((req.token or "").encode(), self._token):
                if isinstance(req, p.Release):
                    return
                self._error(ident, req_id, "unauthorized", "missing or wrong auth token")
                return
            if isinstance(req, p.Release):  # one-way
                self.store.release(req.leases, req.corrupt)
                return
            self._settling |= isinstance(req, _SETTLING)
            if isinstance(req, p.Await) and self._park(ident, req):
                return
            reply, loaded = self._dispatch(req, [f.buffer for f in frames[2:]])
        except Exception as exc:  # a bug must not take the store down with it either
            code = next((c for kinds, c in _ERROR_CODES if isinstance(exc, kinds)), None)
            if code is None:
                log.exception("internal error")
                code = "internal"
            self._error(ident, req_id, code, str(exc) if code != "internal" else f"{type(exc).__name__}: {exc}")
            return
        reply.id = req_id
        self._send(ident, reply, loaded)

    def _dispatch(self, req: p.Request, frames: list[memoryview]) -> Answer:
        """The handler of `req`'s op (a match, so each handler gets its request's own type); the
        commonest ops first. Release is one-way and answered before this."""
        store = self.store
        match req:
            case p.Get():
                return self._get(req, frames)
            case p.Put():
                return self._put(req, frames)
            case p.Commit():
                return self._commit(req, frames)
            case p.Lookup():
                count = store.lookup(req.ns, req.groups, req.keys)
                return p.LookupResult(count=count, generation=store.generation(req.ns)), None
            case p.Await():
                return self._ready(req), None
            case p.PutTail():
                return self._put_tail(req, frames)
            case p.GetTail():
                return self._get_tail(req, frames)
            case p.DropTail():
                store.drop_tail(req.ns, req.request_id)
                return p.Ok(), None
            case p.Clear():
                return p.Cleared(objects=store.clear(req.ns), generation=store.generation(req.ns)), None
            case p.Info():
                return self._info()
            case p.RegisterLayout():
                return p.Registered(namespace=store.register(req.layout, req.namespace)), None
            case p.Stats():
                return self._stats()
            case p.Release():
                raise p.BadRequest("release is one-way")
            case _:
                assert_never(req)

    def _send(self, ident: zmq.Frame, reply: p.Reply, loaded: LoadResult | None) -> None:
        if loaded is None or loaded.shm or not loaded.objs:  # shm leases end on Release
            self.sock.send_multipart([ident, p.encode(reply)], copy=False)
        elif isinstance(reply, p.Loaded):
            self._send_parts(ident, reply, loaded.objs)
        else:
            self._send_frames(ident, reply, loaded.objs)

    def _send_parts(self, ident: zmq.Frame, reply: p.Loaded, objs: list[Obj]) -> None:
        """Send a load as parts of about PIPELINE_BYTES, so the client verifies one while the next arrives."""
        pending = iter(objs)
        start, size, part_objs = 0, 0, []
        n = len(reply.items)
        for i, found in enumerate(reply.items):
            if found is not None:
                part_objs.append(next(pending))
                size += found.size
            if i + 1 == n or size >= p.PIPELINE_BYTES:
                last = i + 1 == n
                part = p.Loaded(
                    id=reply.id, items=reply.items[start : i + 1], first=start, more=not last,
                    retry=reply.retry if last else [],
                )
                self._send_frames(ident, part, part_objs)
                start, size, part_objs = i + 1, 0, []

    def _send_frames(self, ident: zmq.Frame, reply: p.Reply, objs: list[Obj]) -> None:
        """Header plus payloads straight from the arena; the objects stay leased until ZMQ is done."""
        payload = [zmq.Frame(self.store.l1.view(obj), track=True) for obj in objs]
        self.sock.send_multipart([ident, p.encode(reply), *payload], copy=False)
        if payload:
            self._in_flight.append((zmq.MessageTracker(*payload), objs))

    def _error(self, ident: zmq.Frame, req_id: int, code: str, message: str) -> None:
        self.metrics.errors.labels(code).inc()
        log.debug("error reply %s: %s", code, message)
        self.sock.send_multipart([ident, p.encode(p.Error(id=req_id, code=code, message=message))], copy=False)

    # ------------------------------------------------------------ ops

    def _park(self, ident: zmq.Frame, req: p.Await) -> bool:
        """Hold an await that cannot be answered yet; False: answer it now (its handler does)."""
        self.store.check_await(req.ns, req.items, req.tail_id, req.wait_ms)
        if req.wait_ms == 0:
            return False
        if self._ready(req).settled(req.tail_id):
            return False
        return self.waiters.park(ident, req)

    def _info(self) -> Answer:
        arena = self.store.arena
        return (
            p.ServerInfo(
                version=__version__,
                protocol=p.PROTOCOL_VERSION,
                chunk_size=self.cfg.chunk_size,
                l1_bytes=self.store.l1.capacity,
                max_object_bytes=self.store.max_object_bytes,
                shm_path=str(arena.path) if arena.path else None,
                shm_nonce=arena.nonce if arena.path else None,
                shm_size=arena.size,
                store_id=self.cfg.identity,
                advertise_url=self.cfg.advertised_url,
            ),
            None,
        )

    def _stats(self) -> Answer:
        self.store.refresh_gauges()
        return p.StatsReply(stats=self.metrics.snapshot()), None

    def _shm(self, nonce: str, frames: list[memoryview]) -> bool:
        """Whether a request uses the arena; refuses a nonce of another (e.g. a previous) server's arena."""
        if not nonce:
            return False
        if self.store.arena.path is None or not hmac.compare_digest(nonce, self.store.arena.nonce):
            raise StaleArena("shared memory of another server instance; fetch info and map the arena again")
        if frames:
            raise p.BadRequest("a shared-memory request carries no payload frames")
        return True

    def _put(self, req: p.Put, frames: list[memoryview]) -> Answer:
        if self._shm(req.shm, frames):
            return self.store.reserve(req.ns, req.items, req.generation), None
        stored, errors = self.store.put_frames(req.ns, req.items, frames, req.generation)
        return p.Stored(stored=stored, errors=errors), None

    def _put_tail(self, req: p.PutTail, frames: list[memoryview]) -> Answer:
        if self._shm(req.shm, frames):
            return self.store.reserve_tail(req.ns, req.request_id, req.items, req.ttl_s, req.generation), None
        self.store.put_tail_frames(req.ns, req.request_id, req.items, frames, req.ttl_s, req.generation)
        return p.Ok(), None

    def _commit(self, req: p.Commit, frames: list[memoryview]) -> Answer:
        stored, errors = self.store.commit(req.leases, req.checksums)
        return p.Stored(stored=stored, errors=errors), None

    def _get(self, req: p.Get, frames: list[memoryview]) -> Answer:
        self._reap_sent()  # leases of frames already sent make room for promotions from L2
        loaded = self.store.get(req.ns, req.items, self._shm(req.shm, frames))
        return p.Loaded(items=loaded.found, retry=loaded.retry), loaded

    def _get_tail(self, req: p.GetTail, frames: list[memoryview]) -> Answer:
        found = self.store.get_tail(req.ns, req.request_id, self._shm(req.shm, frames))
        if found is None:
            return p.TailLoaded(groups=[], items=[], found=False), None
        groups, loaded = found
        return p.TailLoaded(groups=groups, items=[f for f in loaded.found if f is not None]), loaded
