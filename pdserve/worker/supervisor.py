"""The supervisor behind `pdserve prefill` / `pdserve decode`: stock vLLM's OpenAI server, wired for P/D.

The worker is a small supervisor around an unmodified `python -m
vllm.entrypoints.openai.api_server` child. It adds exactly what vLLM cannot know:
- the KV connector config for its role (prefill: kv_producer; decode: kv_both, so a
  decode worker can also prefill short prompts locally), for pdserve's store or an
  LMCache server (whose chunk size it asks first: see lmcache_backend.py);
- registration in Redis with a TTL heartbeat that carries the engine's load, read
  from vLLM's own /metrics;
- a graceful stop: on SIGTERM it deregisters first (the router stops sending), waits
  for in-flight requests to finish (bounded), and only then stops vLLM;
- restarts: when vLLM exits (or stops answering /health for --unhealthy-timeout
  seconds) the worker deregisters at once, restarts it with doubling delays, and
  registers again once it is healthy, so routers re-admit it through discovery. A vLLM
  whose server answers /health while its engine answers nothing (a hung core) is restarted
  too, when routers have reported it stalled in Redis for --stall-restart-timeout seconds
  and a request of the worker's own gets no answer either (registration.py's StallReport). After
  --max-restarts restarts within the backoff window it gives up: it logs why and exits
  with EXIT_GAVE_UP, which `pdserve up` takes as final. A vLLM that dies before it was
  ever healthy is not restarted: that is a start-up problem (bad flags, no memory) that
  a restart repeats, so the worker exits 1 at once, as before.
The flags and the vLLM command line they make are in `config.py`, the Redis record in
`registration.py`, the process groups and restart backoff in `children.py`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.kvstore.client import lmcache_mp
from pdserve.kvstore.client.malloc import ENV as MALLOC_ENV
from pdserve.kvstore.connector.vllm_plugin import CONNECTOR_NAME
from pdserve.kvstore.connector.vllm_release import installed_version, unsupported_reason
from pdserve.worker.children import StopFlag, Supervised, describe_exit, spawn, stop_group
from pdserve.worker import lmcache_backend
from pdserve.worker.config import WorkerConfig, WorkerError, config_from_args
from pdserve.worker.ports import server_can_bind, wait_for_port
from pdserve.worker.registration import Registrar, Role, WorkerRecord

log = logging.getLogger("pdserve.worker")

# Exit code of a worker whose vLLM ran out of restarts: its parent should not restart it again.
EXIT_GAVE_UP = 3
# How often the supervisor looks at its vLLM process between heartbeats.
TICK_S = 0.5
# A reported stall's last check: a one-token request, which an engine that steps answers in well under this
# (the routers that reported it have cut their requests on it).
CANARY_TIMEOUT_S = 15.0

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


_LMCACHE_CHECK = (
    "import importlib.util\n"
    "if importlib.util.find_spec('lmcache') is None:\n"
    "    raise SystemExit('lmcache is not installed')\n"
    f"import {lmcache_backend.CONNECTOR_MODULE} as c\n"
    f"c.{lmcache_backend.CONNECTOR}\n"
)


def check_lmcache_connector() -> None:
    """Fail fast with a clear message when vLLM's Python cannot load LMCache's connector."""
    result = subprocess.run([sys.executable, "-c", _LMCACHE_CHECK], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {result.returncode}"
        raise WorkerError(
            f"vLLM cannot load {lmcache_backend.CONNECTOR} from {lmcache_backend.CONNECTOR_MODULE} ({reason}). "
            "Install LMCache next to vLLM (`pip install pdserve[lmcache]`), or use --kv-backend pdserve."
        )


def lmcache_extra_args(cfg: WorkerConfig) -> list[str]:
    """Ask the LMCache server for its chunk size (it must be up, as LMCache's connector needs it
    to start) and derive the flags it implies for this model."""
    assert cfg.lmcache_url is not None
    try:
        chunk = lmcache_mp.chunk_size(cfg.lmcache_url)
    except lmcache_mp.LMCacheError as exc:
        raise WorkerError(f"no LMCache server answers at {cfg.lmcache_url} ({exc}); start `lmcache server` first")
    try:
        return lmcache_backend.retention_args(cfg.model, cfg.vllm_args, chunk)
    except ValueError as exc:
        raise WorkerError(str(exc)) from None


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


class WorkerSupervisor:
    """Supervises one vLLM server: start, register, heartbeat load, restart, drain, stop."""

    def __init__(self, cfg: WorkerConfig, stopping: StopFlag, extra_vllm_args: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.extra_vllm_args = tuple(extra_vllm_args)
        self.stopping = stopping
        self.vllm = Supervised("vLLM", self._spawn_vllm, cfg.backoff)
        self.registrar: Registrar | None = None
        self.http = httpx.Client(timeout=5.0)
        self.healthy = False  # the current vLLM has answered /health since it started
        self.ever_healthy = False  # some vLLM of this worker has: only then are exits restarted
        self.started_at = 0.0
        self.failing_since: float | None = None  # when a healthy vLLM's /health began to fail
        self.reported_since: float | None = None  # since when routers report this vLLM stalled

    def _spawn_vllm(self) -> subprocess.Popen:
        # the user's own malloc settings win over the store-friendly defaults
        child = spawn(self.cfg.vllm_argv(self.extra_vllm_args), env={k: v for k, v in MALLOC_ENV.items() if k not in os.environ})
        log.info("%s %s: started vLLM (pid %d) on %s", self.cfg.role, self.cfg.worker_id, child.pid, self.cfg.local_url)
        self.healthy, self.started_at, self.failing_since, self.reported_since = False, time.monotonic(), None, None
        return child

    def _health_ok(self) -> bool:
        try:
            return self.http.get(f"{self.cfg.local_url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _register(self) -> None:
        """Announce this worker (again, after a restart) so routers add it back."""
        cfg = self.cfg
        if not cfg.redis_url:
            return
        record = WorkerRecord(
            id=cfg.worker_id, role=cfg.role, url=cfg.url, model=cfg.served_model_name,
            kvstore_url=cfg.kv_url, kv_backend=cfg.kv_backend, load={"running": 0, "waiting": 0},
            lmcache_key=lmcache_backend.cache_key(cfg.model, cfg.vllm_args)
            if cfg.kv_backend == "lmcache" and cfg.connector else None,
        )
        self.registrar = Registrar(cfg.redis_url, record, cfg.heartbeat_ttl)
        self.registrar.start()

    def _deregister(self) -> None:
        if self.registrar is not None:
            self.registrar.stop()
            self.registrar = None

    def _restart_unresponsive(self, why: str) -> None:
        """Stop a vLLM that is alive but useless; the next poll() sees the exit and restarts it."""
        log.error("%s; restarting it", why)
        self._deregister()
        assert self.vllm.popen is not None
        stop_group(self.vllm.popen, timeout_s=10.0, name="vLLM")

    def _check(self) -> None:
        """One look at a running vLLM: becoming ready, staying healthy, advertising its load."""
        cfg, now = self.cfg, time.monotonic()
        if not self.healthy:
            if self._health_ok():
                self.healthy = self.ever_healthy = True
                log.info("%s %s: ready at %s (model %s)", cfg.role, cfg.worker_id, cfg.url, cfg.served_model_name)
                self._register()
            elif now - self.started_at > cfg.start_timeout:
                self._restart_unresponsive(f"vLLM not healthy after {cfg.start_timeout:.0f} s")
            return
        if not self._health_ok():
            self.failing_since = self.failing_since or now
            if now - self.failing_since >= cfg.unhealthy_timeout:
                self._restart_unresponsive(f"vLLM has failed /health for {cfg.unhealthy_timeout:.0f} s")
            return
        self.failing_since = None
        if self.registrar is not None:
            try:
                self.registrar.update_load(**read_load(self.http, cfg.local_url))
            except httpx.HTTPError as exc:
                log.warning("reading load from vLLM failed: %s", exc)
            self._check_stall_report(now)

    def _answers_canary(self) -> bool:
        """Whether vLLM answers a one-token completion within CANARY_TIMEOUT_S."""
        key = self.cfg.api_key
        try:
            resp = self.http.post(f"{self.cfg.local_url}/v1/completions", timeout=CANARY_TIMEOUT_S,
                                  json={"model": self.cfg.served_model_name, "prompt": [0], "max_tokens": 1},
                                  headers={"Authorization": f"Bearer {key}"} if key else None)
        except httpx.HTTPError:
            return False
        if resp.status_code != 200:  # an answer all the same: its engine is not stuck
            log.warning("vLLM refused the worker's own check request: HTTP %d %s", resp.status_code, resp.text[:200])
        return True

    def _check_stall_report(self, now: float) -> None:
        """Restart a vLLM that routers have reported stalled for --stall-restart-timeout, unless it answers us."""
        timeout, registrar = self.cfg.stall_restart_timeout, self.registrar
        if not timeout or registrar is None:
            return
        report = registrar.stall_report()
        if report is None:
            self.reported_since = None
            return
        if self.reported_since is None:
            self.reported_since = now
            log.warning("%s %s: a router reports vLLM stalled (%s); restarting it if that lasts %.0f s",
                        self.cfg.role, self.cfg.worker_id, report.reason, timeout)
        if now - self.reported_since < timeout:
            return
        if self._answers_canary():  # the router's view, not the engine: say so and look again after another timeout
            log.warning("%s %s: routers have reported vLLM stalled for %.0f s, but it answers the worker's own "
                        "request; not restarting it", self.cfg.role, self.cfg.worker_id, now - self.reported_since)
            self.reported_since = time.monotonic()
            return
        self._restart_unresponsive(
            f"routers have reported vLLM stalled for {now - self.reported_since:.0f} s ({report.reason}) and it "
            f"answered no request of the worker's own in {CANARY_TIMEOUT_S:.0f} s")

    def _supervise(self) -> int:
        """Until a signal: watch vLLM every tick, check it every ttl/3. 0 on a stop, else why not."""
        interval = self.cfg.heartbeat_ttl / 3
        next_check = 0.0
        while not self.stopping.wait(TICK_S):
            change = self.vllm.poll()
            if change is not None and change.kind != "restarted":
                # Out of the routers first: requests sent to a dead engine fail.
                self._deregister()
                self.healthy = False
                if not self.ever_healthy:
                    assert self.vllm.popen is not None
                    log.error("%s %s: vLLM %s before it was ever healthy; not restarting it (see its log above)",
                              self.cfg.role, self.cfg.worker_id, describe_exit(self.vllm.popen.returncode))
                    return 1
                log.error("%s %s: %s", self.cfg.role, self.cfg.worker_id, change.message)
                if change.kind == "gave_up":
                    return EXIT_GAVE_UP
            if self.vllm.running() and (not self.healthy or time.monotonic() >= next_check):
                self._check()
                next_check = time.monotonic() + interval
        return 0

    def _drain(self) -> None:
        """Wait until vLLM has no running or waiting request (twice in a row), bounded."""
        deadline = time.monotonic() + self.cfg.drain_timeout
        idle_polls = 0
        while time.monotonic() < deadline and self.vllm.running():
            try:
                load = read_load(self.http, self.cfg.local_url)
            except httpx.HTTPError as exc:
                log.warning("drain: reading load failed (%s); stopping now", exc)
                return
            idle_polls = idle_polls + 1 if load["running"] + load["waiting"] == 0 else 0
            if idle_polls >= 2:
                return
            time.sleep(0.5)
        if self.vllm.running():
            log.warning("drain: requests still in flight after %.0f s; stopping anyway", self.cfg.drain_timeout)

    def run(self) -> int:
        self.vllm.start()
        try:
            return self._supervise()
        finally:
            self._deregister()
            if self.healthy and self.vllm.running():
                self._drain()
            self.vllm.stop(timeout_s=30.0)
            self.stopping.ignore_from_now()
            self.http.close()
            log.info("%s %s: stopped", self.cfg.role, self.cfg.worker_id)


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per health/metrics poll would drown vLLM's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def wait_for_own_port(cfg: WorkerConfig) -> None:
    """Start vLLM only on a port nothing else listens on. A server already there answered the worker's /health
    checks in vLLM's place: seen under Ray, where a restarted actor's worker found the previous one's vLLM still
    draining on its port, reported itself ready at once and registered, then restarted its own vLLM (still
    starting) when the old one went. An earlier process of this worker may still be draining, so wait as long
    as a drain and a stop take; then refuse."""
    if server_can_bind(cfg.host, cfg.port):
        return
    wait_s = cfg.drain_timeout + 30.0
    log.warning("%s %s: port %d is in use (an earlier vLLM still stopping?); waiting up to %.0f s for it",
                cfg.role, cfg.worker_id, cfg.port, wait_s)
    if not wait_for_port(cfg.host, cfg.port, wait_s):
        raise WorkerError(f"port {cfg.port} on {cfg.host} is in use by another process; pass a free --port")


def run_worker(role: Role, argv: Sequence[str] | None) -> int:
    """Entry point shared by `pdserve prefill` and `pdserve decode`."""
    configure_logging()
    try:
        cfg = config_from_args(role, sys.argv[1:] if argv is None else argv)
        extra: list[str] = []
        if cfg.connector and cfg.kv_backend == "lmcache":
            check_lmcache_connector()
            extra = lmcache_extra_args(cfg)
        elif cfg.connector:
            check_connector()
        wait_for_own_port(cfg)
    except WorkerError as exc:
        print(f"pdserve {role}: error: {exc}", file=sys.stderr)
        return 2
    return WorkerSupervisor(cfg, StopFlag().install(), extra).run()
