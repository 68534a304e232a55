"""`pdserve prefill` / `pdserve decode`: stock vLLM's OpenAI server, wired for P/D and discovery.

The worker is a small supervisor around an unmodified `python -m
vllm.entrypoints.openai.api_server` child. It adds exactly what vLLM cannot know:
- the KV connector config for its role (prefill: kv_producer; decode: kv_both, so a
  decode worker can also prefill short prompts locally);
- registration in Redis with a TTL heartbeat that carries the engine's load, read
  from vLLM's own /metrics;
- a graceful stop: on SIGTERM it deregisters first (the router stops sending), waits
  for in-flight requests to finish (bounded), and only then stops vLLM.
Every argument we do not define passes to vLLM unchanged, so the flags users already
run (`--tensor-parallel-size`, `--kv-cache-dtype`, `--api-key`, ...) just work.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.cli import split_passthrough
from pdserve.deploy.children import spawn, stop_group
from pdserve.kvstore.config import add_client_token_flag
from pdserve.kvstore.malloc import ENV as MALLOC_ENV
from pdserve.kvstore.vllm_release import installed_version, unsupported_reason
from pdserve.router.discovery import DEFAULT_TTL_S, Registrar, Role, WorkerRecord, new_worker_id

log = logging.getLogger("pdserve.worker")

CONNECTOR_NAME = "PDServeConnector"
KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_both"}
DEFAULT_PORTS: dict[Role, int] = {"prefill": 8100, "decode": 8200}
# Flags that the worker owns and therefore must not also appear among vLLM's arguments.
OWNED_VLLM_FLAGS = ("--model", "--host", "--port")

# Run in a throwaway interpreter: importing vLLM costs seconds and hundreds of MB,
# which the long-lived supervisor should not keep.
_CONNECTOR_CHECK = (
    # vLLM logs a plugin that fails to import and goes on; name the usual cause instead: a
    # source checkout in the working directory (first on sys.path) shadowing the installed package.
    "import importlib.util, pdserve\n"
    "if importlib.util.find_spec('pdserve.kvstore') is None:\n"
    "    raise SystemExit(f'pdserve.kvstore is not importable: {pdserve.__path__[0]} shadows the installed '\n"
    "                     'pdserve (a source folder in the working directory?); run from another directory')\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
    f"KVConnectorFactory.get_connector_class_by_name({CONNECTOR_NAME!r})\n"
)


class WorkerError(RuntimeError):
    """A configuration or start-up problem, reported to the user in one line."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker needs; built from the CLI by `config_from_args`."""

    role: Role
    model: str
    kvstore_url: str | None
    kvstore_auth_token: str | None
    redis_url: str | None
    host: str
    port: int
    advertise_url: str | None
    worker_id: str
    heartbeat_ttl: float
    connector: bool
    drain_timeout: float
    start_timeout: float
    vllm_args: tuple[str, ...]

    @property
    def local_url(self) -> str:
        """Where this supervisor reaches its own vLLM server."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The URL the router is told to use."""
        return self.advertise_url or self.local_url

    @property
    def served_model_name(self) -> str:
        """The name clients send as `model`: vLLM's first --served-model-name, else --model."""
        args = list(self.vllm_args)
        for i, arg in enumerate(args):
            if arg == "--served-model-name" and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith("--served-model-name="):
                return arg.split("=", 1)[1]
        return self.model

    def kv_transfer_config(self) -> dict:
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": KV_ROLES[self.role],
            "kv_connector_extra_config": {
                "kvstore_url": self.kvstore_url,
                **({"auth_token": self.kvstore_auth_token} if self.kvstore_auth_token else {}),
            },
        }

    def vllm_argv(self) -> list[str]:
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
        ]
        if self.connector:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(), separators=(",", ":"))]
        return argv + list(self.vllm_args)


