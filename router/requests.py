"""Checks on a client's request before any worker sees it.

Only what the router itself depends on is checked here: the body's size and how
long it takes to arrive, that it is a JSON object nested no deeper than
`MAX_NESTING`, and the types of the fields the router reads or rewrites for the
prefill leg. A wrong type there would otherwise surface only at the decode leg,
after a wasted prefill; everything else is left to vLLM, whose 400s pass through.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Iterable, Literal, TypeGuard

import msgspec
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from pdserve.router.errors import RouterError

# The two completion APIs the router serves, and where a worker serves each.
Route = Literal["chat", "completions"]
PATHS: dict[Route, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of")
# Deeper bodies are refused: far deeper than any real request (tool schemas included), and far enough
# below Python's recursion limit that re-encoding the body or rendering a chat template cannot hit it.
MAX_NESTING = 128
# `n` and `best_of` fan one request out into that many sequences in the engine: a bound keeps one
# request from holding a worker for minutes (vLLM itself takes any n).
MAX_CHOICES = 128
_TOO_DEEP = f"request body is nested more than {MAX_NESTING} levels deep"


@dataclass
class RequestHead:
    """The headers a completion request is served by, found in one pass over the ASGI scope's list
    (names are lowercase there): cheaper than Starlette's Request and Headers, built per request."""

    content_length: bytes | None = None
    chunked: bool = False  # a transfer-encoding was sent: a body of unknown length follows
    authorization: bytes = b""
    request_id: bytes = b""  # the client's X-Request-Id, if any

    @classmethod
    def of(cls, headers: Iterable[tuple[bytes, bytes]]) -> "RequestHead":
        head = cls()
        for name, value in headers:
            if name == b"content-length":
                head.content_length = value
            elif name == b"transfer-encoding":
                head.chunked = True
            elif name == b"authorization":
                head.authorization = value
            elif name == b"x-request-id":
                head.request_id = value
        return head

    @property
    def has_body(self) -> bool:
        return (self.content_length is not None and self.content_length != b"0") or self.chunked


async def read_body(receive: Receive, head: RequestHead, limit: int, timeout: float) -> bytes:
    """The request body: over `limit` bytes is a 413 without reading it all, slower than `timeout` s a 408.
    A client that hangs up first raises ClientDisconnect."""
    declared = head.content_length
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RouterError(413, f"request body of {declared.decode()} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):  # a deadline for the whole body: a trickle of bytes must not reset it
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    raise ClientDisconnect()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise RouterError(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise RouterError(408, f"request body not received within {timeout:g} s") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _deeper_than(body: Any, limit: int) -> bool:
    """True when containers nest more than `limit` levels deep (iterative: deep input must not recurse here)."""
    stack = [(body, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > limit:
            return True
        children = obj.values() if isinstance(obj, dict) else obj
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def token_ids(value: Any) -> TypeGuard[list[int]]:
    """True for a non-empty list of plain ints (a bool is not a token id). The check runs at C speed
    (types mapped into a set): a prompt may hold a million ids, and this runs on the event loop, where
    a generator over them took 0.17 s per pass for 1.9M ids on the 2-core VM."""
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str) or token_ids(prompt):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    kinds = set(map(type, prompt))
    return kinds == {str} or (kinds == {list} and all(map(token_ids, prompt)))


def validate(route: Route, raw: bytes) -> dict[str, Any]:
    """The parsed body, or a 400 that names the offending field."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RouterError(400, _TOO_DEEP) from None
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object")
    # Every container opens with a bracket, so few brackets (strings' included) cannot nest deep: no walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and _deeper_than(body, MAX_NESTING):
        raise RouterError(400, _TOO_DEEP)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RouterError(400, "`model` must be a string", param="model")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise RouterError(400, "`stream` must be a boolean", param="stream")
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and (type(value) is not int or value < 0):
            raise RouterError(400, f"`{name}` must be a non-negative integer", param=name)
    for name in ("n", "best_of"):
        if (body.get(name) or 0) > MAX_CHOICES:
            raise RouterError(400, f"`{name}` must be at most {MAX_CHOICES}", param=name)
    # The handoff between the legs is the router's: a client's own would make a prefill worker hold
    # KV for nobody, or a decode worker wait on (or fetch from) a store the client names.
    if "kv_transfer_params" in body:
        raise RouterError(400, "`kv_transfer_params` is set by the router, not by clients", param="kv_transfer_params")
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RouterError(400, "`messages` must be a non-empty list of message objects", param="messages")
    elif not _is_prompt(body.get("prompt")):
        raise RouterError(
            400, "`prompt` must be a string, a list of strings, or (lists of) token ids", param="prompt"
        )
    return body
