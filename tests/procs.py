"""Start and stop the real processes that tests run against (redis, vLLM, pdserve services).

Every test module uses these helpers, so they are generic: `start_process` runs any
argv in its own session with its log in a file, waits until a readiness check passes,
and raises with the log's tail if the process dies first. `Proc.stop()` kills the
whole process group, because vLLM spawns an engine-core child that would otherwise
outlive the test and eat one of the machine's two cores. An atexit hook stops
whatever a crashed test left running.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence, Union

from pdserve.bench.fault_stack import redis_pongs
from pdserve.deploy.ports import free_port  # noqa: F401  (tests import it from here with the rest)
from pdserve.deploy.tiny_model import TINY_ENGINE_ENV

# Flags that keep a tiny CPU engine small and quick to start (measured: see tests/test_tiny_model.py).
# The KV cache size must be explicit on the CPU (otherwise vLLM reserves 90% of RAM and refuses to
# start next to other engines); 256 MiB holds ~58k tokens of tiny DeepSeek-V3 MLA KV, ~128k of
# tiny Gemma-3. The flag is used rather than VLLM_CPU_KVCACHE_SPACE because that env var counts
# whole GiB (and, when set, overrides the flag). --enforce-eager skips torch.compile.
ENGINE_ARGS: tuple[str, ...] = (
    "--max-model-len", "4096",
    "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", str(256 * 2**20),
    "--enforce-eager",
)
# The tiny stack's engine settings (one unpinned OpenMP thread each: vLLM's default binding pins
# every engine's worker to core 0 of this 2-core machine; a short idle spin), and nothing online.
ENGINE_ENV: dict[str, str] = {
    **TINY_ENGINE_ENV,
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Start-up measured 35-170 s depending on how many engines share the 2 cores.
ENGINE_START_TIMEOUT_S = 360.0

Ready = Union[str, Callable[["Proc"], bool], None]

_LIVE: list["Proc"] = []
_LOG_DIR: Path | None = None
_LOG_DIR_LOCK = threading.Lock()  # start_together starts processes from several threads


def log_dir() -> Path:
    """One temp folder a test session for all process logs, kept after exit for post-mortems."""
    global _LOG_DIR
    with _LOG_DIR_LOCK:
        if _LOG_DIR is None:
            _LOG_DIR = Path(tempfile.mkdtemp(prefix="pdserve-test-logs-"))
        return _LOG_DIR


class ProcessDied(RuntimeError):
    """The process exited (or never became ready); the message carries its log's tail."""

    def __init__(self, message: str, proc: "Proc") -> None:
        super().__init__(message)
        self.proc = proc


@dataclass
class Proc:
    """A started process: its port, base URL, log file, and a stop() that kills its whole group."""

    name: str
    argv: list[str]
    popen: subprocess.Popen
    log_path: Path
    port: int | None = None
    host: str = "127.0.0.1"
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise ValueError(f"{self.name} was started without a port")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text[-chars:]

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `timeout`; idempotent. Returns the exit code."""
        if self in _LIVE:
            _LIVE.remove(self)
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Children (vLLM's engine core) may outlive a leader that exited on SIGTERM.
        _signal_group(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return self.popen.returncode

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET url answers 2xx; any connection error or other status is False."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start_process(
    argv: Sequence[str],
    ready: Ready,
    *,
    name: str | None = None,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 60.0,
    poll_s: float = 0.25,
) -> Proc:
    """Start argv in a new session with output to a log file, and wait until `ready` holds.

    `ready` is a URL (ready when GET answers 2xx), a callable taking the Proc, or None
    (ready as soon as it started). With `port`, readiness also needs the process (or a
    child) to hold the listening socket on it, so a stranger on a raced port cannot pass
    for ours. `env` is added to the current environment. Raises
    ProcessDied with the log tail if the process exits or `timeout` passes first; the
    process is stopped in both cases so a failed start leaks nothing.
    """
    argv = [str(a) for a in argv]
    name = name or Path(argv[0]).name
    log_path = log_dir() / f"{name}-{port or 'noport'}-{time.time_ns()}.log"
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    proc = Proc(name=name, argv=argv, popen=popen, log_path=log_path, port=port)
    _LIVE.append(proc)
    check: Callable[[Proc], bool]
    if ready is None:
        check = lambda _p: True  # noqa: E731
    elif isinstance(ready, str):
        check = lambda _p, u=ready: http_ok(u)  # noqa: E731
    else:
        check = ready
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            code = proc.popen.returncode
            proc.stop()
            raise ProcessDied(f"{name} exited with code {code} before it was ready; log {log_path}:\n{proc.log_tail()}", proc)
        if check(proc) and (port is None or listens_on(proc.pid, port)):
            proc.ready_after_s = time.monotonic() - proc.started_at
            return proc
        if time.monotonic() > deadline:
            proc.stop()
            raise ProcessDied(f"{name} not ready after {timeout:.0f} s; log {log_path}:\n{proc.log_tail()}", proc)
        time.sleep(poll_s)


def start_on_port(start: Callable[[int], Proc], port: int | None = None, attempts: int = 3) -> Proc:
    """Run start(port); with no port given, pick free ones and retry if another process took it first.

    free_port() can race with the other test sessions sharing this machine, which
    also bind fresh ports (vLLM alone opens several); a lost race shows up in the log.
    """
    if port is not None:
        return start(port)
    for _ in range(attempts - 1):
        try:
            return start(free_port())
        except ProcessDied as exc:
            if "address already in use" not in exc.proc.log_tail().lower():
                raise
    return start(free_port())


def start_together(starts: Sequence[Callable[[], Proc]]) -> list[Proc]:
    """Run independent starts at once and return their processes in order.

    An engine start is mostly one core's work and the machine has two, so two engines
    started together are ready in about the time of one. If a start fails, the ones that
    succeeded are stopped and the first failure is raised: nothing is left running.
    """
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        for proc in started:
            proc.stop()
        raise errors[0]
    return started


class BackgroundRun:
    """A command that runs to its end beside other work, for a later test to read its outcome.

    For a test whose subject is a whole start-up (an engine that must refuse to start, ~50 s
    of one core): begun by a fixture while the module's other engine runs, so the two use
    both cores. Output goes to files (a pipe nobody reads would stall the child).
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], timeout: float) -> None:
        self.timeout = timeout
        self._out = tempfile.TemporaryFile(mode="w+", dir=log_dir())
        self._err = tempfile.TemporaryFile(mode="w+", dir=log_dir())
        self.popen = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=self._out,
                                      stderr=self._err, text=True, env=dict(env), start_new_session=True)
        self._started = time.monotonic()

    def result(self) -> subprocess.CompletedProcess[str]:
        """Wait for the end (raises TimeoutExpired after `timeout` from the start) and return its output."""
        self.popen.wait(max(0.0, self.timeout - (time.monotonic() - self._started)))
        outputs = []
        for f in (self._out, self._err):
            f.seek(0)
            outputs.append(f.read())
        return subprocess.CompletedProcess(self.popen.args, self.popen.returncode, *outputs)

    def stop(self) -> None:
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        self._out.close()
        self._err.close()


