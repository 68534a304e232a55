"""The KV store wire protocol: msgspec structs, independent of the transport.

A message is a ZMQ multipart: one msgpack header (a tagged-union struct below,
tag field "op") followed by zero or more payload frames, one per item that carries
bytes. Nothing on the wire is ever unpickled. Payloads either travel as frames
(TCP) or stay in the server's shared-memory arena (same host): the header then
carries lease ids and arena offsets that the server chose, never sizes or offsets
it would trust from a client.

Shared-memory requests carry the nonce of the arena the client mapped (`shm`; empty
means TCP frames), so a client still mapping a restarted server's old arena gets a
`stale_shm` error instead of writing where nobody reads. Putting through shared
memory takes two round trips: `Put` reserves arena space and answers `Reserved`;
the client copies the payloads in and sends `Commit` with their checksums. Reading
leases the objects (`Get` answers offsets); the client copies them out and sends a
one-way `Release`, which also reports payloads whose checksum did not match.
"""

from __future__ import annotations

import re
from typing import Sequence, Union

import msgspec

from pdserve.kvstore.client.layout import KVLayout

PROTOCOL_VERSION = 1
MAX_ITEMS = 65536  # items in one batch
MAX_KEY_BYTES = 64
MAX_GROUP = 1023
MAX_HEADER_BYTES = 16 << 20
MAX_WAIT_MS = 60_000  # the longest an Await may be held
# TCP batches travel as several messages of about this many payload bytes, so one side
# processes a message while the next is on the wire.
PIPELINE_BYTES = 8 << 20
NAMESPACE_RE = re.compile(r"^[0-9A-Za-z_-][0-9A-Za-z_.-]{0,127}$")
REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII, no spaces


class _Req(msgspec.Struct, tag_field="op", kw_only=True):
    id: int = 0  # echoed in the reply so a client can drop stale replies
    token: str | None = None


class _Rep(msgspec.Struct, tag_field="op", kw_only=True):
    id: int = 0


# ---------------------------------------------------------------- items


class ItemMeta(msgspec.Struct, array_like=True):
    """One object to put: its payload is the next frame (TCP; the server computes the checksum)
    or is written into a reserved slot (shm; the client sends the checksum in `Commit`)."""

    group: int
    key: bytes
    size: int


class ItemRef(msgspec.Struct, array_like=True):
    """One object to get."""

    group: int
    key: bytes


class TailItem(msgspec.Struct, array_like=True):
    """One group's partial last chunk."""

    group: int
    size: int


class Found(msgspec.Struct, array_like=True):
    """An object in a reply: frame order (TCP) or an arena slice under a lease (shm)."""

    obj: int  # object id, for reporting a checksum mismatch
    size: int
    checksum: int
    lease: int = 0  # shm only: release after copying out
    offset: int = -1  # shm only: byte offset in the arena


class Slot(msgspec.Struct, array_like=True):
    """A reserved arena slice for the client to fill (shm put)."""

    lease: int
    offset: int
    size: int


# ---------------------------------------------------------------- requests


class Info(_Req, tag="info"):
    pass


class RegisterLayout(_Req, tag="register"):
    layout: KVLayout
    namespace: str | None = None


class Lookup(_Req, tag="lookup"):
    ns: str
    groups: list[int]
    keys: list[bytes]


class Put(_Req, tag="put"):
    ns: str
    items: list[ItemMeta]
    shm: str = ""  # nonce of the mapped arena; empty: payloads travel as frames
    generation: int | None = None  # the namespace's generation the save was planned in (see `Clear`)


class PutTail(_Req, tag="put_tail"):
    ns: str
    request_id: str
    items: list[TailItem]
    ttl_s: float | None = None
    shm: str = ""  # nonce of the mapped arena; empty: payloads travel as frames
    generation: int | None = None  # as for Put


class Commit(_Req, tag="commit"):
    """Second half of a shm put: the reserved slots are filled; checksums in slot order."""

    leases: list[int]
    checksums: list[int]


class Get(_Req, tag="get"):
    ns: str
    items: list[ItemRef]
    shm: str = ""  # nonce of the mapped arena; empty: payloads travel as frames


class GetTail(_Req, tag="get_tail"):
    ns: str
    request_id: str
    shm: str = ""  # nonce of the mapped arena; empty: payloads travel as frames


class DropTail(_Req, tag="drop_tail"):
    ns: str
    request_id: str


class Clear(_Req, tag="clear"):
    """Drop every object and tail of namespace `ns`, in memory and on disk (its KV no longer holds,
    e.g. the model's weights changed). Other namespaces are untouched.

    It also advances the namespace's generation (lookups report it). A put that names an older
    generation was planned before the clear, from KV that may be stale, and is refused: saves upload
    in the background, so one in flight at the clear would otherwise land after it."""

    ns: str


class Await(_Req, tag="await"):
    """Answer `Ready` once every item (and the tail, if named) is stored, or after `wait_ms`.

    A decode's load asks this while its producer may still be uploading: the store
    answers the moment the last object lands instead of the client polling.
    """

    ns: str
    items: list[ItemRef]
    tail_id: str | None = None
    wait_ms: int = 0


