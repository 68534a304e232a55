"""Overlapped legs through real engines: the decode leg goes out with the prefill leg and waits in
the store for the producer's upload.

The router learns a prefill worker's store from its first answer, so each router's first
P/D request runs its legs in sequence and the ones after it overlap. A throwaway prefill
engine of this module is stopped (SIGSTOP) to hold a decode leg in its wait, then the client
hangs up or the engine is killed. Last, a producer that answers and dies before its upload
lands: a stub (stub_producer.py) that answers but never uploads stands in for it, since a real
engine's upload follows its answer by tens of ms (and stopping the store to hold it back makes
the decode engine's own wait fail within its 1 s store deadline and recompute, so no decode leg
would be left waiting).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

pytest.register_assert_rewrite("router_fixtures")
from procs import Proc, free_port, start_process
from router_fixtures import API_KEY, Stack, long_prompt, metric, pd_router, raw_post, start_router, wait_until

pytest_plugins = ("router_fixtures",)
pytestmark = [pytest.mark.engine, pytest.mark.pd_spare("kv_producer")]  # HeldPrefill's engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def complete(base: str, model: str, prompt: str | list[int], max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream_text(base: str, model: str, prompt: str | list[int], max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    return text


def read_response(sock) -> tuple[bytes, bytes]:
    """(status line and headers, body) of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    sock.close()
    return head, body


def overlapped(router: Proc) -> float:
    return metric(router.url, "pdserve_router_paths_total", {"path": "pd_overlap"})


def waiting(url: str) -> float:
    return metric(url, "vllm:num_requests_waiting")


def loads(url: str) -> tuple[float, float]:
    return metric(url, "vllm:pdserve_loads_total"), metric(url, "vllm:pdserve_failed_loads_total")


def test_overlapped_legs_equal_a_recomputing_engine(pd_stack: Stack) -> None:
    """Text prompts and token prompts with a tail and chunk-aligned (the store's chunk is 256
    tokens), streamed and not: each equals the prefill engine's own answer (a kv_producer never
    loads, so it recomputes), and the decode engine loaded each. Every prompt is new to the store:
    a stored one would be served decode-only."""
    # Health checks far apart: a loaded machine can miss them. Queue-aware paths off: the reference
    # answers below run straight on the prefill engine, and a queue scrape that saw one still running
    # made the next prompt's plan wait for it and go decode-only (seen once in a full-suite run).
    # Every stream overlapped too: by default the streamed ones would take the handed-token flow.
    router = pd_router(pd_stack, "--health-interval", "600", "--no-pd-queue-aware", "--no-pd-first-token")
    try:
        complete(router.url, pd_stack.model, long_prompt(40, seed=30))  # teaches the router its store
        assert overlapped(router) == 0
        loads_before = loads(pd_stack.decode.url)
        for i, send in enumerate((complete, stream_text)):
            prompts: list[str | list[int]] = [long_prompt(120, seed=31 + i), [(t * 37 + i) % 900 + 5 for t in range(512)],
                                              [(t * 11 + i) % 700 + 5 for t in range(301)]]
            for prompt in prompts:
                got = send(router.url, pd_stack.model, prompt)
                assert got == complete(pd_stack.prefill.url, pd_stack.model, prompt)
        assert overlapped(router) == 6
        # vLLM ships the connector's counters to /metrics on its logging interval
        wait_until(lambda: loads(pd_stack.decode.url)[0] - loads_before[0] >= 6, what="six loads counted")
        done, failed = (a - b for a, b in zip(loads(pd_stack.decode.url), loads_before))
        assert done == 6 and failed == 0
    finally:
        router.stop()


