"""Unit tests of the router's pure parts: config, request checks, policies, pool admission, errors.

No engines here: these pin the rules (which worker is picked, when 429, which 400)
cheaply, so the engine tests can stay few.
"""

from __future__ import annotations

import asyncio
import random
from typing import AsyncGenerator

import aiohttp
import msgspec
import pytest

from pdserve.kvstore.client.keys import adapter_identity
from pdserve.router.config import RouterConfig, config_from_args
from pdserve.router.errors import RouterError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.flow.prefill_leg import prefill_body
from pdserve.router.flow.relay import _has_token
from pdserve.router.policies import LeastLoaded, PrefixAware, RoundRobin, make_policy
from pdserve.router.pool import Pool, RouteContext, Worker
from pdserve.router.requests import validate


def _pool(role: str = "decode", n: int = 2, **cfg: object) -> Pool:
    config = RouterConfig(decode_urls=("http://d",), **cfg)  # type: ignore[arg-type]
    pool = Pool(role, config, RouterMetrics())  # type: ignore[arg-type]
    pool.add_static(f"http://w{i}" for i in range(n))
    for w in pool.workers.values():
        pool.set_health(w, True)
    return pool


def _ctx(tokens: int = 10, **prefix: int) -> RouteContext:
    return RouteContext(model=None, prompt_tokens=tokens, prefix_tokens=dict(prefix))


# ---------------------------------------------------------------- config


