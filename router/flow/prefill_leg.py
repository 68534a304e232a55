"""The prefill leg: the client's request, cut to one token, on a prefill worker.

The body is the client's with `max_tokens=1`, `stream=false`,
`kv_transfer_params={"do_remote_decode": true}` and `return_token_ids` (and a text completion's
prompt as the token ids the router counted), under the same
X-Request-Id as the decode leg. Inside the worker's vLLM the connector saves the prompt's
KV to the store and answers with kv_transfer_params naming the store and the chunks.
Transport failures and 5xx replies move the leg to another prefill worker; when none is
left the request falls back to decode-only. `decode_payload` then builds the decode leg's
body: the client's plus those params and the prompt token ids (vLLM then skips
re-rendering the prompt, so both legs see the same tokens).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import msgspec
import numpy as np

from pdserve.kvstore.connector.handoff import HANDOFF_KEY, HANDOFF_WAIT_KEY
from pdserve.router.config import RouterConfig
from pdserve.router.errors import RouterError
from pdserve.router.flow.call import ERROR_REPLY_WORKERS, Call, UpstreamResponse
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Policy, Pool, RouteContext, Worker
from pdserve.router.prefill_estimate import TokenCost
from pdserve.router.requests import PATHS
from pdserve.router.store_view import StoreView
from pdserve.router.upstream import UPSTREAM_ERRORS, describe
from pdserve.router.worker_http import WorkerHTTP

log = logging.getLogger("pdserve.router.flow")

# Fields of the client's body that would contradict a one-token, unstreamed prefill.
_PREFILL_DROP = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n", "best_of")


def prefill_body(body: dict[str, Any], handoff: str | None = None,
                 prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The prefill leg's body: the client's, cut to one unstreamed token that keeps its KV for decode;
    with `handoff`, the producer names its upload after it (an overlapped decode leg waits for that).

    With `prompt_ids` (the prompt as the router counted it for routing) a completion's prompt goes as
    those ids (a chat request keeps its messages: the router's template rendering is not vLLM's), so
    the prefill engine does not tokenize it a second time on the request's critical path (2k tokens:
    2-4 ms here, which colocated serving pays once). Only this leg gets them: the
    decode leg renders the text itself, and its connector loads only KV made for its own tokens
    (chunk keys and the prompt's digest), so a router tokenizer that differs from the engine's
    costs a recompute, never wrong tokens."""
    sent = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    if prompt_ids is not None and "prompt" in sent:
        sent["prompt"] = prompt_ids
    sent["max_tokens"] = 1
    sent["stream"] = False
    sent["return_token_ids"] = True  # the decode leg reuses these ids instead of re-rendering
    sent["kv_transfer_params"] = {"do_remote_decode": True, **({HANDOFF_KEY: handoff} if handoff else {})}
    return sent


_IDS_KEY = b'"prompt_token_ids":['  # as vLLM's server writes it (compact JSON)
ANSWER_BASE_BYTES = 64 << 20  # a prefill answer's allowance beside its prompt's (answer_limit)
_CUT = "\x00cut"  # what stands in the answer for the ids cut out of it, until they are put back as bytes


