"""Discovery through a real redis-server: Registrar and MembershipWatcher, then a router following it.

The first tests need no engine (records may point anywhere); the last one registers
the session's real engines and checks that the router serves through them while
they are registered, and stops when they leave.
"""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import openai
import pytest
import redis

pytest.register_assert_rewrite("router_fixtures")  # it is imported here before pytest loads it as a plugin
from pdserve.router.membership import MembershipWatcher
from pdserve.worker.registration import KEY_PREFIX, Registrar, WorkerRecord
from procs import Proc
from router_fixtures import API_KEY, Stack, chat_messages, long_prompt, metric, start_router, wait_until

pytest_plugins = ("router_fixtures",)


def _record(wid: str, role: str = "decode", model: str = "m", url: str = "http://127.0.0.1:9") -> WorkerRecord:
    return WorkerRecord(id=wid, role=role, url=url, model=model)  # type: ignore[arg-type]


async def _until(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:g} s"
        await asyncio.sleep(0.02)


async def test_join_load_leave_and_expiry(redis_url: str) -> None:
    views: list[set[str]] = []
    watcher = MembershipWatcher(redis_url, lambda recs: views.append(set(recs)), model="m")
    await watcher.start()
    try:
        clean = Registrar(redis_url, _record("d-clean"), ttl_s=1.0)
        killed = Registrar(redis_url, _record("d-killed"), ttl_s=1.0)
        other_model = Registrar(redis_url, _record("d-other", model="other"), ttl_s=1.0)
        for reg in (clean, killed, other_model):
            await reg.astart()
        await _until(lambda: set(watcher.records) == {"d-clean", "d-killed"}, "both joined")
        clean.update_load(running=3, waiting=1)
        await _until(lambda: watcher.records["d-clean"].load == {"running": 3, "waiting": 1}, "load update")
        await clean.astop()  # DEL + leave: gone without waiting for the TTL
        await _until(lambda: "d-clean" not in watcher.records, "clean leave")
        assert redis.Redis.from_url(redis_url).exists(KEY_PREFIX + "d-clean") == 0
        killed._stop.set()  # what SIGKILL does: the heartbeat stops and nothing is deleted
        await _until(lambda: "d-killed" not in watcher.records, "expiry of a silent worker")
        await other_model.astop()
        assert all("d-other" not in v for v in views)  # filtered by model
    finally:
        await watcher.stop()


async def test_malformed_records_are_ignored(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.set(KEY_PREFIX + "junk", b"{not json", ex=30)
    r.set(KEY_PREFIX + "wrong-role", b'{"id":"x","role":"chef","url":"http://x","model":"m"}', ex=30)
    reg = Registrar(redis_url, _record("d-good", model="mm"), ttl_s=5.0)
    reg.start()
    watcher = MembershipWatcher(redis_url, lambda recs: None, model="mm")
    try:
        await watcher.start()
        await _until(lambda: "d-good" in watcher.records, "good record")
        assert set(watcher.records) == {"d-good"}
    finally:
        await watcher.stop()
        reg.stop()
        r.delete(KEY_PREFIX + "junk", KEY_PREFIX + "wrong-role")


def test_registrar_rejects_a_bad_ttl(redis_url: str) -> None:
    with pytest.raises(ValueError):
        Registrar(redis_url, _record("x"), ttl_s=0)


@pytest.fixture
def redis_router(pd_stack: Stack, redis_url: str) -> Iterator[Proc]:
    proc = start_router("--redis-url", redis_url, "--model", pd_stack.model, "--api-key", API_KEY,
                        "--pd-min-prompt-tokens", "0", "--health-interval", "0.5", ready="/health")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.engine
def test_router_follows_workers_joining_and_leaving(pd_stack: Stack, redis_url: str, redis_router: Proc) -> None:
    ready = lambda: httpx.get(redis_router.url + "/ready", timeout=10).status_code == 200  # noqa: E731
    client = openai.OpenAI(base_url=redis_router.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert not ready()
    prefill = Registrar(redis_url, _record("p-1", "prefill", pd_stack.model, pd_stack.prefill.url), ttl_s=2.0)
    decode = Registrar(redis_url, _record("d-1", "decode", pd_stack.model, pd_stack.decode.url), ttl_s=2.0)
    prefill.start()
    decode.start()
    try:
        wait_until(ready, what="router ready after decode joined")
        wait_until(lambda: metric(redis_router.url, "pdserve_router_worker_healthy", {"role": "prefill"}) == 1,
                   what="prefill worker healthy")
        resp = client.chat.completions.create(
            model=pd_stack.model, messages=chat_messages(long_prompt(30, seed=22)), max_tokens=3
        )
        assert resp.choices[0].finish_reason == "length"
        assert metric(redis_router.url, "pdserve_router_paths_total", {"path": "pd"}) == 1
    finally:
        decode.stop()
    wait_until(lambda: not ready(), what="router unready after decode left")
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model=pd_stack.model, messages=chat_messages("x"), max_tokens=1)
    assert exc.value.status_code == 503
    prefill.stop()
    wait_until(lambda: metric(redis_router.url, "pdserve_router_worker_healthy") == 0, what="no worker left")


async def test_a_redis_restart_takes_no_worker_out() -> None:
    """Redis killed and started again empty: the watcher keeps its view until the workers' next
    heartbeats have written their records again (before: every worker left until then)."""
    from procs import start_redis

    first = start_redis()
    port, url = first.port, f"redis://127.0.0.1:{first.port}/0"
    views: list[set[str]] = []
    watcher = MembershipWatcher(url, lambda recs: views.append(set(recs)), rescan_s=0.2, grace_s=5.0)
    regs = [Registrar(url, _record(f"d{i}"), ttl_s=3.0) for i in range(2)]
    second = None
    try:
        await watcher.start()
        for reg in regs:
            await reg.astart()
        await _until(lambda: set(watcher.records) == {"d0", "d1"}, "both joined")
        views.clear()
        first.stop()
        await asyncio.sleep(1.0)  # rescans fail meanwhile
        second = start_redis(port)  # same port, no data
        fresh = redis.Redis.from_url(url)
        await _until(lambda: fresh.exists(KEY_PREFIX + "d0") and fresh.exists(KEY_PREFIX + "d1"), "re-registered")
        await asyncio.sleep(0.5)
        assert set(watcher.records) == {"d0", "d1"}
        assert all(v == {"d0", "d1"} for v in views), views  # never fewer, at any change
    finally:
        for reg in regs:
            await reg.astop()
        await watcher.stop()
        for proc in (first, second):
            if proc is not None:
                proc.stop()
