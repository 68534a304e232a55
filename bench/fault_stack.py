"""The stack that `pdserve bench faults` (and its test) breaks on purpose, and how to break and read it.

One `LocalStack` (KV store, prefill and decode workers discovered through Redis, router)
plus a private redis-server, all children of this process. A watcher thread runs the
stack's own supervision (`LocalStack.watch`, what `pdserve up` runs), so killed parts
come back exactly as they would under `pdserve up`. The store runs with a short tail
TTL, so a leaked request tail is visible on its /stats within seconds.

Redis is passed in as a factory (`port -> handle with .popen, .port, .stop()`): the
tests hand over their own throwaway redis-server; the CLI uses `start_redis` below.
Neither ever touches the machine's Redis: kill -9 only hits the process we started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

import httpx

from pdserve.worker.children import spawn
from pdserve.deploy.local import LocalStack, StackConfig, parse_up_args
from pdserve.deploy.ports import free_port
from pdserve.worker.ports import server_can_bind
from pdserve.kvstore.client.client import KVStoreClient

# Short enough that a leaked tail shows within one scenario, long enough for any handoff here.
TAIL_TTL_S = 5.0
# Router bounds for the partial-body scenario (defaults 30/60 s would only slow the run).
ROUTER_BODY_TIMEOUT_S = 5.0
START_TIMEOUT_S = 1200.0


class RedisHandle(Protocol):
    @property
    def port(self) -> int | None: ...

    @property
    def popen(self) -> subprocess.Popen: ...

    def stop(self) -> object: ...


RedisFactory = Callable[[int | None], RedisHandle]


@dataclass
class OwnRedis:
    """A redis-server this process started: loopback only, no persistence."""

    popen: subprocess.Popen
    port: int

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def redis_pongs(port: int) -> bool:
    """Whether a redis-server on loopback `port` answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(port: int | None = None) -> OwnRedis:
    """A private redis-server on `port` (a free one when None), ready when it answers PING."""
    port = port or free_port()
    popen = spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                  stdout=subprocess.DEVNULL)
    handle = OwnRedis(popen, port)
    deadline = time.monotonic() + 30
    while not redis_pongs(port):
        if popen.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise RuntimeError(f"redis-server on port {port} did not start (exit {popen.poll()})")
        time.sleep(0.2)
    return handle


def _consecutive_free(count: int) -> int:
    """A base port whose next `count` ports are free now (workers take base + i)."""
    while True:
        base = free_port()
        if all(server_can_bind("127.0.0.1", base + i) for i in range(count)):
            return base


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def children_of(pid: int) -> list[int]:
    """Direct children of pid, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children_of(current))
    return out


def engine_core(server: int) -> int:
    """The engine core process of the vLLM API server `server` (the one process that steps the model)."""
    cores = [p for p in tree(server)[1:] if "EngineCore" in cmdline(p) or "spawn_main" in cmdline(p)]
    assert len(cores) == 1, [(p, cmdline(p)) for p in tree(server)]
    return cores[0]


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE")


# /proc/PID/status fields that split RSS: private memory, and shared memory (e.g. the store's arena).
RSS_PARTS = {"anon": "RssAnon", "shm": "RssShmem"}


def rss_parts(pids: list[int]) -> dict[str, int]:
    """RSS split by kind, in bytes, summed over pids. A shared page counts once per mapping of it:
    a process that maps the store's arena twice shows its touched pages twice in RssShmem."""
    total = dict.fromkeys(RSS_PARTS, 0)
    fields = {v: k for k, v in RSS_PARTS.items()}
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(":")
            if key in fields:
                total[fields[key]] += int(value.split()[0]) * 1024
    return total


