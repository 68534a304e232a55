"""Queue-aware paths through real engines: an idle prefill worker gets P/D, a queued one is
skipped (decode-only, reason `decode_only_prefill_queue`) and the answer is still the
recomputing engine's, token for token.

The queue is made deterministic by stopping the prefill engine (SIGSTOP of its process
group) with two P/D requests in it, sent one at a time: they cannot drain, and its /metrics hang meanwhile,
so the router has to decide from its own accounting while its scrapes of that worker fail.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import httpx
import pytest

pytest.register_assert_rewrite("router_fixtures")
from pdserve.router.queue_view import parse_queue
from router_fixtures import API_KEY, Stack, long_prompt, metric, pd_router, wait_until

pytest_plugins = ("router_fixtures",)
pytestmark = pytest.mark.engine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def complete(base: str, model: str, prompt: str, max_tokens: int = 8) -> list[int]:
    """Greedy completion's token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def stream_ids(base: str, model: str, prompt: str, max_tokens: int = 8, timeout: float = 300) -> list[int]:
    """A streamed greedy completion's token ids (the relay sees its first token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    ids: list[int] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += httpx.Response(200, content=line[6:]).json()["choices"][0].get("token_ids") or []
    return ids


def paths(router_url: str) -> dict[str, float]:
    names = ("pd", "pd_overlap", "decode_only_prefill_queue")
    return {p: metric(router_url, "pdserve_router_paths_total", {"path": p}) for p in names}


def test_a_prefill_queue_sends_prompts_decode_only_and_tokens_stay_identical(pd_stack: Stack) -> None:
    stack, model = pd_stack, pd_stack.model
    # An idle vLLM's /metrics as the router reads them: the names this vLLM exports, zero queue.
    counts = parse_queue(urllib.request.urlopen(stack.prefill.url + "/metrics", timeout=30).read())
    assert counts is not None and (counts.running, counts.waiting) == (0, 0)

    # Health checks far apart and no stall watch: a stopped engine must stay a candidate, so the queue decides.
    router = pd_router(stack, "--pd-queue-poll-interval", "0.2", "--health-interval", "600",
                       "--prefill-stall-timeout", "0")
    stuck: list[threading.Thread] = []
    stuck_ids: dict[str, list[int]] = {}
    stopped = False
    try:
        # Idle: P/D, and the prefill legs teach the router the prefill speed.
        answers = {p: complete(router.url, model, p) for p in (long_prompt(200, seed=60), long_prompt(200, seed=61))}
        assert paths(router.url) == {"pd": 1, "pd_overlap": 1, "decode_only_prefill_queue": 0}
        assert metric(router.url, "pdserve_router_token_seconds", {"pool": "prefill"}) > 0
        for role in ("prefill", "decode"):  # with traffic, the router scrapes both workers' queues
            wait_until(lambda: metric(router.url, "pdserve_router_queue_scrapes_total",
                                      {"role": role, "outcome": "ok"}) >= 1, what=f"a {role} queue scrape")

        # Two prompts stuck in a stopped prefill engine, sent one at a time: the second waits behind at most
        # the first's length, no more than recomputing it costs, so it goes P/D too. (Sent together, all
        # plan against an empty queue and the test depends on their order.) Each is ~1056 tokens.
        os.killpg(stack.prefill.pid, signal.SIGSTOP)
        stopped = True
        failed_scrapes = metric(router.url, "pdserve_router_queue_scrapes_total", {"role": "prefill", "outcome": "failed"})
        stuck_prompts = [long_prompt(200, seed=s) for s in (62, 63)]
        for held, prompt in enumerate(stuck_prompts, 1):
            stuck.append(threading.Thread(
                target=lambda p=prompt: stuck_ids.__setitem__(p, complete(router.url, model, p)), daemon=True))
            stuck[-1].start()
            wait_until(lambda: metric(router.url, "pdserve_router_inflight", {"role": "prefill"}) == held,
                       what=f"{held} prefill legs held")
        wait_until(lambda: metric(router.url, "pdserve_router_queue_scrapes_total",
                                  {"role": "prefill", "outcome": "failed"}) > failed_scrapes,
                   what="a scrape of the stopped worker to fail")

        # A shorter prompt (~790 tokens) now waits behind at least one whole stuck prompt: decode-only.
        probe = long_prompt(150, seed=65)
        try:  # the decode worker alone can answer
            probe_ids = stream_ids(router.url, model, probe, timeout=120)
        except httpx.TimeoutException as exc:  # the router's reasons say which path it took and why
            raise AssertionError(f"the probe timed out; paths {paths(router.url)}; "
                                 f"router log:\n{router.log_tail(8000)}") from exc
        assert paths(router.url)["decode_only_prefill_queue"] == 1
        assert metric(router.url, "pdserve_router_inflight", {"role": "prefill"}) == 2  # still stuck

        os.killpg(stack.prefill.pid, signal.SIGCONT)
        stopped = False
        for t in stuck:
            t.join(300)
        assert sorted(stuck_ids) == sorted(stuck_prompts)

        # Token identity: every answer equals the prefill engine's own (a kv_producer recomputes).
        assert probe_ids and probe_ids == complete(stack.prefill.url, model, probe)
        for prompt, ids in {**answers, **stuck_ids}.items():
            assert ids == complete(stack.prefill.url, model, prompt)

        # Idle again: back to P/D. The reference answers above ran straight on the prefill engine, and a scrape
        # that saw the last one running counts it as another client's queue for two poll intervals (0.4 s):
        # the next prompt then went decode-only (seen once in a full run). After 0.5 s that snapshot is
        # stale or replaced by one of the idle engine.
        wait_until(lambda: metric(router.url, "pdserve_router_inflight", {"role": "prefill"}) == 0,
                   what="the prefill legs to end")
        time.sleep(0.5)
        before = paths(router.url)
        complete(router.url, model, long_prompt(200, seed=66))
        after = paths(router.url)
        assert after["decode_only_prefill_queue"] == before["decode_only_prefill_queue"]
        assert after["pd"] + after["pd_overlap"] == before["pd"] + before["pd_overlap"] + 1
    finally:
        if stopped:
            os.killpg(stack.prefill.pid, signal.SIGCONT)
        for t in stuck:
            t.join(60)
        router.stop()
