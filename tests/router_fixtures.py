"""Shared real parts for the router's engine tests (used as a pytest plugin).

Engines are the expensive part on a 2-core machine, so the whole session shares
one P/D pair: a KV store, a prefill engine (PDServeConnector as kv_producer) and a
decode engine (kv_both), all plain `python -m vllm.entrypoints.openai.api_server`
on the tiny DeepSeek-V3 with random weights, behind `--api-key` so every router
test also checks that the router passes its key on. Routers are cheap: each test
starts the one it needs with the flags it tests.

A module that needs an engine of its own on the same store (one it may kill or stop)
takes it with `Stack.engine(role)` and says so with the `pd_spare(role)` marker: the
stack then starts that engine together with its own two, while both cores are busy
anyway, instead of alone when the module begins.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from kvstore_fixtures import KVStoreProc, start_kvstore
from procs import Proc, free_port, pdserve_argv, start_process, start_together, start_vllm_server

API_KEY = "sk-router-test"


@dataclass
class Stack:
    model: str  # the served model name (the model folder)
    kvstore: KVStoreProc
    prefill: Proc
    decode: Proc
    spares: dict[str, list[Proc]] = field(default_factory=dict)  # role -> engines started for pd_spare modules

    def engine(self, role: str) -> Proc:
        """An engine of `role` on the stack's store for one module's own use: one the stack started
        beside its own (pd_spare), or a new one. The module stops it."""
        left = self.spares.get(role)
        return left.pop() if left else start_engine(Path(self.model), role, self.kvstore.url)


def connector_args(role: str, kvstore_url: str) -> list[str]:
    cfg = {
        "kv_connector": "PDServeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"kvstore_url": kvstore_url},
    }
    return ["--kv-transfer-config", json.dumps(cfg), "--api-key", API_KEY]


def start_engine(model_dir: Path, role: str, kvstore_url: str) -> Proc:
    return start_vllm_server(model_dir, extra_args=connector_args(role, kvstore_url))


def spare_roles(items: Sequence[pytest.Item]) -> list[str]:
    """The roles of the pd_spare markers of the modules these tests come from (a module marker)."""
    modules = {m.nodeid: m for item in items if (m := item.getparent(pytest.Module)) is not None}
    return [role for module in modules.values() for mark in module.iter_markers("pd_spare") for role in mark.args]


@pytest.fixture(scope="session")
def pd_stack(tiny_deepseek_v3: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    store = start_kvstore(l1_size_gb=0.5)
    spares = spare_roles(request.session.items)
    try:
        # All at once: each start is mostly one core's work, and the machine has two.
        engines = start_together([lambda role=role: start_engine(tiny_deepseek_v3, role, store.url)
                                  for role in ("kv_producer", "kv_both", *spares)])
    except BaseException:
        store.stop()
        raise
    stack = Stack(str(tiny_deepseek_v3), store, engines[0], engines[1])
    for role, proc in zip(spares, engines[2:]):
        stack.spares.setdefault(role, []).append(proc)
    try:
        yield stack
    finally:
        for proc in [p for left in stack.spares.values() for p in left] + [stack.decode, stack.prefill]:
            proc.stop()
        store.stop()


def start_router(*args: str, ready: str = "/ready") -> Proc:
    """`pdserve router` on a free port, ready when `ready` answers 2xx."""
    port = free_port()
    argv = pdserve_argv("router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "debug", *args)
    return start_process(argv, f"http://127.0.0.1:{port}{ready}", name="router", port=port, timeout=60.0)


def pd_router(stack: Stack, *extra: str) -> Proc:
    """A router over the session's P/D pair that disaggregates every prompt."""
    return start_router(
        "--prefill", stack.prefill.url, "--decode", stack.decode.url, "--api-key", API_KEY,
        "--pd-min-prompt-tokens", "0", *extra,
    )


def metric(base_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus series' samples at base_url/metrics whose labels include `labels` (0 if none)."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in (labels or {}).items()):
            total += float(m.group(3))
    return total


def wait_until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail the test (not hang) if it never does."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:g} s"
        time.sleep(0.05)


def raw_post(base_url: str, path: str, body: dict, api_key: str | None = None) -> socket.socket:
    """Send a POST on a bare socket and return it unread, so a test can hang up at a moment it chooses."""
    parsed = urllib.parse.urlsplit(base_url)
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {parsed.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}"]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=120)
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    return sock


def long_prompt(words: int, seed: int = 0) -> str:
    """A deterministic prompt of about `words` tokens (distinct per seed, so prefixes do not collide)."""
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    return " ".join(f"{vocab[(i * 7 + seed) % len(vocab)]}{(i + seed) % 13}" for i in range(words))


def chat_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def sse_events(lines: Sequence[str]) -> list[str]:
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
