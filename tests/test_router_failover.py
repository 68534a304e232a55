"""Failure paths through real engines: a worker killed with SIGKILL, dead prefill pools, client disconnects.

A throwaway decode engine (the module's own) is killed mid-stream. Routers that
must still believe it alive afterwards (to exercise the retry on another worker
rather than the health check) are started before the kill, with a long
--health-interval. Ties between idle workers go to the first one listed, so each
router lists the victim first.
"""

from __future__ import annotations

import os
import signal
from typing import Iterator

import openai
import pytest

pytest.register_assert_rewrite("router_fixtures")  # it is imported here before pytest loads it as a plugin
from procs import free_port
from router_fixtures import (
    API_KEY, Stack, chat_messages, long_prompt, metric, pd_router, raw_post, start_router, wait_until,
)

pytest_plugins = ("router_fixtures",)
pytestmark = [pytest.mark.engine, pytest.mark.pd_spare("kv_both")]  # Victims' engine

LONG_STREAM = {"max_tokens": 3000, "extra_body": {"ignore_eos": True}}


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _running(url: str) -> float:
    return metric(url, "vllm:num_requests_running")


class Victims:
    """A decode engine to kill, and the routers that were started while it was alive."""

    def __init__(self, stack: Stack) -> None:
        self.engine = stack.engine("kv_both")
        slow_health = ("--health-interval", "600", "--api-key", API_KEY)
        e, p, d = self.engine.url, stack.prefill.url, stack.decode.url
        self.streaming = start_router("--prefill", p, "--decode", e, d, "--pd-min-prompt-tokens", "0", *slow_health)
        self.decode_retry = start_router("--decode", e, d, *slow_health)
        self.prefill_retry = start_router("--prefill", e, p, "--decode", d, "--pd-min-prompt-tokens", "0", *slow_health)
        self.prefill_gone = start_router("--prefill", e, "--decode", d, "--pd-min-prompt-tokens", "0", *slow_health)

    def kill_engine(self) -> None:
        os.killpg(self.engine.pid, signal.SIGKILL)
        self.engine.popen.wait(30)

    def stop(self) -> None:
        for proc in (self.streaming, self.decode_retry, self.prefill_retry, self.prefill_gone, self.engine):
            proc.stop()


@pytest.fixture(scope="module")
def victims(pd_stack: Stack) -> Iterator[Victims]:
    v = Victims(pd_stack)
    try:
        yield v
    finally:
        v.stop()


def test_decode_killed_mid_stream_then_retries_elsewhere(pd_stack: Stack, victims: Victims) -> None:
    # 1. Mid-stream: the stream ends with an error event, which the SDK raises (no hang, no silent cut).
    stream = _client(victims.streaming.url).completions.create(
        model=pd_stack.model, prompt=long_prompt(60, seed=10), stream=True, **LONG_STREAM
    )
    received = 0
    with pytest.raises(openai.APIError) as exc:
        for _ in stream:
            received += 1
            if received == 3:
                victims.kill_engine()
    assert "mid-stream" in str(exc.value)
    assert metric(victims.streaming.url, "pdserve_router_requests_total", {"status": "502"}) == 1

    # 2. Before the first token: a router that still thinks the dead worker is up retries on the live one.
    prompt = chat_messages(long_prompt(30, seed=11))
    resp = _client(victims.decode_retry.url).chat.completions.create(
        model=pd_stack.model, messages=prompt, max_tokens=8, temperature=0.0
    )
    direct = _client(pd_stack.decode.url).chat.completions.create(
        model=pd_stack.model, messages=prompt, max_tokens=8, temperature=0.0
    )
    assert resp.choices[0].message.content == direct.choices[0].message.content
    assert metric(victims.decode_retry.url, "pdserve_router_retries_total", {"leg": "decode"}) == 1
    # The dead worker is now out: the next request goes straight to the live one.
    _client(victims.decode_retry.url).chat.completions.create(model=pd_stack.model, messages=prompt, max_tokens=2)
    assert metric(victims.decode_retry.url, "pdserve_router_retries_total", {"leg": "decode"}) == 1
    assert metric(victims.decode_retry.url, "pdserve_router_worker_healthy", {"worker": victims.engine.url}) == 0


def test_prefill_failure_moves_to_another_prefill_worker(pd_stack: Stack, victims: Victims) -> None:
    if victims.engine.alive():
        victims.kill_engine()
    hits_before = metric(pd_stack.decode.url, "vllm:external_prefix_cache_hits_total")
    resp = _client(victims.prefill_retry.url).completions.create(
        model=pd_stack.model, prompt=long_prompt(60, seed=12), max_tokens=4, temperature=0.0
    )
    assert resp.choices[0].finish_reason == "length"
    assert metric(victims.prefill_retry.url, "pdserve_router_retries_total", {"leg": "prefill"}) == 1
    assert metric(victims.prefill_retry.url, "pdserve_router_paths_total", {"path": "pd"}) == 1
    assert metric(pd_stack.decode.url, "vllm:external_prefix_cache_hits_total") - hits_before >= 256


