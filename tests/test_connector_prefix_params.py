"""A decode leg whose prompt is the producer's plus the token the prefill generated (the router's
`--pd-first-token`): the consumer loads the producer's KV for the start of its prompt, tail included,
and only when the producer's whole-prompt digest matches that start."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.kvstore.client.keys import chunk_keys, prompt_digest
from test_store_faults import CHUNK, Store

BLOCK = 16


def _params(prompt: list[int], digest: bool = True) -> dict[str, Any]:
    return {"pdserve": 1, "namespace": "ns", "chunk_keys": [k.hex() for k in chunk_keys("ns", prompt, CHUNK, None)],
            "num_tokens": len(prompt), "tail_id": "tail-1",
            **({"prompt_digest": prompt_digest(prompt)} if digest else {})}


@pytest.mark.slow  # the scheduler side imports vLLM
def test_params_made_for_the_start_of_the_prompt_load_that_start_and_its_tail() -> None:
    from pdserve.kvstore.connector.plan import GroupGeometry
    from pdserve.kvstore.connector.scheduler_side import SchedulerSide

    store = Store()
    try:
        args = {"url": store.url, "auth_token": None, "timeout_s": 1.0, "shm": None}
        sched = SchedulerSide(args, "ns", CHUNK, [GroupGeometry(BLOCK)], saves=False, loads=True, handoff_wait_s=7.0)
        produced = [(i * 37) % 900 + 3 for i in range(608)]  # 2 whole chunks and a 96-token tail, 38 blocks

        def plan(prompt: list[int], params: dict[str, Any]) -> Any:
            req = SimpleNamespace(request_id=f"r{len(sched.reqs)}", prompt_token_ids=prompt, kv_transfer_params=params,
                                  cache_salt=None)
            return req, sched._handoff_plan(sched._state(req), params)

        # the prompt plus the handed token: the producer's 608 tokens load, the decode engine computes the 609th
        req, got = plan([*produced, 42], _params(produced))
        assert got is not None and (got.num_chunks, got.load_end, got.tail_end, got.tail_id) == (2, 608, 608, "tail-1")
        sched.plans[req.request_id] = got
        blocks = list(range(100, 139))  # 39 blocks: the consumer's 609 tokens
        sched.update_state_after_alloc(req, [blocks], 608)
        [job] = sched.pending_loads
        tail = [o for o in job.objects if o.key is None]
        assert [len(o.block_ids) for o in job.objects] == [16, 16, 6] and tail[0].block_ids == blocks[32:38]

        # the producer's own prompt: as before (the last token is the decode engine's to compute)
        _, same = plan(list(produced), _params(produced))
        assert same is not None and (same.load_end, same.tail_end) == (607, 608)

        # the same whole chunks and length, but the start of the tail differs: nothing of the params
        other = [*produced[:-1], produced[-1] + 1, 42]
        assert plan(other, _params(produced))[1] is None
        # a prefix without the producer's digest (chunk keys cover whole chunks only), or params for a longer prompt
        assert plan([*produced, 42], _params(produced, digest=False))[1] is None
        assert plan(produced[:-1], _params(produced))[1] is None
    finally:
        store.proc.stop()
