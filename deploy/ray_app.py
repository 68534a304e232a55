"""`python -m pdserve.deploy.ray_app --config cluster.yaml`: the P/D stack on a Ray cluster.

Submitted as a Ray job from the repository root:

    ray job submit --working-dir . -- python -m pdserve.deploy.ray_app --config deploy/examples/cluster.yaml

The driver reserves each prefill and decode replica's GPUs with a placement group (its
tensor x pipeline x data parallel size; no GPUs on a CPU cluster), starts one KV store
on every node those groups landed on, then the workers inside their groups and the
router on the driver's node, waits until the router sees every worker healthy, prints
its URL and exits. Every actor and placement group is named and detached, so the stack
outlives the job; `pdserve ray status` shows it and `pdserve ray down` removes it.

Each actor runs its service exactly as a user would (`pdserve kvstore|prefill|decode|
router ...`, the worker supervisor of pdserve/worker/supervisor.py included) as a child process
group that dies with the actor. A service that crashes after it was ready takes its
actor down with it, and Ray restarts the actor (`max_restarts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import logging
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import httpx
import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, placement_group_table
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pdserve.worker.children import open_log, spawn, stop_group
from pdserve.deploy.ray_config import (
    NODE_IP, TINY_MODEL, ClusterConfig, ConfigError, ServiceSpec, kvstore_spec, load_config,
    router_spec, worker_specs,
)

log = logging.getLogger("pdserve.ray")

# Teardown order: no new requests first, then the workers (they drain), then the stores.
STOP_ORDER = ("router", "prefill", "decode", "kvstore")
STOP_TIMEOUT_S = 120.0
POLL_S = 2.0
NOTE_EVERY_S = 30.0


class StackError(RuntimeError):
    """The stack could not start (or is already running); the message says which service and why."""


def log_dir(namespace: str) -> Path:
    return Path(tempfile.gettempdir()) / "pdserve-ray" / namespace


def _tiny_model_on_this_node() -> str:
    """The tiny model folder, generated once per node even when several actors ask at once."""
    from pdserve.deploy.tiny_model import cache_dir, tiny_model_dir

    lock_path = cache_dir() / "tiny-model.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(tiny_model_dir())


def _running_service(pid: int) -> bool:
    """Whether pid is a live (not zombie) `pdserve` service process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != "Z" and b"pdserve.deploy.cli" in cmdline


def wait_for_predecessor(pid_path: Path, timeout_s: float) -> None:
    """Let the service a killed actor left behind finish before its restarted actor starts another.

    That service got SIGTERM when its actor died (the parent-death signal) and may still be draining on the
    ports the new one needs: a router or store that cannot bind exits before it is ready, and a worker's health
    checks would reach the old vLLM. Waits up to timeout_s for it, then SIGKILLs its process group. A worker's
    vLLM runs in a session of its own and stops with its worker; the new worker waits for its port itself."""
    try:
        pid = int(pid_path.read_text())
    except (OSError, ValueError):
        return
    if not _running_service(pid):
        return
    log.warning("the previous %s (pid %d) is still stopping; waiting up to %.0f s for it", pid_path.stem, pid,
                timeout_s)
    deadline = time.monotonic() + timeout_s
    while _running_service(pid) and time.monotonic() < deadline:
        time.sleep(POLL_S / 4)
    if _running_service(pid):
        log.warning("the previous %s (pid %d) did not stop; killing its group", pid_path.stem, pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        while _running_service(pid) and time.monotonic() < deadline + 10:
            time.sleep(POLL_S / 4)


@ray.remote
class ServiceActor:
    """Runs one service as a child process group on this actor's node, and reports on it.

    Takes and returns plain data only (a spec dict, a status dict).
    """

    def __init__(self, spec: dict[str, Any], namespace: str) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health poll
        self.spec = ServiceSpec(**{**spec, "argv": tuple(spec["argv"])})
        self.node_ip = ray.util.get_node_ip_address()
        tiny = any(TINY_MODEL in a for a in self.spec.argv)
        fills = {NODE_IP: self.node_ip, TINY_MODEL: _tiny_model_on_this_node() if tiny else TINY_MODEL}
        self.argv = [self._fill(a, fills) for a in self.spec.argv]
        self.url = self._fill(self.spec.url, fills) if self.spec.url else None
        self.log_path = log_dir(namespace) / f"{self.spec.name}.log"
        self.ready = False
        self.stopping = threading.Event()
        pid_path = self.log_path.with_suffix(".pid")
        wait_for_predecessor(pid_path, STOP_TIMEOUT_S)
        with open_log(self.log_path) as out:
            # Actor tasks run on the worker's main thread, so the child's parent-death
            # signal (see children.spawn) fires only when the actor process itself dies.
            self.popen = spawn([sys.executable, "-m", "pdserve.deploy.cli", *self.argv], stdout=out, env=self.spec.env)
        pid_path.write_text(str(self.popen.pid))
        log.info("%s: started pdserve %s (pid %d), log %s", self.spec.name, shlex.join(self.argv), self.popen.pid,
                 self.log_path)
        threading.Thread(target=self._watch, name=f"watch-{self.spec.name}", daemon=True).start()

    @staticmethod
    def _fill(text: str, fills: dict[str, str]) -> str:
        for key, value in fills.items():
            text = text.replace(key, value)
        return text

    def _watch(self) -> None:
        """Mark the service ready once its health URL answers; if it dies after that, die with it."""
        with httpx.Client(timeout=2.0) as http:
            while not self.stopping.wait(1.0):
                if self.popen.poll() is not None:
                    if self.ready and not self.stopping.is_set():
                        log.error("%s exited with code %s after it was ready; restarting the actor",
                                  self.spec.name, self.popen.returncode)
                        stop_group(self.popen, timeout_s=5.0, name=self.spec.name)
                        os._exit(1)  # Ray restarts the actor (and so the service) up to max_restarts times
                    return  # died while starting: stay down and report it
                if not self.ready:
                    try:
                        self.ready = http.get(self.spec.health_url).status_code == 200
                    except httpx.HTTPError:
                        pass

    def status(self) -> dict[str, Any]:
        return {
            "name": self.spec.name, "kind": self.spec.kind, "node_ip": self.node_ip, "url": self.url,
            "pid": self.popen.pid, "alive": self.popen.poll() is None, "ready": self.ready,
            "exit_code": self.popen.returncode, "gpus": self.spec.num_gpus,
            "log": str(self.log_path),
        }

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the service's group (a worker drains first), SIGKILL what is left after timeout_s."""
        self.stopping.set()
        return stop_group(self.popen, timeout_s=timeout_s, name=self.spec.name)


# ---------------------------------------------------------------- stack-wide operations


def connect(address: str | None, namespace: str, **options: Any) -> None:
    """Join the cluster as a driver in the stack's namespace (the app and `pdserve ray` alike)."""
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=namespace,
             logging_level=logging.WARNING, **options)


