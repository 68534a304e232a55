"""GPU P/D: real GPU vLLM engines hand bf16 MLA and fp8_ds_mla KV to each other through the store.

Runs on a CUDA host with GPU vLLM installed (`make test-gpu`); skipped elsewhere. Per model
(tiny DeepSeek-V3: bf16 MLA; tiny DeepSeek-V3.2: sparse MLA with the fp8_ds_mla cache) one
stack of separate processes shares the GPU: two KV stores, `pdserve prefill`, `pdserve decode`,
the router, and a colocated engine. The colocated engine computes every prompt itself (its
greedy tokens are the reference) and, as a kv_producer on the second store, saves the KV it
computed, which is the byte reference for what a consumer loads.

PDSERVE_TEST_ENGINE_ARGS replaces the GPU engine flags and PDSERVE_TEST_ARCHS (comma-separated)
picks the models; `PDSERVE_TEST_ON_CPU=1` dry-runs the same tests on the CPU build (deepseek_v3
only), to find a broken test before spending GPU time.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pdserve.deploy.cli import main as pdserve_main
from pdserve.bench.engine_counters import parse_counters
from pdserve.kvstore.client.client import KVStoreClient
from pdserve.kvstore.client.keys import chunk_keys
from procs import ENGINE_ARGS, ENGINE_START_TIMEOUT_S, Proc, free_port, http_ok, pdserve_argv, start_process

pytest.register_assert_rewrite("router_fixtures")
from router_fixtures import metric  # noqa: E402

ON_CPU = os.environ.get("PDSERVE_TEST_ON_CPU") == "1"


def _gpu_vllm() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not (ON_CPU or _gpu_vllm()), reason="needs a CUDA device and GPU vLLM"),
]

CHUNK = 256
MAX_TOKENS = 16
# Lengths straddle KV blocks (16 tokens bf16 MLA, 64 fp8_ds_mla) and store chunks (256).
LENGTHS = (40, 255, 256, 257, 1000, 1025, 2047, 3000)
GPU_ENGINE_ARGS = (
    "--max-model-len", "8192", "--max-num-seqs", "16", "--enforce-eager",
    "--kv-cache-memory-bytes", str(4 << 30), "--gpu-memory-utilization", "0.15", "--enable-prompt-tokens-details",
)
CPU_ENGINE_ARGS = (*ENGINE_ARGS, "--enable-prompt-tokens-details")
ARCHS = {"deepseek_v3": (), "deepseek_v32": ("--kv-cache-dtype", "fp8_ds_mla")}
TIMEOUT = httpx.Timeout(300.0)


def engine_args(arch: str) -> tuple[str, ...]:
    base = os.environ.get("PDSERVE_TEST_ENGINE_ARGS")
    if base is not None:
        args = tuple(shlex.split(base))
    else:
        args = CPU_ENGINE_ARGS if ON_CPU else GPU_ENGINE_ARGS
    return ("--load-format", "dummy", *args, *ARCHS[arch])


def kv_config(role: str, store_url: str) -> str:
    return json.dumps({"kv_connector": "PDServeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"kvstore_url": store_url}})


class Store:
    def __init__(self) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.proc = start_process(
            [*pdserve_argv("kvstore"), "--port", str(self.port), "--http-port", str(self.http_port),
             "--chunk-size", str(CHUNK), "--l1-size-gb", "2", "--log-level", "WARNING"],
            f"http://127.0.0.1:{self.http_port}/health", name="kvstore", port=self.port, timeout=60,
        )


class GPUStack:
    """Every process of one model's P/D stack, the engines started side by side."""

    def __init__(self, arch: str, model: Path):
        self.arch, self.model = arch, str(model)
        self.procs: list[Proc] = []
        self.store, self.ref_store = Store(), Store()
        self.procs += [self.store.proc, self.ref_store.proc]
        args = engine_args(arch)
        self.prefill_port, self.decode_port, self.coloc_port = free_port(), free_port(), free_port()
        launches = [
            (pdserve_argv("prefill", "--model", self.model, "--port", str(self.prefill_port),
                          "--kvstore-url", self.store.url, "--", *args), self.prefill_port, "prefill"),
            (pdserve_argv("decode", "--model", self.model, "--port", str(self.decode_port),
                          "--kvstore-url", self.store.url, "--", *args), self.decode_port, "decode"),
            ([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
              "--host", "127.0.0.1", "--port", str(self.coloc_port),
              "--kv-transfer-config", kv_config("kv_producer", self.ref_store.url), *args],
             self.coloc_port, "colocated"),
        ]
        env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if ON_CPU:
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
        for argv, _, name in launches:  # all at once: each waits below
            self.procs.append(start_process(argv, None, name=name, env=env))
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        for proc, (_, port, name) in zip(self.procs[2:], launches):
            while not http_ok(f"http://127.0.0.1:{port}/health"):
                if not proc.alive() or time.monotonic() > deadline:
                    raise AssertionError(f"{name} did not start; log {proc.log_path}:\n{proc.log_tail()}")
                time.sleep(1.0)
        self.router_port = self._router("router")  # the defaults: --pd-first-token for streamed completions

    def _router(self, name: str) -> int:
        port = free_port()
        self.procs.append(start_process(
            [*pdserve_argv("router"), "--port", str(port), "--prefill", self.url(self.prefill_port),
             "--decode", self.url(self.decode_port), "--tokenizer", self.model, "--pd-min-prompt-tokens", "0"],
            f"{self.url(port)}/health", name=name, port=port, timeout=120,
        ))
        return port

    @staticmethod
    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def complete(self, port: int, prompt: list[int], **extra: object) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, **extra}
        r = httpx.post(f"{self.url(port)}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    @functools.cached_property
    def namespace(self) -> str:
        """The store namespace of this model's KV layout, as the prefill worker reports it for a handoff."""
        out = self.complete(self.prefill_port, [5, 6, 7], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        return out["kv_transfer_params"]["namespace"]

    def stream(self, port: int, prompt: list[int]) -> list[dict]:
        """A streamed greedy completion's events (usage included), [DONE] left out."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.url(port)}/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200, r.read()
            data = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
        return [json.loads(d) for d in data if d != "[DONE]"]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def connector_counts(stack: "GPUStack", port: int) -> dict[str, float]:
    """An engine's vllm:pdserve_* counters (loads, failed_loads, saved_bytes, ...), summed."""
    return parse_counters(httpx.get(f"{stack.url(port)}/metrics", timeout=30).text)


def _settled_counts(stack: "GPUStack", port: int, key: str, want: float) -> dict[str, float]:
    """vLLM ships connector stats to /metrics with its periodic logging: wait (bounded) for `key` to reach `want`."""
    counts = connector_counts(stack, port)
    for _ in range(60):
        if counts.get(key, 0.0) >= want:
            break
        time.sleep(0.5)
        counts = connector_counts(stack, port)
    return counts


def cached_tokens(out: dict) -> int:
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(3, 1000) for _ in range(length)]


def _archs() -> list[str]:
    chosen = os.environ.get("PDSERVE_TEST_ARCHS")
    return chosen.split(",") if chosen else ["deepseek_v3"] if ON_CPU else list(ARCHS)


@pytest.fixture(scope="module", params=_archs())
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GPUStack]:
    arch = request.param
    model = tmp_path_factory.mktemp(f"tiny-{arch}")
    assert pdserve_main(["model", "tiny", "--arch", arch, "--out", str(model)]) == 0
    s = GPUStack(arch, model)
    try:
        yield s
    finally:
        s.stop()


