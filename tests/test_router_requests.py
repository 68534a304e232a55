"""Unit tests of router/requests.py: body deadline, size limit and nesting depth.

The HTTP-level behaviour (a 408/413 answered on a real socket, then the connection
closed) is tested through a running router in test_router_faults.py; here read_body
is fed by a hand-written ASGI receive, which is the one way to make a body arrive as
slowly as a test wants.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from starlette.requests import ClientDisconnect

from pdserve.router.errors import RouterError
from pdserve.router.requests import MAX_NESTING, RequestHead, read_body, validate

NO_HEAD = RequestHead.of([])


def _trickle(byte_every_s: float) -> Any:
    """A client that sends one byte at a time, forever: each byte alone would reset an idle timer."""

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(byte_every_s)
        return {"type": "http.request", "body": b"{", "more_body": True}

    return receive


async def test_a_body_that_trickles_in_gets_408_when_the_deadline_passes() -> None:
    with pytest.raises(RouterError) as exc:
        await read_body(_trickle(0.01), NO_HEAD, limit=1 << 20, timeout=0.2)
    assert exc.value.status == 408
    assert msgspec.json.decode(exc.value.body())["error"]["code"] == 408


async def test_a_chunked_body_over_the_limit_gets_413_before_it_is_all_read() -> None:
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        sent += 1
        return {"type": "http.request", "body": b"x" * 600, "more_body": True}  # never ends

    with pytest.raises(RouterError) as exc:
        await read_body(receive, NO_HEAD, limit=1000, timeout=30.0)
    assert exc.value.status == 413
    assert sent == 2


async def test_a_declared_length_over_the_limit_gets_413_without_reading() -> None:
    async def receive() -> dict[str, Any]:
        raise AssertionError("the body must not be read")

    with pytest.raises(RouterError) as exc:
        await read_body(receive, RequestHead.of([(b"content-length", b"5000")]), limit=1000, timeout=30.0)
    assert exc.value.status == 413


async def test_a_body_in_time_and_size_is_returned_whole() -> None:
    parts = [b'{"prompt":', b' "x"}']

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    assert await read_body(receive, NO_HEAD, limit=1000, timeout=30.0) == b'{"prompt": "x"}'


async def test_a_client_that_hangs_up_mid_body_is_a_disconnect() -> None:
    messages = [{"type": "http.request", "body": b'{"prompt":', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    with pytest.raises(ClientDisconnect):
        await read_body(receive, NO_HEAD, limit=1000, timeout=30.0)


def test_the_request_head_is_read_in_one_pass_and_knows_when_a_body_follows() -> None:
    head = RequestHead.of([(b"content-length", b"12"), (b"authorization", b"Bearer k"), (b"x-request-id", b"abc"),
                           (b"accept", b"*/*")])
    assert (head.content_length, head.authorization, head.request_id, head.has_body) == (b"12", b"Bearer k", b"abc", True)
    assert not RequestHead.of([(b"content-length", b"0")]).has_body
    assert not NO_HEAD.has_body
    assert RequestHead.of([(b"transfer-encoding", b"chunked")]).has_body


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
