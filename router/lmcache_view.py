"""The router's prefix view of LMCache servers: how much of a prompt each already holds.

The counterpart of store_view.py for workers on the LMCache backend. Such a worker's
Redis record names its LMCache server (`kvstore_url`) and what the server keys the
model's chunks by (`lmcache_key`); LMCache's connector says nothing in a response's
kv_transfer_params, so workers known only by static URLs give no prefix hint. The answer
has the same shape as StoreView.prefix_tokens (prompt tokens per URL), so conditional
disaggregation and the prefix-aware policy read both alike.

After a prefill on such a worker, `wait_stored` holds the decode leg until the worker's
LMCache server has every full chunk of the prompt (LMCache's connector stores them after
the engine has answered), for at most STORE_WAIT_S: the decode engine looks its prompt up
once, and what it misses then it recomputes. The partial last chunk is never stored; the
decode engine recomputes it.

Every call is bounded and best-effort: a server that does not answer within the timeout
is left alone for DOWN_S, and routing goes on without its hint. A lookup takes and frees
read locks in the server (see kvstore/client/lmcache_mp.py); no KV bytes move.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from pdserve.kvstore.client.lmcache_mp import AsyncLMCacheClient, LMCacheError, LMCacheKey
from pdserve.router.pool import Worker

log = logging.getLogger("pdserve.router.lmcache_view")

LMCACHE_CALL_TIMEOUT_S = 0.5
DOWN_S = 5.0  # after a failed lookup, how long a server gets no more
STORE_WAIT_S = 1.0  # at most this long after a prefill for its chunks to land
STORE_POLL_S = 0.005


class LMCacheView:
    def __init__(self) -> None:
        self._clients: dict[str, AsyncLMCacheClient] = {}
        self._down_until: dict[str, float] = {}

    @staticmethod
    def servers(workers: Sequence[Worker]) -> dict[str, LMCacheKey]:
        """LMCache server URL -> key, for the workers on that backend (one key per server and model)."""
        return {w.kvstore_url: w.lmcache_key for w in workers
                if w.kv_backend == "lmcache" and w.kvstore_url and w.lmcache_key is not None}

    def _client(self, url: str) -> AsyncLMCacheClient:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = AsyncLMCacheClient(url, LMCACHE_CALL_TIMEOUT_S)
        return client

    def _down(self, url: str) -> bool:
        return time.monotonic() < self._down_until.get(url, 0.0)

    def _failed(self, url: str, exc: LMCacheError) -> None:
        self._down_until[url] = time.monotonic() + DOWN_S
        log.warning("LMCache at %s failed (no prefix hints from it for %.0f s): %s", url, DOWN_S, exc)

    async def _lookup(self, url: str, key: LMCacheKey, token_ids: list[int], salt: str | None) -> int:
        if self._down(url):
            return 0
        try:
            return await self._client(url).prefix_tokens(key, token_ids, salt)
        except LMCacheError as exc:  # any server failure only costs the routing hint
            self._failed(url, exc)
            return 0

    async def prefix_tokens(self, workers: Sequence[Worker], token_ids: list[int], salt: str | None) -> dict[str, int]:
        """Prompt tokens already held, per LMCache server URL of `workers` (0 for one that did not answer)."""
        servers = self.servers(workers)
        counts = await asyncio.gather(*(self._lookup(u, k, token_ids, salt) for u, k in servers.items()))
        return dict(zip(servers, counts))

    async def wait_stored(self, worker: Worker, token_ids: list[int] | None, salt: Any) -> int:
        """After `worker` answered a prefill: wait (bounded) until its LMCache server holds the prompt's
        full chunks. Returns the prompt tokens it holds (0 when the worker is not on LMCache)."""
        url, key = worker.kvstore_url, worker.lmcache_key
        if worker.kv_backend != "lmcache" or url is None or key is None or not token_ids or self._down(url):
            return 0
        try:
            chunk = await self._client(url).chunk_size()
        except LMCacheError as exc:
            self._failed(url, exc)
            return 0
        want = len(token_ids) // chunk * chunk
        salt = salt if isinstance(salt, str) else None
        deadline = time.monotonic() + STORE_WAIT_S
        while True:
            held = await self._lookup(url, key, token_ids, salt)
            if held >= want or self._down(url):
                return held
            if time.monotonic() >= deadline:
                log.info("LMCache at %s holds %d of %d prompt tokens %.1f s after the prefill; decoding anyway",
                         url, held, want, STORE_WAIT_S)
                return held
            await asyncio.sleep(STORE_POLL_S)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