def _holders(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Where the prompt's ids may be: the answer (chat), then its first choice (completions)."""
    choices = data.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return [data, first] if isinstance(first, dict) else [data]


def _ids_holder(data: dict[str, Any]) -> dict[str, Any]:
    """The dict that holds the prompt's ids."""
    return next((h for h in _holders(data) if h.get("prompt_token_ids") is not None), data)


def decode_answer(content: bytes) -> dict[str, Any]:
    """The prefill's JSON answer, its prompt token ids kept as their own bytes (a `msgspec.Raw`).

    Why: the ids are the largest part of the answer and the router only passes them on to the decode
    leg; decoding them into Python ints and encoding them again held the router's event loop, and every
    stream on it, for 45-59 ms per request at 1M tokens (6 ms at 128k). Cut out before decoding
    and spliced into the decode leg's body as they came, they cost a search and two copies. Taken only
    when the ids appear once as a compact array of digits and commas (no other JSON can ride in it);
    anything else is decoded as before. `prompt_ids` decodes them where a path needs the list."""
    start = content.find(_IDS_KEY)
    if start >= 0 and content.find(_IDS_KEY, start + 1) < 0:
        begin = start + len(_IDS_KEY) - 1
        end = content.find(b"]", begin) + 1
        raw = content[begin:end]
        if _int_array(raw):
            data = msgspec.json.decode(content[:begin] + msgspec.json.encode(_CUT) + content[end:])
            if isinstance(data, dict):
                for holder in _holders(data):
                    if holder.get("prompt_token_ids") == _CUT:
                        holder["prompt_token_ids"] = msgspec.Raw(raw)
                        return data
    return msgspec.json.decode(content)


def _int_array(raw: bytes) -> bool:
    """Whether `raw` (from `[` to `]`) is a non-empty JSON array of integers written compactly: digits and
    commas only, a number between every two commas and at both ends (1M tokens: 2.6 ms of translate, 0.7 of
    numpy; `b",," in raw` alone took 10)."""
    if len(raw) <= 2 or raw[1:-1].translate(None, b"0123456789,"):
        return False
    commas = np.frombuffer(raw, np.uint8) == ord(",")
    return not (commas[1] or commas[-2] or (commas[1:] & commas[:-1]).any())


def answer_limit(prompt_tokens: int) -> int:
    """The most bytes a prefill answer may take: its prompt's ids (at most 8 bytes a token as JSON), its
    chunk keys and one token with its logprobs fit many times over. A worker that sends more is broken."""
    return ANSWER_BASE_BYTES + 32 * max(0, prompt_tokens)


def readable_answer(content: bytes) -> dict[str, Any]:
    """A 200's answer as a JSON object; anything else is the worker's failure (another worker, or decode-only),
    not the request's: a proxy's HTML page or a broken engine had every request answered 500."""
    try:
        data = decode_answer(content)
    except msgspec.DecodeError as exc:
        raise aiohttp.ClientPayloadError(f"prefill answer is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise aiohttp.ClientPayloadError(f"prefill answer is a JSON {type(data).__name__}, not an object")
    return data


def _ids(data: dict[str, Any]) -> list[int] | msgspec.Raw | None:
    ids = _ids_holder(data).get("prompt_token_ids")
    return ids if isinstance(ids, msgspec.Raw) or (isinstance(ids, list) and ids) else None


def prompt_ids(data: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids the prefill answered, as a list (decoded here when kept as bytes)."""
    ids = _ids(data)
    return msgspec.json.decode(ids, type=list[int]) if isinstance(ids, msgspec.Raw) else ids


def overlap_params(handoff: str, store: tuple[str, str | None], wait_s: float) -> dict[str, Any]:
    """An overlapped decode leg's kv_transfer_params: wait in `store` (URL, id) for handoff `handoff`, as
    long as the prefill may take (`wait_s`: the router drops the leg sooner if the prefill fails)."""
    url, store_id = store
    return {"pdserve": 1, HANDOFF_KEY: handoff, "kvstore_url": url, "kvstore_id": store_id, HANDOFF_WAIT_KEY: wait_s}


def decode_payload(call: Call, prefill: dict[str, Any]) -> bytes:
    """The decode leg's body: the client's plus the prefill's kv_transfer_params and prompt token ids."""
    params = dict(call.kv_params or {})
    ids = _ids(prefill)  # as the prefill wrote them, when kept as bytes
    if ids is not None:
        params["prompt_token_ids"] = ids
    if not params:
        return call.raw
    return msgspec.json.encode({**call.body, "kv_transfer_params": params})


class PrefillLeg:
    def __init__(self, cfg: RouterConfig, pool: Pool, policy: Policy, http: WorkerHTTP,
                 headers: dict[str, str], store: StoreView, metrics: RouterMetrics, cost: TokenCost) -> None:
        self.pool = pool
        self.policy = policy
        self.http = http
        self.headers = headers
        self.store = store
        self.metrics = metrics
        self.cost = cost  # learns the prefill pool's speed from each answered leg
        self.timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout, connect=cfg.connect_timeout)

    async def run(
        self, call: Call, ctx: RouteContext, handoff: str | None = None, chosen: "asyncio.Future[Worker] | None" = None
    ) -> dict[str, Any] | None:
        """The prefill response, or None when no prefill worker could serve it (then decode prefills).
        `chosen` learns the first worker picked (an overlapped decode leg waits in its store)."""
        payload = msgspec.json.encode(prefill_body(call.body, handoff, call.prompt_ids))
        headers = {**self.headers, "X-Request-Id": call.request_id}
        tried: set[str] = set()
        error_replies = 0
        while True:
            try:
                slot = await self.pool.acquire(self.policy, ctx, exclude=tried)
            except RouterError as exc:
                if exc.status == 503:  # none (left) alive: decode-only
                    return None
                raise
            tried.add(slot.worker.id)
            if chosen is not None and not chosen.done():
                chosen.set_result(slot.worker)
            with slot, self.cost.leg(slot.worker, ctx.prompt_tokens) as timing:
                t = time.perf_counter()
                call.t_first_call = call.t_first_call or t
                try:
                    async with self.http.post(
                        slot.worker.url + PATHS[call.route], data=payload, headers=headers, timeout=self.timeout,
                        work=ctx.prompt_tokens,
                    ) as resp:
                        status, content = resp.status, await resp.read(answer_limit(ctx.prompt_tokens))
                    t_answer = time.perf_counter()
                    data = readable_answer(content) if status == 200 else None
                    timing.ok = status == 200
                except UPSTREAM_ERRORS as exc:
                    slot.failed(exc)
                    log.warning("prefill on %s failed (%s); trying another worker", slot.worker.url, describe(exc))
                    self.metrics.retries.labels("prefill").inc()
                    continue
                slot.answered()
            if status >= 500:
                error_replies += 1
                if error_replies < ERROR_REPLY_WORKERS:
                    log.warning("prefill on %s answered %d; trying another worker", slot.worker.url, status)
                    self.metrics.retries.labels("prefill").inc()
                    continue
            if status != 200:  # the request's fault: the client gets the worker's error
                raise UpstreamResponse(status, content)
            self.metrics.leg.labels("prefill").observe(time.perf_counter() - t)
            assert data is not None  # a 200's answer (readable_answer)
            call.prefill_worker = slot.worker
            call.t_prefill_answer = t_answer
            params = data.get("kv_transfer_params")
            if isinstance(params, dict):
                call.kv_params = params
                store_url = self.store.learn(params)
                if store_url and slot.worker.kvstore_url is None:
                    slot.worker.kvstore_url = store_url
                if store_url:
                    store_id = params.get("kvstore_id")
                    slot.worker.produces_to = (store_url, store_id if isinstance(store_id, str) else None)
            return data