def test_pd_through_the_router_equals_colocated(stack: GPUStack) -> None:
    """P/D greedy tokens equal a colocated engine's for prompts across block and chunk edges,
    and the decode engine loaded each prompt instead of computing it."""
    before = connector_counts(stack, stack.decode_port)
    for length in LENGTHS:
        prompt = prompt_of(length, seed=1)
        reference = stack.complete(stack.coloc_port, prompt)
        pd = stack.complete(stack.router_port, prompt)
        assert pd["choices"][0]["text"] == reference["choices"][0]["text"], f"{stack.arch} {length} tokens"
        assert cached_tokens(reference) == 0
        # vLLM loads all but the last prompt token (it computes that one to sample).
        assert cached_tokens(pd) >= length - 1 - (length - 1) % 16, (length, pd["usage"])
    # cached_tokens counts what vLLM was promised; the connector's counters say every load landed.
    after = _settled_counts(stack, stack.decode_port, "loads", before.get("loads", 0) + len(LENGTHS))
    assert after.get("loads", 0) - before.get("loads", 0) == len(LENGTHS), (before, after)
    assert after.get("failed_loads", 0) == before.get("failed_loads", 0), (before, after)
    assert after.get("scatter_bytes", 0) > before.get("scatter_bytes", 0)


def test_pd_first_token_streams_what_colocated_answers(stack: GPUStack) -> None:
    """`--pd-first-token` (the default) on GPU engines: the prefill's token opens the stream and the decode
    engine, handed the prompt plus that token, loads the prompt's KV (params made for its prompt's start) and
    goes on; the text is the colocated engine's greedy answer and usage counts the handed token as generated."""
    handed_before = metric(stack.url(stack.router_port), "pdserve_router_paths_total",
                           {"path": "pd_first_token"})
    before = connector_counts(stack, stack.decode_port)
    for length in LENGTHS:
        prompt = prompt_of(length, seed=4)
        reference = stack.complete(stack.coloc_port, prompt)
        events = stack.stream(stack.router_port, prompt)
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert text == reference["choices"][0]["text"], f"{stack.arch} {length} tokens"
        assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS, events[-1]
        assert events[-1]["usage"]["prompt_tokens"] == length, events[-1]
    handed = metric(stack.url(stack.router_port), "pdserve_router_paths_total",
                    {"path": "pd_first_token"}) - handed_before
    # Prompts whose first token ends inside a character take the overlapped flow; most start with a whole one.
    assert handed >= len(LENGTHS) // 2, handed
    after = _settled_counts(stack, stack.decode_port, "loads", before.get("loads", 0) + len(LENGTHS))
    assert after.get("loads", 0) - before.get("loads", 0) == len(LENGTHS), (before, after)
    assert after.get("failed_loads", 0) == before.get("failed_loads", 0), (before, after)


