"""The router's OpenAI API over a real P/D pair (prefill kv_producer, decode kv_both, real KV store).

Greedy decoding on identical random weights makes outputs comparable: what the
client gets through the router (prefill on one engine, KV through the store,
decode on the other) must equal what the decode engine answers alone.
"""

from __future__ import annotations

import threading
import urllib.request
from typing import Iterator

import httpx
import msgspec
import openai
import pytest

pytest.register_assert_rewrite("router_fixtures")  # it is imported here before pytest loads it as a plugin
from procs import Proc
from router_fixtures import API_KEY, Stack, chat_messages, long_prompt, metric, pd_router, start_router, wait_until

pytest_plugins = ("router_fixtures",)
pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def router(pd_stack: Stack) -> Iterator[Proc]:
    proc = pd_router(pd_stack)
    try:
        yield proc
    finally:
        proc.stop()


def _client(base: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def test_chat_through_pd_equals_the_decode_engine_alone(pd_stack: Stack, router: Proc) -> None:
    prompt = long_prompt(110, seed=1)  # about 580 tokens: two full 256-token chunks and a tail move
    hits_before = metric(pd_stack.decode.url, "vllm:external_prefix_cache_hits_total")
    via_router = _client(router.url).chat.completions.create(
        model=pd_stack.model, messages=chat_messages(prompt), **GREEDY
    )
    hits_after = metric(pd_stack.decode.url, "vllm:external_prefix_cache_hits_total")
    direct = _client(pd_stack.decode.url).chat.completions.create(
        model=pd_stack.model, messages=chat_messages(prompt), **GREEDY
    )
    assert via_router.choices[0].message.content == direct.choices[0].message.content
    assert via_router.usage.completion_tokens == GREEDY["max_tokens"]
    assert via_router.usage.prompt_tokens == direct.usage.prompt_tokens > 256
    # The decode engine loaded the prompt's KV from the store instead of computing it.
    assert hits_after - hits_before >= 256
    assert metric(router.url, "pdserve_router_paths_total", {"path": "pd"}) >= 1


def test_streamed_chat_has_every_token_once(pd_stack: Stack, router: Proc) -> None:
    prompt = long_prompt(60, seed=2)
    kwargs = dict(model=pd_stack.model, messages=chat_messages(prompt), **GREEDY)
    whole = _client(router.url).chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        _client(router.url).chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"  # the stream starts like vLLM's, once
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]


def test_completions_streamed_and_not_equal_the_decode_engine(pd_stack: Stack, router: Proc) -> None:
    prompt = long_prompt(110, seed=3)
    kwargs = dict(model=pd_stack.model, prompt=prompt, **GREEDY)
    direct = _client(pd_stack.decode.url).completions.create(**kwargs).choices[0].text
    whole = _client(router.url).completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in _client(router.url).completions.create(stream=True, **kwargs))
    assert whole.choices[0].text == streamed == direct
    assert whole.usage.completion_tokens == GREEDY["max_tokens"]


def test_request_fields_pass_through(pd_stack: Stack, router: Proc) -> None:
    """Fields the router does not know reach the engine: logprobs, n, seed, vLLM extras. n > 1 is served
    decode-only (vLLM forks child requests that could not share the prefill's single-use tail)."""
    resp = _client(router.url).chat.completions.create(
        model=pd_stack.model, messages=chat_messages(long_prompt(40, seed=4)), max_tokens=5, temperature=1.0,
        logprobs=True, top_logprobs=2, n=2, seed=7, extra_body={"return_token_ids": True, "top_k": 3},
    )
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert len(choice.logprobs.content) == 5
        assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)
        assert len(choice.model_extra["token_ids"]) == 5
    assert metric(router.url, "pdserve_router_paths_total", {"path": "decode_only_n"}) == 1


