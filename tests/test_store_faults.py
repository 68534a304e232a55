"""The KV store as a fault domain, on a real store process and real vLLM CPU engines.

A store that dies (SIGKILL) or wedges (SIGSTOP) under several concurrent P/D
handoffs costs each request at most one short deadline, in parallel, not one
timeout per request in series: the first loads to miss the deadline mark the store
down, every other load fails at once, vLLM recomputes, and the answers equal the
colocated ones. Once the store is back (restarted on its port, or resumed), it is
used again. The engines run the connector's defaults (timeout_s, handoff_wait_s).
"""

from __future__ import annotations

from typing import Any

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pdserve.kvstore.client.client import KVStoreClient, KVStoreUnavailable
from pdserve.kvstore.server.config import KVStoreConfig
from pdserve.kvstore.connector.worker_side import LOAD_THREADS
from pdserve.kvstore.client.health import StoreDown, StoreHealth
from procs import Proc, free_port, pdserve_argv, start_process, start_together, start_vllm_server
from test_connector import _eventually, _metric, prompts

CHUNK = 256
CONCURRENT = 2 * LOAD_THREADS  # more handoffs at once than the consumer has load threads
HANDOFF_WAIT_S = 10.0  # the connector's default, spelled out for the bound below
TIMEOUT = httpx.Timeout(180.0)


