"""A decode worker that stops listening while it holds streams open without another byte (fast tier).

A server half-way through shutting down stops listening and can then hold a stream open with no
limit (a kill -9 probe of a worker's process group once left six streams waiting 90 s for bytes
that never came); the router's client would wait for the decode timeout (ten minutes). The router's health check finds nothing listening on the worker's
port and ends what it has open there (router/health.py, worker_http.py `cut`): a stream that
already showed a token ends with an OpenAI error event, one that had not is retried on the other
decode worker and answered in full. A real `pdserve router` over two raw-socket stub workers (the
test needs to close a listener while its connections stay open, which aiohttp's server does not
offer)."""

from __future__ import annotations

import asyncio
import json

import httptools
import httpx

from router_fixtures import metric, start_router

BODY = {"model": "stub", "prompt": [5, 6, 7, 8], "max_tokens": 2, "stream": True}
CLIENT_TIMEOUT_S = 30.0  # far below the router's decode timeout (600 s): a stream the router left open fails here
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _token(text: str, finish: str | None = None) -> bytes:
    event = {"id": "c", "object": "text_completion", "model": "stub",
             "choices": [{"index": 0, "text": text, "token_ids": [9], "finish_reason": finish}]}
    return _chunk(b"data: " + json.dumps(event).encode() + b"\n\n")


FULL = STREAM_HEAD + _token("a") + _token("b", "length") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class Legs:
    """What both stubs share: the first decode leg, wherever it lands, gets the stream's head and `hold`,
    then nothing more; later legs are answered in full."""

    def __init__(self, hold: bytes) -> None:
        self.hold = hold
        self.count = 0
        self.holder: Stub | None = None
        self.holding = asyncio.Event()


class Stub:
    """A decode worker on loopback whose listener can close while its connections stay open."""

    def __init__(self, legs: Legs) -> None:
        self.legs = legs
        self.served = 0
        self.server: asyncio.Server | None = None
        self.conns: set[_Conn] = set()

    async def start(self) -> str:
        self.server = await asyncio.get_running_loop().create_server(lambda: _Conn(self), "127.0.0.1", 0)
        return "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        """What a shutting-down uvicorn does: new connections are refused, idle keep-alive ones closed,
        and a stream left open."""
        assert self.server is not None
        self.server.close()
        for conn in [c for c in self.conns if not c.held]:
            conn.transport.close()

    def answer(self, conn: _Conn, url: bytes) -> bytes:
        if url != b"/v1/completions":
            body = b'{"data": [{"id": "stub", "object": "model"}]}' if url == b"/v1/models" else b""
            return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
                len(body), body)
        self.legs.count += 1
        self.served += 1
        if self.legs.count > 1:
            return FULL
        self.legs.holder, conn.held = self, True
        self.legs.holding.set()
        return STREAM_HEAD + self.legs.hold


class _Conn(asyncio.Protocol):
    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.held = False  # holds the first leg's stream open

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.stub.conns.add(self)

    def connection_lost(self, _exc: Exception | None) -> None:
        self.stub.conns.discard(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        self.transport.write(self.stub.answer(self, url))


async def _serve(hold: bytes) -> tuple[list[str], Legs, list[Stub]]:
    """One streamed request whose first decode leg holds after `hold` until its worker stops listening:
    the client's data events, the legs and the stubs."""
    legs = Legs(hold)
    stubs = [Stub(legs), Stub(legs)]
    urls = [await s.start() for s in stubs]
    router = await asyncio.to_thread(start_router, "--decode", *urls, "--health-interval", "0.3")
    events: list[str] = []

    async def kill_when_held() -> None:
        await legs.holding.wait()
        assert legs.holder is not None
        legs.holder.stop_listening()

    killer = asyncio.ensure_future(kill_when_held())
    try:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            async with client.stream("POST", router.url + "/v1/completions", json=BODY) as r:
                assert r.status_code == 200
                events = [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert killer.done()
            assert metric(router.url, "pdserve_router_inflight") == 0
            assert (await client.get(router.url + "/health")).status_code == 200
        log = router.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
        assert "is dead" in log and "ended 1 request(s) open on it" in log, log[-3000:]
        return events, legs, stubs
    finally:
        killer.cancel()
        router.stop()
        for s in stubs:
            s.stop_listening()


async def test_a_stream_with_a_token_shown_ends_with_an_error_event_when_its_worker_stops_listening() -> None:
    events, legs, _stubs = await _serve(_token("a"))
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    error = json.loads(events[-1])["error"]
    assert error["code"] == 502 and "is dead" in error["message"], error
    assert legs.count == 1  # a token was shown: no retry


async def test_a_stream_without_a_token_moves_to_the_other_worker_when_its_first_stops_listening() -> None:
    events, legs, stubs = await _serve(b"")
    texts = [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"]
    assert texts == ["a", "b"] and events[-1] == "[DONE]", events
    assert legs.count == 2 and sorted(s.served for s in stubs) == [1, 1]  # retried on the other worker
