"""The prefill leg before the router's count of the prompt (`--pd-early-prefill`, router/flow/paths.py), fast tier.

An in-process router over stub workers, with no local tokenizer: the router counts a prompt with the
prefill worker's /tokenize, which the stub answers only once the prefill leg has reached it, so the
order is the test's to see. A body long enough goes P/D at once: its prefill leg carries the client's
text (the prefill engine counts it), while the router counts the prompt beside it (no store lookup: the last
test says why). When that count finds the prompt short after all (a body made
long by another field), the verdict cancels the prefill leg, which the prefill worker sees as a hang-up
(vLLM aborts the request), and the request is served decode-only, counted as such; a verdict that comes
after the prefill has answered changes nothing.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
from aiohttp import web

from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.flow.call import Call
from pdserve.router.flow.paths import PathPlanner
from pdserve.router.lmcache_view import LMCacheView
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefill_estimate import QueueEstimate
from pdserve.router.store_view import StoreLayout, StoreView
from worker_stubs import healthy, listening, planner_pools, serves_stub, worker_app

LONG = "The quick brown fox jumps over the lazy dog " * 40  # about 400 tokens, 1.8 kB


class Workers:
    """A prefill stub that answers, or (hold) keeps the leg waiting until the router hangs up; its /tokenize,
    which answers `tokens` ids once the prefill leg has arrived; a decode stub."""

    def __init__(self, hold: bool, tokens: int, count_after_decode: bool = False, count_wait_s: float = 10.0) -> None:
        self.hold = hold
        self.count_wait_s = count_wait_s
        self.counts_after_prefill: list[bool] = []
        self.tokens = tokens
        self.prefill: list[dict[str, Any]] = []
        self.prefill_came = asyncio.Event()
        self.counted_after_prefill: bool | None = None
        self.hung_up = asyncio.Event()
        self.decode: list[dict[str, Any]] = []
        self.decode_came = asyncio.Event()
        self.counted = asyncio.Event()
        self.count_after_decode = count_after_decode  # the count comes only once the decode leg is out, and that
        # leg answers only after the count

    async def on_tokenize(self, _r: web.Request) -> web.Response:
        try:
            await asyncio.wait_for((self.decode_came if self.count_after_decode else self.prefill_came).wait(),
                                   self.count_wait_s)
        except TimeoutError:
            pass
        self.counted_after_prefill = self.prefill_came.is_set()
        self.counts_after_prefill.append(self.counted_after_prefill)
        self.prefill_came.clear()  # for the next request
        self.counted.set()
        return web.json_response({"tokens": list(range(self.tokens))})

    async def on_prefill(self, r: web.Request) -> web.Response:
        self.prefill.append(msgspec.json.decode(await r.read()))
        self.prefill_came.set()
        if self.hold:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # the connection closed (worker_stubs: handler_cancellation)
                self.hung_up.set()
                raise
        return web.json_response({"choices": [{"index": 0, "text": "p", "finish_reason": "length"}]})

    async def on_decode(self, r: web.Request) -> web.Response:
        self.decode.append(msgspec.json.decode(await r.read()))
        self.decode_came.set()
        if self.count_after_decode:
            await asyncio.wait_for(self.counted.wait(), 10)
            await asyncio.sleep(0.2)  # the router has the verdict before this leg answers
        return web.json_response({"choices": [{"index": 0, "text": "d", "finish_reason": "length"}]})


async def _serve(workers: Workers, body: dict[str, Any], times: int = 1, **cfg: Any) -> tuple[httpx.Response, str]:
    """The client's last response and the router's metrics, after `times` requests of `body` in turn
    (`cfg`: RouterConfig fields besides the test's)."""
    prefill_app = worker_app(healthy, serves_stub, workers.on_prefill, {"/tokenize": workers.on_tokenize})
    async with listening(prefill_app, worker_app(healthy, serves_stub, workers.on_decode)) as (prefill, decode):
        cfg = RouterConfig(prefill_urls=(prefill,), decode_urls=(decode,), pd_min_prompt_tokens=64,
                           pd_queue_aware=False, health_interval=600.0, pd_early_prefill=True, **cfg)
        app = create_app(cfg)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
                for _ in range(times):
                    r = await client.post("/v1/completions", json=body, timeout=30)
                return r, (await client.get("/metrics")).text


async def test_a_long_prompt_goes_out_as_text_before_the_router_has_counted_it() -> None:
    workers = Workers(hold=False, tokens=400)
    r, metrics = await _serve(workers, {"model": "stub", "prompt": LONG, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d", r.text
    assert workers.counted_after_prefill  # the router's count was not waited for ...
    assert workers.prefill[0]["prompt"] == LONG  # ... so the prefill engine counts the prompt itself
    assert workers.prefill[0]["max_tokens"] == 1 and len(workers.decode) == 1
    assert 'pdserve_router_paths_total{path="pd"} 1.0' in metrics
    assert 'pdserve_router_plan_seconds_count{step="tokenize"} 1.0' in metrics  # counted beside the leg


async def test_a_prompt_found_short_after_its_prefill_leg_went_out_cancels_the_leg() -> None:
    workers = Workers(hold=True, tokens=8)
    # 8 tokens of prompt in a body made long by another field: the body's size says P/D, the count says short
    body = {"model": "stub", "prompt": "a short prompt of a few words", "max_tokens": 2, "user": "u" * 2000}
    r, metrics = await _serve(workers, body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d", r.text
    assert len(workers.prefill) == 1 and workers.counted_after_prefill  # it went out early ...
    await asyncio.wait_for(workers.hung_up.wait(), 10)  # ... and was hung up on: vLLM aborts it
    assert workers.decode[0]["prompt"] == body["prompt"] and "kv_transfer_params" not in workers.decode[0]
    assert 'pdserve_router_paths_total{path="decode_only_short"} 1.0' in metrics
    assert 'path="pd"' not in metrics.split("pdserve_router_paths_total", 1)[1].split("# HELP", 1)[0]


async def test_a_verdict_that_comes_after_the_prefill_answered_changes_nothing() -> None:
    """A count that late may have seen the chunks this prefill stored; the prefill's work is done anyway."""
    workers = Workers(hold=False, tokens=8, count_after_decode=True)
    body = {"model": "stub", "prompt": "a short prompt of a few words", "max_tokens": 2, "user": "u" * 2000}
    r, metrics = await _serve(workers, body, pd_overlap=False)  # legs in sequence: the decode leg follows the answer
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d", r.text
    assert workers.counted.is_set() and not workers.hung_up.is_set()
    assert len(workers.prefill) == len(workers.decode) == 1  # the decode leg after the prefill, no second one
    assert 'pdserve_router_paths_total{path="pd"} 1.0' in metrics


async def test_a_prompt_that_opens_as_a_recent_one_is_counted_first() -> None:
    """It may be in the store (a chat's next turn): an early leg its verdict cancels would cost work for nothing."""
    workers = Workers(hold=False, tokens=400, count_wait_s=0.5)
    r, metrics = await _serve(workers, {"model": "stub", "prompt": LONG, "max_tokens": 2}, times=2)
    assert r.status_code == 200, r.text
    assert workers.counts_after_prefill == [True, False]  # early the first time, counted first the second
    assert workers.prefill[0]["prompt"] == LONG and workers.prefill[1]["prompt"] != LONG  # the second as ids


def test_a_prompt_sharing_half_its_text_with_a_recent_one_is_taken_for_stored() -> None:
    planner = SimpleNamespace(_prefixes=OrderedDict())

    def seen(route: str, body: dict[str, Any]) -> bool:
        return PathPlanner._maybe_stored(planner, Call(route, b"", body, "r"))  # type: ignore[arg-type]

    words = [f"w{i}" for i in range(2000)]
    first = " ".join(words[:1000])
    assert not seen("completions", {"prompt": first})
    assert seen("completions", {"prompt": first + " " + " ".join(words[1000:1800])})  # 55% shared
    assert not seen("completions", {"prompt": "x" + first})  # the same words, another opening
    turn1 = [{"role": "system", "content": "be brief " * 40}, {"role": "user", "content": first}]
    assert not seen("chat", {"messages": turn1})
    assert seen("chat", {"messages": [*turn1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]})
    # the same long system prompt before another long question: not half of it
    assert not seen("chat", {"messages": [turn1[0], {"role": "user", "content": " ".join(words[1000:])}]})
    assert seen("completions", {"prompt": [1, 2, 3]})  # no text to go by: counted first (at once, for ids)


class _CountsAll:
    """The router's prompt counter, standing in: every prompt is 400 tokens, counted at once."""

    def estimate(self, body_size: int) -> int:
        return body_size // 4

    async def ids(self, route: str, body: dict[str, Any], url: str, body_size: int) -> list[int]:
        return list(range(400))


class _HoldsEverything(StoreView):
    """A store that holds every prompt whole, and counts the lookups asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.layouts["tcp://store"] = StoreLayout("ns", 256, (0,), None)
        self.asked = 0

    async def prefix_tokens(self, token_ids: list[int], salt: str | None, adapter: str | None = None) -> dict[str, int]:
        self.asked += 1
        return {"tcp://store": len(token_ids)}


async def test_an_early_leg_is_not_looked_up_in_the_store() -> None:
    """A lookup sent after the leg can find the chunks that very prefill is storing; its verdict would then
    cancel a prefill all but done (seen in a full test run: a fresh prompt went decode_only_cached 0.34 s
    after its leg). So the early verdict only counts; a prompt likely stored is counted and looked up first."""
    cfg = RouterConfig(decode_urls=("http://d",), pd_min_prompt_tokens=64, pd_queue_aware=False,
                       pd_early_prefill=True)
    metrics = RouterMetrics()
    prefill, decode = planner_pools(cfg, metrics)
    store = _HoldsEverything()
    planner = PathPlanner(cfg, prefill, decode, _CountsAll(), store, LMCacheView(),  # type: ignore[arg-type]
                          QueueEstimate(None), metrics)
    body = {"model": "stub", "prompt": LONG}
    first = Call(route="completions", raw=msgspec.json.encode(body), body=body, request_id="a")
    path, _ = await planner.plan(first)
    assert path == "pd" and first.verdict is not None  # the leg goes out early ...
    assert await first.verdict is None and first.prompt_ids is not None  # ... counted beside it, not looked up
    assert store.asked == 0
    again = Call(route="completions", raw=msgspec.json.encode(body), body=body, request_id="b")
    path, _ = await planner.plan(again)  # the same text again: counted and looked up before any leg
    assert (path, again.verdict, store.asked) == ("decode_only_cached", None, 1)
