"""`pdserve up`: the whole P/D stack on this machine, one command, no orphans on exit.

Starts the KV store, N prefill and M decode workers and the router as child process
groups (see pdserve/worker/children.py), shows which of them are still starting (engines take
about a minute on a CPU), waits until the router sees every worker healthy, prints
the URL and a curl line, sends one chat request and prints its reply and TTFT, then
serves until Ctrl-C or SIGTERM, which stops the router first, then the workers (they
drain), then the store. `LocalStack` is also what `pdserve bench serve --compare`
uses to bring up its P/D and colocated stacks.

While serving, a child that exits is restarted in place (same ports) with backoff and
a cap (pdserve/worker/children.py: Supervised); a worker restarts its own engine the same way
(pdserve/worker/supervisor.py) and only exits when it gave up, which is final here. Every few
seconds `up` checks each child's health and prints which ones are down, so one dead
engine costs its own capacity, not the stack. It stops by itself only when nothing can
serve any more: the router or every decode worker is down for good.

Without `--model`, a tiny random-weight DeepSeek-V3 is generated once into the cache
folder and served with `--load-format dummy` and CPU-friendly engine settings.

With `--kv-backend lmcache` an `lmcache server` (deploy/lmcache_server.py) takes the
store's place, on the same ports, and the workers use LMCache's connector.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import httpx
from tqdm import tqdm

from pdserve.worker.config import split_passthrough
from pdserve.deploy import lmcache_server
from pdserve.deploy.tiny_model import TINY_ENGINE_ENV, TINY_SERVED_NAME, TINY_VLLM_ARGS, tiny_model_dir
from pdserve.worker.children import QUIET_ENV, Backoff, StopFlag, Supervised, open_log, signal_group, spawn
from pdserve.worker.supervisor import EXIT_GAVE_UP
from pdserve.kvstore.connector.vllm_release import installed_version, unsupported_reason

DEMO_PROMPT = "Say hello to the prefill/decode stack."
# How often `up` looks for exited children, and how often it asks each one's health.
TICK_S = 0.5
HEALTH_EVERY_S = 5.0


@dataclass(frozen=True)
class StackConfig:
    """One local stack. Ports of the i-th worker are the base port + i."""

    model: str
    served_model_name: str
    tokenizer: str | None = None
    vllm_args: tuple[str, ...] = ()
    engine_env: dict[str, str] = field(default_factory=dict)
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_port: int = 8100
    decode_port: int = 8200
    kvstore_port: int = 5556
    kvstore_http_port: int = 18556
    kvstore_l1_size_gb: float = 1.0
    kv_backend: str = "pdserve"  # or "lmcache": an `lmcache server` on the store's ports
    chunk_size: int | None = None  # the store's (None: its default)
    redis_url: str | None = None
    connector: bool = True
    pd_min_prompt_tokens: int | None = None
    api_key: str | None = None
    router_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()  # pdserve flags for every worker (not vLLM's: those are vllm_args)
    gpus: tuple[str, ...] = ()  # CUDA device ids the workers take in turn (prefill first); () leaves CUDA_VISIBLE_DEVICES alone
    log_dir: Path | None = None  # None: a fresh temp folder when the stack starts
    start_timeout: float = 900.0

    def __post_init__(self) -> None:
        if self.num_decode < 1:
            raise ValueError("a stack needs at least one decode worker (--num-decode)")
        if self.num_prefill < 0:
            raise ValueError("--num-prefill must not be negative")
        if self.kv_backend not in ("pdserve", "lmcache"):
            raise ValueError(f"--kv-backend must be pdserve or lmcache, not {self.kv_backend!r}")

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kvstore_url(self) -> str:
        return f"tcp://127.0.0.1:{self.kvstore_port}"

    def worker_urls(self, role: str) -> list[str]:
        base, count = (self.prefill_port, self.num_prefill) if role == "prefill" else (self.decode_port, self.num_decode)
        return [f"http://127.0.0.1:{base + i}" for i in range(count)]

    def placement(self) -> list[tuple[str, list[str]]]:
        """Per worker (prefill workers first), its GPU's id and the vLLM flags that placing it there needs: ("", [])
        for all without --gpus. Workers that share a GPU split its memory, as vLLM's default (about 0.9 of it) would
        leave the second engine too little to start (an H100 refused one), unless the user set it."""
        workers = self.num_prefill + self.num_decode
        if not self.gpus:
            return [("", [])] * workers
        ids = [self.gpus[k % len(self.gpus)] for k in range(workers)]
        own = any(a == "--gpu-memory-utilization" or a.startswith("--gpu-memory-utilization=") for a in self.vllm_args)
        return [(gpu, [] if own or ids.count(gpu) == 1 else ["--gpu-memory-utilization", f"{0.9 / ids.count(gpu):.2f}"])
                for gpu in ids]


@dataclass
class Component:
    """One child: how to start it and how to tell it is ready."""

    name: str
    argv: list[str]
    ready: Callable[[httpx.Client], bool]
    env: dict[str, str] = field(default_factory=dict)
    live: Callable[[httpx.Client], bool] | None = None  # health while serving; None: `ready`
    popen: subprocess.Popen | None = None
    log_path: Path | None = None
    ready_after_s: float | None = None
    supervised: Supervised | None = None
    up: bool = True  # as of the last health round

    @property
    def supervisor(self) -> Supervised:
        """Its Supervised: every component of a LocalStack gets one when the stack is made."""
        if self.supervised is None:
            raise RuntimeError(f"{self.name} belongs to no LocalStack")
        return self.supervised

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class StackFailed(RuntimeError):
    """A component exited or did not become ready; the message names it and quotes its log."""


class StopRequested(Exception):
    """A stop signal arrived while the stack was starting."""


def _get_ok(url: str) -> Callable[[httpx.Client], bool]:
    def check(client: httpx.Client) -> bool:
        try:
            return client.get(url).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def _router_sees_all(cfg: StackConfig) -> Callable[[httpx.Client], bool]:
    """Ready when the router reports every configured worker healthy, not just one."""

    def check(client: httpx.Client) -> bool:
        try:
            body = client.get(f"{cfg.router_url}/ready").json()
        except (httpx.HTTPError, json.JSONDecodeError):
            return False
        return (
            body.get("ready") is True
            and body.get("prefill", {}).get("healthy") == cfg.num_prefill
            and body.get("decode", {}).get("healthy") == cfg.num_decode
        )

    return check


def _pdserve(*words: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.deploy.cli", *words]


STORES = ("kvstore", "lmcache")  # the component names of the two KV backends' servers


def _store(cfg: StackConfig) -> Component:
    if cfg.kv_backend == "lmcache":
        return Component(
            "lmcache",
            lmcache_server.server_argv(cfg.kvstore_port, cfg.kvstore_http_port, l1_size_gb=cfg.kvstore_l1_size_gb,
                                       chunk_size=cfg.chunk_size or lmcache_server.DEFAULT_CHUNK_SIZE),
            _get_ok(lmcache_server.health_url(cfg.kvstore_http_port)), env=dict(lmcache_server.ENV),
        )
    chunk = ["--chunk-size", str(cfg.chunk_size)] if cfg.chunk_size else []
    return Component(
        "kvstore",
        _pdserve("kvstore", "--port", str(cfg.kvstore_port), "--http-port", str(cfg.kvstore_http_port),
                 "--l1-size-gb", str(cfg.kvstore_l1_size_gb), *chunk),
        _get_ok(f"http://127.0.0.1:{cfg.kvstore_http_port}/health"),
    )


def _kv_flags(cfg: StackConfig) -> list[str]:
    if not cfg.connector:
        return ["--no-connector"]
    if cfg.kv_backend == "lmcache":
        return ["--kv-backend", "lmcache", "--lmcache-url", cfg.kvstore_url]
    return ["--kvstore-url", cfg.kvstore_url]


def build_components(cfg: StackConfig) -> list[Component]:
    """The children of a stack, in start order: store, workers, router."""
    comps: list[Component] = []
    if cfg.connector:
        comps.append(_store(cfg))
    workers = [(role, i, url) for role in ("prefill", "decode") for i, url in enumerate(cfg.worker_urls(role))]
    for (role, i, url), (gpu, placed) in zip(workers, cfg.placement()):
        argv = _pdserve(role, "--model", cfg.model, "--port", url.rsplit(":", 1)[1])
        argv += _kv_flags(cfg)
        if cfg.redis_url:
            argv += ["--redis-url", cfg.redis_url]
        argv += cfg.worker_args
        vllm_args = [*placed, *cfg.vllm_args]
        if cfg.served_model_name != cfg.model:
            vllm_args += ["--served-model-name", cfg.served_model_name]
        if cfg.api_key:
            vllm_args += ["--api-key", cfg.api_key]
        env = {**cfg.engine_env, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {})}
        comps.append(Component(f"{role}-{i}", [*argv, "--", *vllm_args], _get_ok(f"{url}/health"), env=env))
    router = _pdserve("router", "--host", cfg.host, "--port", str(cfg.port))
    if cfg.redis_url:
        router += ["--redis-url", cfg.redis_url, "--model", cfg.served_model_name]
    else:
        if cfg.num_prefill:
            router += ["--prefill", *cfg.worker_urls("prefill")]
        router += ["--decode", *cfg.worker_urls("decode")]
    if cfg.tokenizer:
        router += ["--tokenizer", cfg.tokenizer]
    if cfg.pd_min_prompt_tokens is not None:
        router += ["--pd-min-prompt-tokens", str(cfg.pd_min_prompt_tokens)]
    if cfg.api_key:
        router += ["--api-key", cfg.api_key]
    comps.append(Component("router", [*router, *cfg.router_args], _router_sees_all(cfg),
                           live=_get_ok(f"{cfg.router_url}/health")))
    return comps


class LocalStack:
    """Start, watch and stop one stack's children. Use as a context manager."""

    def __init__(self, cfg: StackConfig, label: str = "pdserve", *, stop: StopFlag | None = None,
                 components: list[Component] | None = None, backoff: Backoff = Backoff()) -> None:
        """`stop` makes start-up end early on a signal; `components` replaces the ones cfg describes."""
        self.cfg = cfg
        self.label = label
        self.components = build_components(cfg) if components is None else components
        for comp in self.components:
            # A worker that exits EXIT_GAVE_UP already spent its engine's restarts.
            final = (EXIT_GAVE_UP,) if comp.name.startswith(("prefill-", "decode-")) else ()
            comp.supervised = Supervised(comp.name, partial(self._spawn, comp), backoff, final_codes=final)
        self.log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self._stop = stop
        self._http = httpx.Client(timeout=2.0)
        self._show_progress = True
        self._next_health = 0.0

    def _spawn(self, comp: Component) -> subprocess.Popen:
        comp.log_path = self.log_dir / f"{comp.name}.log"
        with open_log(comp.log_path) as log:
            comp.popen = spawn(comp.argv, stdout=log, env={**QUIET_ENV, **comp.env})
        return comp.popen

    def _pause(self, seconds: float) -> None:
        if self._stop is None:
            time.sleep(seconds)
        elif self._stop.wait(seconds):
            raise StopRequested

    def _wait(self, comps: list[Component], bar: tqdm, deadline: float) -> None:
        """Poll until every comp in `comps` is ready; raise StackFailed if one exits or time runs out."""
        started = last_note = time.monotonic()
        pending = list(comps)
        while pending:
            for comp in list(pending):
                if not comp.alive():
                    code = comp.popen.returncode if comp.popen is not None else None
                    raise StackFailed(f"{comp.name} exited with code {code} while starting; "
                                      f"log {comp.log_path}:\n{comp.log_tail()}")
                if comp.ready(self._http):
                    comp.ready_after_s = time.monotonic() - started
                    pending.remove(comp)
                    bar.update(1)
                    if self._show_progress:
                        bar.write(f"  {comp.name} ready after {comp.ready_after_s:.0f} s", file=sys.stderr)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StackFailed(f"not ready after {self.cfg.start_timeout:.0f} s: {names}; logs in {self.log_dir}")
            waiting = f"waiting for {', '.join(c.name for c in pending)}"
            bar.set_postfix_str(waiting, refresh=True)
            now = time.monotonic()
            if self._show_progress and bar.disable and now - last_note >= 30.0:
                # No terminal to redraw a bar on (a log file, CI): one line every 30 s.
                print(f"  {waiting} ({now - started:.0f} s)", file=sys.stderr, flush=True)
                last_note = now
            self._pause(1.0)

    def start(self, show_progress: bool = True) -> "LocalStack":
        """Store first (workers connect to it), then workers and router together."""
        deadline = time.monotonic() + self.cfg.start_timeout
        self._show_progress = show_progress
        bar = tqdm(total=len(self.components), desc=f"starting {self.label}", file=sys.stderr,
                   disable=not (show_progress and sys.stderr.isatty()),
                   bar_format="{desc}: {n}/{total} ready [{elapsed}]{postfix}")
        try:
            store = [c for c in self.components if c.name in STORES]
            for comp in store:
                comp.supervisor.start()
            self._wait(store, bar, deadline)
            rest = [c for c in self.components if c.name not in STORES]
            for comp in rest:
                comp.supervisor.start()
            self._wait(rest, bar, deadline)
        except BaseException:
            bar.close()
            self.stop()
            raise
        bar.close()
        return self

    def _note(self, message: str) -> None:
        print(f"pdserve up: {message}", file=sys.stderr, flush=True)

    def status_line(self) -> str:
        down = [c.name for c in self.components if not c.up]
        up = [c.name for c in self.components if c.up]
        return f"down: {', '.join(down) or 'none'}; serving with: {', '.join(up) or 'nothing'}"

    def watch(self) -> bool:
        """One supervision round: restart what exited, report health changes.

        False once the stack cannot serve any more (the router or every decode worker
        is down for good); everything else keeps serving with what is left.
        """
        for comp in self.components:
            change = comp.supervisor.poll()
            if change is not None:
                where = "" if change.kind == "restarted" else f"; log {comp.log_path}:\n{comp.log_tail(10)}"
                self._note(change.message + where)
        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + HEALTH_EVERY_S
            changed = False
            for comp in self.components:
                up = comp.alive() and (comp.live or comp.ready)(self._http)
                changed, comp.up = changed or up != comp.up, up
            if changed:
                self._note(self.status_line())
        lost = {c.name for c in self.components if c.supervisor.gave_up}
        decode = {c.name for c in self.components if c.name.startswith("decode-")}
        if "router" in lost or (decode and decode <= lost):
            self._note(f"cannot serve without {', '.join(sorted(lost))}; stopping")
            return False
        return True

    def stop(self) -> None:
        """Router first (no new requests), then workers together (each drains), then the store (and the rest)."""
        router = [c for c in self.components if c.name == "router"]
        workers = [c for c in self.components if c.name.startswith(("prefill-", "decode-"))]
        order = [router, workers, [c for c in self.components if c not in router and c not in workers]]
        for group in order:
            running = [(c, c.popen) for c in group if c.popen is not None]
            for _, popen in running:
                signal_group(popen, signal.SIGTERM)
            for comp, _ in running:
                comp.supervisor.stop(timeout_s=90.0)
        self._http.close()

    @property
    def router_url(self) -> str:
        return self.cfg.router_url

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def chat_once(base_url: str, model: str, prompt: str, api_key: str | None = None,
              max_tokens: int = 32) -> tuple[str, float, int]:
    """One streamed chat request: (reply text, TTFT in seconds, completion tokens)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "stream": True, "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    ttft, tokens = float("nan"), 0
    start = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=300) as resp:
        if resp.status_code != 200:
            raise StackFailed(f"demo request failed: HTTP {resp.status_code} {resp.read().decode(errors='replace')}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise StackFailed(f"demo request failed mid-stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if (piece or choice.get("finish_reason")) and ttft != ttft:  # first token (NaN until set)
                    ttft = time.perf_counter() - start
                text.append(piece)
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens", 0))
    return "".join(text), ttft, tokens


def gpu_list(text: str) -> tuple[str, ...]:
    """`--gpus 0,1`: the device ids, as CUDA_VISIBLE_DEVICES takes them."""
    gpus = tuple(part.strip() for part in text.split(",") if part.strip())
    if not gpus or any(not gpu.isdigit() for gpu in gpus):
        raise argparse.ArgumentTypeError(f"device numbers separated by commas, e.g. 0,1; not {text!r}")
    return gpus


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve up",
        description=("Run a local P/D stack: KV store, prefill and decode workers, router. "
                     "Arguments after `--` go to every vLLM worker unchanged."),
        allow_abbrev=False,
    )
    p.add_argument("--model", default=None,
                   help=f"model for the workers (default: a tiny random-weight DeepSeek-V3, served as {TINY_SERVED_NAME})")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers (0: decode-only)")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--prefill-port", type=int, default=8100, help="port of the first prefill worker (+1 for each next)")
    p.add_argument("--decode-port", type=int, default=8200, help="port of the first decode worker (+1 for each next)")
    p.add_argument("--kvstore-port", type=int, default=5556)
    p.add_argument("--kvstore-http-port", type=int, default=18556)
    p.add_argument("--kvstore-l1-size-gb", type=float, default=1.0)
    p.add_argument("--kv-backend", choices=("pdserve", "lmcache"), default="pdserve",
                   help="the KV store: `pdserve kvstore`, or `lmcache server` (needs lmcache installed) on the same ports")
    p.add_argument("--chunk-size", type=int, default=None, help="the store's chunk size in tokens (default: its own)")
    p.add_argument("--redis-url", default=None, help="discover workers through Redis instead of fixed URLs")
    p.add_argument("--no-connector", action="store_true", help="no KV store: the decode leg recomputes the prompt")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=None, help="router: shorter prompts skip the prefill leg")
    p.add_argument("--api-key", default=None, help="Bearer key for clients; the workers get it too")
    p.add_argument("--gpus", type=gpu_list, default=(),
                   help="GPUs for the workers, one each in turn, prefill workers first: 0,1 puts the prefill worker on "
                        "GPU 0 and the decode worker on GPU 1 (CUDA_VISIBLE_DEVICES); workers that share one split its "
                        "memory (--gpu-memory-utilization 0.9/n unless given after --). Default: as CUDA_VISIBLE_DEVICES says")
    p.add_argument("--unhealthy-timeout", type=float, default=None,
                   help="workers: restart a running vLLM whose /health has failed this long (default: the worker's, 30 s)")
    p.add_argument("--stall-restart-timeout", type=float, default=None,
                   help="workers: restart a vLLM the router has reported stalled this long; 0: never (default: the worker's, 60 s)")
    p.add_argument("--log-dir", type=Path, default=None, help="where each child's log goes (default: a temp folder)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for the whole stack")
    p.add_argument("--no-demo", action="store_true", help="skip the demo chat request")
    return p


def parse_up_args(argv: Sequence[str]) -> tuple[StackConfig, argparse.Namespace]:
    """The stack to run and the raw options (for the flags that are not about the stack)."""
    argv, vllm_args = split_passthrough(argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    tokenizer: str | None
    if a.model is None:
        model_dir = tiny_model_dir()
        model, served, tokenizer = str(model_dir), a.served_model_name or TINY_SERVED_NAME, str(model_dir)
        vllm_args = [*TINY_VLLM_ARGS, *vllm_args]
        engine_env = dict(TINY_ENGINE_ENV)
    else:
        model, served, engine_env = a.model, a.served_model_name or a.model, {}
        tokenizer = a.model if Path(a.model).is_dir() else None
    if a.unhealthy_timeout is not None and not a.unhealthy_timeout > 0:
        parser.error("--unhealthy-timeout takes a positive number of seconds")
    if a.stall_restart_timeout is not None and not a.stall_restart_timeout >= 0:
        parser.error("--stall-restart-timeout takes 0 (never) or a positive number of seconds")
    worker_args: list[str] = []
    for flag, value in (("--unhealthy-timeout", a.unhealthy_timeout), ("--stall-restart-timeout", a.stall_restart_timeout)):
        if value is not None:
            worker_args += [flag, str(value)]
    try:
        cfg = StackConfig(
            model=model, served_model_name=served, tokenizer=tokenizer, vllm_args=tuple(vllm_args),
            engine_env=engine_env, num_prefill=a.num_prefill, num_decode=a.num_decode, host=a.host,
            port=a.port, prefill_port=a.prefill_port, decode_port=a.decode_port, kvstore_port=a.kvstore_port,
            kvstore_http_port=a.kvstore_http_port, kvstore_l1_size_gb=a.kvstore_l1_size_gb,
            kv_backend=a.kv_backend, chunk_size=a.chunk_size,
            redis_url=a.redis_url, connector=not a.no_connector, pd_min_prompt_tokens=a.pd_min_prompt_tokens,
            api_key=a.api_key, worker_args=tuple(worker_args), gpus=a.gpus, start_timeout=a.start_timeout,
            log_dir=a.log_dir,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if cfg.connector and cfg.kv_backend == "lmcache":
        reason = lmcache_server.runnable()
    else:
        reason = unsupported_reason(installed_version()) if cfg.connector else None
    if reason:
        parser.error(f"{reason} (or pass --no-connector)")
    return cfg, a


def curl_line(cfg: StackConfig) -> str:
    auth = f" -H 'Authorization: Bearer {cfg.api_key}'" if cfg.api_key else ""
    body = json.dumps({"model": cfg.served_model_name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    return f"curl {cfg.router_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def run_demo(cfg: StackConfig, stop: StopFlag) -> None:
    """The demo request on a thread, so that a stop signal does not wait for its reply."""
    outcome: list[tuple[str, float, int] | Exception] = []

    def request() -> None:
        try:
            outcome.append(chat_once(cfg.router_url, cfg.served_model_name, DEMO_PROMPT, cfg.api_key))
        except Exception as exc:  # reported below, on the main thread
            outcome.append(exc)

    thread = threading.Thread(target=request, name="demo-request", daemon=True)
    thread.start()
    while thread.is_alive():
        if stop.wait(TICK_S):
            raise StopRequested
    result = outcome[0]
    if isinstance(result, StackFailed):
        raise result
    if isinstance(result, Exception):
        raise StackFailed(f"demo request failed: {result!r}")
    reply, ttft, tokens = result
    print(f"demo reply ({tokens} tokens, TTFT {ttft * 1000:.0f} ms): {reply!r}", flush=True)


def serve(stack: LocalStack, stop: StopFlag, demo: bool = True) -> int:
    """Start, (demo,) keep serving and supervising until a signal, then stop everything.

    Signals only set `stop` (see StopFlag); this loop notices it, so a burst of signals
    during start-up or shutdown cannot interrupt the orderly stop or hang the process.
    """
    cfg = stack.cfg
    code = 0
    try:
        stack.start()
        print(f"\nready: {cfg.router_url}/v1  (model {cfg.served_model_name})\n  {curl_line(cfg)}\n", flush=True)
        if demo:
            run_demo(cfg, stop)
        print("serving; Ctrl-C stops every process", flush=True)
        while not stop.wait(TICK_S):
            if not stack.watch():
                code = 1
                break
    except StackFailed as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        code = 1
    except StopRequested:
        pass
    finally:
        print("stopping...", flush=True)
        stack.stop()
        stop.ignore_from_now()
        print("stopped", flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    cfg, opts = parse_up_args(sys.argv[1:] if argv is None else argv)
    stop = StopFlag().install()
    stack = LocalStack(cfg, stop=stop)
    print(f"pdserve up: {cfg.num_prefill} prefill + {cfg.num_decode} decode worker(s) of {cfg.served_model_name}; "
          f"logs in {stack.log_dir}", flush=True)
    return serve(stack, stop, demo=not opts.no_demo)
