"""Queue-aware paths without engines: the /metrics parser, the background scrapes (against
real HTTP servers that answer well, garbage, nothing or too much), the per-token costs,
the backlog and the planner's decision.

The decision's figures are pure arithmetic over given times, so these tests pass the
times in instead of sleeping; the engine test (test_router_queue_aware.py) shows the
whole path through real vLLM engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from pdserve.router.config import RouterConfig, config_from_args
from pdserve.router.flow.call import Call
from pdserve.router.flow.paths import PathPlanner
from pdserve.router.lmcache_view import LMCacheView
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool, Worker
from pdserve.router import prefill_estimate
from pdserve.router.prefill_estimate import LEARN_MIN_TOKENS, QueueEstimate, TokenCost
from pdserve.router.queue_view import QueueCounts, QueueSnapshot, QueueView, parse_queue, progress_mark
from pdserve.router.store_view import StoreView
from pdserve.router.tokens import PromptTokens
from worker_stubs import planner_pools

# The shape of vLLM 0.32's exposition: HELP/TYPE lines, one sample per engine, the split by reason,
# and neighbours whose names start like ours.
VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/tiny model {x}"} 2.0
vllm:num_requests_running{engine="1",model_name="/tmp/tiny model {x}"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/tmp/tiny model {x}"} 5.0
vllm:num_requests_waiting{engine="1",model_name="/tmp/tiny model {x}"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 2.0
vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="m",stage="in_progress"} 2.0
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 123456.0
"""


# ---------------------------------------------------------------- parser


def test_parse_queue_sums_engines_and_reads_the_capacity_split() -> None:
    assert parse_queue(VLLM_METRICS) == QueueCounts(running=3, waiting=5, capacity_waiting=3)


def test_the_progress_mark_moves_with_the_engines_stats_only() -> None:
    """What the stall watch reads to tell a slow engine from a stuck one: KV usage, step and token counters."""
    base = VLLM_METRICS + b'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:prompt_tokens_total{engine="0"} 100.0\n'
    mark = progress_mark(base)
    assert progress_mark(base + b'vllm:num_requests_waiting{engine="9"} 1.0\n') == mark  # a queue is no step
    assert progress_mark(base.replace(b"} 0.25", b"} 0.5")) != mark
    assert progress_mark(base.replace(b"} 100.0", b"} 164.0")) != mark
    assert progress_mark(base + b'vllm:iteration_tokens_total_count{engine="0"} 7.0\n') != mark


def test_parse_queue_without_the_split_says_none_for_capacity() -> None:
    text = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 4 1700000000000\n"
    assert parse_queue(text) == QueueCounts(running=0, waiting=4, capacity_waiting=None)


@pytest.mark.parametrize("text", [
    b"",
    b"not prometheus at all \x00\xff",
    b"<html><body>502 Bad Gateway</body></html>",
    b"vllm:num_requests_running 1\n",  # waiting missing
    b"vllm:num_requests_waiting 1\n",  # running missing
    b"vllm:num_requests_running 1\nvllm:num_requests_waiting NaN\n",
    b"vllm:num_requests_running -1\nvllm:num_requests_waiting 0\n",
    b"vllm:num_requests_running 1.5\nvllm:num_requests_waiting 0\n",
    b"vllm:num_requests_running +Inf\nvllm:num_requests_waiting 0\n",
    b"vllm:num_requests_running 1\nvllm:num_requests_waiting{engine=\"0\" 3\n",  # unterminated labels
    b"vllm:num_requests_running 1\nvllm:num_requests_waiting lots\n",
])
def test_parse_queue_refuses_what_is_not_a_queue(text: bytes) -> None:
    assert parse_queue(text) is None


# ---------------------------------------------------------------- scrapes against real servers


def _pool(role: str, urls: list[str]) -> Pool:
    pool = Pool(role, RouterConfig(decode_urls=("http://d",)), RouterMetrics())  # type: ignore[arg-type]
    pool.add_static(urls)
    return pool


