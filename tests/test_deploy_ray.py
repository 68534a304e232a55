"""The Ray deployment: its config (fast, no cluster), then the whole stack on a real local Ray cluster.

The end-to-end test starts `ray start --head` on loopback (CPU only, its own temp dir
and ports), submits `python -m pdserve.deploy.ray_app` as a Ray job with the repository
as working directory and the CPU example config (tiny model, no GPUs), talks to the
router with the openai client, runs `pdserve ray down`, and checks that no actor,
placement group or service process of the stack is left. It then stops the cluster
by killing the processes it started (never `ray stop`, which would stop every Ray
cluster on the machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import yaml

from pdserve.deploy.ray_cli import COLUMNS, format_table
from pdserve.deploy.ray_config import (
    NODE_IP, TINY_MODEL, ConfigError, gpus_per_replica, kvstore_spec, load_config, router_spec, worker_specs,
)
from pdserve.worker.config import config_from_args as worker_config
from pdserve.kvstore.client.auth import TOKEN_ENV
from pdserve.kvstore.server.config import build_parser as kvstore_parser
from pdserve.kvstore.server.config import from_args as kvstore_config
from pdserve.router.config import config_from_args as router_config
from procs import (
    ENGINE_START_TIMEOUT_S, Proc, free_port, http_ok, log_dir, pdserve_argv, redis_url, start_process, start_redis,
)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NAMESPACE = "pdserve-test"
# Everything on loopback: Ray otherwise advertises the machine's routable address.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_enable_worker_prestart": "0",  # no idle Python workers on a 2-core machine
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    # Ray's memory monitor counts every process on the node; on a machine shared with other
    # test sessions it would kill our actors for their memory.
    "RAY_memory_monitor_refresh_ms": "0",
}


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Config paths are relative to the working directory, which `ray job submit --working-dir .` makes the repo."""
    monkeypatch.chdir(ROOT)


def write_config(tmp_path: Path, example: str, **changes: object) -> Path:
    data = yaml.safe_load((ROOT / "deploy/examples" / example).read_text())
    data.update(changes)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def filled(argv: tuple[str, ...]) -> list[str]:
    return [a.replace(NODE_IP, "10.1.2.3").replace(TINY_MODEL, "/models/tiny") for a in argv]


# ---------------------------------------------------------------- config, no cluster


def test_a_restarted_actor_waits_for_the_service_its_predecessor_left_then_kills_it(tmp_path: Path) -> None:
    """The killed actor's service (here a real store that nobody told to stop) holds its ports: the restarted
    actor waits for it, then kills its group, so that its own service can bind them. A pid file naming a
    process that is not a pdserve service, or nothing, is left alone."""
    from pdserve.deploy.ray_app import wait_for_predecessor
    from pdserve.worker.ports import server_can_bind

    port, http_port = free_port(), free_port()
    store = start_process(pdserve_argv("kvstore", "--port", str(port), "--http-port", str(http_port), "--l1-size-gb",
                                       "0.01"), f"http://127.0.0.1:{http_port}/health", name="old-store", timeout=60)
    pid_path = tmp_path / "kvstore-0.pid"
    try:
        pid_path.write_text(str(os.getpid()))  # not a service: never touched
        wait_for_predecessor(pid_path, timeout_s=1.0)
        pid_path.write_text("garbage")
        wait_for_predecessor(pid_path, timeout_s=1.0)
        assert not server_can_bind("127.0.0.1", port)
        pid_path.write_text(str(store.popen.pid))
        started = time.monotonic()
        wait_for_predecessor(pid_path, timeout_s=2.0)
        assert time.monotonic() - started >= 2.0  # it waited before it killed
        assert store.popen.wait(10) == -signal.SIGKILL
        assert server_can_bind("127.0.0.1", port) and server_can_bind("127.0.0.1", http_port)
    finally:
        store.stop()