def build_parser(role: Role) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"pdserve {role}",
        description=(
            f"Run a {role} worker: vLLM's OpenAI server with PDServeConnector "
            f"({KV_ROLES[role]}), registered in Redis. Arguments this parser does not know "
            "(or everything after `--`) go to vLLM unchanged."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("--model", required=True, help="model path or name, as for `vllm serve`")
    parser.add_argument("--kvstore-url", default=None, help="KV store address, e.g. tcp://127.0.0.1:5556")
    add_client_token_flag(parser, "for the connector")
    parser.add_argument("--redis-url", default=None, help="register here for discovery, e.g. redis://host:6379/0")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of the vLLM server")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[role], help="port of the vLLM server")
    parser.add_argument("--advertise-url", default=None, help="URL the router should use (default http://host:port)")
    parser.add_argument("--worker-id", default=None, help=f"unique id in Redis (default {role}-<random>)")
    parser.add_argument("--heartbeat-ttl", type=float, default=DEFAULT_TTL_S, help="seconds a registration lives without a heartbeat")
    parser.add_argument("--no-connector", action="store_true", help="serve without KV transfer (the decode leg recomputes the prompt)")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for in-flight requests on SIGTERM")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for vLLM to become healthy")
    return parser


def config_from_args(role: Role, argv: Sequence[str]) -> WorkerConfig:
    """Split argv into our flags and vLLM's, and validate the combination."""
    argv, explicit = split_passthrough(argv)
    args, unknown = build_parser(role).parse_known_args(argv)
    vllm_args = tuple(unknown + explicit)
    for flag in OWNED_VLLM_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in vllm_args):
            raise WorkerError(f"pass {flag} to pdserve {role} itself, not after `--`")
    connector = not args.no_connector
    if connector and any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in vllm_args):
        raise WorkerError("pdserve builds --kv-transfer-config itself; add --no-connector to pass your own")
    if connector and not args.kvstore_url:
        raise WorkerError("--kvstore-url is required (or --no-connector to serve without KV transfer)")
    if args.heartbeat_ttl <= 0:
        raise WorkerError(f"--heartbeat-ttl must be positive, got {args.heartbeat_ttl}")
    return WorkerConfig(
        role=role,
        model=args.model,
        kvstore_url=args.kvstore_url,
        kvstore_auth_token=args.kvstore_auth_token,
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        advertise_url=args.advertise_url,
        worker_id=args.worker_id or new_worker_id(role),
        heartbeat_ttl=args.heartbeat_ttl,
        connector=connector,
        drain_timeout=args.drain_timeout,
        start_timeout=args.start_timeout,
        vllm_args=vllm_args,
    )