def start_redis(port: int | None = None) -> Proc:
    """A throwaway redis-server on a free port: no persistence, ready when it answers PING."""

    def start(port: int) -> Proc:
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        return start_process(argv, lambda _p: redis_pongs(port), name="redis", port=port, timeout=30.0)

    return start_on_port(start, port)


def redis_url(proc: Proc, db: int = 0) -> str:
    return f"redis://127.0.0.1:{proc.port}/{db}"


def pdserve_argv(*words: str) -> list[str]:
    """argv that runs `pdserve <words>` with this interpreter (no reliance on PATH or console scripts)."""
    return [sys.executable, "-m", "pdserve.deploy.cli", *words]


def start_vllm_server(
    model_dir: str | os.PathLike,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    engine_args: Sequence[str] = ENGINE_ARGS,
    timeout: float = ENGINE_START_TIMEOUT_S,
) -> Proc:
    """vLLM's OpenAI server on a tiny random-weight model, ready when GET /health answers.

    Uses `python -m vllm.entrypoints.openai.api_server` because the `vllm` console
    script cannot find the `vllm-cpu` distribution's metadata.
    """

    def start(port: int) -> Proc:
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir),
            "--load-format", "dummy",
            "--host", "127.0.0.1",
            "--port", str(port),
            *engine_args,
            *extra_args,
        ]
        return start_process(
            argv,
            f"http://127.0.0.1:{port}/health",
            name="vllm",
            port=port,
            env={**ENGINE_ENV, **(env or {})},
            timeout=timeout,
            poll_s=0.25,
        )

    return start_on_port(start, port)


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants, read from /proc (Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, stack = [], [pid]
    while stack:
        current = stack.pop()
        tree.append(current)
        stack.extend(children.get(current, []))
    return tree


def process_tree_rss_bytes(pid: int) -> int:
    """Resident memory of pid and its descendants (shared library pages count once a process)."""
    total = 0
    for member in process_tree(pid):
        try:
            total += int((Path("/proc") / str(member) / "statm").read_text().split()[1])
        except (OSError, IndexError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE")


def listens_on(pid: int, port: int) -> bool:
    """True when pid or a descendant holds the listening TCP socket on port.

    Guards readiness checks against a lost free_port() race: another session's server
    on the same port would answer /health while ours is still starting.
    """
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for member in process_tree(pid):
        fd_dir = Path("/proc") / str(member) / "fd"
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) in inodes:
                        return True
                except OSError:
                    continue
        except OSError:
            continue
    return False


@atexit.register
def _stop_leftovers() -> None:
    for proc in list(_LIVE):
        proc.stop(timeout=5.0)
