"""Unit tests of router/requests.py: body deadline, size limit and nesting depth.

The HTTP-level behaviour (a 408/413 answered on a real socket, then the connection
closed) is tested through a running router in test_router_faults.py; here a
starlette Request is fed by a hand-written ASGI receive, which is the one way to
make a body arrive as slowly as a test wants.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from starlette.requests import Request

from pdserve.router.errors import RouterError
from pdserve.router.requests import MAX_NESTING, read_body, validate


def _request(receive: Any, headers: list[tuple[bytes, bytes]] = ()) -> Request:  # type: ignore[assignment]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)}
    return Request(scope, receive)


def _trickle(byte_every_s: float) -> Any:
    """A client that sends one byte at a time, forever: each byte alone would reset an idle timer."""

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(byte_every_s)
        return {"type": "http.request", "body": b"{", "more_body": True}

    return receive


async def test_a_body_that_trickles_in_gets_408_when_the_deadline_passes() -> None:
    with pytest.raises(RouterError) as exc:
        await read_body(_request(_trickle(0.01)), limit=1 << 20, timeout=0.2)
    assert exc.value.status == 408
    assert msgspec.json.decode(exc.value.body())["error"]["code"] == 408


async def test_a_chunked_body_over_the_limit_gets_413_before_it_is_all_read() -> None:
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        sent += 1
        return {"type": "http.request", "body": b"x" * 600, "more_body": True}  # never ends

    with pytest.raises(RouterError) as exc:
        await read_body(_request(receive), limit=1000, timeout=30.0)
    assert exc.value.status == 413
    assert sent == 2


async def test_a_declared_length_over_the_limit_gets_413_without_reading() -> None:
    async def receive() -> dict[str, Any]:
        raise AssertionError("the body must not be read")

    with pytest.raises(RouterError) as exc:
        await read_body(_request(receive, [(b"content-length", b"5000")]), limit=1000, timeout=30.0)
    assert exc.value.status == 413


async def test_a_body_in_time_and_size_is_returned_whole() -> None:
    parts = [b'{"prompt":', b' "x"}']

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    assert await read_body(_request(receive), limit=1000, timeout=30.0) == b'{"prompt": "x"}'


def _nested(depth: int) -> bytes:
    """A completions body whose deepest value sits `depth` containers down (the body object is one)."""
    return b'{"prompt": "x", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 900, 100_000], ids=["just-over", "deep", "beyond-recursion"])
def test_bodies_nested_too_deep_are_a_400(depth: int) -> None:
    with pytest.raises(RouterError) as exc:
        validate("completions", _nested(depth))
    assert exc.value.status == 400
    assert f"more than {MAX_NESTING} levels" in exc.value.message


def test_nesting_up_to_the_limit_and_brackets_inside_strings_pass() -> None:
    assert validate("completions", _nested(MAX_NESTING))["prompt"] == "x"
    body = validate("completions", msgspec.json.encode({"prompt": "[{" * 5000, "tools": [{"a": [1, {"b": 2}]}] * 300}))
    assert len(body["tools"]) == 300