def test_the_same_prompt_twice_at_once(pd_stack: Stack) -> None:
    """Two requests with one prompt get two handoffs: each loads its own, both answers are right.
    (Whichever plans second may find the first's chunks stored: only a whole prompt stored skips P/D.)"""
    router = pd_router(pd_stack, "--pd-max-cached-fraction", "1.0", "--health-interval", "600", "--no-pd-queue-aware")
    try:
        complete(router.url, pd_stack.model, long_prompt(40, seed=32))
        prompt = long_prompt(150, seed=33)
        got: list[str] = []
        threads = [threading.Thread(target=lambda: got.append(complete(router.url, pd_stack.model, prompt)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        expected = complete(pd_stack.prefill.url, pd_stack.model, prompt)
        assert got == [expected, expected]
        assert overlapped(router) == 2
    finally:
        router.stop()


class HeldPrefill:
    """A prefill engine of this module that can be stopped mid-request, and a router over it."""

    def __init__(self, stack: Stack) -> None:
        self.engine = stack.engine("kv_producer")
        self.router = start_router("--prefill", self.engine.url, "--decode", stack.decode.url,
                                   "--api-key", API_KEY, "--pd-min-prompt-tokens", "0", "--health-interval", "600",
                                   "--prefill-stall-timeout", "0")  # a stopped engine's legs stay where they are

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.engine.pid, sig)

    def stop(self) -> None:
        self.router.stop()
        if self.engine.alive():
            self.signal(signal.SIGCONT)
        self.engine.stop()


@pytest.fixture(scope="module")
def held(pd_stack: Stack) -> Iterator[HeldPrefill]:
    h = HeldPrefill(pd_stack)
    try:
        complete(h.router.url, pd_stack.model, long_prompt(40, seed=34))  # the router learns its store
        yield h
    finally:
        h.stop()


def _hold_a_decode_leg(stack: Stack, held: HeldPrefill, seed: int):
    """Stop the prefill engine, send a request: its decode leg waits in the decode engine."""
    held.signal(signal.SIGSTOP)
    waiting_before = waiting(stack.decode.url)
    sock = raw_post(held.router.url, "/v1/completions", {
        "model": stack.model, "prompt": long_prompt(100, seed=seed), "max_tokens": 6, "temperature": 0.0,
    }, API_KEY)
    wait_until(lambda: waiting(stack.decode.url) == waiting_before + 1, what="the decode leg held in the engine")
    return sock, waiting_before


def test_client_gone_while_the_decode_leg_waits(pd_stack: Stack, held: HeldPrefill) -> None:
    sock, waiting_before = _hold_a_decode_leg(pd_stack, held, seed=35)
    aborted = metric(pd_stack.decode.url, "vllm:request_success_total", {"finished_reason": "abort"})
    sock.close()
    # The router drops the decode leg at once; the engine aborts it (no wait for handoff_wait_s).
    wait_until(lambda: waiting(pd_stack.decode.url) == waiting_before, what="the held decode leg aborted")
    held.signal(signal.SIGCONT)
    wait_until(lambda: metric(held.router.url, "pdserve_router_requests_total", {"status": "499"}) == 1,
               what="the router to count the client's hang-up")
    assert metric(pd_stack.decode.url, "vllm:request_success_total", {"finished_reason": "abort"}) >= aborted
    # The stack still serves, overlapped.
    prompt = long_prompt(90, seed=36)
    overlapped_before = overlapped(held.router)
    assert complete(held.router.url, pd_stack.model, prompt) == complete(pd_stack.prefill.url, pd_stack.model, prompt)
    assert overlapped(held.router) == overlapped_before + 1


def test_prefill_killed_while_the_decode_leg_waits(pd_stack: Stack, held: HeldPrefill) -> None:
    sock, waiting_before = _hold_a_decode_leg(pd_stack, held, seed=37)
    held.signal(signal.SIGKILL)
    head, body = read_response(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    expected = complete(pd_stack.prefill.url, pd_stack.model, long_prompt(100, seed=37), max_tokens=6)
    assert httpx.Response(200, content=body).json()["choices"][0]["text"] == expected
    # The overlapped leg was dropped for a decode-only one, not waited out.
    assert metric(held.router.url, "pdserve_router_paths_total", {"path": "decode_only_prefill_failed"}) == 1
    wait_until(lambda: waiting(pd_stack.decode.url) == waiting_before, what="no decode leg left waiting")


def test_producer_dead_after_its_answer_means_decode_only(pd_stack: Stack) -> None:
    """The stub producer answers the prefill leg; the overlapped decode leg waits in the store (for
    up to the router's prefill timeout, 300 s) for KV that never comes. While the producer lives, its
    health checks pass and the leg is kept; once it is killed (-9), the next check gives the leg up
    and the decode engine serves the request decode-only, as a recomputing engine answers it."""
    port = free_port()
    stub = start_process([sys.executable, str(Path(__file__).with_name("stub_producer.py")), "--port", str(port),
                          "--kvstore-url", pd_stack.kvstore.url, "--model", pd_stack.model],
                         f"http://127.0.0.1:{port}/health", name="stub-producer", port=port)
    # The decode leg goes out with the prefill leg (start): with the late send, a stub that answers at
    # once on a loaded machine could answer before the leg was due, and a leg built from the answer
    # is not watched (it waits handoff_wait_s, 10 s, and recomputes). Even with `start` an instant
    # answer could win (seen in 2 of 4 runs here): the stub answers after a second.
    router = start_router("--prefill", stub.url, "--decode", pd_stack.decode.url, "--api-key", API_KEY,
                          "--pd-min-prompt-tokens", "0", "--health-interval", "600", "--pd-overlap-send", "start")

    def stub_stats() -> dict[str, int]:
        return httpx.get(stub.url + "/stats", timeout=10).json()

    def lost() -> float:
        return metric(router.url, "pdserve_router_producer_lost_total")

    try:
        complete(router.url, pd_stack.model, long_prompt(40, seed=38))  # sequential: the router learns the store
        prompt = long_prompt(100, seed=39)
        waiting_before = waiting(pd_stack.decode.url)
        sock = raw_post(router.url, "/v1/completions", {
            "model": pd_stack.model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0}, API_KEY)
        wait_until(lambda: waiting(pd_stack.decode.url) == waiting_before + 1, what="the decode leg held in the engine")
        wait_until(lambda: metric(router.url, "pdserve_router_leg_seconds_count", {"leg": "prefill"}) == 2,
                   what="the prefill leg's answer")
        checks = stub_stats()["health_checks"]
        wait_until(lambda: stub_stats()["health_checks"] >= checks + 2, what="two health checks of the live producer")
        assert lost() == 0 and waiting(pd_stack.decode.url) == waiting_before + 1  # a live producer keeps its leg
        os.killpg(stub.pid, signal.SIGKILL)
        head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200"), head
        expected = complete(pd_stack.prefill.url, pd_stack.model, prompt, max_tokens=6)
        assert httpx.Response(200, content=body).json()["choices"][0]["text"] == expected
        assert lost() == 1
        assert overlapped(router) == 1
        wait_until(lambda: waiting(pd_stack.decode.url) == waiting_before, what="no decode leg left waiting")
    finally:
        router.stop()
        stub.stop()