def test_gpu_example_reserves_the_settings_gpus_and_every_command_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config("deploy/examples/cluster.yaml")
    assert [gpus_per_replica(cfg, r) for r in ("prefill", "decode")] == [8, 8]  # tensor-parallel-size in the settings
    spec = kvstore_spec(cfg, "n" * 40)
    monkeypatch.setenv(TOKEN_ENV, spec.env[TOKEN_ENV])  # as the store's actor runs it
    store = kvstore_config(kvstore_parser().parse_args(filled(spec.argv)[1:]))
    # Bound to the node's addresses, advertised at the node's IP, with the stack's token: a decode
    # worker on another node loads a handoff from the producer's store.
    assert (store.host, store.chunk_size, store.advertise_url) == ("0.0.0.0", 1024, "tcp://10.1.2.3:5556")
    assert store.auth_token and len(store.auth_token) >= 32
    assert spec.url == f"tcp://{NODE_IP}:5556"  # filled with the node's IP where the store runs
    for other in (*worker_specs(cfg), router_spec(cfg)):  # everyone that talks to stores has the token
        assert other.env[TOKEN_ENV] == store.auth_token
    for spec in worker_specs(cfg):
        role, *rest = filled(spec.argv)
        w = worker_config(role, rest)
        assert w.url == f"http://10.1.2.3:{w.port}" and w.kvstore_url == f"tcp://127.0.0.1:{cfg.kvstore.port}"
        assert w.served_model_name == "deepseek-v4-flash" and w.redis_url == cfg.redis_url
        assert w.vllm_args[:2] == ("--config", "deploy/settings/dsv4-flash.yaml")
        assert spec.num_gpus == 8 and spec.env["NCCL_ALGO"] == "Ring"
    router = router_config(filled(router_spec(cfg).argv)[1:])
    assert router.model == "deepseek-v4-flash" and router.prefill_policy == "prefix-aware"


def test_role_flags_override_the_settings_parallelism(tmp_path: Path) -> None:
    path = write_config(tmp_path, "cluster.yaml", prefill={"vllm_args": ["-tp", "4", "--pipeline-parallel-size=2"]},
                        decode={"port": 8200, "vllm_args": ["--tensor-parallel-size", "2"]})
    cfg = load_config(path)
    assert (gpus_per_replica(cfg, "prefill"), gpus_per_replica(cfg, "decode")) == (8, 2)


def test_cpu_example_reserves_no_gpus_and_runs_the_tiny_model() -> None:
    cfg = load_config("deploy/examples/cluster-cpu.yaml")
    specs = worker_specs(cfg)
    assert [s.num_gpus for s in specs] == [0, 0]
    role, *rest = filled(specs[0].argv)
    assert worker_config(role, rest).served_model_name == "tiny-deepseek-v3"
    assert router_config(filled(router_spec(cfg).argv)[1:]).tokenizer == "/models/tiny"


@pytest.mark.parametrize("changes, message", [
    ({"replicas_typo": 1}, "unknown key(s) ['replicas_typo']"),
    ({"prefill": {"replicas": 1, "prot": 1}}, "prefill: unknown key(s) ['prot']"),
    ({"redis_url": "http://x"}, "redis_url must be a redis:// URL"),
    ({"decode": {"replicas": 0}}, "decode.replicas must be at least 1"),
    ({"kvstore": {"chunk_size": 768}}, "--prefix-cache-retention-interval 1024 must divide kvstore.chunk_size 768"),
    ({"router": {"port": 8100}}, "both want port 8100"),
    ({"vllm_config": "deploy/settings/missing.yaml"}, "vllm_config: no file 'deploy/settings/missing.yaml'"),
    ({"kvstore": {"l1_size_gb": "big"}}, "kvstore.l1_size_gb: expected float, got 'big'"),
])
def test_bad_configs_fail_with_the_key_to_fix(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, "cluster.yaml", **changes))
    assert message in str(err.value)


