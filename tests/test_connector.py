"""PDServeConnector on real vLLM CPU engines: P/D handoff, prefix reuse, faults.

One KV store and two OpenAI servers per model (a kv_producer and a kv_both
consumer) are shared by every test of the module. The producer's own greedy output
is the colocated baseline: it never loads KV, so it always computes the prompt.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pdserve.kvstore.client.client import KVStoreClient
from pdserve.kvstore.client.keys import chunk_keys
from procs import Proc, free_port, pdserve_argv, start_process, start_together, start_vllm_server

pytestmark = pytest.mark.engine  # every test here runs a producer and a consumer engine

CHUNK = 256
MAX_TOKENS = 12
TIMEOUT = httpx.Timeout(180.0)


def kv_config(role: str, store_url: str) -> str:
    return json.dumps(
        {
            "kv_connector": "PDServeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"kvstore_url": store_url, "timeout_s": 3, "handoff_wait_s": 3},
        }
    )


class PDPair:
    """A store, a producer engine and a consumer engine on one tiny model."""

    def __init__(self, model: Path, extra: tuple[str, ...] = ()):
        port = free_port()
        self.store_url = f"tcp://127.0.0.1:{port}"
        http_port = free_port()
        self.store = start_process(
            [*pdserve_argv("kvstore"), "--port", str(port), "--http-port", str(http_port),
             "--chunk-size", str(CHUNK), "--tail-ttl-s", "5", "--l1-size-gb", "0.5"],
            f"http://127.0.0.1:{http_port}/health",
            name="kvstore",
        )
        self.store_http = f"http://127.0.0.1:{http_port}"
        self.procs: list[Proc] = [self.store]
        try:
            self.producer, self.consumer = start_together([  # together: one core each
                lambda: start_vllm_server(model, extra_args=("--kv-transfer-config", kv_config("kv_producer", self.store_url),
                                                             *extra)),
                lambda: start_vllm_server(model, extra_args=("--kv-transfer-config", kv_config("kv_both", self.store_url),
                                                             "--enable-prompt-tokens-details", *extra)),
            ])
        except BaseException:
            self.store.stop()
            raise
        self.procs += [self.producer, self.consumer]
        self.model = httpx.get(f"{self.producer.url}/v1/models").json()["data"][0]["id"]

    def complete(self, proc: Proc, prompt: list[int], **extra) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
        r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    def prefill(self, prompt: list[int]) -> dict:
        out = self.complete(self.producer, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = out["kv_transfer_params"]
        assert params and params["num_tokens"] == len(prompt)
        return params

    def decode(self, prompt: list[int], params: dict | None, **extra) -> tuple[str, int]:
        out = self.complete(self.consumer, prompt, kv_transfer_params=params, **extra)
        cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return out["choices"][0]["text"], cached

    def baseline(self, prompt: list[int]) -> str:
        return self.complete(self.producer, prompt)["choices"][0]["text"]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


# From under one chunk to over four chunks, with chunk-aligned and off-by-one lengths.
LENGTHS = [40, 255, 256, 257, 600, 768, 1030, 1300]


@pytest.fixture(scope="module")
def ds3(tiny_one_group: Path) -> Iterator[PDPair]:
    """DeepSeek-V3 where the CPU build runs MLA, else a one-group Gemma-3 (see conftest).

    vLLM turns its own prefix cache off for MLA on the CPU; off for Gemma too, so every
    reuse these tests see comes from the store."""
    pair = PDPair(tiny_one_group, extra=("--no-enable-prefix-caching",))
    yield pair
    pair.stop()


def test_pd_equals_colocated_one_group(ds3: PDPair) -> None:
    texts = set()
    for prompt in prompts(1, LENGTHS):
        want = ds3.baseline(prompt)
        params = ds3.prefill(prompt)
        got, cached = ds3.decode(prompt, params)
        assert got == want, f"{len(prompt)} tokens: P/D output differs from colocated"
        assert cached >= len(prompt) - 1, f"{len(prompt)} tokens: only {cached} loaded"
        texts.add(want)
    assert len(texts) > 1, "the tiny model answers every prompt alike: equality would prove nothing"


def test_params_for_another_tail_load_only_the_shared_chunks(ds3: PDPair) -> None:
    """A prompt with the producer's whole chunks and length but another tail (as when a router's
    tokenizer differs from the engine's near the end) must not load that tail: the params' prompt
    digest tells the two apart, and the consumer falls back to its own lookup of whole chunks."""
    (prompt,) = prompts(11, [2 * CHUNK + 40])
    other = prompt[: 2 * CHUNK] + [3 + (t + 1) % 997 for t in prompt[2 * CHUNK:]]
    params = ds3.prefill(prompt)
    want = ds3.baseline(other)
    got, cached = ds3.decode(other, params)
    assert got == want
    assert 2 * CHUNK <= cached < len(other) - 1, f"loaded {cached} tokens: the other prompt's tail came too"


def test_loaded_bytes_equal_computed_bytes(ds3: PDPair) -> None:
    """The consumer computing the same prompt (under a salt, so nothing is loaded)
    produces exactly the bytes the producer stored, and which the consumer loads."""
    (prompt,) = prompts(2, [3 * CHUNK + 10])
    params = ds3.prefill(prompt)
    ns = params["namespace"]
    _, cached = ds3.decode(prompt, None, cache_salt="bytes-check")
    assert cached == 0
    salted = chunk_keys(ns, prompt, CHUNK, salt="bytes-check")
    plain = [bytes.fromhex(k) for k in params["chunk_keys"]]
    with KVStoreClient(ds3.store_url) as client:
        deadline = time.monotonic() + 10
        while client.lookup(ns, salted, [0]) < len(salted) and time.monotonic() < deadline:
            time.sleep(0.1)
        produced = client.get(ns, [(0, k) for k in plain])
        computed = client.get(ns, [(0, k) for k in salted])
    assert len(produced) == 3 and all(p is not None for p in produced)
    for p, c in zip(produced, computed):
        assert c is not None and bytes(p) == bytes(c)


def test_prefix_reuse_loads_shared_chunks(ds3: PDPair) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(2 * CHUNK)]
    first = shared + [rng.randrange(3, 1000) for _ in range(CHUNK + 30)]
    second = shared + [rng.randrange(3, 1000) for _ in range(100)]
    ds3.decode(first, None)  # kv_both computes and saves the first prompt's chunks
    want = ds3.baseline(second)
    got, cached = ds3.decode(second, None)
    assert cached >= 2 * CHUNK
    assert got == want


def test_missing_or_corrupt_chunk_is_recomputed(ds3: PDPair) -> None:
    """A chunk whose stored bytes do not fit the layout is a load error: vLLM recomputes."""
    (prompt,) = prompts(4, [3 * CHUNK + 20])
    ns = ds3.prefill(prompts(5, [10])[0])["namespace"]
    keys = chunk_keys(ns, prompt, CHUNK)
    with KVStoreClient(ds3.store_url) as client:
        assert client.put(ns, [(0, keys[1], b"\x00" * 1000)]) == [True]  # planted before the producer writes
    want = ds3.baseline(prompt)
    params = ds3.prefill(prompt)
    failures = _recomputes(ds3.consumer)
    got, _ = ds3.decode(prompt, params)
    assert got == want
    assert _eventually(lambda: _recomputes(ds3.consumer) == failures + 1)


def test_store_down_at_load_time_is_recomputed(ds3: PDPair) -> None:
    (prompt,) = prompts(6, [2 * CHUNK + 50])
    want = ds3.baseline(prompt)
    params = ds3.prefill(prompt)
    failures = _recomputes(ds3.consumer)
    os.killpg(ds3.store.popen.pid, signal.SIGSTOP)
    try:
        got, _ = ds3.decode(prompt, params)
    finally:
        os.killpg(ds3.store.popen.pid, signal.SIGCONT)
    assert got == want
    assert _eventually(lambda: _recomputes(ds3.consumer) == failures + 1)


def _recomputes(consumer: Proc) -> float:
    """Failed loads the consumer counted (each recomputed by vLLM), from its /metrics."""
    return _metric(httpx.get(f"{consumer.url}/metrics").text, "vllm:pdserve_failed_loads_total")


def test_handoff_loads_from_the_store_named_in_its_params(ds3: PDPair) -> None:
    """A decode loads from the producer's store (kv_transfer_params.kvstore_url), not its own:
    pointed at an empty store, the load fails and is recomputed although the consumer's own
    store holds every chunk."""
    (prompt,) = prompts(10, [2 * CHUNK + 30])
    want = ds3.baseline(prompt)
    params = ds3.prefill(prompt)
    port, http_port = free_port(), free_port()
    empty = start_process(
        [*pdserve_argv("kvstore"), "--port", str(port), "--http-port", str(http_port), "--chunk-size", str(CHUNK),
         "--l1-size-gb", "0.1"],
        f"http://127.0.0.1:{http_port}/health",
        name="kvstore-empty",
    )
    try:
        failures = _recomputes(ds3.consumer)
        got, _ = ds3.decode(prompt, {**params, "kvstore_url": f"tcp://127.0.0.1:{port}"})
        assert got == want
        assert _eventually(lambda: _recomputes(ds3.consumer) == failures + 1)
        assert httpx.get(f"http://127.0.0.1:{http_port}/stats").json()["metrics"]["misses_total"] > 0
    finally:
        empty.stop()


def test_aborted_producer_frees_blocks_and_tail(ds3: PDPair) -> None:
    (prompt,) = prompts(7, [CHUNK + 100])
    body = {"model": ds3.model, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}}
    with httpx.stream("POST", f"{ds3.producer.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        for _ in r.iter_lines():
            break  # the client goes away after the first token: vLLM aborts the request
    deadline = time.monotonic() + 30
    metrics = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{ds3.producer.url}/metrics").text
        stats = httpx.get(f"{ds3.store_http}/stats").json()
        if _metric(metrics, "vllm:num_requests_running") == 0 and _live_tails(stats) == 0:
            break
        time.sleep(0.5)
    assert _metric(metrics, "vllm:num_requests_running") == 0
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0
    assert _live_tails(httpx.get(f"{ds3.store_http}/stats").json()) == 0


def _eventually(check, timeout_s: float = 30.0) -> bool:
    """vLLM publishes connector counters from its logger loop: give them a few seconds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exposed")