def test_config_parses_the_documented_flags() -> None:
    cfg = config_from_args(
        ["--port", "9000", "--prefill", "http://p1/", "http://p2", "--decode", "http://d1",
         "--prefill-policy", "prefix-aware", "--decode-policy", "round-robin", "--pd-min-prompt-tokens", "0",
         "--api-key", "k", "--max-inflight-per-worker", "2", "--max-queue", "0", "--max-header-bytes", "8192"]
    )
    assert cfg.port == 9000
    assert cfg.prefill_urls == ("http://p1", "http://p2")
    assert (cfg.prefill_policy, cfg.decode_policy) == ("prefix-aware", "round-robin")
    assert (cfg.pd_min_prompt_tokens, cfg.api_key, cfg.max_queue, cfg.max_header_bytes) == (0, "k", 0, 8192)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no decode worker and no Redis
        ["--decode", "localhost:8000"],  # not a URL
        ["--decode", "http://d", "--max-inflight-per-worker", "0"],
        ["--decode", "http://d", "--max-header-bytes", "0"],
        ["--decode", "http://d", "--prefill-policy", "random"],
    ],
)
def test_config_rejects_bad_flags(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2


# ---------------------------------------------------------------- request checks


@pytest.mark.parametrize(
    "route, raw, param",
    [
        ("chat", b"{not json", None),
        ("chat", b"[1, 2]", None),
        ("chat", b'{"messages": "hi"}', "messages"),
        ("chat", b'{"messages": []}', "messages"),
        ("chat", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "max_tokens"),
        ("chat", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        ("chat", b'{"messages": [{"role": "user", "content": "x"}], "model": 3}', "model"),
        ("completions", b'{"prompt": 5}', "prompt"),
        ("completions", b'{"prompt": [1, "a"]}', "prompt"),
        ("completions", b'{"prompt": [1, true]}', "prompt"),  # a bool is not a token id
        ("completions", b'{"prompt": [[1, 2], []]}', "prompt"),
        ("completions", b'{"prompt": [[1, 2], "a"]}', "prompt"),
        ("completions", b'{"prompt": ["a", ["b"]]}', "prompt"),
        ("completions", b'{"prompt": []}', "prompt"),
        ("completions", b'{"prompt": "x", "n": -1}', "n"),
        ("completions", b'{"prompt": "x", "n": 100000}', "n"),
        ("completions", b'{"prompt": "x", "best_of": 129}', "best_of"),
        ("completions", b'{"prompt": "x", "kv_transfer_params": {"do_remote_decode": true}}', "kv_transfer_params"),
        ("chat", b'{"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {}}', "kv_transfer_params"),
    ],
)
def test_validate_gives_400_naming_the_field(route: str, raw: bytes, param: str | None) -> None:
    with pytest.raises(RouterError) as exc:
        validate(route, raw)
    assert exc.value.status == 400
    assert exc.value.param == param
    err = msgspec.json.decode(exc.value.body())["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


def test_validate_accepts_every_prompt_form_and_keeps_unknown_fields() -> None:
    for prompt in ("x", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert validate("completions", msgspec.json.encode({"prompt": prompt}))["prompt"] == prompt
    body = validate("chat", b'{"messages": [{"role": "user", "content": "x"}], "tools": [], "seed": 1}')
    assert body["tools"] == [] and body["seed"] == 1


# ---------------------------------------------------------------- policies


def test_least_loaded_prefers_fewer_requests_then_fewer_tokens() -> None:
    a, b, c = (Worker(id=n, role="decode", url=n, source="static") for n in "abc")
    a.inflight, b.inflight, c.inflight = 2, 1, 1
    b.inflight_tokens, c.inflight_tokens = 500, 100
    assert LeastLoaded().choose([a, b, c], _ctx()) is c


def test_round_robin_cycles_in_id_order() -> None:
    ws = [Worker(id=n, role="decode", url=n, source="static") for n in "cab"]
    rr = RoundRobin()
    assert [rr.choose(ws, _ctx()).id for _ in range(4)] == ["a", "b", "c", "a"]


def test_prefix_aware_picks_the_longest_stored_prefix_then_least_loaded() -> None:
    a, b, c = (Worker(id=n, role="prefill", url=n, source="static", kvstore_url=f"tcp://{n}") for n in "abc")
    a.inflight = 0
    b.inflight, c.inflight = 3, 1
    ctx = _ctx(**{"tcp://a": 0, "tcp://b": 512, "tcp://c": 512})
    assert PrefixAware().choose([a, b, c], ctx) is c
    assert PrefixAware().choose([a, b, c], _ctx()) is a  # nothing stored: least-loaded


def test_make_policy_knows_every_cli_name() -> None:
    for name in ("least-loaded", "round-robin", "prefix-aware"):
        assert make_policy(name) is not None  # type: ignore[arg-type]


# ---------------------------------------------------------------- pool admission


async def test_pool_queues_then_refuses_with_429_and_retry_after() -> None:
    pool = _pool(n=1, max_inflight_per_worker=1, max_queue=1, queue_timeout=30.0)
    policy = LeastLoaded()
    first = await pool.acquire(policy, _ctx())
    waiter = asyncio.create_task(pool.acquire(policy, _ctx()))
    await asyncio.sleep(0)  # let it enter the queue
    assert pool.waiting == 1
    with pytest.raises(RouterError) as exc:
        await pool.acquire(policy, _ctx())
    assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "1"
    first.answered()
    second = await asyncio.wait_for(waiter, 5)
    assert second.worker is first.worker and pool.waiting == 0
    second.answered()
    assert first.worker.inflight == 0 and first.worker.inflight_tokens == 0


async def test_queue_timeout_gives_429() -> None:
    pool = _pool(n=1, max_inflight_per_worker=1, max_queue=4, queue_timeout=0.05)
    lease = await pool.acquire(LeastLoaded(), _ctx())
    with pytest.raises(RouterError) as exc:
        await pool.acquire(LeastLoaded(), _ctx())
    assert exc.value.status == 429
    lease.answered()


async def test_breaker_opens_after_repeated_failures_and_hard_failure_marks_down() -> None:
    pool = _pool(n=2, breaker_failures=2, breaker_cooldown=60.0)
    w0, w1 = pool.workers.values()
    for _ in range(2):
        lease = await pool.acquire(LeastLoaded(), _ctx(), exclude={w1.id})
        lease.failed(asyncio.TimeoutError())
    assert [w.id for w in pool.candidates(None)] == [w1.id]
    pool.set_health(w0, True)  # a passing health check cannot close the breaker before the cooldown
    assert w0 not in pool.candidates(None)
    lease = await pool.acquire(LeastLoaded(), _ctx())
    assert lease.worker is w1
    lease.failed(aiohttp.ClientConnectionError("refused"))
    with pytest.raises(RouterError) as exc:
        await pool.acquire(LeastLoaded(), _ctx())
    assert exc.value.status == 503
    pool.set_health(w1, True)
    assert pool.candidates(None) == [w1]


def test_unknown_model_is_404_once_models_are_known() -> None:
    pool = _pool(n=1)
    (w,) = pool.workers.values()
    pool.check_model("anything")  # not known yet: the worker decides
    w.model_cards = [{"id": "m1", "object": "model"}]
    pool.check_model("m1")
    with pytest.raises(RouterError) as exc:
        pool.check_model("m2")
    assert exc.value.status == 404 and exc.value.param == "model"


def test_max_model_len_is_the_smallest_a_models_workers_report_once_all_have() -> None:
    pool = _pool(n=2)
    w0, w1 = pool.workers.values()
    assert pool.max_model_len("m1") is None  # no cards yet
    w0.model_cards = [{"id": "m1", "max_model_len": 4096}, {"id": "m2", "max_model_len": 100}]
    assert pool.max_model_len("m1") is None  # w1 has not said
    w1.model_cards = [{"id": "m1", "max_model_len": 2048}]
    assert pool.max_model_len("m1") == 2048
    assert pool.max_model_len("m2") == 100  # only w0 serves it
    w1.model_cards = [{"id": "m1", "max_model_len": "2048"}]  # not an int: unknown
    assert pool.max_model_len("m1") is None
    pool.set_health(w1, False)
    assert pool.max_model_len("m1") == 4096


def test_a_model_is_an_adapter_where_its_card_names_a_parent() -> None:
    pool = _pool(n=1)
    [w] = pool.workers.values()
    w.model_cards = [{"id": "base", "parent": None}, {"id": "sql", "parent": "base", "root": "/adapters/sql"}]
    assert (pool.adapter("base"), pool.adapter("other")) == (None, None)
    assert pool.adapter("sql") == adapter_identity("sql", "/adapters/sql")  # as the connector keys it


# ---------------------------------------------------------------- stream parsing and prefill body


def test_first_token_detection_skips_the_role_chunk() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    assert not _has_token("chat", role)
    assert not _has_token("chat", role + token[:20])  # incomplete event
    assert _has_token("chat", role + token)
    assert _has_token("completions", b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
    assert _has_token("chat", b'data: {"error":{"message":"x"}}\n\n')
    assert _has_token("chat", b"data: [DONE]\n\n")


def test_prefill_body_is_one_unstreamed_token_with_remote_decode() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 50, "min_tokens": 5, "n": 2, "seed": 7, "tools": [{"type": "function"}]}
    sent = prefill_body(body)
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    assert sent["return_token_ids"] is True
    for dropped in ("stream_options", "max_completion_tokens", "min_tokens", "n"):
        assert dropped not in sent
    assert sent["seed"] == 7 and sent["tools"] == body["tools"]



def test_prefill_body_sends_the_routers_token_ids_as_the_prompt() -> None:
    body = {"model": "m", "prompt": "hello world", "max_tokens": 9}
    sent = prefill_body(body, "h" * 32, [5, 6, 7])
    assert sent["prompt"] == [5, 6, 7] and body["prompt"] == "hello world"
    assert prefill_body(body)["prompt"] == "hello world"


# ---------------------------------------------------------------- store view


async def test_store_view_degrades_when_the_store_is_down() -> None:
    """A store that does not answer (nothing listens on the port) costs only the routing hint."""
    from pdserve.router.store_view import StoreView
    from procs import free_port

    view = StoreView()
    url = f"tcp://127.0.0.1:{free_port()}"
    params = {"kvstore_url": url, "namespace": "ns", "chunk_size": 4, "tail_id": "t-1", "chunk_keys": []}
    assert view.learn(params) == url
    assert view.learn({"kvstore_url": url}) is None  # incomplete params teach nothing
    assert await view.prefix_tokens(list(range(12)), None) == {url: 0}
    await view.drop_tail(params)  # logged, not raised
    await view.close()


@pytest.mark.parametrize("token", [None, "s3cret"], ids=["open", "auth"])
async def test_store_view_counts_stored_prefix_tokens(token: str | None) -> None:
    """Against a real store: chunks put under the connector's keys are found as a token count."""
    from kvstore_fixtures import LAYOUT, start_kvstore

    from pdserve.kvstore.client.client import AsyncKVStoreClient
    from pdserve.kvstore.client.keys import chunk_keys
    from pdserve.router.store_view import StoreView

    store = start_kvstore(*(["--auth-token", token] if token else []))
    try:
        async with AsyncKVStoreClient(store.url, auth_token=token, shm=False) as client:
            ns = await client.register_layout(LAYOUT)
            tokens = list(range(40))
            keys = chunk_keys(ns, tokens, 16)
            await client.put(ns, [(0, keys[0], b"x" * 64), (0, keys[1], b"y" * 64)])
        params = {"kvstore_url": store.url, "namespace": ns, "chunk_size": 16}
        view = StoreView(token)
        view.learn(params)
        assert await view.prefix_tokens(tokens, None) == {store.url: 32}
        assert await view.prefix_tokens([7] + tokens[1:], None) == {store.url: 0}  # first chunk differs
        await view.close()
        if token:  # without the token the store refuses, which costs only the hint
            tokenless = StoreView()
            tokenless.learn(params)
            assert await tokenless.prefix_tokens(tokens, None) == {store.url: 0}
            await tokenless.close()
    finally:
        store.stop()


# ---------------------------------------------------------------- local tokenization


async def test_prompt_tokens_locally_from_the_model_folder(tiny_deepseek_v3) -> None:  # type: ignore[no-untyped-def]
    from pdserve.router.tokens import PromptTokens
    from pdserve.router.upstream import new_session

    async with new_session() as http:
        tokens = PromptTokens(http, {}, None)
        model = str(tiny_deepseek_v3)
        assert await tokens.ids("completions", {"prompt": [5, 6, 7]}, "http://unused") == [5, 6, 7]
        tokens.prepare(model)
        await asyncio.wait_for(asyncio.gather(*tokens._loading.values()), 120)
        chat = await tokens.ids("chat", {"model": model, "messages": [{"role": "user", "content": "hi there"}]},
                                "http://127.0.0.1:9")
        plain = await tokens.ids("completions", {"model": model, "prompt": "hi there"}, "http://127.0.0.1:9")
        assert chat and plain and len(chat) > len(plain)  # the chat template adds its markers
        # A request's own chat template is never rendered here (the unreachable worker's count: none).
        template = "{{ 'x' * 5000 }}"
        for own in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
            body = {"model": model, "messages": [{"role": "user", "content": "hi there"}], **own}
            assert await tokens.ids("chat", body, "http://127.0.0.1:9") is None
        # No local tokenizer and no reachable worker: None, so the router routes by its estimate.
        assert await PromptTokens(http, {}, None).ids("completions", {"prompt": "x"}, "http://127.0.0.1:9") is None
        await tokens.stop()


def test_fast_encode_counts_as_the_tokenizers_encode(tiny_deepseek_v3) -> None:  # type: ignore[no-untyped-def]
    """The offset-free encode is used where it counts prompts exactly as `encode` does (here, with
    and without special tokens, on text the probe did not contain), and refused where it does not."""
    from transformers import AutoTokenizer

    from pdserve.router.tokens import Encoders, PromptTokens, fast_encode_matches

    tok = AutoTokenizer.from_pretrained(tiny_deepseek_v3)
    assert Encoders(tok).fast
    rng = random.Random(5)
    words = ["alpha", "Beta", "  gamma", "42", "3.14", "\u00e9t\u00e9", "\u65e5\u672c", "\n", "don't", "x_y"]
    for n in (1, 40, 2000):
        text = "".join(rng.choice(words) + rng.choice(" \t") for _ in range(n))
        for add in (True, False):
            body = {"prompt": text, "add_special_tokens": add}
            assert PromptTokens._encode_locally(tok, True, "completions", body) == tok.encode(text, add_special_tokens=add)
    for fast in (True, False):  # a batch of one prompt counts as that prompt, in flat ids
        assert PromptTokens._encode_locally(tok, fast, "completions", {"prompt": ["hi there"]}) == tok.encode("hi there")

    class Skewed:  # a tokenizer whose Python encode differs from its backend's (as a subclass might)
        backend_tokenizer = tok.backend_tokenizer
        all_special_tokens: list[str] = []

        @staticmethod
        def encode(text: str, add_special_tokens: bool = True) -> list[int]:
            return [7, *tok.encode(text, add_special_tokens=add_special_tokens)]

    assert not fast_encode_matches(Skewed()) and not fast_encode_matches(object())


async def test_long_prompts_tokenize_at_once_each_on_its_own_copy(tiny_deepseek_v3, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Concurrent prompts are tokenized in parallel on copies of the tokenizer (one fast tokenizer
    shared by two threads fails with "Already borrowed", which would send them to a worker's
    /tokenize, here unreachable: None), and every count is the tokenizer's own. A prompt waits for a
    free copy as long as it takes here: with fewer copies than prompts (one per core), a busy machine
    kept some waiting past the router's BORROW_WAIT_S, which sends them to the worker, and that is
    not what this test is about."""
    from transformers import AutoTokenizer

    from pdserve.router import tokens as tokens_module
    from pdserve.router.tokens import PromptTokens
    from pdserve.router.upstream import new_session

    monkeypatch.setattr(tokens_module, "BORROW_WAIT_S", 600.0)

    model = str(tiny_deepseek_v3)
    reference = AutoTokenizer.from_pretrained(model)
    prompts = [" ".join(f"w{i}x{j}" for j in range(3000)) for i in range(8)]
    async with new_session() as http:
        tokens = PromptTokens(http, {}, None)
        tokens.prepare(model)
        (encoders,) = await asyncio.wait_for(asyncio.gather(*tokens._loading.values()), 120)
        got = await asyncio.gather(*(
            tokens.ids("completions", {"model": model, "prompt": p}, "http://127.0.0.1:9") for p in prompts))
        assert got == [reference.encode(p) for p in prompts]
        assert 1 <= encoders.made <= 8
        await tokens.stop()


def test_encoders_lend_each_copy_to_one_thread_at_a_time() -> None:
    import threading
    import time

    from pdserve.router.tokens import Encoders

    encoders = Encoders(object(), limit=3)
    users: dict[int, int] = {}  # copy -> threads holding it now
    count = threading.Lock()
    overlaps: list[int] = []
    start = threading.Barrier(6)

    def use() -> None:
        start.wait()
        for _ in range(20):
            with encoders.borrow() as tok:
                with count:
                    users[id(tok)] = users.get(id(tok), 0) + 1
                    overlaps.append(users[id(tok)])
                time.sleep(0.001)
                with count:
                    users[id(tok)] -= 1

    threads = [threading.Thread(target=use) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert max(overlaps) == 1  # never two threads on one copy
    assert encoders.made == 3 and len(users) == 3  # copies made up to the limit, then waited for


def test_a_prompt_does_not_wait_long_for_a_busy_tokenizer() -> None:
    """When every copy is busy (say with huge prompts), a borrow gives up after its wait, and the
    router asks the worker instead of queuing every prompt's routing behind them."""
    import queue
    import threading

    from pdserve.router.tokens import Encoders

    encoders = Encoders(object(), limit=1)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with encoders.borrow():
            holding.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert holding.wait(10)
        with pytest.raises(queue.Empty):
            with encoders.borrow(wait_s=0.05):
                pass
    finally:
        release.set()
        t.join(10)
    with encoders.borrow(wait_s=0.05) as tok:  # free again
        assert tok is not None


# ---------------------------------------------------------------- GC


def test_tune_gc_freezes_startup_objects_and_still_collects_cycles() -> None:
    import gc
    import weakref

    from pdserve.router.app import GC_THRESHOLDS, tune_gc

    class Node:
        pass

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 1000  # the imports' objects are out of every collection
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.isenabled()
        cycle = Node()
        cycle.self = cycle  # type: ignore[attr-defined]
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None  # garbage made after start-up is still found
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


# ---------------------------------------------------------------- client disconnects


class _Client:
    """An ASGI receive channel whose client hangs up when told to (`leave`), as uvicorn reports it."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, object]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.left.set()


async def test_client_watch_turns_a_hang_up_into_an_end_of_the_request() -> None:
    from pdserve.router.flow.call import ClientWatch

    client = _Client()
    cleaned = []

    async def serve() -> str:
        with ClientWatch(client.receive) as watch:
            try:
                try:
                    await asyncio.sleep(3600)  # an upstream call
                finally:
                    cleaned.append("leg")
            except asyncio.CancelledError:
                if not watch.gone():
                    raise
                return "499"
        return "served"

    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0)
    client.leave()
    assert await task == "499"
    assert cleaned == ["leg"] and not task.cancelled()


async def test_client_watch_lets_other_cancels_through() -> None:
    from pdserve.router.flow.call import ClientWatch

    client = _Client()

    async def serve() -> None:
        with ClientWatch(client.receive) as watch:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                assert not watch.gone()
                raise

    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0)
    task.cancel()  # a shutdown, say: the client is still there
    with pytest.raises(asyncio.CancelledError):
        await task
    # Both at once: the client leaves and the server shuts down. The shutdown's cancel must survive.
    client = _Client()
    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0)
    client.leave()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_client_watch_ignores_the_disconnect_after_its_block() -> None:
    from pdserve.router.flow.call import ClientWatch

    client = _Client()

    async def serve() -> str:
        with ClientWatch(client.receive):
            await asyncio.sleep(0)
            client.leave()  # uvicorn reports a finished response as a disconnect, during the last send
        await asyncio.sleep(0.01)  # the next request's work on this task would be cancelled here
        return "served"

    assert await serve() == "served"


async def test_event_stream_relays_until_the_client_leaves_and_cleans_up_at_once() -> None:
    from pdserve.router.flow.call import ClientWatch
    from pdserve.router.flow.relay import EventStream

    client = _Client()
    sent: list[dict[str, object]] = []
    ended = []

    async def relay() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: 1\n\n"
            client.leave()
            await asyncio.sleep(3600)  # the decode worker is slow with the next token
            yield b"data: 2\n\n"
        finally:
            ended.append("499")

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    stream = EventStream(relay(), {"X-Request-Id": "r"}, lambda: ended.append("unsent"))
    with ClientWatch(client.receive):
        await stream({"type": "http"}, client.receive, send)  # type: ignore[arg-type]
    assert ended == ["499"]  # the relay's finally ran: slots and upstream connection released
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"data: 1\n\n"
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]  # type: ignore[operator]


async def test_a_stream_the_client_left_before_its_first_chunk_is_cleaned_up_by_its_unsent_callback() -> None:
    """Closing an async generator that never started runs none of its code, so the relay's own cleanup
    (the decode leg's slot, the request's count) cannot run: the response calls `unsent` instead."""
    from pdserve.router.flow.relay import EventStream

    ran: list[str] = []
    unsent: list[int] = []
    sent: list[dict] = []

    async def relay() -> AsyncGenerator[bytes, None]:
        ran.append("started")
        try:
            yield b"data: 1\n\n"
        finally:
            ran.append("cleaned")

    async def stuck_at_headers(message: dict) -> None:  # a client that reads nothing: the headers' send waits
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await EventStream(relay(), {}, lambda: unsent.append(1))({"type": "http"}, None, stuck_at_headers)  # type: ignore[arg-type]
    assert unsent == [1] and ran == []

    async def reads(message: dict) -> None:
        sent.append(message)

    await EventStream(relay(), {}, lambda: unsent.append(2))({"type": "http"}, None, reads)  # type: ignore[arg-type]
    assert unsent == [1] and ran == ["started", "cleaned"]
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", b""]


def test_metrics_series_are_looked_up_once_and_counted_as_labels_would() -> None:
    metrics = RouterMetrics()
    ok = metrics.series(metrics.requests, "chat", "200")
    assert metrics.series(metrics.requests, "chat", "200") is ok
    assert metrics.series(metrics.requests, "chat", "499") is not ok
    ok.inc()
    metrics.series(metrics.requests, "chat", "200").inc()
    text = metrics.exposition().decode()
    assert 'pdserve_router_requests_total{route="chat",status="200"} 2.0' in text
    assert 'pdserve_router_requests_total{route="chat",status="499"} 0.0' in text


async def test_client_watch_leaves_no_cycle_for_the_gc() -> None:
    """Every request has a watch: its remains must go by reference counting, not pile up for the GC."""
    import gc
    import weakref

    from pdserve.router.flow.call import ClientWatch

    client = _Client()
    gc.disable()
    try:
        with ClientWatch(client.receive) as watch:
            watcher = weakref.ref(watch._watcher)  # type: ignore[arg-type]
            await asyncio.sleep(0)
        del watch
        for _ in range(3):  # the watcher's cancel runs, then the loop lets go of it
            await asyncio.sleep(0)
        assert watcher() is None
    finally:
        gc.enable()