def _metric_sum(text: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class FaultStack:
    """The stack, its redis, a supervision thread, and the handles faults and probes need."""

    def __init__(self, redis_factory: RedisFactory = start_redis, num_prefill: int = 1, num_decode: int = 2,
                 log_dir: Path | None = None) -> None:
        self.redis_factory = redis_factory
        self.redis = redis_factory(None)
        base, _ = parse_up_args(["--no-demo"])
        self.cfg: StackConfig = replace(
            base, num_prefill=num_prefill, num_decode=num_decode, port=free_port(),
            prefill_port=_consecutive_free(num_prefill), decode_port=_consecutive_free(num_decode),
            kvstore_port=free_port(), kvstore_http_port=free_port(), kvstore_l1_size_gb=0.5,
            redis_url=f"redis://127.0.0.1:{self.redis.port}/0", log_dir=log_dir, start_timeout=START_TIMEOUT_S,
            router_args=("--body-timeout", str(ROUTER_BODY_TIMEOUT_S), "--header-timeout", str(ROUTER_BODY_TIMEOUT_S)),
        )
        self.stack = LocalStack(self.cfg, label="pdserve bench faults")
        store = self.component("kvstore")
        store.argv += ["--tail-ttl-s", str(TAIL_TTL_S), "--log-level", "WARNING"]
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="fault-stack-watch", daemon=True)
        self.http = httpx.Client(timeout=10.0)
        self._closed = False

    # ------------------------------------------------------------ life

    def start(self, show_progress: bool = True) -> "FaultStack":
        try:
            self.stack.start(show_progress=show_progress)
        except BaseException:
            self.redis.stop()
            raise
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self.stack.watch()

    def close(self) -> None:
        """Stop everything this stack started; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join(30)
        self.stack.stop()
        self.redis.stop()
        self.http.close()

    def __enter__(self) -> "FaultStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ parts

    @property
    def url(self) -> str:
        return self.cfg.router_url

    @property
    def model(self) -> str:
        return self.cfg.served_model_name

    @property
    def store_http(self) -> str:
        return f"http://127.0.0.1:{self.cfg.kvstore_http_port}"

    def component(self, name: str):
        (comp,) = [c for c in self.stack.components if c.name == name]
        return comp

    def workers(self) -> list[str]:
        return [c.name for c in self.stack.components if c.name.startswith(("prefill-", "decode-"))]

    def worker_url(self, name: str) -> str:
        role, index = name.split("-")
        return self.cfg.worker_urls(role)[int(index)]

    def vllm_server(self, worker: str) -> int | None:
        """The vLLM API server a worker runs now (None while it restarts)."""
        popen = self.component(worker).popen
        found = [p for p in children_of(popen.pid) if "vllm.entrypoints.openai.api_server" in cmdline(p)]
        return found[0] if found else None

    def engine_core(self, worker: str) -> int:
        server = self.vllm_server(worker)
        assert server is not None, f"{worker} runs no vLLM now"
        return engine_core(server)

    # ------------------------------------------------------------ faults

    def kill_engine(self, worker: str) -> int:
        """kill -9 of a worker's vLLM engine core (its API server then exits; the worker restarts it)."""
        return self.signal_engine(worker, signal.SIGKILL)

    def signal_engine(self, worker: str, sig: signal.Signals) -> int:
        """Send `sig` to a worker's vLLM engine core alone (its API server keeps answering)."""
        core = self.engine_core(worker)
        os.kill(core, sig)
        return core

    def kill_worker(self, worker: str) -> int:
        """kill -9 of a worker's own process group (the `pdserve decode`/`prefill` process, not the vLLM it
        runs: that is in a session of its own and gets SIGTERM from the kernel as its parent dies); the
        stack restarts the worker, which starts a fresh vLLM on the same port."""
        return self._kill_group(worker)

    def kill_router(self) -> int:
        """kill -9 of the router: its connections to the clients and to the workers drop at once, with
        overlapped decode legs waiting in the store and prefill legs mid-way; the stack restarts it on the same
        port and it finds the workers again through Redis."""
        return self._kill_group("router")

    def _kill_group(self, name: str) -> int:
        pid = self.component(name).popen.pid
        os.killpg(pid, signal.SIGKILL)
        return pid

    def kill_store(self) -> int:
        """kill -9 of the KV store (the stack restarts it in place); its shared-memory arena is removed here,
        as a crashed store cannot unlink it."""
        try:
            with KVStoreClient(self.cfg.kvstore_url, shm=False) as client:
                arena = client.info().shm_path
        except Exception:  # noqa: BLE001 - no store answering: nothing to clean
            arena = None
        pid = self.component("kvstore").popen.pid
        os.kill(pid, signal.SIGKILL)
        if arena:
            Path(arena).unlink(missing_ok=True)
        return pid

    def kill_redis(self, down_s: float = 3.0) -> None:
        """kill -9 of our redis-server, down for `down_s`, then a fresh (empty) one on the same port."""
        os.kill(self.redis.popen.pid, signal.SIGKILL)
        self.redis.popen.wait(10)
        self.redis.stop()
        time.sleep(down_s)
        self.redis = self.redis_factory(self.redis.port)

    # ------------------------------------------------------------ probes

    def ready(self) -> dict:
        try:
            return self.http.get(f"{self.url}/ready").json()
        except (httpx.HTTPError, ValueError):
            return {}

    def all_back(self) -> bool:
        """Every part up: the router sees all workers healthy, the store and redis answer."""
        body = self.ready()
        return (body.get("prefill", {}).get("healthy") == self.cfg.num_prefill
                and body.get("decode", {}).get("healthy") == self.cfg.num_decode
                and self.live_tails() is not None and self.redis.port is not None and redis_pongs(self.redis.port))

    def router_metric(self, name: str) -> float | None:
        """Sum of a router metric's samples (None while the router does not answer)."""
        try:
            return _metric_sum(self.http.get(f"{self.url}/metrics").text, name)
        except httpx.HTTPError:
            return None

    def live_tails(self) -> float | None:
        try:
            metrics = self.http.get(f"{self.store_http}/stats").json()["metrics"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return metrics.get("live_tails", 0.0)

    def engine_requests(self) -> dict[str, float | None]:
        """vLLM's running + waiting requests per worker (None where the engine does not answer)."""
        out: dict[str, float | None] = {}
        for name in self.workers():
            try:
                text = self.http.get(f"{self.worker_url(name)}/metrics").text
            except httpx.HTTPError:
                out[name] = None
                continue
            out[name] = _metric_sum(text, "vllm:num_requests_running") + _metric_sum(text, "vllm:num_requests_waiting")
        return out

    def rss_mib(self, detail: bool = False) -> dict[str, float]:
        """RSS of every process of the stack: router, store, redis, each worker and each worker's vLLM tree;
        with `detail`, each vLLM tree's RSS also split into private ('anon') and shared ('shm') memory."""
        out: dict[str, float] = {}
        for comp in self.stack.components:
            if comp.popen is None or comp.popen.poll() is not None:
                continue
            out[comp.name] = rss_bytes([comp.popen.pid]) / 2**20
            if comp.name in self.workers():
                server = self.vllm_server(comp.name)
                pids = tree(server) if server else []
                out[f"{comp.name}/vllm"] = rss_bytes(pids) / 2**20
                if detail:
                    for part, size in rss_parts(pids).items():
                        out[f"{comp.name}/vllm:{part}"] = size / 2**20
        out["redis"] = rss_bytes([self.redis.popen.pid]) / 2**20
        return out