def stack_actors(namespace: str) -> dict[str, Any]:
    """name -> handle of every actor in the stack's namespace (the caller is connected to it)."""
    names = ray.util.list_named_actors(all_namespaces=False)
    return {name: ray.get_actor(name, namespace=namespace) for name in sorted(names)}


def _kind(name: str) -> str:
    return name.split("-", 1)[0]


def _placement_groups(namespace: str) -> dict[str, PlacementGroup]:
    """The stack's placement groups that still exist, by name (names are unique per namespace)."""
    found: dict[str, PlacementGroup] = {}
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(f"{namespace}-") and info.get("state") != "REMOVED":
            try:
                found[name] = get_placement_group(name)
            except ValueError:  # same name in another namespace
                continue
    return found


def teardown(namespace: str, timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
    """Stop every service in STOP_ORDER, kill the actors, free the placement groups; returns what was removed."""
    actors = stack_actors(namespace)
    for kind in STOP_ORDER:
        pending = {a.stop.remote(timeout_s): n for n, a in actors.items() if _kind(n) == kind}
        if not pending:
            continue
        done, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s + 15.0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:  # a dead actor: nothing left to stop
                log.warning("%s: stop failed (%s)", pending[ref], type(exc).__name__)
        for ref in late:
            log.warning("%s did not stop within %.0f s; killing its actor", pending[ref], timeout_s)
    for actor in actors.values():
        ray.kill(actor, no_restart=True)
    groups = _placement_groups(namespace)
    for pg in groups.values():
        remove_placement_group(pg)
    return sorted(actors) + sorted(groups)


def _start(spec: ServiceSpec, namespace: str, max_restarts: int, strategy: Any) -> Any:
    return ServiceActor.options(  # type: ignore[attr-defined]  # added by @ray.remote; mypy ignores class decorators
        name=spec.name, namespace=namespace, lifetime="detached", max_restarts=max_restarts,
        num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, scheduling_strategy=strategy,
    ).remote(dataclasses.asdict(spec), namespace)


def _reserve(cfg: ClusterConfig, spec: ServiceSpec, deadline: float) -> tuple[PlacementGroup, str]:
    """A detached placement group holding one worker's CPUs and GPUs on one node; returns it and the node."""
    bundle = {"CPU": spec.num_cpus, **({"GPU": spec.num_gpus} if spec.num_gpus else {})}
    pg = placement_group([bundle], strategy="STRICT_PACK", name=f"{cfg.name}-{spec.name}", lifetime="detached")
    if not pg.wait(max(1.0, deadline - time.monotonic())):
        raise StackError(f"cannot reserve {bundle} for {spec.name}: the cluster has {ray.available_resources()} "
                         "available (each replica needs all its GPUs on one node)")
    return pg, placement_group_table(pg)["bundles_to_node_id"][0]


def _wait_ready(actors: dict[str, Any], deadline: float, what: str) -> dict[str, dict[str, Any]]:
    """Poll the actors' status until all are ready; raise with the log of one that died."""
    started = last_note = time.monotonic()
    while True:
        states = {}
        for name, actor in actors.items():
            try:
                states[name] = ray.get(actor.status.remote())
            except ray.exceptions.RayActorError as exc:  # e.g. Ray's out-of-memory killer
                raise StackError(f"the actor of {name} died while starting: {exc}") from None
        for name, st in states.items():
            if not st["alive"]:
                tail = ray.get(actors[name].log_tail.remote())
                raise StackError(f"{name} exited with code {st['exit_code']} while starting "
                                 f"(log {st['log']} on {st['node_ip']}):\n{tail}")
        waiting = [n for n, st in states.items() if not st["ready"]]
        if not waiting:
            return states
        now = time.monotonic()
        if now > deadline:
            raise StackError(f"{what} not ready in time: {', '.join(waiting)}")
        if now - last_note >= NOTE_EVERY_S:
            print(f"  waiting for {', '.join(waiting)} ({now - started:.0f} s)", flush=True)
            last_note = now
        time.sleep(POLL_S)


def _wait_router_sees_all(url: str, cfg: ClusterConfig, deadline: float) -> None:
    """Ready when the router has found every replica healthy through Redis, not just one."""
    want = {"prefill": cfg.prefill.replicas, "decode": cfg.decode.replicas}
    body: dict[str, Any] = {}
    with httpx.Client(timeout=5.0) as http:
        while time.monotonic() < deadline:
            try:
                body = http.get(f"{url}/ready").json()
            except (httpx.HTTPError, ValueError):
                body = {}
            if all(body.get(role, {}).get("healthy") == n for role, n in want.items()):
                return
            time.sleep(POLL_S)
    raise StackError(f"the router at {url} does not see every worker healthy in time (last /ready: {body})")


def start_stack(cfg: ClusterConfig) -> str:
    """Place and start the whole stack; returns the router's URL. On failure removes what it started."""
    namespace = cfg.name
    running = stack_actors(namespace)
    if running:
        raise StackError(f"stack {namespace!r} is already running ({', '.join(running)}); "
                         f"remove it first: pdserve ray down --namespace {namespace}")
    deadline = time.monotonic() + cfg.start_timeout_s
    try:
        workers = worker_specs(cfg)
        placed = [(spec, *_reserve(cfg, spec, deadline)) for spec in workers]
        print(f"reserved {len(placed)} worker placement group(s) "
              f"({sum(s.num_gpus for s in workers)} GPUs) on {len({n for *_, n in placed})} node(s)", flush=True)
        stores = {}
        for node in dict.fromkeys(n for *_, n in placed):
            spec = kvstore_spec(cfg, node)
            stores[spec.name] = _start(spec, namespace, cfg.max_restarts,
                                       NodeAffinitySchedulingStrategy(node_id=node, soft=False))
        _wait_ready(stores, deadline, "KV stores")
        print(f"KV stores ready: {', '.join(stores)}", flush=True)
        engines = {spec.name: _start(spec, namespace, cfg.max_restarts, PlacementGroupSchedulingStrategy(pg, 0))
                   for spec, pg, _ in placed}
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        router = {"router": _start(router_spec(cfg), namespace, cfg.max_restarts, here)}
        print(f"starting {', '.join(engines)} and the router (engines take minutes to load)", flush=True)
        states = _wait_ready({**engines, **router}, deadline, "services")
        url = states["router"]["url"]
        _wait_router_sees_all(url, cfg, deadline)
        return url
    except BaseException:
        removed = teardown(namespace, timeout_s=30.0)
        print(f"start failed; removed {', '.join(removed) or 'nothing'}", file=sys.stderr, flush=True)
        raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.deploy.ray_app",
        description="Start a pdserve stack on a Ray cluster (run it as a Ray job: ray job submit --working-dir . "
                    "-- python -m pdserve.deploy.ray_app --config deploy/examples/cluster.yaml).",
    )
    p.add_argument("--config", required=True, help="cluster config YAML (see deploy/examples/cluster.yaml)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, as set for a Ray job, else auto)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"pdserve ray: {args.config}: {exc}", file=sys.stderr)
        return 2
    connect(args.address, cfg.name)
    try:
        url = start_stack(cfg)
    except StackError as exc:
        print(f"pdserve ray: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"\nready: {url}/v1  (model {cfg.served_name}, namespace {cfg.name})\n"
          f"  status:   pdserve ray status --namespace {cfg.name}\n"
          f"  teardown: pdserve ray down --namespace {cfg.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
