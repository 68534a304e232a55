"""The fast upstream `pdserve bench router` puts behind the router: an OpenAI-compatible stub.

It answers /health, /v1/models, /tokenize and both completion routes, streaming `--tokens`
token events as soon as a request's body is in (no model, no waiting), so whatever time a
request spends beyond the stub's is the router's or the client's. It is a bare asyncio
protocol on uvloop rather than a web framework, because on a 2-core machine every
microsecond the stub spends is taken from the router it measures. Prefill legs
(`kv_transfer_params.do_remote_decode`) get a one-token answer with the prompt's token ids,
as vLLM's producer gives, but name no KV store: the router then runs its legs in sequence.

Run as `python -m pdserve.bench.router_stub --port N`; it prints `ready` on stdout once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Sequence, cast

import msgspec

MODEL = "stub"
_MAX_BODY = 64 << 20


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    """Token ids for the prompt: given ones, else one per 4 bytes of text (what the router estimates)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    text = prompt if isinstance(prompt, str) else msgspec.json.encode(body.get("messages") or [])
    return list(range(max(1, len(text) // 4)))


class Answers:
    """The bytes of each kind of answer, built from a request's body."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def stream(self, route: str, body: dict[str, Any]) -> bytes:
        """The whole SSE body of a streamed answer: `tokens` token events, the finish, usage, [DONE]."""
        model = body.get("model") or MODEL
        base = {"id": "cmpl-stub", "created": 0, "model": model}
        events: list[bytes] = []
        if route == "chat":
            obj = {**base, "object": "chat.completion.chunk"}
            events.append(_event({**obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]}))
            for i in range(self.tokens):
                done = "length" if i == self.tokens - 1 else None
                events.append(_event({**obj, "choices": [{"index": 0, "delta": {"content": f" t{i}"},
                                                          "finish_reason": done}]}))
        else:
            obj = {**base, "object": "text_completion"}
            for i in range(self.tokens):
                done = "length" if i == self.tokens - 1 else None
                events.append(_event({**obj, "choices": [{"index": 0, "text": f" t{i}", "logprobs": None,
                                                          "finish_reason": done}]}))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            prompt = len(_prompt_ids(body))
            usage = {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}
            events.append(_event({**obj, "choices": [], "usage": usage}))
        events.append(b"data: [DONE]\n\n")
        return b"".join(events)

    def unary(self, route: str, body: dict[str, Any]) -> bytes:
        ids = _prompt_ids(body)
        prefill = isinstance(body.get("kv_transfer_params"), dict)
        n = 1 if prefill else self.tokens
        text = "".join(f" t{i}" for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if route == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out: dict[str, Any] = {"id": "cmpl-stub", "object": "text_completion", "created": 0,
                               "model": body.get("model") or MODEL, "choices": [choice],
                               "usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                                         "total_tokens": len(ids) + n}}
        if prefill:
            out["prompt_token_ids"] = ids
            out["kv_transfer_params"] = {"do_remote_prefill": True}
        return msgspec.json.encode(out)


def _response(status: int, content_type: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, content_type, len(body))
            + body)


def _chunked(body: bytes) -> bytes:
    """A streamed answer as one chunk of chunked encoding (as vLLM streams, without a length)."""
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")


_MODELS = msgspec.json.encode({"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL}]})
_ROUTES = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}


class StubProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies: all the router and the bench's client send."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].split(b"\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length > _MAX_BODY:
                self._reply(_response(413, b"application/json", b'{"error":{"message":"too large"}}'), close=True)
                return
            if len(self.buf) < end + 4 + length:
                return  # the body is still coming
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path = (head[0].split(b" ") + [b"", b""])[:2]
            self._reply(self._answer(method, path.split(b"?")[0], body))

    def _answer(self, method: bytes, path: bytes, raw: bytes) -> bytes:
        if method == b"GET" and path == b"/health":
            return _response(200, b"application/json", b"{}")
        if method == b"GET" and path == b"/v1/models":
            return _response(200, b"application/json", _MODELS)
        try:
            body = msgspec.json.decode(raw) if raw else {}
        except msgspec.DecodeError:
            return _response(400, b"application/json", b'{"error":{"message":"bad JSON"}}')
        if method == b"POST" and path == b"/tokenize" and isinstance(body, dict):
            ids = _prompt_ids(body)
            return _response(200, b"application/json", msgspec.json.encode({"tokens": ids, "count": len(ids)}))
        route = _ROUTES.get(path)
        if method != b"POST" or route is None or not isinstance(body, dict):
            return _response(404, b"application/json", b'{"error":{"message":"not found"}}')
        if body.get("stream"):
            return _chunked(self.answers.stream(route, body))
        return _response(200, b"application/json", self.answers.unary(route, body))

    def _reply(self, data: bytes, close: bool = False) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            if close:
                self.transport.close()


async def serve(host: str, port: int, tokens: int) -> None:
    loop = asyncio.get_running_loop()
    answers = Answers(tokens)
    server = await loop.create_server(lambda: StubProtocol(answers), host, port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.router_stub",
                                description="a fast OpenAI-compatible stub upstream for pdserve bench router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=4, help="token events per streamed answer")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    try:
        uvloop.run(serve(a.host, a.port, a.tokens))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
