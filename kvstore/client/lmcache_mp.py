"""The few calls pdserve makes to an LMCache MP server (`lmcache server`), in its own wire format.

LMCache's MP server speaks msgpack over a ZMQ ROUTER socket: a request is the frames
[request uid, operation, payload...], each one msgpack; the reply is [uid, operation,
response] (no response frame when the answer is None). Operations go by the integer ids
LMCache 0.5.3 sends (its RequestType enum) and 0.5.6 still accepts (its legacy id table),
so one client serves both. Nothing here imports lmcache, and every reply is decoded into
a declared type (int or None): no pickle crosses the wire. (LMCache's engine-driven copy
path does pickle KV tensors between an engine and its server; pdserve's workers ask for
the server-driven path, and the router never touches KV bytes.)

What pdserve asks for:
- `chunk_size()`: the server's --chunk-size (a worker needs it for
  --prefix-cache-retention-interval);
- `prefix_tokens()`: how much of a prompt the server holds, for the router's
  conditional disaggregation and prefix-aware routing. LMCache has no side-effect-free
  lookup: LOOKUP read-locks the hit chunks (and prefetches any from L2 into L1) under a
  session, so the call always frees those locks and ends the session afterwards, under a
  request id of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, Sequence

import msgspec
import zmq
import zmq.asyncio

# LMCache's operation ids (0.5.3 RequestType values; 0.5.6 LEGACY_OPERATION_IDS).
OP_LOOKUP = 8
OP_WAIT_PREFETCH_STATUS = 10
OP_FREE_LOOKUP_LOCKS = 12
OP_END_SESSION = 13
OP_GET_CHUNK_SIZE = 21

DEFAULT_TIMEOUT_S = 0.5
# How long the server may take to finish a lookup's prefetch before we stop waiting for it.
PREFETCH_WAIT_S = 0.2


class LMCacheError(RuntimeError):
    """The LMCache server did not answer in time, could not be reached, or answered nonsense."""


class LMCacheKey(msgspec.Struct, frozen=True):
    """What an LMCache server keys a model's chunks by, as the engine's connector registers it:
    vLLM's --model (the model path or name, not the served name) and the KV world size."""

    model_name: str
    world_size: int = 1


def parse_url(url: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (HOST, PORT), with a clear error for anything else."""
    rest = url.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not url.startswith("tcp://") or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"LMCache URL must look like tcp://HOST:PORT, got {url!r}")
    return host, int(port)


def _key(key: LMCacheKey, token_ids: Sequence[int], end: int, request_id: str, salt: str) -> dict[str, Any]:
    """LMCache's IPCCacheServerKey as the msgpack map it decodes (fields by name; a server that
    does not know a field, such as 0.5.3 and num_kv_readers, ignores it)."""
    return {
        "model_name": key.model_name, "world_size": key.world_size, "worker_id": None,
        "token_ids": list(token_ids[:end]), "start": 0, "end": end, "request_id": request_id,
        "cache_salt": salt, "request_configs": None, "num_kv_readers": 1,
    }


class AsyncLMCacheClient:
    """One DEALER socket to one LMCache server, for one event loop; calls are serialised."""

    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        parse_url(url)
        self.url = url
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._uids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._chunk: int | None = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.url)
        return self._sock

    def _reset(self) -> None:
        """After a timeout: a late reply must never be taken for the next call's."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def call(self, op: int, *payloads: Any, reply: Any = None, timeout_s: float | None = None) -> Any:
        async with self._lock:
            uid = next(self._uids)
            sock = self._socket()
            await sock.send_multipart([msgspec.msgpack.encode(uid), msgspec.msgpack.encode(op),
                                       *(msgspec.msgpack.encode(p) for p in payloads)])
            deadline = asyncio.get_running_loop().time() + (timeout_s or self.timeout_s)
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or not await sock.poll(timeout=int(left * 1000) + 1):
                    self._reset()
                    raise LMCacheError(f"LMCache server {self.url} did not answer operation {op} in time")
                frames = await sock.recv_multipart()
                try:
                    if len(frames) < 2 or msgspec.msgpack.decode(frames[0], type=int) != uid:
                        continue  # a reply to a call that timed out earlier on this socket
                    return msgspec.msgpack.decode(frames[2], type=reply or type(None)) if len(frames) > 2 else None
                except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
                    raise LMCacheError(f"LMCache server {self.url} answered operation {op} with {exc}") from exc

    async def chunk_size(self) -> int:
        if self._chunk is None:
            chunk = await self.call(OP_GET_CHUNK_SIZE, reply=int)
            if not isinstance(chunk, int) or chunk <= 0:
                raise LMCacheError(f"LMCache server {self.url} reports chunk size {chunk!r}")
            self._chunk = chunk
        return self._chunk

    async def prefix_tokens(self, key: LMCacheKey, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Leading prompt tokens the server holds (whole chunks only; it never stores a partial one)."""
        chunk = await self.chunk_size()
        end = len(token_ids) // chunk * chunk
        if end == 0:
            return 0
        request_id = f"pdserve-router-{uuid.uuid4().hex}"
        wire_key = _key(key, token_ids, end, request_id, salt or "")
        await self.call(OP_LOOKUP, wire_key, 1)
        found = await self.call(OP_WAIT_PREFETCH_STATUS, request_id, PREFETCH_WAIT_S, reply=int | None,
                                timeout_s=self.timeout_s + PREFETCH_WAIT_S)
        # Unlock what the lookup locked (while its prefetch still runs the server holds those
        # locks back and they expire by its read-lock TTL), then drop the session. A server that
        # stopped answering half-way keeps them until those TTLs too. With no hit nothing is
        # locked, and the server cannot even resolve the keys of a model no engine registered
        # yet (it answers nothing), so there is nothing to free.
        if found:
            await self.call(OP_FREE_LOOKUP_LOCKS, {**wire_key, "end": int(found) * chunk}, 1)
        await self.call(OP_END_SESSION, request_id)
        return min(int(found or 0) * chunk, end)

    def close(self) -> None:
        self._reset()


def chunk_size(url: str, timeout_s: float = 5.0) -> int:
    """The server's chunk size, from blocking code (a worker before it starts vLLM)."""

    async def ask() -> int:
        client = AsyncLMCacheClient(url, timeout_s)
        try:
            return await client.chunk_size()
        finally:
            client.close()

    return asyncio.run(ask())
