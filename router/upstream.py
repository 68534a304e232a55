"""The router's HTTP client for its side requests to workers, and how failures talking to workers are classified.

The legs of a request go through worker_http.py, which raises the same aiohttp exception
types; health checks, /v1/models, /tokenize, /metrics scrapes and store calls use this
aiohttp session. aiohttp rather than httpx: on this project's machines an httpx request
costs about 4x the CPU of an aiohttp one (measured against a local server: 1.7 vs 0.4 ms
a streamed request).
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

# Everything a request to a worker can raise that means "this worker failed us".
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)
# ... and, for a side request whose JSON answer the router reads (health, /v1/models, /tokenize), an
# answer it cannot read (not JSON, or JSON of another shape).
SIDE_REQUEST_ERRORS: tuple[type[BaseException], ...] = (*UPSTREAM_ERRORS, msgspec.DecodeError, AttributeError)


def new_session() -> aiohttp.ClientSession:
    """One pooled session for all workers; admission is bounded by the pools, so no connection cap here."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0, enable_cleanup_closed=True),
        trust_env=False,  # a proxy from the environment must never sit between router and workers
    )


def is_hard_failure(exc: BaseException) -> bool:
    """True when the worker is unreachable or died (refused, reset, cut off), not merely slow."""
    if isinstance(exc, asyncio.TimeoutError):
        return False
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
