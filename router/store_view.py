"""What the router asks of the KV store: prefix lookups for routing, and dropping tails.

The router learns each store's namespace and chunk size from the prefill responses'
`kv_transfer_params` (the connector puts them there), so it needs no model or layout
knowledge of its own. Every call is bounded and best-effort: a store that is down or
slow makes the router route without prefix information (and leave a tail to expire
by its TTL), never fail or stall a request.

The URL is the store's advertised one, and the params name the store's id: a store
that answers at that URL under another id (every host's store may be
tcp://127.0.0.1:5556, and the router's host has one too) is not asked for a prefix
it never saw.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.kvstore.client.keys import chunk_keys

if TYPE_CHECKING:
    from pdserve.kvstore.client.client import AsyncKVStoreClient

log = logging.getLogger("pdserve.router.store_view")

STORE_CALL_TIMEOUT_S = 0.5
# How long a store's id, once checked at its URL, is trusted without asking again. Asking is a round trip
# in front of every P/D request's first call; a store replaced at that URL meanwhile (a restart) is noticed
# within this long, and until then only gives a prefix hint of 0 (a fresh store holds nothing).
STORE_ID_TRUST_S = 1.0


class StoreLayout(msgspec.Struct, frozen=True):
    namespace: str
    chunk_size: int
    groups: tuple[int, ...]
    store_id: str | None = None  # the id the store announced to its producer


class StoreView:
    def __init__(self, auth_token: str | None = None, id_trust_s: float = STORE_ID_TRUST_S) -> None:
        self.auth_token = auth_token
        self.id_trust_s = id_trust_s
        self.layouts: dict[str, StoreLayout] = {}
        self._clients: dict[str, AsyncKVStoreClient] = {}
        self._id_checked: dict[str, float] = {}  # URL -> when its store last answered with the layout's id

    def _client(self, url: str) -> AsyncKVStoreClient:
        client = self._clients.get(url)
        if client is None:
            # Imported here: a router without P/D traffic never loads the store client (zmq).
            from pdserve.kvstore.client.client import AsyncKVStoreClient

            # Lookups and tail drops carry no payload, so no shared-memory arena is mapped.
            client = self._clients[url] = AsyncKVStoreClient(
                url, auth_token=self.auth_token, timeout_s=STORE_CALL_TIMEOUT_S, shm=False
            )
        return client

    def learn(self, params: dict[str, Any]) -> str | None:
        """Remember the layout a prefill response advertises; returns its store URL."""
        url, ns, chunk = params.get("kvstore_url"), params.get("namespace"), params.get("chunk_size")
        if not (isinstance(url, str) and isinstance(ns, str) and isinstance(chunk, int) and chunk > 0):
            return None
        groups, store_id = params.get("groups"), params.get("kvstore_id")
        layout = StoreLayout(
            ns, chunk, tuple(groups) if isinstance(groups, list) and groups else (0,),
            store_id if isinstance(store_id, str) and store_id else None,
        )
        if self.layouts.get(url) != layout:
            self.layouts[url] = layout
            self._id_checked.pop(url, None)
            log.info("learned KV store %s (%s): namespace %s, chunk %d tokens", url, layout.store_id, ns, chunk)
        return url

    async def _lookup(self, url: str, layout: StoreLayout, token_ids: list[int], salt: str | None,
                      adapter: str | None) -> int:
        keys = chunk_keys(layout.namespace, token_ids, layout.chunk_size, salt, adapter)
        if not keys:
            return 0
        client = self._client(url)
        try:
            if layout.store_id is not None and not await self._is_announced(url, client, layout.store_id):
                return 0
            found = await client.lookup(layout.namespace, keys, list(layout.groups))
        except Exception as exc:  # any store failure only costs the routing hint
            self._id_checked.pop(url, None)
            log.debug("store lookup at %s failed: %s", url, exc)
            return 0
        return int(found) * layout.chunk_size

    async def _is_announced(self, url: str, client: "AsyncKVStoreClient", store_id: str) -> bool:
        """Whether the store at `url` is the one announced under `store_id` (asked at most every id_trust_s)."""
        now = time.monotonic()
        if now - self._id_checked.get(url, -math.inf) < self.id_trust_s:
            return True
        found_id = (await client.info()).store_id
        if found_id != store_id:
            self._id_checked.pop(url, None)
            log.debug("store at %s is %s, not %s: no prefix hint from it", url, found_id, store_id)
            return False
        self._id_checked[url] = now
        return True

    async def prefix_tokens(self, token_ids: list[int], salt: str | None, adapter: str | None = None) -> dict[str, int]:
        """Prompt tokens already stored, per known store URL (0 for a store that did not answer)."""
        urls = list(self.layouts)
        counts = await asyncio.gather(*(self._lookup(u, self.layouts[u], token_ids, salt, adapter) for u in urls))
        return dict(zip(urls, counts))

    async def drop_tail(self, params: dict[str, Any]) -> None:
        """Free the partial last chunk a prefill left for a decode that will never come."""
        url, ns, tail = params.get("kvstore_url"), params.get("namespace"), params.get("tail_id")
        if not (isinstance(url, str) and isinstance(ns, str) and isinstance(tail, str)):
            return
        try:
            await self._client(url).drop_tail(ns, tail)
            log.debug("dropped tail %s at %s", tail, url)
        except Exception as exc:
            log.warning("could not drop tail %s at %s (it expires by TTL): %s", tail, url, exc)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