def test_prefix_saved_by_one_engine_is_loaded_by_another(stack: GPUStack) -> None:
    """The prefill engine saves a prompt's chunks; the decode engine, seeing the prompt for the
    first time, loads them by prefix from the store and answers as the colocated engine does."""
    length = 4 * CHUNK + 37
    prompt = prompt_of(length, seed=2)
    reference = stack.complete(stack.coloc_port, prompt)
    stack.complete(stack.prefill_port, prompt, max_tokens=1)
    _wait_for_chunks(stack, prompt, [stack.store])
    before = connector_counts(stack, stack.decode_port)
    loaded = stack.complete(stack.decode_port, prompt)
    assert loaded["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached_tokens(loaded) >= 4 * CHUNK
    after = _settled_counts(stack, stack.decode_port, "loads", before.get("loads", 0) + 1)
    assert after.get("loads", 0) == before.get("loads", 0) + 1 and after.get("failed_loads", 0) == before.get(
        "failed_loads", 0), (before, after)


def _chunks_in(store: Store, stack: GPUStack, prompt: list[int]) -> int:
    with KVStoreClient(store.url) as client:
        return client.lookup(stack.namespace, chunk_keys(stack.namespace, prompt, CHUNK), [0])


def _wait_for_chunks(stack: GPUStack, prompt: list[int], stores: list[Store]) -> None:
    """Producers upload after the step that computed a chunk: wait (bounded) until every store has them."""
    want = len(prompt) // CHUNK
    for _ in range(300):
        if all(_chunks_in(s, stack, prompt) == want for s in stores):
            return
        time.sleep(0.1)
    store_stats = [httpx.get(f"http://127.0.0.1:{s.http_port}/stats", timeout=10).json() for s in stores]
    raise AssertionError(
        f"chunks never reached the stores: {[_chunks_in(s, stack, prompt) for s in stores]} in namespace "
        f"{stack.namespace}; stores: {store_stats}; prefill engine: {connector_counts(stack, stack.prefill_port)}; "
        f"log: {stack.procs[2].log_tail(3000)}"
    )


CONSUMER = textwrap.dedent(
    """
    import json, sys
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from pdserve.kvstore.connector import worker_side

    loaded = []  # per object loaded: group, chunk key, and its blocks read back from the paged cache
    load_one = worker_side.WorkerIO._load_one

    def recording_load_one(self, client, job, health):
        outcome = load_one(self, client, job, health)
        for spec in job.objects if outcome.ok else ():
            group = self.groups[spec.group]
            ids = torch.tensor(spec.block_ids, device=group.device)
            back = torch.cat([torch.stack([v[ids] for v in part.views]).flatten() for part in group.parts])
            loaded.append({"group": spec.group, "key": spec.key.hex() if spec.key else None,
                           "skip": spec.skip_blocks, "bytes": back.cpu().numpy().tobytes().hex()})
        return outcome

    worker_side.WorkerIO._load_one = recording_load_one

    if __name__ == "__main__":
        model, url, prompt, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
        llm = LLM(model=model, load_format="dummy", kv_transfer_config=KVTransferConfig(
            kv_connector="PDServeConnector", kv_role="kv_consumer",
            kv_connector_extra_config={"kvstore_url": url}), **args)
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0))[0]
        print("RESULT " + json.dumps({"cached": out.num_cached_tokens, "loaded": loaded}))
    """
)


def _llm_kwargs(arch: str) -> dict:
    """The engine flags as LLM(...) keyword arguments."""
    args, out, i = engine_args(arch), {}, 0
    while i < len(args):
        key = args[i].lstrip("-").replace("-", "_")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            value: object = args[i + 1]
            for kind in (int, float):
                try:
                    value = kind(value)
                    break
                except ValueError:
                    pass
            out[key] = value
            i += 2
        else:
            out[key] = True
            i += 1
    out.pop("load_format", None)
    out.pop("enable_prompt_tokens_details", None)
    return out


def test_loaded_blocks_equal_the_blocks_a_colocated_engine_computes(stack: GPUStack, tmp_path: Path) -> None:
    """Byte for byte: what a consumer engine's paged cache holds right after loading a prompt
    from the store equals the KV the colocated engine computed for it (saved to its own store)."""
    prompt = prompt_of(3 * CHUNK + 11, seed=3)
    stack.complete(stack.prefill_port, prompt, max_tokens=1)  # into the P/D store
    stack.complete(stack.coloc_port, prompt, max_tokens=1)  # computed, into the reference store
    _wait_for_chunks(stack, prompt, [stack.store, stack.ref_store])
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    run = subprocess.run(
        [sys.executable, str(script), stack.model, stack.store.url, json.dumps(prompt),
         json.dumps(_llm_kwargs(stack.arch))],
        capture_output=True, text=True, env=env, timeout=ENGINE_START_TIMEOUT_S, cwd=tmp_path,
    )
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"consumer failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    result = json.loads(line[len("RESULT "):])
    loaded = result["loaded"]
    assert result["cached"] >= 3 * CHUNK, result["cached"]
    assert {obj["key"] for obj in loaded} == {k.hex() for k in chunk_keys(stack.namespace, prompt, CHUNK)}
    with KVStoreClient(stack.ref_store.url) as ref:
        computed = ref.get(stack.namespace, [(obj["group"], bytes.fromhex(obj["key"])) for obj in loaded])
    for obj, reference in zip(loaded, computed):
        assert reference is not None and obj["skip"] == 0
        assert bytes.fromhex(obj["bytes"]) == bytes(reference), f"group {obj['group']} chunk {obj['key']} differs"
