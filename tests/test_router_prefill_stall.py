"""A prefill engine whose core stops while its API server answers: the router's stall watch (stall_watch.py).

vLLM's API server answers /health while its engine core makes no progress, so only the router's own
accounting shows the stall: a leg open past the window with none answered. This module's own prefill
engine has its engine core stopped (SIGSTOP of that one process, the API server left running) with a
P/D request in it. The request is answered decode-only while the core is still stopped, the worker
leaves the pool (the next prompt goes decode-only without a leg), a canary puts it back once the core
runs again, P/D resumes, the cut leg leaves no request behind in the engine, and every answer is the
prefill engine's own, token for token.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

pytest.register_assert_rewrite("router_fixtures")
from pdserve.bench.fault_stack import engine_core
from router_fixtures import API_KEY, Stack, long_prompt, metric, start_router, wait_until

pytest_plugins = ("router_fixtures",)
pytestmark = [pytest.mark.engine, pytest.mark.pd_spare("kv_producer")]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STALL_S = 3.0  # the router's --prefill-stall-timeout here


def complete(base: str, model: str, prompt: str, timeout: float = 300) -> list[int]:
    """Greedy completion's token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def path_count(router_url: str, path: str) -> float:
    return metric(router_url, "pdserve_router_paths_total", {"path": path})


def prefill_available(router_url: str) -> int:
    return httpx.get(f"{router_url}/ready", timeout=10).json()["prefill"]["healthy"]


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_stalled_prefill_engine_leaves_the_pool_its_leg_goes_decode_only_and_it_comes_back(
        pd_stack: Stack) -> None:
    model = pd_stack.model
    engine = pd_stack.engine("kv_producer")
    router = start_router("--prefill", engine.url, "--decode", pd_stack.decode.url, "--api-key", API_KEY,
                          "--pd-min-prompt-tokens", "0", "--prefill-stall-timeout", str(STALL_S),
                          "--health-interval", "1")
    core = engine_core(engine.pid)
    frozen = False
    try:
        # The pool learns its speed from answered legs: before that no worker is judged.
        for seed in (80, 81):
            complete(router.url, model, long_prompt(120, seed=seed))
        assert metric(router.url, "pdserve_router_token_seconds", {"pool": "prefill"}) > 0
        assert path_count(router.url, "decode_only_prefill_failed") == 0

        os.kill(core, signal.SIGSTOP)
        frozen = True
        assert httpx.get(f"{engine.url}/health", timeout=30).status_code == 200  # what health checks see
        held = long_prompt(120, seed=82)
        held_ids = complete(router.url, model, held, timeout=120)  # no thaw comes until it is answered
        assert stopped(core)
        assert metric(router.url, "pdserve_router_stalls_total", {"role": "prefill"}) == 1
        assert path_count(router.url, "decode_only_prefill_failed") == 1
        assert prefill_available(router.url) == 0

        # Out of the pool: the next prompt goes decode-only without a leg.
        later = long_prompt(120, seed=83)
        later_ids = complete(router.url, model, later, timeout=120)
        assert path_count(router.url, "decode_only_no_prefill") == 1
        assert stopped(core)

        os.kill(core, signal.SIGCONT)
        frozen = False
        wait_until(lambda: prefill_available(router.url) == 1, timeout=120, what="a canary to put the worker back")
        assert metric(router.url, "pdserve_router_stalls_total") == 1  # and none of the decode worker

        # P/D again for a new prompt (the decode engine, a kv_both, stored the ones it recomputed), and every
        # answer is the prefill engine's own, token for token (a kv_producer recomputes).
        legs = metric(router.url, "pdserve_router_leg_seconds_count", {"leg": "prefill"})
        after = long_prompt(120, seed=84)
        after_ids = complete(router.url, model, after)
        assert metric(router.url, "pdserve_router_leg_seconds_count", {"leg": "prefill"}) == legs + 1
        for prompt, ids in ((held, held_ids), (later, later_ids), (after, after_ids)):
            assert ids == complete(engine.url, model, prompt)

        # The cut leg was aborted in the engine once its core ran again: nothing left running or waiting.
        wait_until(lambda: metric(engine.url, "vllm:num_requests_running")
                   + metric(engine.url, "vllm:num_requests_waiting") == 0, what="the engine to be empty")
    finally:
        if frozen:
            os.kill(core, signal.SIGCONT)
        router.stop()
        engine.stop()