class Store:
    """A store process on fixed ports, so it can be killed and started again where clients look."""

    def __init__(self, *flags: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.flags = flags
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.proc = self._start()

    def _start(self) -> Proc:
        return start_process(
            [*pdserve_argv("kvstore"), "--port", str(self.port), "--http-port", str(self.http_port),
             "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25", "--log-level", "WARNING", *self.flags],
            f"{self.http}/health",
            name="kvstore",
        )

    def arena(self) -> Path | None:
        with KVStoreClient(self.url, shm=False) as client:
            path = client.info().shm_path
        return Path(path) if path else None

    def kill(self) -> None:
        """SIGKILL, as a crash; the arena a killed store cannot unlink is removed here."""
        arena = self.arena()
        os.killpg(self.proc.popen.pid, signal.SIGKILL)
        self.proc.popen.wait(10)
        if arena is not None:
            arena.unlink(missing_ok=True)

    def restart(self) -> None:
        self.proc.stop()
        self.proc = self._start()

    def metrics(self) -> dict[str, float]:
        return httpx.get(f"{self.http}/stats").json()["metrics"]


def kv_config(role: str, store_url: str) -> str:
    """The connector with its default deadlines: what a user gets."""
    return json.dumps(
        {"kv_connector": "PDServeConnector", "kv_role": role, "kv_connector_extra_config": {"kvstore_url": store_url}}
    )


class Stack:
    def __init__(self, model: Path) -> None:
        self.store = Store("--tail-ttl-s", "30")
        self.procs: list[Proc] = []
        try:
            self.procs = start_together([  # together: one core each
                lambda: start_vllm_server(model, extra_args=("--kv-transfer-config", kv_config("kv_producer", self.store.url))),
                lambda: start_vllm_server(model, extra_args=("--kv-transfer-config", kv_config("kv_both", self.store.url),
                                                             "--enable-prompt-tokens-details")),
            ])
            self.producer, self.consumer = self.procs
        except BaseException:
            self.stop()
            raise
        self.model = httpx.get(f"{self.producer.url}/v1/models").json()["data"][0]["id"]

    def complete(self, proc: Proc, prompt: list[int], **extra) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
        r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    def prefill(self, prompt: list[int]) -> dict:
        return self.complete(self.producer, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
            "kv_transfer_params"
        ]

    def decode(self, prompt: list[int], params: dict) -> tuple[str, int]:
        out = self.complete(self.consumer, prompt, kv_transfer_params=params)
        return out["choices"][0]["text"], (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def baseline(self, prompt: list[int]) -> str:
        """The producer never loads: its own answer is the recomputed one."""
        return self.complete(self.producer, prompt)["choices"][0]["text"]

    def counters(self) -> dict[str, float]:
        text = httpx.get(f"{self.consumer.url}/metrics").text
        return {name: _metric(text, f"vllm:pdserve_{name}_total") for name in ("loads", "failed_loads", "store_timeouts", "loads_store_down")}

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.store.proc.stop()


@pytest.fixture(scope="module")
def stack(tiny_deepseek_v3: Path) -> Iterator[Stack]:
    s = Stack(tiny_deepseek_v3)
    yield s
    s.stop()


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.engine
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_dead_store_costs_one_deadline_not_one_per_request(stack: Stack, fault: str) -> None:
    seed = 100 if fault == "kill" else 200
    handoffs = prompts(seed, [300 + 37 * i for i in range(CONCURRENT)])
    fresh = prompts(seed + 1, [280 + 41 * i for i in range(CONCURRENT)])
    want = {tuple(p): stack.baseline(p) for p in handoffs + fresh}
    assert len(set(want.values())) > 1, "the tiny model answers every prompt alike: equality would prove nothing"
    params = [stack.prefill(p) for p in handoffs]
    before = stack.counters()

    if fault == "kill":
        stack.store.kill()
    else:
        os.killpg(stack.store.proc.popen.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(CONCURRENT) as pool:
            decoded = list(pool.map(lambda a: stack.decode(*a), zip(handoffs, params)))
        elapsed = time.monotonic() - started
        # the producer side too: lookups and saves on the dead store while new requests arrive
        with ThreadPoolExecutor(CONCURRENT) as pool:
            flows = list(pool.map(lambda p: stack.decode(p, stack.prefill(p)), fresh))
    finally:
        if fault == "stop":
            os.killpg(stack.store.proc.popen.pid, signal.SIGCONT)

    for prompt, (text, _) in zip(handoffs + fresh, decoded + flows):
        assert text == want[tuple(prompt)], f"{len(prompt)} tokens: output differs from recompute"
    assert _eventually(lambda: _delta(stack.counters(), before)["failed_loads"] >= CONCURRENT)
    d = _delta(stack.counters(), before)
    # Every handoff load failed and was recomputed; at most one wave of loads (one per load
    # thread, side by side) waited out the deadline, every other one failed without waiting.
    assert d["failed_loads"] >= CONCURRENT
    assert 1 <= d["store_timeouts"] <= LOAD_THREADS, d
    assert d["store_timeouts"] + d["loads_store_down"] == d["failed_loads"], d
    # A generous bound (the issue saw 30 s per request, in series): the batch took under a few handoff waits.
    assert elapsed < 3 * HANDOFF_WAIT_S, f"{CONCURRENT} concurrent handoffs took {elapsed:.1f} s"

    if fault == "kill":
        stack.store.restart()
    used = stack.store.metrics()
    (again,) = prompts(seed + 2, [2 * CHUNK + 40])
    want_again = stack.baseline(again)

    def loaded_again() -> bool:
        text, cached = stack.decode(again, stack.prefill(again))
        assert text == want_again
        return cached >= len(again) - 1

    assert _eventually(loaded_again), "the store was not used again after it came back"
    now = stack.store.metrics()
    assert now["requests_total{op=put}"] > used.get("requests_total{op=put}", 0)
    assert now["requests_total{op=get}"] > used.get("requests_total{op=get}", 0)
    assert now["hits_total{tier=l1}"] > used.get("hits_total{tier=l1}", 0)


# ---------------------------------------------------------------- health state, no engines


def test_missed_deadline_marks_store_down_and_probe_brings_it_back() -> None:
    store = Store()
    try:
        args = {"url": store.url, "auth_token": None, "timeout_s": 0.5, "shm": None}
        health = StoreHealth(args)
        with KVStoreClient(**args) as client:
            with health.guard():
                client.info()
            os.killpg(store.proc.popen.pid, signal.SIGSTOP)
            try:
                with pytest.raises(KVStoreUnavailable):
                    with health.guard():
                        client.lookup("ns", [b"k"], [0])
                assert not health.up
                with pytest.raises(StoreDown):  # refused without asking
                    with health.guard():
                        raise AssertionError("a guarded call ran while the store was down")
            finally:
                os.killpg(store.proc.popen.pid, signal.SIGCONT)
            assert _eventually(lambda: health.up, timeout_s=10)
            with health.guard():
                assert client.info().chunk_size == CHUNK
    finally:
        store.proc.stop()


def test_store_announces_its_id_and_advertised_url() -> None:
    plain = Store()
    named = Store("--store-id", "store-a", "--advertise-url", "tcp://10.1.2.3:7000")
    try:
        with KVStoreClient(plain.url) as client:
            info = client.info()
        assert info.store_id == f"{socket.gethostname()}/{plain.url}"
        assert info.advertise_url == plain.url
        with KVStoreClient(named.url) as client:
            info = client.info()
        assert (info.store_id, info.advertise_url) == ("store-a", "tcp://10.1.2.3:7000")
        assert httpx.get(f"{named.http}/stats").json()["store_id"] == "store-a"
    finally:
        plain.proc.stop()
        named.proc.stop()


def test_store_identity_flags_are_checked() -> None:
    assert KVStoreConfig(host="0.0.0.0", auth_token="t").advertised_url is None
    with pytest.raises(ValueError, match="--advertise-url"):
        KVStoreConfig(advertise_url="http://host:1").validate()
    with pytest.raises(ValueError, match="--store-id"):
        KVStoreConfig(store_id=" ").validate()


async def test_router_prefix_view_asks_only_the_store_the_params_name() -> None:
    """The router reaches a store by its advertised URL and trusts its count only under the
    announced id: another store answering at that URL (every host's store may be
    tcp://127.0.0.1:5556) gives no prefix hint for chunks it never saw."""
    from kvstore_fixtures import LAYOUT

    from pdserve.kvstore.client.client import AsyncKVStoreClient
    from pdserve.kvstore.client.keys import chunk_keys
    from pdserve.router.store_view import StoreView

    store = Store("--store-id", "host-b-store")
    try:
        async with AsyncKVStoreClient(store.url, shm=False) as client:
            ns = await client.register_layout(LAYOUT)
            tokens = list(range(40))
            keys = chunk_keys(ns, tokens, 16)
            await client.put(ns, [(0, keys[0], b"x" * 64), (0, keys[1], b"y" * 64)])
        for store_id, want in (("host-b-store", 32), ("host-a-store", 0)):
            view = StoreView()
            view.learn({"kvstore_url": store.url, "kvstore_id": store_id, "namespace": ns, "chunk_size": 16})
            assert await view.prefix_tokens(tokens, None) == {store.url: want}, store_id
            await view.close()
        # The id is asked once per id_trust_s, not before every lookup (a round trip on each request's way).
        for trust_s, asked in ((3600.0, 1), (0.0, 3)):
            view = StoreView(id_trust_s=trust_s)
            view.learn({"kvstore_url": store.url, "kvstore_id": "host-b-store", "namespace": ns, "chunk_size": 16})
            client = view._client(store.url)
            calls = []
            info = client.info
            async def counted_info() -> Any:
                calls.append(1)
                return await info()
            client.info = counted_info  # type: ignore[method-assign]
            for _ in range(3):
                assert await view.prefix_tokens(tokens, None) == {store.url: 32}
            assert len(calls) == asked, trust_s
            await view.close()
    finally:
        store.proc.stop()


@pytest.mark.slow  # the scheduler side imports vLLM
def test_producer_store_is_chosen_by_id_not_url_string() -> None:
    """Every Ray node's store is tcp://127.0.0.1:5556: params naming that URL under another
    store's id are not ours, and a load there does not wait for an upload that will never come."""
    from pdserve.kvstore.connector.plan import GroupGeometry, TransferJob
    from pdserve.kvstore.connector.scheduler_side import SchedulerSide
    from pdserve.kvstore.connector.worker_side import WorkerIO

    store = Store("--store-id", "node-b")
    args = {"url": store.url, "auth_token": None, "timeout_s": 1.0, "shm": None}
    io = WorkerIO(args, "ns", [], writes=False)
    try:
        sched = SchedulerSide(args, "ns", CHUNK, [GroupGeometry(16)], saves=False, loads=True, handoff_wait_s=7.0)
        assert (sched.store_id, sched.advertise_url) == ("node-b", store.url)
        assert sched._producer_store({"kvstore_url": store.url, "kvstore_id": "node-b"}) == (None, "node-b")
        assert sched._producer_store({"kvstore_url": store.url}) == (None, None)  # a producer without ids
        assert sched._producer_store({"kvstore_url": store.url, "kvstore_id": "node-a"}) == (store.url, "node-a")
        assert sched._producer_store({"kvstore_url": "tcp://10.0.0.1:5556", "kvstore_id": "node-a"}) == (
            "tcp://10.0.0.1:5556", "node-a")
        with KVStoreClient(**args) as client:
            assert io._wait_budget(client, TransferJob("r", wait_s=7.0, store_url=store.url, store_id="node-b")) == 7.0
            assert io._wait_budget(client, TransferJob("r", wait_s=7.0, store_url=store.url, store_id="node-a")) == 0.0
    finally:
        io.close()
        store.proc.stop()
