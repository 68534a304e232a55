"""LoRA adapters and the KV store, on a real engine (vLLM CPU) with PDServeConnector as kv_both.

The same prompt has another KV on each adapter (an adapter on one layer changes the hidden
states every later layer caches), so the connector keys each adapter's chunks apart
(kvstore/client/keys.py). Before that, a request on adapter b loaded the chunks a request on
adapter a had stored and answered with other tokens. On the CPU build the model is the tiny
Gemma-3 (with LoRA on, vLLM runs the tiny DeepSeek's MoE layers through Triton kernels the CPU
build lacks); on a CUDA host with GPU vLLM (deploy/gpu_host/session.sh lora) it is the tiny
DeepSeek-V3. The adapters are random, on every layer's o_proj. On the H100 (GPU vLLM 0.26.0) the
tiny DeepSeek's next-token distribution came out uniform whichever adapter was named, so there the
isolation test fails its own precondition (the adapters must answer differently) rather than pass
without showing anything.
"""

from __future__ import annotations

import importlib.util
import json
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from kvstore_fixtures import start_kvstore
from procs import ENGINE_ARGS, Proc, start_vllm_server
from router_fixtures import API_KEY, connector_args, long_prompt, metric, start_router

pytestmark = pytest.mark.engine

CHUNK = 256  # the store's default chunk size
RANK = 8
HITS = "vllm:external_prefix_cache_hits_total"
GPU_ENGINE_ARGS = ("--max-model-len", "4096", "--max-num-seqs", "8", "--enforce-eager",
                   "--kv-cache-memory-bytes", str(1 << 30), "--gpu-memory-utilization", "0.15")


def _on_gpu() -> bool:
    """GPU vLLM on a CUDA host (torch is imported here, not at collection: the fast tier collects this module)."""
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _write_adapter(folder: Path, model_dir: Path, seed: int) -> Path:
    """A PEFT LoRA adapter with random (not zero) weights on every layer's o_proj."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    width = cfg["num_attention_heads"] * cfg.get("v_head_dim", cfg.get("head_dim"))  # o_proj's input
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        name = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        tensors[f"{name}.lora_A.weight"] = (torch.randn(RANK, width, generator=gen) * 0.5).to(torch.bfloat16)
        tensors[f"{name}.lora_B.weight"] = (torch.randn(cfg["hidden_size"], RANK, generator=gen) * 0.5).to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "target_modules": ["o_proj"], "bias": "none", "base_model_name_or_path": str(model_dir),
    }))
    return folder


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    on_gpu = _on_gpu()
    model: Path = request.getfixturevalue("tiny_deepseek_v3" if on_gpu else "tiny_gemma3")
    folder = tmp_path_factory.mktemp("adapters")
    adapters = [f"{name}={_write_adapter(folder / name, model, seed)}" for name, seed in (("a", 1), ("b", 2))]
    # Gemma-3's sliding-window layers need the retention interval (vLLM 0.32, the CPU build)
    own = () if on_gpu else ("--prefix-cache-retention-interval", str(CHUNK))
    store = start_kvstore(l1_size_gb=0.2)
    try:
        proc = start_vllm_server(model, extra_args=[
            *connector_args("kv_both", store.url), *own,
            "--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", *adapters,
        ], env={"VLLM_SERVER_DEV_MODE": "1"},  # for /reset_prefix_cache
            engine_args=GPU_ENGINE_ARGS if on_gpu else ENGINE_ARGS)
    except BaseException:
        store.stop()
        raise
    try:
        yield proc
    finally:
        proc.stop()
        store.stop()


def _post(engine: Proc, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(engine.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else {}


def _complete(engine: Proc, model: str, prompt: str, salt: str | None = None) -> tuple[str, list[float]]:
    """The greedy answer and its tokens' logprobs: random tiny models may answer alike on two adapters (seen on
    the GPU with the tiny DeepSeek), their logprobs tell the adapters apart."""
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "logprobs": 1,
            **({"cache_salt": salt} if salt else {})}
    choice = _post(engine, "/v1/completions", body)["choices"][0]
    return str(choice["text"]), list(choice["logprobs"]["token_logprobs"])


def test_an_adapters_kv_is_never_loaded_for_another_adapter(engine: Proc) -> None:
    prompt = long_prompt(300, seed=11)  # over two chunks
    own = _complete(engine, "b", prompt, salt="computed")  # a salt of its own: nothing in the store is its
    assert _complete(engine, "a", prompt) != own  # the adapters answer differently (a's chunks are stored now)
    hits = metric(engine.url, HITS)
    assert _complete(engine, "b", prompt) == own
    assert metric(engine.url, HITS) == hits  # nothing of a's was loaded for b


def test_an_adapters_kv_is_saved_and_loaded_for_that_adapter(engine: Proc) -> None:
    prompt = long_prompt(300, seed=12)
    first = _complete(engine, "b", prompt)  # computed, and its whole chunks stored under b's keys
    _post(engine, "/reset_prefix_cache")  # the engine's own cache forgets them; the store does not
    hits = metric(engine.url, HITS)
    assert _complete(engine, "b", prompt) == first
    assert metric(engine.url, HITS) - hits >= CHUNK


def test_pd_through_the_router_on_an_adapter_equals_that_adapter_alone(engine: Proc) -> None:
    """The router's legs both name the adapter; the engine serves both legs here (a kv_both engine can), so the
    prefill's tail goes through the store under the adapter's handoff name."""
    router = start_router("--prefill", engine.url, "--decode", engine.url, "--api-key", API_KEY,
                          "--pd-min-prompt-tokens", "0")
    try:
        prompt = long_prompt(300, seed=13)
        own = _complete(engine, "a", prompt, salt="computed")
        assert _complete(router, "a", prompt) == own
        paths = sum(metric(router.url, "pdserve_router_paths_total", {"path": p}) for p in ("pd", "pd_overlap"))
        assert paths == 1
    finally:
        router.stop()