def check_connector() -> None:
    """Fail fast with a clear message when vLLM cannot load PDServeConnector."""
    reason = unsupported_reason(installed_version())
    if reason:
        raise WorkerError(f"{reason}: install a supported vLLM, or pass --no-connector to serve without KV transfer.")
    result = subprocess.run(
        [sys.executable, "-c", _CONNECTOR_CHECK], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {result.returncode}"
        raise WorkerError(
            f"vLLM cannot load {CONNECTOR_NAME} ({reason}). Install pdserve into vLLM's environment "
            "(`pip install -e .` registers the vllm.general_plugins entry point), "
            "or pass --no-connector to serve without KV transfer."
        )


def read_load(client: httpx.Client, base_url: str) -> dict[str, int]:
    """Running and waiting requests from vLLM's Prometheus /metrics (summed over engines)."""
    resp = client.get(f"{base_url}/metrics")
    resp.raise_for_status()
    wanted = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
    load = {"running": 0, "waiting": 0}
    for family in text_string_to_metric_families(resp.text):
        key = wanted.get(family.name)
        if key is not None:
            load[key] = int(sum(sample.value for sample in family.samples))
    return load


class Worker:
    """Supervises one vLLM server: start, register, heartbeat load, drain, stop."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None
        self.registrar: Registrar | None = None
        self.http = httpx.Client(timeout=5.0)

    def _child_exited(self) -> bool:
        return self.child is None or self.child.poll() is not None

    def _wait_healthy(self) -> bool:
        """True once GET /health answers; False if vLLM died, we were told to stop, or time ran out."""
        deadline = time.monotonic() + self.cfg.start_timeout
        while time.monotonic() < deadline and not self.stopping.is_set():
            if self._child_exited():
                return False
            try:
                if self.http.get(f"{self.cfg.local_url}/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            self.stopping.wait(1.0)
        return False

    def _heartbeat_until_stopped(self) -> None:
        """Refresh the advertised load every ttl/3 until a signal arrives or vLLM exits."""
        interval = self.cfg.heartbeat_ttl / 3
        while not self.stopping.wait(interval):
            if self._child_exited():
                return
            if self.registrar is None:
                continue
            try:
                self.registrar.update_load(**read_load(self.http, self.cfg.local_url))
            except httpx.HTTPError as exc:
                log.warning("reading load from vLLM failed: %s", exc)

    def _drain(self) -> None:
        """Wait until vLLM has no running or waiting request (twice in a row), bounded."""
        deadline = time.monotonic() + self.cfg.drain_timeout
        idle_polls = 0
        while time.monotonic() < deadline and not self._child_exited():
            try:
                load = read_load(self.http, self.cfg.local_url)
            except httpx.HTTPError as exc:
                log.warning("drain: reading load failed (%s); stopping now", exc)
                return
            idle_polls = idle_polls + 1 if load["running"] + load["waiting"] == 0 else 0
            if idle_polls >= 2:
                return
            time.sleep(0.5)
        if not self._child_exited():
            log.warning("drain: requests still in flight after %.0f s; stopping anyway", self.cfg.drain_timeout)

    def run(self) -> int:
        cfg = self.cfg
        # the user's own malloc settings win over the store-friendly defaults
        self.child = spawn(cfg.vllm_argv(), env={k: v for k, v in MALLOC_ENV.items() if k not in os.environ})
        log.info("%s %s: started vLLM (pid %d) on %s", cfg.role, cfg.worker_id, self.child.pid, cfg.local_url)
        code, ready = 0, False
        try:
            ready = self._wait_healthy()
            if not ready:
                if self.stopping.is_set():
                    return 0
                if self._child_exited():
                    log.error("vLLM exited with code %s before it was healthy", self.child.returncode)
                else:
                    log.error("vLLM not healthy after %.0f s", cfg.start_timeout)
                return 1
            log.info("%s %s: ready at %s (model %s)", cfg.role, cfg.worker_id, cfg.url, cfg.served_model_name)
            if cfg.redis_url:
                record = WorkerRecord(
                    id=cfg.worker_id, role=cfg.role, url=cfg.url, model=cfg.served_model_name,
                    kvstore_url=cfg.kvstore_url if cfg.connector else None,
                    load={"running": 0, "waiting": 0},
                )
                self.registrar = Registrar(cfg.redis_url, record, cfg.heartbeat_ttl)
                self.registrar.start()
            self._heartbeat_until_stopped()
            if self._child_exited():
                log.error("vLLM exited unexpectedly with code %s", self.child.returncode)
                code = 1
        finally:
            if self.registrar is not None:
                self.registrar.stop()
            if ready and self.stopping.is_set() and not self._child_exited():
                self._drain()
            stop_group(self.child, timeout_s=30.0, name="vLLM")
            self.http.close()
            log.info("%s %s: stopped", cfg.role, cfg.worker_id)
        return code


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per health/metrics poll would drown vLLM's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_worker(role: Role, argv: Sequence[str] | None) -> int:
    """Entry point shared by `pdserve prefill` and `pdserve decode`."""
    configure_logging()
    try:
        cfg = config_from_args(role, sys.argv[1:] if argv is None else argv)
        if cfg.connector:
            check_connector()
    except WorkerError as exc:
        print(f"pdserve {role}: error: {exc}", file=sys.stderr)
        return 2
    worker = Worker(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: worker.stopping.set())
    return worker.run()
