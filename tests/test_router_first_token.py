"""`pdserve router` (`--pd-first-token` is on by default) over the session's real P/D engines: the
prefill's token opens the stream, the decode leg (the prompt plus that token) loads the prompt's KV and
goes on, and the client gets the decode engine's own answer; requests outside the mode's allow-list take
the other flow (overlapped legs)."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

pytest.register_assert_rewrite("router_fixtures")  # it is imported here before pytest loads it as a plugin
from procs import Proc
from router_fixtures import API_KEY, Stack, long_prompt, metric, pd_router, sse_events

pytest_plugins = ("router_fixtures",)
pytestmark = pytest.mark.engine

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def router(pd_stack: Stack) -> Iterator[Proc]:
    proc = pd_router(pd_stack)  # the mode is on by default
    try:
        yield proc
    finally:
        proc.stop()


def _stream(base: str, body: dict) -> tuple[list[dict], str]:
    """The stream's events (without [DONE]) and the X-Request-Id it answered with."""
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, headers=HEADERS,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(list(r.iter_lines()))
        return [json.loads(e) for e in events if e != "[DONE]"], r.headers.get("x-request-id", "")


def _direct(stack: Stack, body: dict) -> str:
    """The decode engine's own answer, salted: its blocks then stay out of the prefix cache that the routed
    requests' decode legs look in, so those load the prompt's KV from the store rather than finding it there."""
    whole = {k: v for k, v in body.items() if k != "stream_options"} | {"cache_salt": "reference"}
    r = httpx.post(stack.decode.url + "/v1/completions", json={**whole, "stream": False}, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _prompt_tokens(stack: Stack, body: dict) -> int:
    r = httpx.post(stack.decode.url + "/tokenize", json={"model": stack.model, "prompt": body["prompt"]},
                   headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _whole_first_token(stack: Stack, seeds: range) -> dict:
    """A greedy request whose first token is a whole character (the random-weight model also answers with
    tokens that end inside one, which the mode leaves to the overlapped flow: first_token.handed_token)."""
    for seed in seeds:
        body = {"model": stack.model, "prompt": long_prompt(110, seed=seed), "max_tokens": 12, "temperature": 0.0}
        first = _direct(stack, {**body, "max_tokens": 1})
        if first and "\ufffd" not in first:
            return body
    raise AssertionError(f"no prompt among seeds {seeds} starts its answer with a whole character")


def test_the_prefills_token_opens_the_stream_and_the_decode_engine_goes_on(pd_stack: Stack, router: Proc) -> None:
    body = {**_whole_first_token(pd_stack, range(21, 61)), "stream_options": {"include_usage": True}}
    hits_before = metric(pd_stack.decode.url, "vllm:external_prefix_cache_hits_total")
    ttfts_before = metric(router.url, "pdserve_router_ttft_seconds_count")
    events, request_id = _stream(router.url, body)
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text == _direct(pd_stack, body)  # the colocated engine's greedy answer, token for token
    # The handed token's event, then the decode engine's. Its API server merges tokens into one event when it
    # falls behind its engine (seen on 2 busy cores), so the count is a range; the text above is the proof
    # that no token came twice.
    assert 2 <= sum(1 for e in events if e.get("choices")) <= body["max_tokens"]
    assert {e["id"] for e in events} == {f"cmpl-{request_id}"}  # the handed token's event looks like the rest
    assert [e for e in events if e.get("choices")][-1]["choices"][0]["finish_reason"] == "length"
    # usage as the colocated engine counts it: the handed token is generated, not prompt
    assert events[-1]["usage"]["completion_tokens"] == body["max_tokens"]
    assert events[-1]["usage"]["prompt_tokens"] == _prompt_tokens(pd_stack, body)
    assert metric(router.url, "pdserve_router_paths_total", {"path": "pd_first_token"}) == 1
    assert events[0]["choices"][0]["text"] == _direct(pd_stack, {**body, "max_tokens": 1})  # the prefill's token
    assert metric(router.url, "pdserve_router_ttft_seconds_count") - ttfts_before == 1  # timed once, at the lead
    # The decode engine loaded the prompt's KV (two whole chunks at least) instead of computing it.
    assert metric(pd_stack.decode.url, "vllm:external_prefix_cache_hits_total") - hits_before >= 512


def test_a_token_inside_a_character_takes_the_default_flow(pd_stack: Stack, router: Proc) -> None:
    """The prompt whose greedy answer starts with a token that ends inside a UTF-8 character (seen with
    this model): the decode leg regenerates it, the text is the decode engine's own."""
    body = {"model": pd_stack.model, "prompt": long_prompt(110, seed=21), "max_tokens": 12, "temperature": 0.0}
    first = _direct(pd_stack, {**body, "max_tokens": 1})
    if first and "\ufffd" not in first:
        pytest.fail(f"seed 21 now starts with a whole character ({first!r}): pick a prompt that does not")
    before = metric(router.url, "pdserve_router_paths_total", {"path": "pd_first_token"})
    events, _ = _stream(router.url, body)
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == _direct(pd_stack, body)
    assert metric(router.url, "pdserve_router_paths_total", {"path": "pd_first_token"}) == before


def test_requests_a_handed_token_could_change_take_the_default_flow(pd_stack: Stack, router: Proc) -> None:
    body = {"model": pd_stack.model, "prompt": long_prompt(110, seed=22), "max_tokens": 6, "temperature": 0.0,
            "logprobs": 1}
    before = metric(router.url, "pdserve_router_paths_total", {"path": "pd_first_token"})
    events, _ = _stream(router.url, body)
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == _direct(pd_stack, body)
    assert all(e["choices"][0]["logprobs"] for e in events if e.get("choices"))
    assert metric(router.url, "pdserve_router_paths_total", {"path": "pd_first_token"}) == before
    # and a whole (unstreamed) response the same
    r = httpx.post(router.url + "/v1/completions", json={**body, "logprobs": None}, headers=HEADERS, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _direct(pd_stack, {**body, "logprobs": None})
    assert metric(router.url, "pdserve_router_paths_total", {"path": "pd_first_token"}) == before


def test_a_request_the_decode_engine_refuses_is_its_error_not_a_token_then_an_error(pd_stack: Stack,
                                                                                    router: Proc) -> None:
    body = {**_whole_first_token(pd_stack, range(21, 61)), "max_tokens": 10**6, "stream": True}
    r = httpx.post(router.url + "/v1/completions", json=body, headers=HEADERS, timeout=120)
    direct = httpx.post(pd_stack.decode.url + "/v1/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == direct.status_code == 400, r.text
    assert r.json()["error"]["type"] == direct.json()["error"]["type"]
