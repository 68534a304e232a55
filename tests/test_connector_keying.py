"""What the connector's chunk keys stand for: a request's token ids, its cache salt and its LoRA adapter.
Requests whose token ids do not say what their KV is (images, audio or video, whose placeholder
tokens are the same for any picture of a size; prompt embeddings, which have no real token ids) are
neither loaded nor saved. The scheduler side on a real store, with request objects carrying the
fields vLLM's `Request` has (the engine test of adapters is tests/test_connector_lora.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstore_fixtures import KVStoreProc
from pdserve.kvstore.client.client import KVStoreClient
from pdserve.kvstore.client.keys import adapter_identity, chunk_keys

pytestmark = pytest.mark.slow  # the scheduler side imports vLLM

CHUNK = 16
BLOCK = 16
PROMPT = list(range(100, 100 + 3 * CHUNK + 5))  # three whole chunks and a tail


def _sched(store: KVStoreProc) -> Any:
    from pdserve.kvstore.connector.plan import GroupGeometry
    from pdserve.kvstore.connector.scheduler_side import SchedulerSide

    args = {"url": store.url, "auth_token": None, "timeout_s": 2.0, "shm": None}
    return SchedulerSide(args, "ns", CHUNK, [GroupGeometry(BLOCK)], saves=True, loads=True, handoff_wait_s=5.0)


def _request(rid: str, **fields: Any) -> SimpleNamespace:
    base = {"request_id": rid, "prompt_token_ids": PROMPT, "kv_transfer_params": None, "cache_salt": None,
            "lora_request": None, "mm_features": None, "prompt_embeds": None}
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("adapter", [None, "sql"])
def test_stored_chunks_load_only_for_requests_their_keys_stand_for(store: KVStoreProc, adapter: str | None) -> None:
    keys = chunk_keys("ns", PROMPT, CHUNK, None, adapter_identity(adapter, "/adapters/1") if adapter else None)
    with KVStoreClient(store.url) as client:
        assert all(client.put("ns", [(0, k, bytes(64)) for k in keys]))
    sched = _sched(store)
    lora = SimpleNamespace(lora_name=adapter, lora_path="/adapters/1") if adapter else None
    # another adapter, or the same name pointed at other weights (vLLM's block hashes key the path too)
    others = ([SimpleNamespace(lora_name="chat", lora_path="/adapters/1"),
               SimpleNamespace(lora_name=adapter, lora_path="/adapters/2")] if adapter
              else [SimpleNamespace(lora_name="sql", lora_path="/adapters/1")])
    media = [SimpleNamespace(identifier="img-1")]
    loads = {
        "same": _request("r1", lora_request=lora),
        **{f"other adapter {i}": _request(f"r2-{i}", lora_request=o) for i, o in enumerate(others)},
        "salted": _request("r3", lora_request=lora, cache_salt="user-7"),
        "with an image": _request("r4", lora_request=lora, mm_features=media),
        "with embeddings": _request("r5", lora_request=lora, prompt_embeds=object()),
    }
    got = {what: sched.get_num_new_matched_tokens(req, 0) for what, req in loads.items()}
    assert got.pop("same") == (3 * CHUNK, True)
    assert set(got.values()) == {(0, False)}, got


def test_a_prefill_with_media_saves_nothing_and_promises_nothing(store: KVStoreProc) -> None:
    sched = _sched(store)
    params = {"do_remote_decode": True}
    fresh = [t + 1 for t in PROMPT]  # none of it stored
    plain = _request("p1", kv_transfer_params=params, prompt_token_ids=fresh)
    media = _request("p2", kv_transfer_params=params, prompt_token_ids=fresh, mm_features=[SimpleNamespace(identifier="i")])
    blocks = [list(range(len(PROMPT) // BLOCK + 1))]
    jobs = {}
    for req in (plain, media):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # an empty store: nothing to load
        state = sched.reqs[req.request_id]
        state.block_ids = blocks
        jobs[req.request_id] = sched._save_job(req.request_id, state, len(PROMPT))
    assert jobs["p1"] is not None and len(jobs["p1"].objects) == 4  # three chunks and the tail
    assert jobs["p2"] is None
    finished = SimpleNamespace(is_finished=lambda: True, status="FINISHED_LENGTH_CAPPED")
    assert sched.request_finished(SimpleNamespace(**vars(plain), **vars(finished))) is not None
    assert sched.request_finished(SimpleNamespace(**vars(media), **vars(finished))) is None
