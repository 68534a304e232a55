"""Overlapped handoffs without an engine: the tail's name binds the prompt, and a watch waits in a
real store until the producer's upload lands (or is cancelled, or gives up)."""

from __future__ import annotations

import threading

import pytest
from kvstore_fixtures import LAYOUT, KVStoreProc, start_kvstore

from pdserve.kvstore.client.client import KVStoreClient
from pdserve.kvstore.connector.handoff import HANDOFF_KEY, HandoffWatch, handoff_id, handoff_tail_id

NS = LAYOUT.namespace()


def test_the_tail_name_binds_handoff_prompt_and_salt() -> None:
    prompt = list(range(300))
    name = handoff_tail_id("abc", prompt, None)
    assert name == handoff_tail_id("abc", list(prompt), None)  # producer and consumer agree
    assert name != handoff_tail_id("abc", prompt[:-1] + [7], None)  # another prompt: another tail
    assert name != handoff_tail_id("abd", prompt, None)
    assert name != handoff_tail_id("abc", prompt, "salt")
    assert name != handoff_tail_id("abc", prompt, None, "adapter") != handoff_tail_id("abc", prompt, None, "other")


@pytest.mark.parametrize("value", [None, 3, "", "a b", "x" * 65, "../etc"])
def test_malformed_handoff_ids_are_ignored(value: object) -> None:
    assert handoff_id({HANDOFF_KEY: value}) is None
    assert handoff_id({HANDOFF_KEY: "0123abcd-_"}) == "0123abcd-_"


def _watch(store: KVStoreProc, items: list, tail: str | None, wait_s: float) -> tuple[HandoffWatch, threading.Event]:
    wake = threading.Event()
    args = {"url": store.url, "auth_token": None, "timeout_s": 5.0, "shm": None}
    return HandoffWatch(args, NS, items, tail, wait_s, wake), wake


def test_watch_is_ready_once_the_tail_and_chunks_land(store: KVStoreProc) -> None:
    key = b"k" * 16
    tail = handoff_tail_id("h1", list(range(40)), None)
    watch, wake = _watch(store, [(0, key)], tail, wait_s=60)
    with KVStoreClient(store.url) as producer:
        producer.put(NS, [(0, key, b"chunk")])
        assert not watch.done.wait(0.5), "ready without the tail"
        producer.put_tail(NS, tail, [(0, b"tail")])
        assert watch.done.wait(20) and watch.ready and wake.is_set()


def test_watch_ends_unready_when_cancelled_or_out_of_time(store: KVStoreProc) -> None:
    never = handoff_tail_id("h2", [1, 2, 3], None)
    cancelled, _ = _watch(store, [], never, wait_s=60)
    cancelled.cancel()
    assert cancelled.done.wait(20) and not cancelled.ready
    expired, _ = _watch(store, [], never, wait_s=0.3)
    assert expired.done.wait(20) and not expired.ready


def test_watch_of_a_tail_another_engine_loaded_ends_unready_at_once(store: KVStoreProc) -> None:
    """A decode leg retried on a second engine after the first loaded the tail (and died before its first
    token) waits for a tail nobody writes again: its watch ends, unready (it recomputes), long before its wait."""
    tail = handoff_tail_id("h3", list(range(40)), None)
    with KVStoreClient(store.url) as c:
        c.put_tail(NS, tail, [(0, b"tail")])
        assert c.get_tail(NS, tail) is not None  # the first engine's load
    retried, wake = _watch(store, [], tail, wait_s=300)
    assert retried.done.wait(20) and not retried.ready and wake.is_set()


def test_watch_on_a_dead_store_ends_unready() -> None:
    srv = start_kvstore()
    srv.stop()
    wake = threading.Event()
    args = {"url": srv.url, "auth_token": None, "timeout_s": 0.5, "shm": None}
    watch = HandoffWatch(args, NS, [], "h-x-y", 60, wake)
    assert watch.done.wait(20) and not watch.ready and wake.is_set()


@pytest.mark.parametrize("value, expected", [(30, 30.0), (1e9, 600.0), (-1, 10.0), ("60", 10.0), (True, 10.0), (None, 10.0)])
def test_handoff_wait_is_the_routers_bounded(value: object, expected: float) -> None:
    from pdserve.kvstore.connector.handoff import HANDOFF_WAIT_KEY, handoff_wait

    assert handoff_wait({HANDOFF_WAIT_KEY: value}, 10.0) == expected