def test_prompt_logprobs_go_decode_only_and_equal_the_decode_engine(pd_stack: Stack, router: Proc) -> None:
    """Scoring requests (lm-eval's echo + logprobs, vLLM's prompt_logprobs) need the prompt run where they
    are answered: P/D would prefill it for nothing, since vLLM reads no cached KV for them."""
    asks = ({"echo": True, "logprobs": 1, "max_tokens": 1}, {"extra_body": {"prompt_logprobs": 1}, "max_tokens": 2})
    before = metric(router.url, "pdserve_router_paths_total", {"path": "decode_only_prompt_logprobs"})
    for seed, ask in enumerate(asks, start=5):
        kwargs = dict(model=pd_stack.model, prompt=long_prompt(110, seed=seed), temperature=0.0, **ask)
        via_router = _client(router.url).completions.create(**kwargs).model_dump()
        direct = _client(pd_stack.decode.url).completions.create(**kwargs).model_dump()
        scores = (via_router["choices"][0]["logprobs"], via_router["choices"][0].get("prompt_logprobs"))
        assert any(s for s in scores)  # the answer carries the prompt's scores
        assert scores == (direct["choices"][0]["logprobs"], direct["choices"][0].get("prompt_logprobs"))
        assert via_router["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"] > 256
    after = metric(router.url, "pdserve_router_paths_total", {"path": "decode_only_prompt_logprobs"})
    assert after - before == len(asks)


def test_models_lists_what_the_workers_serve(pd_stack: Stack, router: Proc) -> None:
    models = _client(router.url).models.list()
    assert [m.id for m in models.data] == [pd_stack.model]