def test_vllm_config_must_not_set_what_the_services_set(tmp_path: Path) -> None:
    settings = tmp_path / "engine.yaml"
    settings.write_text("tensor-parallel-size: 2\nport: 9000\n")
    with pytest.raises(ConfigError, match=r"sets \['port'\]"):
        load_config(write_config(tmp_path, "cluster.yaml", vllm_config=str(settings)))


def test_status_table_has_a_column_per_field_and_a_row_per_service() -> None:
    rows = [{"name": "router", "kind": "router", "url": "http://h:8000", "alive": True, "ready": False},
            {"name": "decode-0", "error": "GetTimeoutError", "alive": False, "ready": False}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == list(COLUMNS)
    assert lines[1].split()[:4] == ["router", "router", "-", "http://h:8000"]
    assert lines[2].split()[0] == "decode-0" and len(lines) == 3


def test_ray_app_reports_a_bad_config_in_one_line(tmp_path: Path) -> None:
    bad = write_config(tmp_path, "cluster-cpu.yaml", decode={"replicas": 0})
    out = subprocess.run([sys.executable, "-m", "pdserve.deploy.ray_app", "--config", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "decode.replicas must be at least 1" in out.stderr


# ---------------------------------------------------------------- the stack on a local Ray cluster


@dataclass
class RayHead:
    proc: Proc
    gcs_port: int
    dashboard_port: int
    env: dict[str, str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def run(self, *argv: str, timeout: float) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), capture_output=True, text=True, cwd=ROOT, env=self.env, timeout=timeout)
        (log_dir() / f"ray-{Path(argv[0]).name}-{time.time_ns()}.log").write_text(out.stdout + out.stderr)
        return out

    def pdserve_ray(self, *words: str) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-m", "pdserve.deploy.cli", "ray", *words, "--address", self.address,
                        "--namespace", NAMESPACE, timeout=300)


def session_members(sid: int) -> list[int]:
    """Processes of the session `ray start` leads: Ray's workers move to their own groups but stay in it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.append(int(entry.name))
            except OSError:  # exited meanwhile
                continue
    return found


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """`ray start --head --block` on loopback with 4 logical CPUs, no GPUs, fresh ports and temp dir."""
    ports = {name: free_port() for name in ("gcs", "dashboard", "client", "agent", "agent-grpc", "metrics",
                                            "runtime-env", "node-manager", "object-manager")}
    # Short: Ray's socket paths under it must stay within the 107-byte limit of a unix socket name.
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    env = {**os.environ, **RAY_ENV, "PATH": f"{BIN}:{os.environ['PATH']}", "XDG_CACHE_HOME": str(temp / "cache")}
    env.pop("RAY_ADDRESS", None)
    argv = [
        BIN / "ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", ports["gcs"],
        "--num-cpus", "4", "--num-gpus", "0", "--object-store-memory", str(100 << 20), "--temp-dir", temp,
        "--dashboard-host", "127.0.0.1", "--dashboard-port", ports["dashboard"],
        "--ray-client-server-port", ports["client"], "--dashboard-agent-listen-port", ports["agent"],
        "--dashboard-agent-grpc-port", ports["agent-grpc"], "--metrics-export-port", ports["metrics"],
        "--runtime-env-agent-port", ports["runtime-env"], "--node-manager-port", ports["node-manager"],
        "--object-manager-port", ports["object-manager"], "--disable-usage-stats",
    ]
    dashboard = f"http://127.0.0.1:{ports['dashboard']}"
    proc = start_process(argv, lambda p: "block forever" in p.log_tail() and http_ok(f"{dashboard}/api/version"),
                         name="ray-head", env={k: env[k] for k in (*RAY_ENV, "PATH", "XDG_CACHE_HOME")},
                         timeout=240.0, poll_s=1.0)
    try:
        yield RayHead(proc, ports["gcs"], ports["dashboard"], env)
    finally:
        proc.stop(timeout=60.0)  # `ray start --block` stops what it started on SIGTERM
        for pid in session_members(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def kill_leftovers(ports: list[int]) -> list[int]:
    """SIGKILL the process group of any pdserve service that listens on or connects to one of `ports`.

    A service whose actor was killed gets SIGTERM (the parent-death signal) and should
    exit; this is the last resort when one does not, so a failed run leaks nothing.
    """
    wanted = {str(p) for p in ports}
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        # A port is a whole argument, `--flag=PORT`, or `host:PORT` in a URL.
        named = {m for a in argv for m in re.findall(r"(?:^|=|:)(\d+)(?=/|$)", a)}
        if "pdserve.deploy.cli" in argv and named & wanted:
            try:
                os.killpg(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def alive_pids(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


@pytest.mark.ray
@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_ray_job_starts_the_stack_serves_chat_and_ray_down_removes_it(ray_head: RayHead, tmp_path: Path) -> None:
    from ray.util.state import list_actors, list_placement_groups

    redis = start_redis()
    ports = [free_port() for _ in range(5)]
    try:
        config = write_config(
            tmp_path, "cluster-cpu.yaml", name=NAMESPACE, redis_url=redis_url(redis), start_timeout_s=1200,
            kvstore={"port": ports[0], "http_port": ports[1], "chunk_size": 256, "l1_size_gb": 0.25},
            prefill={"replicas": 1, "port": ports[2], "host": "127.0.0.1"},
            decode={"replicas": 1, "port": ports[3], "host": "127.0.0.1"},
            router={"host": "127.0.0.1", "port": ports[4]},
        )
        job = ray_head.run(BIN / "ray", "job", "submit", "--address", ray_head.dashboard, "--working-dir", ".",
                           "--", "python", "-m", "pdserve.deploy.ray_app", "--config", str(config),
                           timeout=4 * ENGINE_START_TIMEOUT_S)
        router = f"http://127.0.0.1:{ports[4]}"
        assert job.returncode == 0 and f"ready: {router}/v1" in job.stdout, job.stdout[-6000:] + job.stderr[-3000:]

        # The stack outlived its job: every service is a named actor, ready.
        status = ray_head.pdserve_ray("status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        rows = {r["name"]: r for r in map(json.loads, status.stdout.splitlines())}
        assert sorted(re.sub(r"^kvstore-\w+$", "kvstore", n) for n in rows) == ["decode-0", "kvstore", "prefill-0",
                                                                                  "router"]
        assert all(r["alive"] and r["ready"] and r["gpus"] == 0 for r in rows.values())
        assert rows["router"]["url"] == router

        client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-deepseek-v3"]
        # Longer than the router's 256-token threshold, so it takes the prefill leg, then decode.
        messages = [{"role": "user", "content": "the ferry crosses the bay at dawn " * 40}]
        reply = client.chat.completions.create(model="tiny-deepseek-v3", messages=messages, max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens > 256 and reply.usage.completion_tokens == 8
        prefill_metrics = httpx.get(f"{rows['prefill-0']['url']}/metrics", timeout=30).text
        prefilled = re.search(r'^vllm:prompt_tokens_total\{[^}]*\} ([\d.]+)$', prefill_metrics, re.M)
        assert prefilled and float(prefilled.group(1)) >= reply.usage.prompt_tokens

        down = ray_head.pdserve_ray("down", "--timeout", "60")
        assert down.returncode == 0 and "removed" in down.stdout, down.stdout + down.stderr
        alive = list_actors(address=ray_head.dashboard, filters=[("state", "=", "ALIVE")], detail=True)
        assert [a.name for a in alive if a.ray_namespace == NAMESPACE] == []
        groups = list_placement_groups(address=ray_head.dashboard, filters=[("state", "!=", "REMOVED")])
        assert [g.name for g in groups if g.name.startswith(NAMESPACE)] == []
        assert alive_pids([r["pid"] for r in rows.values()]) == []
        gone = ray_head.pdserve_ray("status")
        assert gone.returncode == 1 and "no pdserve stack" in gone.stdout
    finally:
        ray_head.pdserve_ray("down", "--timeout", "10")  # idempotent: nothing left after a passing run
        kill_leftovers([*ports, redis.port])
        redis.stop()