class Corrupt(msgspec.Struct, array_like=True):
    """A payload whose checksum did not match on the client; `obj` guards against removing a newer copy."""

    ns: str
    group: int
    key: bytes  # empty for a tail
    obj: int


class Release(_Req, tag="release"):
    """One-way (no reply): end shm read leases, report payloads whose checksum did not match."""

    leases: list[int] = []
    corrupt: list[Corrupt] = []


class Stats(_Req, tag="stats"):
    pass


Request = Union[
    Info, RegisterLayout, Lookup, Put, PutTail, Commit, Get, GetTail, DropTail, Clear, Await, Release, Stats
]

# ---------------------------------------------------------------- replies


class ServerInfo(_Rep, tag="info"):
    version: str
    protocol: int
    chunk_size: int
    l1_bytes: int
    max_object_bytes: int  # larger payloads are refused
    max_items: int = MAX_ITEMS
    shm_path: str | None = None  # the arena, for same-host clients
    shm_nonce: str | None = None  # proves the client mapped this server's arena
    shm_size: int = 0
    # identity: stores on different hosts may share a URL string (every node's tcp://127.0.0.1:5556)
    store_id: str = ""
    advertise_url: str | None = None  # where other hosts reach this store, when it knows


STALE_SHM = "stale_shm"  # the error code that makes a client map the server's arena again


class Error(_Rep, tag="error"):
    code: str  # "bad_request", "unauthorized", "conflict", "no_room", "stale_shm", "internal"
    message: str


class Ok(_Rep, tag="ok"):
    pass


class Registered(_Rep, tag="registered"):
    namespace: str


class Cleared(_Rep, tag="cleared"):
    objects: int  # objects and tails dropped
    generation: int  # the namespace's generation from now on


class LookupResult(_Rep, tag="lookup"):
    count: int
    generation: int = 0  # the namespace's, for the puts of saves planned now


class Stored(_Rep, tag="stored"):
    stored: list[bool]
    errors: list[str | None]  # why an item was refused


class Reserved(_Rep, tag="reserved"):
    """Per item: a slot to fill, or None with `stored` saying present (True) or refused (False)."""

    slots: list[Slot | None]
    stored: list[bool]
    errors: list[str | None]


class Loaded(_Rep, tag="loaded"):
    """Per item: found or None (miss); TCP payload frames follow in order of the found items.

    `retry` lists items that are stored (in L2) but found no unleased room in L1 this
    time: the client asks again for them after releasing what it just loaded.
    """

    items: list[Found | None]
    retry: list[int] = []  # in the last part
    first: int = 0  # index of items[0] in the request: a TCP reply comes in parts of ~PIPELINE_BYTES
    more: bool = False  # another part follows


class TailLoaded(_Rep, tag="tail"):
    groups: list[int]  # empty list with found=False: no such tail
    items: list[Found]
    found: bool = True


class Ready(_Rep, tag="ready"):
    """Per awaited item: stored now; `tail`: the named tail is complete (False when none was named);
    `tail_gone`: it was here and is gone (loaded by a consumer, dropped or expired), so it will not come."""

    present: list[bool]
    tail: bool = False
    tail_gone: bool = False

    def settled(self, tail_id: str | None) -> bool:
        """Nothing more worth waiting for: everything is there, or the tail named will not come."""
        return self.tail_gone or (all(self.present) and (tail_id is None or self.tail))


class StatsReply(_Rep, tag="stats"):
    stats: dict[str, float]


Reply = Union[
    ServerInfo, Error, Ok, Registered, Cleared, LookupResult, Stored, Reserved, Loaded, TailLoaded, Ready, StatsReply
]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> Request:
    """Raises msgspec.ValidationError / DecodeError on garbage or unknown ops."""
    if len(data) > MAX_HEADER_BYTES:
        raise msgspec.DecodeError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return _request_decoder.decode(data)


def decode_reply(data: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(data)


def split_by_bytes(sizes: Sequence[int], budget: int) -> list[range]:
    """Consecutive index ranges of at most `budget` bytes each (a larger item gets a range of its own).

    A batch is written under leases that pin its L1 space until committed; splitting
    keeps one big batch from pinning all of L1 (and lets earlier parts be evicted).
    """
    out: list[range] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > budget:
            out.append(range(start, i))
            start, acc = i, 0
        acc += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


class BadRequest(ValueError):
    """A well-formed message with values the server will not act on."""


def check_namespace(ns: str) -> None:
    if not NAMESPACE_RE.match(ns):
        raise BadRequest(f"invalid namespace {ns[:80]!r}: expected 1-128 of [0-9A-Za-z_.-]")


def check_items(n: int) -> None:
    if n > MAX_ITEMS:
        raise BadRequest(f"{n} items in one batch exceeds {MAX_ITEMS}")


def check_group(group: int) -> None:
    if not 0 <= group <= MAX_GROUP:
        raise BadRequest(f"object group {group} out of range 0..{MAX_GROUP}")


def check_key(key: bytes) -> None:
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise BadRequest(f"chunk key of {len(key)} bytes: expected 1..{MAX_KEY_BYTES}")


def check_request_id(request_id: str) -> None:
    if not REQUEST_ID_RE.match(request_id):
        raise BadRequest(f"invalid request id {request_id[:80]!r}: expected 1-256 printable ASCII characters")
