"""The decode stream, relayed to the client as its bytes arrive.

Only events before the first token are parsed (to tell a role-only chunk from a token
and to keep a retry invisible): until then a failed decode leg moves to another decode
worker, and the client sees nothing of it. Afterwards bytes pass through untouched, and
a failure ends the stream with an OpenAI error event. The one token the prefill leg
generated is never shown: decode regenerates it from the transferred KV, so nothing is
lost or duplicated at the seam. The relay counts the stream's outcome and times its
first token (TTFT, handoff, the router's own overhead) when it ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncGenerator, Callable, Coroutine, Mapping

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router.errors import RouterError
from pdserve.router.flow import first_token
from pdserve.router.flow.call import Call, UpstreamResponse
from pdserve.router.flow.decode_leg import DecodeLeg, DecodeLegs, pd_phases
from pdserve.router.metrics import RouterMetrics
from pdserve.router.requests import Route
from pdserve.router.upstream import UPSTREAM_ERRORS, describe

log = logging.getLogger("pdserve.router.flow")


# Bytes of a decode stream held before its first token is seen; past this they are relayed as they are (a
# prompt echoed whole can be megabytes in one event; nothing else comes near)
PENDING_MAX = 16 << 20


def _carries_token(route: Route, choice: Any) -> bool:
    """True when a stream choice reports generated tokens, even ones whose text is still empty.

    A token that ends inside a UTF-8 character comes with empty text, so text alone
    would hold such chunks back. On completions every choice reports output; on
    chat the one choice that does not is the role announcement opening the stream.
    """
    if not isinstance(choice, dict):
        return True  # not ours to judge: relay it
    if choice.get("finish_reason") or choice.get("logprobs") or choice.get("token_ids"):
        return True
    if route == "completions":
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return True
    return "role" not in delta or any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))


def _has_token(route: Route, buf: bytes | bytearray) -> bool:
    """True once the SSE bytes hold an event that carries output (or ends the stream)."""
    for event in buf.split(b"\n\n")[:-1]:  # the last piece is incomplete
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            try:
                obj = msgspec.json.decode(data)
            except (msgspec.DecodeError, RecursionError):
                return True  # not ours to judge: relay it
            if not isinstance(obj, dict) or "error" in obj:
                return True
            choices = obj.get("choices") or ()
            if not isinstance(choices, list) or any(_carries_token(route, c) for c in choices):
                return True
    return False


class EventStream(StreamingResponse):
    """The relayed stream as an ASGI response, sent by the task that serves the request.

    Starlette's StreamingResponse (on uvicorn's ASGI 2.3) sends from a task of its own in an
    anyio task group beside a disconnect listener: two tasks and a cancel scope per response.
    Here the request's ClientWatch (call.py) is the listener, so send this only inside one: a
    disconnect cancels the serving task, which ends the relay just the same.
    """

    def __init__(self, chunks: AsyncGenerator[bytes, None], headers: Mapping[str, str],
                 unsent: Callable[[], None]) -> None:
        """`unsent` is the relay's cleanup for a stream the client left before its first chunk was asked for:
        the relay never ran, so its own cleanup never will (closing a generator that has not started runs
        none of its code), and what it holds (a decode leg and its worker slot) would stay held."""
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self.chunks = chunks
        self.unsent = unsent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        try:
            # The headers' send can wait (a client that does not read fills the socket) and take the cancel.
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started = True  # the relay starts with the first chunk asked for, before anything can be cancelled
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:  # the relay's cleanup at once, also when the cancel lands in a send rather than in it
            if not started:
                self.unsent()
            await self.chunks.aclose()


class Relay:
    def __init__(self, legs: DecodeLegs, metrics: RouterMetrics, end: Callable[[Call], None]) -> None:
        """`end` runs once the stream is over, whatever ended it (it frees what the call still holds)."""
        self.legs = legs
        self.metrics = metrics
        self.end = end

    async def stream(self, call: Call, leg: DecodeLeg) -> AsyncGenerator[bytes, None]:
        """Relay the decode stream; retry on another worker until the first token, then pass bytes through."""
        outcome = "499"  # unless the stream ends otherwise, the client left
        first = False
        relayed_done = False  # the client has had the stream's last event
        try:
            while True:
                # What came before the first token, and how much of it is whole events that carried none: each
                # chunk's new events are read once (reading it all again at every chunk, and copying it into
                # new bytes, was quadratic: a worker that sent 64 MiB before an event's end took 14 s of the
                # router's CPU, holding every stream on it). Past PENDING_MAX it is relayed as it is.
                pending = bytearray()
                scanned = 0
                t_last = 0.0
                try:
                    async for chunk in leg.resp.content.iter_any():
                        now = time.perf_counter()
                        if first:
                            self.metrics.itl.observe(now - t_last)
                            t_last = now
                            relayed_done = relayed_done or b"data: [DONE]" in chunk
                            yield chunk
                            continue
                        pending += chunk
                        found = False
                        end = pending.rfind(b"\n\n", max(scanned, len(pending) - len(chunk) - 1))
                        if end >= 0:  # new whole events: read them
                            found = _has_token(call.route, pending[scanned:end + 2])
                            scanned = end + 2
                        if found or len(pending) > PENDING_MAX:
                            first, t_last = True, now
                            if call.producer_watch is not None:  # from here a lost producer no longer matters
                                call.producer_watch.stop()
                            relayed_done = b"data: [DONE]" in pending
                            try:
                                yield bytes(pending)  # resumes once the server has sent it on
                            finally:  # also when the client, having it all, hangs up here
                                self._observe_first_token(call, leg, now, time.perf_counter() - now)
                    if pending and not first:
                        yield bytes(pending)  # a stream without any token (e.g. max_tokens=0): relay as is
                    leg.slot.answered()
                    call.finished = True
                    outcome = "200"
                    return
                except UPSTREAM_ERRORS as exc:
                    leg.slot.failed(exc)
                    leg.resp.close()
                    if first:
                        outcome = "502"
                        log.warning("decode worker %s failed mid-stream: %s", leg.slot.worker.url, describe(exc))
                        yield RouterError(502, f"decode worker failed mid-stream: {describe(exc)}").sse_event()
                        return
                    self.metrics.retries.labels("decode").inc()
                    try:
                        leg = await self.legs.open(call, leg.payload, leg.ctx, leg.tried, leg.t_prefill_done)
                    except RouterError as err:
                        outcome = str(err.status)
                        yield err.sse_event()
                        return
                    if leg.resp.status != 200:
                        event, outcome = await self._refusal(leg)
                        yield event
                        return
        finally:
            # Runs on client disconnect too (the generator is cancelled): nothing here may await.
            if outcome == "499" and relayed_done:  # served whole; the client left before the upstream's EOF
                outcome = "200"
                call.finished = True
                leg.slot.answered()
            # Closing (not releasing) an unfinished response drops its connection, which aborts the request.
            leg.slot.abandon()
            leg.resp.close()
            self._count_ended(call, outcome)

    async def stream_handed(self, call: Call, lead: bytes,
                            leg: DecodeLeg | Coroutine[Any, Any, DecodeLeg]) -> AsyncGenerator[bytes, None]:
        """A stream whose first token the prefill made (first_token.py): `lead` at once, then the decode leg's
        events, relayed as `stream` does (retried elsewhere until its own first token), with usage fixed.
        `leg` may still be opening (a coroutine, first awaited after the lead has gone out): a leg that cannot
        open ends the stream with its error as an event."""
        now = time.perf_counter()
        call.token_shown = True
        try:
            yield lead
        except BaseException:  # the client left with the token: the decode leg is dropped (vLLM aborts it)
            self._drop(call, leg)
            raise
        finally:
            self._observe_handed_token(call, now, time.perf_counter() - now)
        if not isinstance(leg, DecodeLeg):
            opened = await self._open_led(call, leg)
            if isinstance(opened, bytes):
                yield opened
                return
            leg = opened
        if not first_token.asks_usage(call.body):  # nothing to fix: the decode leg's bytes pass as they come
            async for chunk in self.stream(call, leg):
                yield chunk
            return
        usage = first_token.UsageFix()
        async for chunk in self.stream(call, leg):
            if fixed := usage.feed(chunk):
                yield fixed
        if rest := usage.rest():
            yield rest

    async def _open_led(self, call: Call, opening: Coroutine[Any, Any, DecodeLeg]) -> DecodeLeg | bytes:
        """The decode leg of a stream whose first token is out, or the error event that ends the stream when
        no decode worker took it (counted as that error; the client leaving meanwhile counts as 499)."""
        outcome = "499"
        try:
            leg = await opening
            if leg.resp.status == 200:
                outcome = ""
                return leg
            event, outcome = await self._refusal(leg)
            return event
        except RouterError as err:
            outcome = str(err.status)
            return err.sse_event()
        finally:
            if outcome:
                self._count_ended(call, outcome)

    @staticmethod
    async def _refusal(leg: DecodeLeg) -> tuple[bytes, str]:
        """A decode leg's non-200 answer as the error event that ends its stream, and the outcome to count: the
        engine's own error, or a 502 when the answer's body cannot be read (the worker dropped the connection
        after its headers). The leg is closed either way."""
        try:
            event = UpstreamResponse(leg.resp.status, await leg.resp.read()).sse_event()
            leg.slot.answered()
            return event, str(leg.resp.status)
        except UPSTREAM_ERRORS as exc:
            leg.slot.failed(exc)
            return RouterError(502, f"decode worker failed: {describe(exc)}").sse_event(), "502"
        finally:
            leg.slot.abandon()  # only when cancelled: the lines above gave the verdict otherwise
            leg.resp.close()

    def respond(self, call: Call, leg: DecodeLeg) -> EventStream:
        """The decode leg's stream as the response."""
        return EventStream(self.stream(call, leg), {"X-Request-Id": call.request_id}, lambda: self._drop(call, leg))

    def respond_handed(self, call: Call, lead: bytes, leg: DecodeLeg | Coroutine[Any, Any, DecodeLeg]) -> EventStream:
        """A stream that opens with the prefill's token (`stream_handed`) as the response."""
        return EventStream(self.stream_handed(call, lead, leg), {"X-Request-Id": call.request_id},
                           lambda: self._drop(call, leg))

    def _drop(self, call: Call, leg: DecodeLeg | Coroutine[Any, Any, DecodeLeg]) -> None:
        """End a stream the client left before its decode leg was relayed: the leg dropped (vLLM aborts it),
        or never sent when it was still to open; counted as the client's."""
        if isinstance(leg, DecodeLeg):
            leg.slot.abandon()
            leg.resp.close()
        else:
            leg.close()
        self._count_ended(call, "499")

    def _count_ended(self, call: Call, outcome: str) -> None:
        self.metrics.series(self.metrics.requests, call.route, outcome).inc()
        self.end(call)

    def _observe_handed_token(self, call: Call, now: float, relay_s: float) -> None:
        """TTFT and the phases of a stream whose first token the prefill made: the router before its first call,
        the prefill leg, the router's work on the answer (between the legs), no decode leg, relaying."""
        self.metrics.series(self.metrics.ttft, call.route, call.path).observe(now - call.t0)
        t_first = call.t_first_call if call.t_first_call is not None else now
        t_answer = call.t_prefill_answer if call.t_prefill_answer is not None else now
        self.metrics.observe_phases({"before_first_call": t_first - call.t0, "prefill_leg": t_answer - t_first,
                                     "between_legs": now - t_answer, "decode_first_token": 0.0, "relay": relay_s})
        self.metrics.handoff.observe(now - t_answer)
        self.metrics.overhead.observe(t_first - call.t0 + relay_s)  # the wait for the decode leg's headers is its engine's

    def _observe_first_token(self, call: Call, leg: DecodeLeg, now: float, relay_s: float) -> None:
        self.metrics.series(self.metrics.leg, "decode").observe(now - leg.t_sent)
        if call.token_shown:  # TTFT and its phases were the prefill's token's (stream_handed)
            return
        self.metrics.series(self.metrics.ttft, call.route, call.path).observe(now - call.t0)
        if call.recompute is not None:
            call.recompute.first_token(leg.slot.worker, leg.t_sent, now)
        own = (call.t_first_call or leg.t_sent) - call.t0 + relay_s
        if leg.t_prefill_done is not None:
            self.metrics.handoff.observe(now - leg.t_prefill_done)
            self.metrics.observe_phases(pd_phases(call, leg, now, relay_s))
            own += max(0.0, leg.t_sent - leg.t_prefill_done)  # an overlapped leg went out before
        self.metrics.overhead.observe(own)