def _live_tails(stats: dict) -> int:
    return int(stats["metrics"]["live_tails"])


def test_gemma3_hybrid_pd_equals_colocated(tiny_gemma3: Path) -> None:
    """Sliding-window + full groups with the hybrid KV cache manager on.

    vLLM with per-request load failures (get_transfer_results) loads both groups. Older
    vLLM can map a failed load back only through one group, so there the connector does
    not load for this model: the decode recomputes, loads nothing, and must still answer
    exactly like the colocated run.
    """
    from pdserve.kvstore.connector import vllm_compat  # imports vLLM: here, not when the module is collected

    loads = vllm_compat.PER_REQUEST_LOAD_FAILURES
    extra = ("--prefix-cache-retention-interval", str(CHUNK)) if _has_retention_interval() else ()
    pair = PDPair(tiny_gemma3, extra=extra)
    try:
        for prompt in prompts(8, [40, 256, 300, 700, 1100]):
            want = pair.baseline(prompt)
            params = pair.prefill(prompt)
            got, cached = pair.decode(prompt, params)
            assert got == want, f"{len(prompt)} tokens: P/D output differs from colocated"
            if loads:
                assert cached >= len(prompt) - 1
            else:
                assert cached == 0, f"{len(prompt)} tokens: {cached} cached although loads are off"
        rng = random.Random(9)
        shared = [rng.randrange(3, 1000) for _ in range(2 * CHUNK)]
        pair.decode(shared + [5] * 40, None)
        second = shared + [rng.randrange(3, 1000) for _ in range(90)]
        got, cached = pair.decode(second, None)
        assert got == pair.baseline(second)
        if loads:
            assert cached >= 2 * CHUNK
        # The producer saves either way: its baseline run stored the shared prefix's chunks
        # (every one in the full-attention group; the sliding-window group keeps fewer).
        ns = params["namespace"]
        keys = chunk_keys(ns, shared, CHUNK)
        with KVStoreClient(pair.store_url) as client:
            assert _eventually(lambda: max(client.lookup(ns, keys, [g]) for g in (0, 1)) == len(keys))
    finally:
        pair.stop()


def _has_retention_interval() -> bool:
    """`--prefix-cache-retention-interval` exists from vLLM 0.32 (and in the seeds' fork)."""
    from vllm.config import CacheConfig

    return "prefix_cache_retention_interval" in CacheConfig.__dataclass_fields__
