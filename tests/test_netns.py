"""Two hosts simulated on this machine: a store and a vLLM engine on each, a veth pair between.

Each "host" is a network namespace (its own loopback, one end of a veth pair in a
private /30) plus a mount namespace with its own /dev/shm, so a store's shared
memory is out of the other host's reach just as on two machines. Both stores run
the way Ray runs them: bound to every address (so the token is required), reached by
their own host's worker as tcp://127.0.0.1:PORT, the same URL string on both hosts,
and told their routable address with --advertise-url. The producer on host A
publishes its store's id and advertised URL; the decode on host B must load the
handoff from A's store over TCP (not look in its own store under the same URL).

Needs root (ip netns, veth, mount); every namespace, link and process is removed in
teardown, and traffic stays between the two namespaces the fixture creates.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import httpx
import pytest

from procs import ENGINE_ARGS, ENGINE_ENV, ENGINE_START_TIMEOUT_S, Proc, pdserve_argv, start_process, start_together
from test_connector import prompts

T = TypeVar("T")
CHUNK = 256
STORE_PORT, STORE_HTTP_PORT, ENGINE_PORT = 5556, 18556, 8100  # the same on both hosts, like Ray nodes
TOKEN = "netns-test-token"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Run fn on a fresh thread that joined `netns` (setns changes only the calling thread's namespace)."""
    out: dict[str, Any] = {}

    def body() -> None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns}")
        finally:
            os.close(fd)
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            out["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@dataclass
class Host:
    name: str  # the network namespace
    addr: str  # its end of the veth pair
    holder: subprocess.Popen  # keeps the host's mount namespace (private /dev/shm) alive

    def argv(self, *argv: str) -> list[str]:
        """argv run inside this host's network and mount namespaces."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", *argv]

    def get(self, port: int, path: str, **kw: Any) -> httpx.Response:
        return in_netns(self.name, lambda: httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10, **kw))

    def post(self, port: int, path: str, body: dict) -> httpx.Response:
        return in_netns(self.name, lambda: httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=180))

    def ok(self, port: int, path: str) -> bool:
        try:
            return self.get(port, path).status_code == 200
        except httpx.HTTPError:
            return False

    def python(self, code: str) -> Any:
        """Run a Python snippet on this host; it prints one JSON value."""
        done = subprocess.run(self.argv(sys.executable, "-c", code), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    if os.geteuid() != 0:
        pytest.fail("test_netns needs root (ip netns, veth pairs, mounts)")
    tag = f"{os.getpid() % 100000}"
    net = f"10.231.{os.getpid() % 250}"
    names = (f"pdsa{tag}", f"pdsb{tag}")
    made: list[Host] = []
    try:
        for ns in names:
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, link, addr in ((names[0], f"va{tag}", f"{net}.1"), (names[1], f"vb{tag}", f"{net}.2")):
            _run("ip", "link", "set", link, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            _run("ip", "-n", ns, "link", "set", link, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                 "mount -t tmpfs -o size=2g tmpfs /dev/shm && echo ready && exec sleep infinity"],
                stdout=subprocess.PIPE, text=True, start_new_session=True,
            )
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            made.append(Host(ns, addr, holder))
        yield made[0], made[1]
    finally:
        for host in made:
            host.holder.kill()  # its mount namespace (and tmpfs) goes with its last process
            host.holder.wait(10)
        for ns in names:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)  # takes the veth pair with it


def start_store(host: Host, *flags: str) -> Proc:
    argv = host.argv(
        *pdserve_argv("kvstore"), "--host", "0.0.0.0", "--port", str(STORE_PORT), "--http-port", str(STORE_HTTP_PORT),
        "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25", "--log-level", "WARNING", *flags,
    )
    return start_process(argv, lambda _p: host.ok(STORE_HTTP_PORT, "/health"), name=f"kvstore-{host.name}")


def start_engine(host: Host, model: Path, role: str) -> Proc:
    config = {"kv_connector": "PDServeConnector", "kv_role": role,
              "kv_connector_extra_config": {"kvstore_url": f"tcp://127.0.0.1:{STORE_PORT}", "auth_token": TOKEN}}
    argv = host.argv(
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--load-format", "dummy",
        "--host", "127.0.0.1", "--port", str(ENGINE_PORT), *ENGINE_ARGS,
        "--kv-transfer-config", json.dumps(config), "--enable-prompt-tokens-details",
    )
    return start_process(argv, lambda _p: host.ok(ENGINE_PORT, "/health"), name=f"vllm-{host.name}",
                         env=ENGINE_ENV, timeout=ENGINE_START_TIMEOUT_S, poll_s=1.0)


@pytest.fixture(scope="module")
def stores(hosts: tuple[Host, Host]) -> Iterator[tuple[Host, Host]]:
    """A store on each host, bound to every address, advertising the host's veth address."""
    procs: list[Proc] = []
    try:
        for host in hosts:
            procs.append(start_store(host, "--auth-token", TOKEN, "--advertise-url", f"tcp://{host.addr}:{STORE_PORT}"))
        yield hosts
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def stack(stores: tuple[Host, Host], tiny_deepseek_v3: Path) -> Iterator[tuple[Host, Host]]:
    """A producer engine on host A and a kv_both engine on host B, each using its own host's store."""
    a, b = stores
    procs: list[Proc] = []
    try:
        procs = start_together([lambda: start_engine(a, tiny_deepseek_v3, "kv_producer"),  # together: one core each
                                lambda: start_engine(b, tiny_deepseek_v3, "kv_both")])
        yield a, b
    finally:
        for proc in reversed(procs):
            proc.stop()


def _complete(host: Host, prompt: list[int], **extra: Any) -> dict:
    model = host.get(ENGINE_PORT, "/v1/models").json()["data"][0]["id"]
    r = host.post(ENGINE_PORT, "/v1/completions",
                  {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _store_metrics(host: Host) -> dict[str, float]:
    return host.get(STORE_HTTP_PORT, "/stats").json()["metrics"]


@pytest.mark.engine
def test_decode_on_host_b_loads_the_handoff_from_host_a_over_tcp(stack: tuple[Host, Host]) -> None:
    a, b = stack
    for prompt in prompts(31, [2 * CHUNK + 70, 3 * CHUNK]):
        want = _complete(a, prompt)["choices"][0]["text"]  # the producer never loads: its answer is recomputed
        params = _complete(a, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        assert params["kvstore_url"] == f"tcp://{a.addr}:{STORE_PORT}"  # advertised, not the loopback URL A's worker uses
        a_before, b_before = _store_metrics(a), _store_metrics(b)
        out = _complete(b, prompt, kv_transfer_params=params)
        assert out["choices"][0]["text"] == want
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 1
        a_after, b_after = _store_metrics(a), _store_metrics(b)
        # loaded from A's store, as TCP frames (B cannot see A's shared memory), not from B's own store
        assert a_after["bytes_out_total{path=tcp}"] > a_before["bytes_out_total{path=tcp}"]
        assert a_after["hits_total{tier=l1}"] > a_before.get("hits_total{tier=l1}", 0)
        assert b_after.get("hits_total{tier=l1}", 0) == b_before.get("hits_total{tier=l1}", 0)


def test_store_on_a_routable_address_demands_its_token(stores: tuple[Host, Host]) -> None:
    a, b = stores
    check = (
        "import json\n"
        "from pdserve.kvstore.client.client import KVStoreClient, KVStoreError\n"
        f"url = 'tcp://{a.addr}:{STORE_PORT}'\n"
        "def code(token):\n"
        "    try:\n"
        "        with KVStoreClient(url, auth_token=token, timeout_s=5) as c:\n"
        "            return c.info().store_id\n"
        "    except KVStoreError as exc:\n"
        "        return exc.code\n"
        f"print(json.dumps([code(None), code('wrong'), code({TOKEN!r})]))\n"
    )
    without, wrong, right = b.python(check)
    assert (without, wrong) == ("unauthorized", "unauthorized")
    assert right and right.endswith(f"tcp://{a.addr}:{STORE_PORT}")  # the default id names the advertised URL
    refused = subprocess.run(
        a.argv(*pdserve_argv("kvstore"), "--host", a.addr, "--port", str(STORE_PORT + 1), "--http-port", "0"),
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == 2 and "--auth-token" in refused.stderr