def test_api_key_is_required_and_passed_to_workers(pd_stack: Stack, router: Proc) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(router.url, key="wrong").models.list()
    resp = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
    # The workers require the key too, so every success above means the router sent it.
    direct = httpx.post(pd_stack.decode.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert direct.status_code == 401


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b'{"messages": "hello"}', 400, "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ],
)
def test_bad_input_gets_openai_errors(router: Proc, body: bytes, status: int, param: str | None) -> None:
    resp = httpx.post(
        router.url + "/v1/chat/completions", content=body, timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"]


def test_prompt_longer_than_the_model_is_a_400_from_the_worker(pd_stack: Stack, router: Proc) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _client(router.url).completions.create(model=pd_stack.model, prompt=[5] * 5000, max_tokens=1)
    assert "context length" in str(exc.value).lower() or "maximum" in str(exc.value).lower()


def test_max_tokens_past_the_decode_context_gets_the_engines_400_without_a_prefill(pd_stack: Stack,
                                                                                  router: Proc) -> None:
    """max_tokens over the decode engine's context: the request goes straight to that engine
    (decode_only_too_long), whose 400 is the answer; the prefill engine sees none of it."""
    cards = httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    limit = next(c["max_model_len"] for c in cards["data"] if c["id"] == pd_stack.model)
    prefilled = metric(pd_stack.prefill.url, "vllm:prompt_tokens_total")
    with pytest.raises(openai.BadRequestError):
        _client(router.url).completions.create(model=pd_stack.model, prompt=list(range(100, 400)), max_tokens=limit + 1)
    assert metric(router.url, "pdserve_router_paths_total", {"path": "decode_only_too_long"}) == 1
    assert metric(pd_stack.prefill.url, "vllm:prompt_tokens_total") == prefilled
    fits = _client(router.url).completions.create(model=pd_stack.model, prompt=list(range(100, 400)), max_tokens=2)
    assert fits.choices[0].finish_reason == "length"  # within the context: P/D as before
    assert metric(pd_stack.prefill.url, "vllm:prompt_tokens_total") > prefilled


def test_body_over_the_size_limit_is_413(pd_stack: Stack) -> None:
    small = start_router("--decode", pd_stack.decode.url, "--api-key", API_KEY, "--max-request-bytes", "2000")
    try:
        with pytest.raises(openai.APIStatusError) as exc:
            _client(small.url).completions.create(model=pd_stack.model, prompt="x" * 5000, max_tokens=1)
        assert exc.value.status_code == 413
        ok = _client(small.url).completions.create(model=pd_stack.model, prompt="hello", max_tokens=1)
        assert ok.choices[0].finish_reason == "length"
    finally:
        small.stop()


def test_short_prompts_skip_the_prefill_leg(pd_stack: Stack) -> None:
    """Under --pd-min-prompt-tokens the decode worker prefills locally; the prefill engine sees nothing."""
    proc = start_router("--prefill", pd_stack.prefill.url, "--decode", pd_stack.decode.url, "--api-key", API_KEY,
                        "--pd-min-prompt-tokens", "256")
    try:
        before = metric(pd_stack.prefill.url, "vllm:request_success_total")
        _client(proc.url).chat.completions.create(model=pd_stack.model, messages=chat_messages("hi"), max_tokens=2)
        _client(proc.url).chat.completions.create(
            model=pd_stack.model, messages=chat_messages(long_prompt(60, seed=6)), max_tokens=2
        )
        assert metric(pd_stack.prefill.url, "vllm:request_success_total") == before + 1
        assert metric(proc.url, "pdserve_router_paths_total", {"path": "decode_only_short"}) == 1
        assert metric(proc.url, "pdserve_router_paths_total", {"path": "pd"}) == 1
    finally:
        proc.stop()


def test_backpressure_queues_then_429_with_retry_after(pd_stack: Stack) -> None:
    proc = start_router("--decode", pd_stack.decode.url, "--api-key", API_KEY,
                        "--max-inflight-per-worker", "1", "--max-queue", "1")
    client = _client(proc.url)
    try:
        stream = client.completions.create(
            model=pd_stack.model, prompt="a b c", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # the worker's one slot is taken
        queued: dict[str, object] = {}
        waiter = threading.Thread(
            target=lambda: queued.update(r=client.completions.create(model=pd_stack.model, prompt="q", max_tokens=1))
        )
        waiter.start()
        wait_until(lambda: metric(proc.url, "pdserve_router_queue_depth", {"role": "decode"}) == 1)
        over = httpx.post(proc.url + "/v1/completions", timeout=30, json={"prompt": "z", "max_tokens": 1},
                          headers={"Authorization": f"Bearer {API_KEY}"})
        assert over.status_code == 429
        assert over.headers["retry-after"] == "1"
        assert over.json()["error"]["type"] == "RateLimitError"
        stream.close()  # frees the slot: the queued request runs
        waiter.join(120)
        assert queued["r"].choices[0].finish_reason == "length"  # type: ignore[attr-defined]
    finally:
        proc.stop()


def test_health_ready_and_metrics(pd_stack: Stack, router: Proc) -> None:
    assert httpx.get(router.url + "/health", timeout=10).json() == {"status": "ok"}
    ready = httpx.get(router.url + "/ready", timeout=10).json()
    assert ready["ready"] is True and ready["decode"]["healthy"] == 1 and ready["prefill"]["healthy"] == 1
    ok_before = metric(router.url, "pdserve_router_requests_total", {"route": "completions", "status": "200"})
    handoffs_before = metric(router.url, "pdserve_router_handoff_seconds_count")
    own_before = metric(router.url, "pdserve_router_overhead_seconds_count")
    list(_client(router.url).completions.create(model=pd_stack.model, prompt="m e t", max_tokens=2, stream=True))
    httpx.post(router.url + "/v1/completions", content=b"[]", headers={"Authorization": f"Bearer {API_KEY}"})
    text = urllib.request.urlopen(router.url + "/metrics", timeout=10).read().decode()
    for name in ("pdserve_router_requests_total", "pdserve_router_ttft_seconds", "pdserve_router_itl_seconds",
                 "pdserve_router_leg_seconds", "pdserve_router_handoff_seconds", "pdserve_router_queue_depth",
                 "pdserve_router_worker_healthy"):
        assert name in text
    # the router counts a stream once its relay has ended, which may be a moment after the client saw [DONE]
    wait_until(lambda: metric(router.url, "pdserve_router_requests_total",
                              {"route": "completions", "status": "200"}) > ok_before, what="the stream to be counted")
    assert metric(router.url, "pdserve_router_requests_total", {"route": "completions", "status": "200"}) == ok_before + 1
    assert metric(router.url, "pdserve_router_requests_total", {"route": "completions", "status": "400"}) >= 1
    assert metric(router.url, "pdserve_router_handoff_seconds_count") == handoffs_before + 1
    # the router's own time is counted once per streamed request, and is a sliver of its TTFT
    assert metric(router.url, "pdserve_router_overhead_seconds_count") == own_before + 1
    assert 0 < metric(router.url, "pdserve_router_overhead_seconds_sum") < metric(router.url, "pdserve_router_ttft_seconds_sum")
    assert metric(router.url, "pdserve_router_worker_healthy", {"role": "decode"}) == 1


def test_router_without_decode_workers_is_not_ready(pd_stack: Stack) -> None:
    proc = start_router("--decode", "http://127.0.0.1:9", ready="/health")
    try:
        resp = httpx.get(proc.url + "/ready", timeout=10)
        assert resp.status_code == 503 and resp.json()["ready"] is False
        chat = httpx.post(proc.url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == 503
        assert msgspec.json.decode(chat.content)["error"]["message"].startswith("no healthy decode worker")
    finally:
        proc.stop()