def test_no_prefill_worker_left_means_decode_only(pd_stack: Stack, victims: Victims) -> None:
    if victims.engine.alive():
        victims.kill_engine()
    prompt = long_prompt(40, seed=13)
    expected = _client(pd_stack.decode.url).completions.create(
        model=pd_stack.model, prompt=prompt, max_tokens=6, temperature=0.0
    ).choices[0].text
    # The only prefill worker died after the router saw it healthy: the request falls back to decode-only.
    got = _client(victims.prefill_gone.url).completions.create(
        model=pd_stack.model, prompt=prompt, max_tokens=6, temperature=0.0
    ).choices[0].text
    assert got == expected
    assert metric(victims.prefill_gone.url, "pdserve_router_paths_total", {"path": "decode_only_prefill_failed"}) == 1
    # A router whose prefill pool was never reachable does not even try it.
    never = start_router("--prefill", f"http://127.0.0.1:{free_port()}", "--decode", pd_stack.decode.url,
                         "--api-key", API_KEY, "--pd-min-prompt-tokens", "0")
    try:
        got = _client(never.url).completions.create(
            model=pd_stack.model, prompt=prompt, max_tokens=6, temperature=0.0
        ).choices[0].text
        assert got == expected
        assert metric(never.url, "pdserve_router_paths_total", {"path": "decode_only_no_prefill"}) == 1
        assert metric(never.url, "pdserve_router_retries_total") == 0
    finally:
        never.stop()


def test_client_disconnect_aborts_both_legs_and_frees_the_tail(pd_stack: Stack) -> None:
    """One decode slot: request A streams and holds it; B's prefill finishes (its tail is stored) and B
    waits for decode; then both clients hang up. Nothing may keep running, and B's tail must be dropped."""
    router = pd_router(pd_stack, "--max-inflight-per-worker", "1", "--max-queue", "4")
    # Other tests' tails may still be alive (or expire meanwhile) in the shared store: count B's by the
    # store's op counters, which only grow, and look at the live-tail gauge only relative to them.
    tails = lambda: metric(pd_stack.kvstore.http, "pdserve_kvstore_live_tails")  # noqa: E731
    ops = lambda op: metric(pd_stack.kvstore.http, "pdserve_kvstore_requests_total", {"op": op})  # noqa: E731
    try:
        a = raw_post(router.url, "/v1/completions", {
            # As long as the engine's 4096-token context allows (the prompt is 126 tokens): at 70-130 tokens/s
            # A outlasts B's steps below, which a loaded 2-core CI machine has seen take longer than 3000 tokens.
            "model": pd_stack.model, "prompt": long_prompt(50, seed=14), "stream": True, "max_tokens": 3950,
            "ignore_eos": True,
        }, API_KEY)
        received = b""
        while b"data: " not in received:  # A is streaming from the decode engine
            chunk = a.recv(65536)
            assert chunk, "router closed A's stream"
            received += chunk
        wait_until(lambda: _running(pd_stack.decode.url) == 1, what="A running on decode")
        puts_before, drops_before = ops("put_tail"), ops("drop_tail")
        b = raw_post(router.url, "/v1/completions", {
            "model": pd_stack.model, "prompt": long_prompt(60, seed=15), "max_tokens": 5,
        }, API_KEY)
        wait_until(lambda: metric(router.url, "pdserve_router_queue_depth", {"role": "decode"}) == 1,
                   what="B queued for decode after its prefill")
        wait_until(lambda: ops("put_tail") == puts_before + 1, what="B's prefill tail stored")
        wait_until(lambda: tails() >= 1, what="the live-tail gauge to count B's tail")
        live = tails()
        b.close()  # B hangs up while it waits for decode
        wait_until(lambda: ops("drop_tail") == drops_before + 1, what="the router to drop B's tail")
        wait_until(lambda: tails() <= live - 1, what="B's tail gone from the store")
        assert _running(pd_stack.decode.url) == 1, "A finished before the test hung up on it: no mid-stream hang-up"
        a.close()  # A hangs up mid-stream
        wait_until(lambda: _running(pd_stack.decode.url) == 0, what="decode engine idle")
        assert _running(pd_stack.prefill.url) == 0
        wait_until(lambda: metric(router.url, "pdserve_router_inflight") == 0, what="router holds no slot")
        assert metric(router.url, "pdserve_router_queue_depth") == 0
        assert metric(router.url, "pdserve_router_requests_total", {"status": "499"}) == 2
    finally:
        router.stop()
