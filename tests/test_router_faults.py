"""Faults a client can cause, through a running router over the session's real engines.

- Requests the engines answer with a 5xx (vLLM 0.32 answers 500 to a
  `structured_outputs` that is not an object and to an astronomic `top_k`): the
  client gets the engine's error, and no worker is taken out, however often it is
  sent. Both engines of the session serve as workers of each pool, so each such
  request meets two workers.
- Bodies nested too deep (400, connection kept), sent too slowly (408, closed) or
  too large (413, closed), on bare sockets.
- Stream chunks of a token that ends inside a UTF-8 character (empty text) count as
  the first token: checked on chunks the engine really sends, then relayed by a
  router from a worker that holds the stream right after such a chunk.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import urllib.parse
from typing import Any, Iterator

import httpx
import pytest
from aiohttp import web

pytest.register_assert_rewrite("router_fixtures")  # it is imported here before pytest loads it as a plugin
from procs import Proc, free_port
from router_fixtures import API_KEY, Stack, chat_messages, metric, start_router

from pdserve.router.flow.relay import _has_token

pytest_plugins = ("router_fixtures",)
pytestmark = pytest.mark.engine

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# (route, fields) that vLLM 0.32 answers with a 500, more of them than --breaker-failures' default (3).
BAD_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"structured_outputs": "x"}),
    ("chat", {"top_k": 10**30}),
    ("completions", {"structured_outputs": ["x"], "stream": True}),
    ("chat", {"structured_outputs": "x"}),
    ("completions", {"top_k": 10**30}),
]


def _body(model: str, route: str, **fields: Any) -> dict[str, Any]:
    prompt = {"messages": chat_messages("hello there")} if route == "chat" else {"prompt": "hello there"}
    return {"model": model, "max_tokens": 4, **prompt, **fields}


def _post(base: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + PATHS[route], json=body, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def shared_routers(pd_stack: Stack) -> Iterator[tuple[Proc, Proc]]:
    """A P/D router and a decode-only router, each pool made of both engines; an open breaker would stay open."""
    p, d = pd_stack.prefill.url, pd_stack.decode.url
    common = ("--api-key", API_KEY, "--breaker-cooldown", "600")
    pd = start_router("--prefill", p, d, "--decode", d, p, "--pd-min-prompt-tokens", "0", *common)
    decode_only = start_router("--decode", d, p, *common)
    try:
        yield pd, decode_only
    finally:
        pd.stop()
        decode_only.stop()


def test_error_replies_reach_the_client_and_take_no_worker_out(
    pd_stack: Stack, shared_routers: tuple[Proc, Proc]
) -> None:
    pd, decode_only = shared_routers
    for route, fields in BAD_REQUESTS:
        body = _body(pd_stack.model, route, **fields)
        direct = _post(pd_stack.decode.url, route, body)
        assert direct.status_code >= 500, f"the engine no longer answers {fields} with a 5xx: {direct.text}"
        for router in (pd, decode_only):
            got = _post(router.url, route, body)
            assert got.status_code == direct.status_code
            assert got.json()["error"] == direct.json()["error"]
    # Each request met two workers of one pool (one retry), and every worker still takes requests.
    n = len(BAD_REQUESTS)
    assert metric(pd.url, "pdserve_router_retries_total", {"leg": "prefill"}) == n
    assert metric(pd.url, "pdserve_router_retries_total", {"leg": "decode"}) == 0
    assert metric(decode_only.url, "pdserve_router_retries_total", {"leg": "decode"}) == n
    assert metric(pd.url, "pdserve_router_worker_healthy") == 4
    assert metric(decode_only.url, "pdserve_router_worker_healthy") == 2
    for router in (pd, decode_only):
        for route in PATHS:
            ok = _post(router.url, route, _body(pd_stack.model, route))
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] == 4


# ---------------------------------------------------------------- bodies: depth, time, size

HEAD_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def guarded(pd_stack: Stack) -> Iterator[Proc]:
    proc = start_router("--decode", pd_stack.decode.url, "--api-key", API_KEY, "--header-timeout", str(HEAD_TIMEOUT_S),
                        "--body-timeout", str(BODY_TIMEOUT_S), "--max-request-bytes", "100000")
    try:
        yield proc
    finally:
        proc.stop()


def _connect(base: str) -> socket.socket:
    url = urllib.parse.urlsplit(base)
    return socket.create_connection((url.hostname, url.port), timeout=60)  # a hang fails the test, never blocks it


def _head(base: str, *lines: str) -> bytes:
    url = urllib.parse.urlsplit(base)
    head = ["POST /v1/completions HTTP/1.1", f"Host: {url.netloc}", f"Authorization: Bearer {API_KEY}",
            "Content-Type: application/json", *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, str | None, dict[str, Any]]:
    """Status, Connection header and JSON body of the next response on `sock`."""
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, resp.getheader("connection"), json.loads(resp.read())


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_deeply_nested_json_is_a_400_and_the_connection_stays_usable(pd_stack: Stack, guarded: Proc) -> None:
    url = urllib.parse.urlsplit(guarded.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    for depth in (200, 5000):  # under and over the depth where decoding JSON would recurse too deep
        deep = b"[" * depth + b"]" * depth
        nested = b'{"model": "%s", "prompt": "x", "metadata": %s}' % (pd_stack.model.encode(), deep)
        conn.request("POST", "/v1/completions", body=nested, headers=AUTH)
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        assert resp.status == 400 and err["code"] == 400 and err["type"] == "BadRequestError"
        assert "nested" in err["message"]
        assert not resp.will_close
    sock = conn.sock
    conn.request("POST", "/v1/completions", body=json.dumps(_body(pd_stack.model, "completions")), headers=AUTH)
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["choices"]
    assert conn.sock is sock  # the same keep-alive connection served all three
    conn.close()


def test_a_body_that_stops_coming_gets_408_and_the_connection_is_closed(guarded: Proc) -> None:
    sock = _connect(guarded.url)
    sock.sendall(_head(guarded.url, "Content-Length: 1000") + b'{"prompt": "only the start')
    status, connection, body = _response(sock)
    assert status == 408 and connection == "close"
    assert body["error"]["code"] == 408 and f"{BODY_TIMEOUT_S} s" in body["error"]["message"]
    assert _closed_by_peer(sock)
    sock.close()
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200


def test_a_request_head_that_does_not_come_gets_the_connection_closed(guarded: Proc) -> None:
    silent = _connect(guarded.url)  # connects and sends nothing
    assert _closed_by_peer(silent)
    silent.close()
    partial = _connect(guarded.url)
    partial.sendall(_head(guarded.url)[:40])  # the request line and part of a header, then nothing
    assert _closed_by_peer(partial)
    partial.close()


def test_an_answer_given_before_the_body_arrived_closes_the_connection(guarded: Proc) -> None:
    """A 401 is answered without reading the body; the rest of it must not keep the connection."""
    sock = _connect(guarded.url)
    head = _head(guarded.url, "Content-Length: 1000").replace(f"Authorization: Bearer {API_KEY}\r\n".encode(), b"")
    sock.sendall(head + b'{"prompt": ')
    status, connection, body = _response(sock)
    assert status == 401 and connection == "close" and body["error"]["code"] == 401
    assert _closed_by_peer(sock)
    sock.close()


def test_a_body_over_the_limit_gets_413_and_the_connection_is_closed(guarded: Proc) -> None:
    declared = _connect(guarded.url)  # the length alone decides: no body byte is sent
    declared.sendall(_head(guarded.url, "Content-Length: 10000000"))
    status, connection, body = _response(declared)
    assert status == 413 and connection == "close"
    assert body["error"]["code"] == 413 and body["error"]["type"] == "RequestTooLargeError"
    assert _closed_by_peer(declared)
    declared.close()

    chunked = _connect(guarded.url)  # no length: counted as it arrives, refused once over
    chunk = b"x" * 150_000
    chunked.sendall(_head(guarded.url, "Transfer-Encoding: chunked") + b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    status, connection, body = _response(chunked)
    assert status == 413 and connection == "close" and body["error"]["code"] == 413
    assert _closed_by_peer(chunked)
    chunked.close()


# ---------------------------------------------------------------- tokens that split UTF-8 characters


def _stream_events(base: str, route: str, body: dict[str, Any]) -> list[bytes]:
    """The SSE events of one stream, each as the bytes the router's relay would see."""
    with httpx.stream("POST", base + PATHS[route], json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        text = r.read()
    return [event + b"\n\n" for event in text.split(b"\n\n") if event.startswith(b"data: {")]


def _text(route: str, event: bytes) -> str | None:
    choice = json.loads(event[len(b"data: "):])["choices"][0]
    return choice["text"] if route == "completions" else choice["delta"].get("content")


def _split_utf8_stream(stack: Stack, route: str) -> tuple[list[bytes], int]:
    """A real stream with a chunk of empty text mid-way (the engine's byte-level tokens split characters)."""
    for seed in range(20):
        body = _body(stack.model, route, max_tokens=48, temperature=1.0, seed=seed, ignore_eos=True)
        events = _stream_events(stack.decode.url, route, body)
        first = 1 if route == "chat" else 0  # after chat's role announcement
        for i in range(first + 1, len(events) - 1):
            if _text(route, events[i]) == "":
                return events, i
    raise AssertionError(f"no {route} stream of the tiny model had an empty-text chunk")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_chunks_of_tokens_that_end_inside_a_character_are_tokens(pd_stack: Stack, route: str) -> None:
    events, _ = _split_utf8_stream(pd_stack, route)
    empty = [e for e in events if _text(route, e) == ""]
    if route == "chat":
        role, empty = empty[0], empty[1:]
        assert b'"role"' in role and not _has_token("chat", role)
    assert empty
    assert all(_has_token(route, e) for e in empty)  # type: ignore[arg-type]


class HoldingWorker:
    """A worker that streams recorded engine events up to a point, then holds the stream until released.

    It answers /health and /v1/models so a router takes it into its decode pool.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.release = threading.Event()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "stub worker did not start"

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub", "object": "model"}]})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in self.before:
            await resp.write(event)
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 120)
        for event in self.after:
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        for path in PATHS.values():
            app.router.add_post(path, self._stream)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def close(self) -> None:
        self.release.set()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_first_token_of_empty_text_is_relayed_at_once(pd_stack: Stack, route: str) -> None:
    """The worker sends real chunks up to an empty-text token and then waits for the client to have
    seen that token; a router that held such a chunk back would leave both waiting."""
    events, i = _split_utf8_stream(pd_stack, route)
    first = 1 if route == "chat" else 0
    worker = HoldingWorker()
    worker.before = events[:first] + [events[i]]  # chat: the role announcement, then the empty token
    worker.after = events[i + 1:]
    router = start_router("--decode", worker.url)
    try:
        body = _body("stub", route)
        with httpx.stream("POST", router.url + PATHS[route], json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen: list[str] = []
            while len(seen) < len(worker.before):  # a router that holds the chunk back times out here
                line = next(lines)
                if line.startswith("data: "):
                    seen.append(line)
            assert seen[-1].encode() + b"\n\n" == events[i]
            worker.release.set()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert [s.encode() + b"\n\n" for s in rest[:-1]] == events[i + 1:]
    finally:
        router.stop()
        worker.close()