@pytest.fixture
async def workers() -> AsyncIterator[dict[str, str]]:
    """One HTTP server with a worker per behaviour; yields name -> base URL."""
    hang = asyncio.Event()

    async def good(_r: web.Request) -> web.Response:
        return web.Response(body=VLLM_METRICS)

    async def garbage(_r: web.Request) -> web.Response:
        return web.Response(body=b"vllm:num_requests_running twelve\nvllm:num_requests_waiting 1\n")

    async def hangs(_r: web.Request) -> web.Response:
        await hang.wait()
        return web.Response(body=VLLM_METRICS)

    async def error(_r: web.Request) -> web.Response:
        return web.Response(status=500, body=VLLM_METRICS)

    async def huge(r: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(r)
        await resp.write(VLLM_METRICS)
        for _ in range(80):  # 5 MiB of comments: over the cap, whatever follows
            await resp.write(b"# " + b"x" * 65534 + b"\n")
        return resp

    app = web.Application()
    for name, handler in (("good", good), ("garbage", garbage), ("hangs", hangs), ("error", error), ("huge", huge)):
        app.router.add_get(f"/{name}/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = "http://127.0.0.1:%d" % runner.addresses[0][1]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        absent = f"http://127.0.0.1:{s.getsockname()[1]}"
    try:
        yield {**{n: f"{base}/{n}" for n in ("good", "garbage", "hangs", "error", "huge")}, "absent": absent}
    finally:
        hang.set()
        await runner.cleanup()


async def test_scrapes_keep_good_snapshots_and_drop_the_rest(workers: dict[str, str]) -> None:
    pool = _pool("prefill", list(workers.values()))
    by_name = {name: pool.workers[url] for name, url in workers.items()}
    by_name["good"].inflight = 2  # the router's own requests there: the other one is foreign
    metrics = RouterMetrics()
    async with aiohttp.ClientSession() as http:
        view = QueueView([pool], http, {}, interval=0.2, metrics=metrics)
        view.start()
        try:
            await asyncio.sleep(0.5)  # no traffic: no scrapes
            assert metrics.queue_scrapes.labels("prefill", "ok")._value.get() == 0
            QueueEstimate(view).prefill_wait([])  # a path decision: the router has traffic
            for _ in range(200):
                await asyncio.sleep(0.05)
                failed = metrics.queue_scrapes.labels("prefill", "failed")._value.get()
                bad = metrics.queue_scrapes.labels("prefill", "bad")._value.get()
                if view.snapshot(by_name["good"]) and failed >= 2 and bad >= 4:
                    break
            snap = view.snapshot(by_name["good"])
            assert snap is not None and snap.counts == QueueCounts(3, 5, 3)
            assert snap.own_inflight == 2 and snap.foreign == 6
            for name in ("garbage", "hangs", "error", "huge", "absent"):
                assert view.snapshot(by_name[name]) is None, name
            # the hung worker holds one scrape open and no more; the good one went on being scraped
            assert len([t for t in asyncio.all_tasks() if t.get_name() == f"queue-scrape:{by_name['hangs'].id}"]) <= 1
            assert metrics.queue_scrapes.labels("prefill", "ok")._value.get() >= 2
        finally:
            await view.stop()
        # a snapshot older than two intervals counts as none
        assert view.snapshot(by_name["good"], now=snap.at + 0.41) is None
        assert view.snapshot(by_name["good"], now=snap.at + 0.39) is not None


async def test_a_worker_that_starts_failing_loses_its_snapshot(workers: dict[str, str]) -> None:
    pool = _pool("decode", [workers["good"]])
    w = next(iter(pool.workers.values()))
    async with aiohttp.ClientSession() as http:
        view = QueueView([pool], http, {}, interval=0.2, metrics=RouterMetrics())
        await view.scrape(pool, w)
        assert view.snapshot(w) is not None
        w.url = workers["garbage"]
        await view.scrape(pool, w)
        assert view.snapshot(w) is None
        w.url = workers["good"]
        pool.workers.clear()  # it left while the scrape was under way: nothing is kept for it
        await view.scrape(pool, w)
        assert view.snapshot(w) is None


# ---------------------------------------------------------------- per-token costs


def _worker(name: str = "w", inflight_tokens: int = 0) -> Worker:
    return Worker(id=name, role="prefill", url=f"http://{name}", source="static", inflight_tokens=inflight_tokens)


def test_queued_legs_count_only_their_own_service() -> None:
    """Three 1000-token legs sent at once to one worker end at 1, 2, 3 s: 1 ms a token, not 2."""
    cost, w = TokenCost(), _worker()
    for end in (1.0, 2.0, 3.0):
        cost.observe(w, 1000, 0.0, end)
    assert cost.per_token == pytest.approx(0.001)


def test_a_batched_step_spreads_over_its_prompts() -> None:
    """Two legs that end together (one engine step) took 1 s for 2000 tokens between them."""
    cost, w = TokenCost(), _worker()
    cost.observe(w, 1000, 0.0, 1.0)
    cost.observe(w, 1000, 0.0, 1.0)
    assert cost.per_token == pytest.approx(0.0008)  # EWMA of seconds (1, then 0) over tokens (1000, 1000)


def test_workers_keep_separate_clocks_and_the_ewma_follows_change() -> None:
    cost, a, b = TokenCost(), _worker("a"), _worker("b")
    cost.observe(a, 1000, 0.0, 1.0)
    cost.observe(b, 1000, 0.0, 1.0)  # b was idle: its own 1 s, not 0
    assert cost.per_token == pytest.approx(0.001)
    for i in range(30):  # the worker slows down to 2 ms a token
        cost.observe(a, 1000, 10.0 + 2 * i, 12.0 + 2 * i)
    assert cost.per_token == pytest.approx(0.002, rel=0.01)


def test_failed_and_short_legs_teach_nothing_but_move_the_clock() -> None:
    cost, w = TokenCost(), _worker()
    cost.observe(w, 1000, 0.0, 5.0, learn=False)
    cost.observe(w, LEARN_MIN_TOKENS - 1, 0.0, 6.0)
    assert cost.per_token is None and cost.mean_tokens is None
    cost.observe(w, 1000, 0.0, 7.0)  # queued behind both: 1 s of its own
    assert cost.per_token == pytest.approx(0.001)


def test_recompute_assumes_the_prefill_speed_until_measured() -> None:
    prefill = TokenCost()
    recompute = TokenCost(prior=prefill)
    assert recompute.per_token is None
    prefill.observe(_worker(), 1000, 0.0, 1.0)
    assert recompute.per_token == pytest.approx(0.001)
    recompute.observe(_worker("d"), 1000, 0.0, 3.0)
    assert recompute.per_token == pytest.approx(0.003)


def test_open_legs_are_served_from_the_busy_stretch_but_at_most_the_largest() -> None:
    cost, w = TokenCost(), _worker()
    cost.observe(w, 1000, 0.0, 1.0)  # 1 ms a token
    assert cost.served_since_busy(w, 100.0) == 0.0  # nothing open
    with cost.leg(w, 1000) as first, cost.leg(w, 3000):
        t0 = first.t_sent
        assert cost.served_since_busy(w, t0 + 0.5) == pytest.approx(500, rel=0.01)
        assert cost.served_since_busy(w, t0 + 60.0) == 3000  # stalled for a minute: not its whole queue
        cost.observe(w, 10, t0, t0 + 0.2, learn=False)  # another leg ended: the stretch goes on from there
        assert cost.served_since_busy(w, t0 + 0.5) == pytest.approx(300, rel=0.01)
    assert cost.served_since_busy(w, t0 + 0.5) == 0.0
    assert cost.samples == 1  # the legs never set ok: not learned


# ---------------------------------------------------------------- the backlog and the decision


def _estimate(view: QueueView | None = None, per_token: float = 0.001) -> QueueEstimate:
    est = QueueEstimate(view)
    est.prefill.observe(_worker("seed"), 1000, 0.0, 1000 * per_token)
    return est


class _Snapshots(QueueView):
    """A view whose snapshots a test sets (its scraping is tested above)."""

    def __init__(self, snaps: dict[Worker, QueueSnapshot]) -> None:
        self.snaps = snaps

    def snapshot(self, w: Worker, now: float | None = None) -> QueueSnapshot | None:
        return self.snaps.get(w)

    def touch(self) -> None:
        pass


def test_backlog_is_own_tokens_plus_foreign_requests_at_the_mean_length() -> None:
    w = _worker("p", inflight_tokens=3000)
    snap = QueueSnapshot(QueueCounts(running=1, waiting=4, capacity_waiting=4), own_inflight=3, at=0.0)
    est = _estimate(_Snapshots({w: snap}))
    assert est.backlog_tokens(w, now=0.0) == 3000 + 2 * 1000
    assert est.prefill_wait([w, _worker("idle")]) == 0.0  # the least backlogged worker counts
    assert est.prefill_wait([w]) == pytest.approx(5.0)
    assert QueueEstimate(None).prefill_wait([w]) is None  # nothing measured yet: no opinion


def test_recompute_cost_counts_recomputes_under_way_and_skips_full_decode_workers() -> None:
    d1, d2 = _worker("d1"), _worker("d2")
    full = QueueSnapshot(QueueCounts(running=8, waiting=3, capacity_waiting=2), own_inflight=8, at=0.0)
    est = _estimate(_Snapshots({d2: full}))
    assert est.recompute_cost(1000, [d1, d2]) == pytest.approx(1.0)
    ticket = est.start_recompute(2000)
    assert est.recompute_cost(1000, [d1, d2]) == pytest.approx(3.0)  # behind the 2000 under way on d1
    ticket.release()
    assert est.recompute_cost(1000, [d1, d2]) == pytest.approx(1.0)
    assert est.recompute_cost(1000, [d2]) is None  # every decode worker has requests waiting for a slot
    est.start_recompute(5000)  # a request that ended without releasing it: gone with it
    gc.collect()
    assert est.recompute_cost(1000, [d1]) == pytest.approx(1.0)


def test_first_token_teaches_the_decode_side_and_releases() -> None:
    est, d = _estimate(), _worker("d")
    ticket = est.start_recompute(1000)
    ticket.first_token(d, 0.0, 4.0)
    assert est.recompute.per_token == pytest.approx(0.004)
    assert est.recompute_cost(1000, [d]) == pytest.approx(4.0)
    ticket.first_token(d, 0.0, 9.0)  # once released, a second report teaches nothing
    assert est.recompute.per_token == pytest.approx(0.004)


async def _plan(cfg: RouterConfig, est: QueueEstimate, prefill_backlog: int) -> tuple[str, Call]:
    metrics = RouterMetrics()
    prefill, decode = planner_pools(cfg, metrics)
    prefill.workers["http://p"].inflight_tokens = prefill_backlog
    async with aiohttp.ClientSession() as http:
        planner = PathPlanner(cfg, prefill, decode, PromptTokens(http, {}, None), StoreView(), LMCacheView(), est,
                              metrics)
        call = Call(route="completions", raw=b"{}", body={"prompt": list(range(1000))}, request_id="r")
        path, ctx = await planner.plan(call)
    assert ctx.prompt_tokens == 1000
    timed = metrics.exposition().decode()  # both steps of the decision, each once
    assert all(f'pdserve_router_plan_seconds_count{{step="{step}"}} 1.0' in timed for step in ("tokenize", "store_lookup"))
    return path, call


async def test_planner_goes_decode_only_when_the_queue_outwaits_a_recompute() -> None:
    cfg = RouterConfig(decode_urls=("http://d",), pd_min_prompt_tokens=0, pd_early_prefill=False)
    path, call = await _plan(cfg, _estimate(), prefill_backlog=0)
    assert (path, call.recompute) == ("pd", None)
    path, call = await _plan(cfg, _estimate(), prefill_backlog=1000)  # waits as long as a recompute takes
    assert path == "pd"
    path, call = await _plan(cfg, _estimate(), prefill_backlog=1500)
    assert path == "decode_only_prefill_queue"
    assert call.recompute is not None and call.recompute.tokens == 1000
    path, _ = await _plan(cfg, QueueEstimate(None), prefill_backlog=10**6)  # cold start: nothing measured
    assert path == "pd"
    off = config_from_args(["--decode", "http://d", "--pd-min-prompt-tokens", "0", "--no-pd-queue-aware"])
    assert not off.pd_queue_aware
    path, _ = await _plan(off, _estimate(), prefill_backlog=10**6)
    assert path == "pd"


async def test_max_tokens_over_the_decode_context_goes_decode_only_before_any_lookup() -> None:
    """max_tokens (max_completion_tokens on chat) over the decode workers' max_model_len: every vLLM refuses
    it, after a prefill leg spent for nothing, so it goes decode-only and the store is not asked. A prompt plus
    max_tokens over the context stays P/D (vLLM 0.32 shortens max_tokens and serves it), as do requests
    without max_tokens or while the workers have not said their context."""
    cfg = RouterConfig(decode_urls=("http://d",), pd_min_prompt_tokens=0, pd_early_prefill=False)

    async def planned(body: dict, max_model_len: int | None, route: str = "completions") -> tuple[str, bool]:
        """The path, and whether the planner also tells the chat's overflow apart (given its count)."""
        metrics = RouterMetrics()
        prefill, decode = planner_pools(cfg, metrics)
        if max_model_len is not None:
            decode.workers["http://d"].model_cards = [{"id": "m", "max_model_len": max_model_len}]
        async with aiohttp.ClientSession() as http:
            planner = PathPlanner(cfg, prefill, decode, PromptTokens(http, {}, None), StoreView(), LMCacheView(),
                                  _estimate(), metrics)
            call = Call(route=route, raw=b"{}", body={"model": "m", **body}, request_id="r")
            path, _ = await planner.plan(call)
            chat = Call(route="chat", raw=b"{}", body={"model": "m", **body}, request_id="c")
            chat.prompt_ids = list(range(1000))
            overflows_as_chat = planner._overflows(chat)
        lookups = 'pdserve_router_plan_seconds_count{step="store_lookup"}' in metrics.exposition().decode()
        assert lookups == (path == "pd")
        return path, overflows_as_chat

    ids = list(range(1000))
    assert await planned({"prompt": ids, "max_tokens": 1101}, 1100) == ("decode_only_too_long", True)
    assert await planned({"prompt": ids, "max_tokens": 1100}, 1100) == ("pd", False)  # 2100 > 1100: still P/D
    assert await planned({"prompt": ids}, 1100) == ("pd", False)  # vLLM fills the context
    assert await planned({"prompt": ids, "max_tokens": 10**12}, None) == ("pd", False)  # context not known yet
    assert await planned({"prompt": ids, "max_tokens": True}, 1100) == ("pd", False)  # not a count: vLLM's 400
    # chat: max_completion_tokens, when given, is the count vLLM goes by
    assert (await planned({"prompt": ids, "max_tokens": 10, "max_completion_tokens": 1101}, 1100))[1]
    assert not (await planned({"prompt": ids, "max_tokens": 1101, "max_completion_tokens": 10}, 1100))[1]


async def test_prompts_whose_kv_the_store_cannot_carry_go_decode_only() -> None:
    """A request that scores its prompt (vLLM reads no cached KV for it) or carries media (the store keys KV
    by token ids alone) would waste its prefill leg."""
    cfg = RouterConfig(decode_urls=("http://d",), pd_min_prompt_tokens=0, pd_early_prefill=False)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = {"type": "text", "text": "what is it"}
    cases = [
        ("completions", {"prompt": list(range(500)), "echo": True, "logprobs": 0}, "decode_only_prompt_logprobs"),
        ("completions", {"prompt": list(range(500)), "prompt_logprobs": 1}, "decode_only_prompt_logprobs"),
        ("completions", {"prompt": list(range(500)), "echo": True}, "pd"),  # echo alone scores nothing
        ("chat", {"messages": [{"role": "user", "content": "x"}], "echo": True, "top_logprobs": 2},
         "decode_only_prompt_logprobs"),
        ("completions", {"prompt": "", "prompt_embeds": "AAAA"}, "decode_only_media"),
        ("chat", {"messages": [{"role": "user", "content": [text, image]}]}, "decode_only_media"),
        ("chat", {"messages": [{"role": "user", "content": [text]}]}, "pd"),
    ]
    metrics = RouterMetrics()
    prefill, decode = planner_pools(cfg, metrics)
    async with aiohttp.ClientSession() as http:
        planner = PathPlanner(cfg, prefill, decode, PromptTokens(http, {}, None), StoreView(), LMCacheView(),
                              _estimate(), metrics)
        for route, body, want in cases:
            path, _ = await planner.plan(Call(route=route, raw=b"x" * 4000, body=body, request_id="r"))
            assert path == want, (route, body)


def test_queue_flags_parse_and_refuse_a_bad_interval() -> None:
    cfg = config_from_args(["--decode", "http://d", "--pd-queue-poll-interval", "0.25"])
    assert (cfg.pd_queue_aware, cfg.pd_queue_poll_interval) == (True, 0.25)
    with pytest.raises(SystemExit):
        config_from_args(["--decode", "http://d", "--pd-queue-poll-interval", "0"])


async def test_uncounted_prompts_are_estimated_at_the_counted_prompts_bytes_per_token() -> None:
    async with aiohttp.ClientSession() as http:
        tokens = PromptTokens(http, {}, None)
        assert tokens.estimate(4000) == 1000  # nothing counted yet: 4 bytes per token
        tokens.learn(1632, 1056)  # the first counted prompt replaces that prior
        assert tokens.estimate(1632) == 1056
        tokens.learn(1632 * 3, 1056)  # later ones move the average by a fifth of the difference
        assert tokens.estimate(1632) == int(1632 / (1632 / 1056 * 1.4))
        tokens.learn(0, 10)  # an empty body or prompt teaches nothing
        tokens.learn(10, 0)
        # Neither do token-id prompts (no tokenizer counted them) nor prompts nothing could count.
        assert await tokens.ids("completions", {"prompt": [1, 2, 3]}, "http://127.0.0.1:9", body_size=999) == [1, 2, 3]
        assert await tokens.ids("completions", {"prompt": "x"}, "http://127.0.0.1:9", body_size=999) is None
        assert tokens.estimate(1632) == int(1632 / (1632 / 1056 * 1.4))


def test_an_overlapped_decode_leg_is_due_at_the_backlogs_end_less_its_ingest() -> None:
    w = _worker("p", inflight_tokens=3000)  # the new prompt's 1000 behind 2000 of others
    est = _estimate(per_token=0.001)
    assert est.overlap_delay(w, now=0.0) is None  # no streamed decode leg seen: no ingest known
    est.decode_ingest.observe(0.05)
    assert est.overlap_delay(w, now=0.0) == pytest.approx(3.0 - 0.05)
    assert QueueEstimate(None).overlap_delay(w) is None  # no prefill timed: no end to predict


def test_one_slow_leg_does_not_move_the_timing_of_the_next() -> None:
    """The EWMA the queue-aware paths weigh moves by a fifth of a 5x slower leg; the median that times
    an overlapped decode leg stays at the other legs' speed until slow legs are the majority."""
    w, est = _worker("p", inflight_tokens=1000), _estimate(per_token=0.001)
    est.decode_ingest.observe(0.01)
    for t in range(2):
        est.prefill.observe(w, 1000, 10.0 * t, 10.0 * t + 1.0)
    est.prefill.observe(w, 1000, 30.0, 35.0)  # one prefill five times slower (a loaded machine)
    assert est.prefill.per_token == pytest.approx(0.001 + prefill_estimate.ALPHA * 0.004)
    assert est.overlap_delay(w, now=40.0) == pytest.approx(1.0 - 0.01)
    for t in range(2):  # slower for good: three of the last five
        est.prefill.observe(w, 1000, 50.0 + 10 * t, 55.0 + 10 * t)
    assert est.prefill.recent.value == pytest.approx(0.005)
    est.decode_ingest.observe(0.5)
    est.decode_ingest.observe(0.02)
    assert est.decode_ingest.value == pytest.approx(0.02)  # median of 0.01, 0.5, 0.02


def test_prompts_batched_into_one_step_still_time_the_next_overlapped_leg(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four 1000-token legs sent one after another and answered together (one engine step for all four,
    as a GPU engine batches them): the timing figure is each leg's latency over the backlog it was sent
    behind, so the next leg is due when four such prompts take, not at once (a leg's service share would
    be 1 s for the first and 0 for the others: median 0)."""
    clock = [0.0]
    monkeypatch.setattr(prefill_estimate.time, "perf_counter", lambda: clock[0])
    cost, w = TokenCost(), _worker()
    with contextlib.ExitStack() as legs:
        for i in range(4):
            clock[0] = 0.001 * i
            legs.enter_context(cost.leg(w, 1000)).ok = True
        clock[0] = 1.0
    # backlogs 1000..4000 (nothing served yet), latencies about 1 s
    assert cost.recent.value == pytest.approx((0.999 / 2000 + 0.998 / 3000) / 2)
    est = QueueEstimate(None)
    est.prefill = cost
    est.decode_ingest.observe(0.01)
    w.inflight_tokens = 4000  # another four behind the same backlog
    assert est.overlap_delay(w, now=1.0) == pytest.approx(4000 * cost.recent.value - 0.01)
    assert est.overlap_delay(w, now=1.0) > 1.0
