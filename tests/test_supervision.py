"""Faults: restarts with backoff and a cap, a stack that outlives one dead engine, signals that cannot hang.

Units first (no engine): the backoff and cap of `Supervised` on real child processes
that always exit, `StopFlag`'s handler (no call, so no lock), and a `pdserve up`-like
parent with cheap children under a burst of nested signals. Then one real `pdserve up`
(KV store, two decode workers on the tiny DeepSeek-V3, router, Redis discovery) shared
by the fault tests: under load, kill -9 of one decode worker's engine core, then SIGSTOP of
the other's server (hung, not dead), then SIGSTOP of an engine core alone (its server answers
/health: restarted on the router's stall reports); then kill -9 of the KV store; the last test
stops the stack with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from pdserve.worker.children import Backoff, Change, StopFlag, Supervised, spawn
from pdserve.worker.supervisor import EXIT_GAVE_UP
from pdstack_fixtures import UpStack, descendants, running_up
from procs import ENGINE_ENV, ENGINE_START_TIMEOUT_S, free_port, listens_on, log_dir, pdserve_argv

EXITS_AT_ONCE = [sys.executable, "-c", "import sys; sys.exit(7)"]
# A bound for things that take well under a second; only hit when something hangs.
HANG_S = 120.0

# ---------------------------------------------------------------- backoff and cap (no engine)


def test_backoff_doubles_up_to_its_ceiling() -> None:
    backoff = Backoff(first_s=1.0, max_s=5.0)
    assert [backoff.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError):
        Backoff(first_s=2.0, max_s=1.0)


def _poll_until_final(sup: Supervised) -> list[Change]:
    changes: list[Change] = []
    deadline = time.monotonic() + HANG_S
    while sup.gave_up is None:
        assert time.monotonic() < deadline, f"never gave up: {changes}"
        if (change := sup.poll()) is not None:
            changes.append(change)
        time.sleep(0.01)
    return changes


def test_child_that_always_exits_is_restarted_with_backoff_then_given_up_with_the_reason() -> None:
    sup = Supervised("crasher", lambda: spawn(EXITS_AT_ONCE), Backoff(first_s=0.01, max_s=0.04, max_restarts=3))
    sup.start()
    changes = _poll_until_final(sup)
    assert [c.kind for c in changes] == ["exited", "restarted"] * 3 + ["gave_up"]
    assert sup.restarts == 3 and sup.popen is not None and sup.popen.returncode == 7
    exits = [c.message for c in changes if c.kind == "exited"]
    assert [re.search(r"in (\S+) s \((\d) of 3", m).groups() for m in exits] == [
        ("0.0", "1"), ("0.0", "2"), ("0.0", "3")]
    assert "crasher exited with code 7" in sup.gave_up and "exit 4 within" in sup.gave_up
    assert "over the cap of 3 restarts: giving up" in sup.gave_up
    assert sup.poll() is None  # final: no more restarts


def test_exits_older_than_the_window_do_not_count_towards_the_cap() -> None:
    now = [0.0]
    sup = Supervised("crasher", lambda: spawn(EXITS_AT_ONCE),
                     Backoff(first_s=1.0, max_s=8.0, max_restarts=1, window_s=100.0), clock=lambda: now[0])
    first = sup.start()
    first.wait(HANG_S)
    assert sup.poll() == Change("exited", "crasher exited with code 7; restarting it in 1.0 s (1 of 1 restarts within 100 s)")
    assert sup.poll() is None and sup.popen is first  # not due yet
    now[0] = 1.0
    assert sup.poll().kind == "restarted" and sup.popen is not first
    sup.popen.wait(HANG_S)
    now[0] = 101.0  # the first exit has left the window: this is again the first
    assert sup.poll().message.endswith("in 1.0 s (1 of 1 restarts within 100 s)")
    now[0] = 102.0
    assert sup.poll().kind == "restarted"
    sup.popen.wait(HANG_S)
    now[0] = 103.0  # second exit within 100 s: over a cap of one restart
    assert sup.poll().kind == "gave_up" and sup.restarts == 2


def test_a_final_exit_code_is_not_restarted() -> None:
    sup = Supervised("worker", lambda: spawn([sys.executable, "-c", f"raise SystemExit({EXIT_GAVE_UP})"]),
                     Backoff(first_s=0.0), final_codes=(EXIT_GAVE_UP,))
    sup.start()
    assert [c.kind for c in _poll_until_final(sup)] == ["gave_up"]
    assert sup.restarts == 0 and "gave up; not restarting it" in sup.gave_up


@pytest.mark.slow  # a real `pdserve decode` whose vLLM child imports vLLM before refusing a flag
def test_worker_whose_vllm_never_became_healthy_exits_at_once(tiny_deepseek_v3: Path) -> None:
    """A real `pdserve decode` whose vLLM refuses its arguments: a start-up problem, so no restart."""
    result = subprocess.run(
        pdserve_argv("decode", "--model", str(tiny_deepseek_v3), "--no-connector", "--port", str(free_port()),
                     "--restart-delay", "0", "--", "--no-such-vllm-flag"),
        env={**os.environ, **ENGINE_ENV}, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(re.findall(r"started vLLM \(pid \d+\)", result.stderr)) == 1, result.stderr[-3000:]
    assert "vLLM exited with code 2 before it was ever healthy; not restarting it" in result.stderr


# ---------------------------------------------------------------- signals (no engine)


@pytest.fixture
def stop_flag() -> Iterator[StopFlag]:
    """A StopFlag installed in this (main) thread; the previous handlers come back afterwards."""
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    old_fd = signal.set_wakeup_fd(-1)
    try:
        yield StopFlag().install()
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_stop_handler_only_sets_a_flag(stop_flag: StopFlag) -> None:
    """No call at all inside the handler: nothing that could take a lock or raise."""
    handler = signal.getsignal(signal.SIGTERM)
    events: list[tuple[str, str]] = []
    sys.setprofile(lambda frame, event, arg: events.append((event, getattr(arg, "__name__", frame.f_code.co_name))))
    try:
        handler(signal.SIGTERM, None)
    finally:
        sys.setprofile(None)
    assert events[:2] == [("call", "_on_signal"), ("return", "_on_signal")]
    assert events[2:] == [("c_call", "setprofile")]
    assert stop_flag.is_set() and stop_flag.signum == signal.SIGTERM


def test_stop_flag_wakes_its_waiter_on_signals_from_another_thread(stop_flag: StopFlag) -> None:
    assert not stop_flag.wait(0.0)
    threading.Thread(target=lambda: [os.kill(os.getpid(), s) for s in (signal.SIGINT, signal.SIGTERM)]).start()
    assert stop_flag.wait(HANG_S)
    assert stop_flag.signum in (signal.SIGINT, signal.SIGTERM)


def test_once_stopped_later_stop_signals_are_ignored(stop_flag: StopFlag) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop_flag.wait(HANG_S)
    stop_flag.ignore_from_now()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGTERM)  # would end this test session under the default handler


# Runs `serve` (what `pdserve up` runs) over two cheap children. A profiler hook sends one
# more SIGTERM each time a C function returns inside the running signal handler; os.kill runs
# the nested handler at once. A handler that takes a lock (threading.Event.set, the old code)
# is re-entered right after its lock.__enter__ returned, so it hangs forever (checked by hand
# against the old handler: it hangs; against a handler that only sets a flag: nothing to nest).
UP_LIKE = r"""
import os, signal, sys
from pathlib import Path
from pdserve.worker.children import StopFlag
from pdserve.deploy.local import Component, LocalStack, StackConfig, serve

extra = [20]

def nest(frame, event, _arg):
    if event != "c_return" or not extra[0]:
        return
    handler = signal.getsignal(signal.SIGTERM)
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    while frame is not None:
        if frame.f_code is code:
            extra[0] -= 1
            os.kill(os.getpid(), signal.SIGTERM)
            return
        frame = frame.f_back

sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
comps = [Component(f"sleeper-{i}", sleeper, ready=lambda _http: True) for i in range(2)]
cfg = StackConfig(model="none", served_model_name="none", log_dir=Path(sys.argv[1]))
stop = StopFlag().install()
sys.setprofile(nest)
sys.exit(serve(LocalStack(cfg, stop=stop, components=comps), stop, demo=False))
"""


def test_burst_of_signals_stops_an_up_like_parent_cleanly(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", UP_LIKE, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving"):
                break
        children = descendants(proc.pid)
        assert len(children) == 2, "".join(lines)
        for sig in (signal.SIGINT, signal.SIGTERM) * 5:
            os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, "".join(lines) + out
    assert out.splitlines()[-2:] == ["stopping...", "stopped"]
    assert [pid for pid in children if os.path.exists(f"/proc/{pid}")] == []


def test_signals_while_an_up_like_parent_exits_after_its_stop_leave_its_exit_code_alone(tmp_path: Path) -> None:
    """A burst can outlast the stop: once "stopped" is printed the process only exits, and Python puts
    the default handlers back while it shuts down. SIGTERM sent all through that exit must not turn a
    clean stop (exit 0) into death by SIGTERM (-15): the burst test above hit that when the sending
    process was preempted in the middle of its burst."""
    proc = subprocess.Popen([sys.executable, "-c", UP_LIKE, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving"):
                os.kill(proc.pid, signal.SIGTERM)
            if line.startswith("stopped"):
                break
        deadline = time.monotonic() + HANG_S
        while proc.poll() is None:  # not reaped yet, so the pid is still ours to signal
            assert time.monotonic() < deadline, "".join(lines)
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.001)
        lines += proc.stdout.readlines()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, "".join(lines)
    assert [line.strip() for line in lines[-2:]] == ["stopping...", "stopped"]


# ---------------------------------------------------------------- one real stack, killed in parts


UNHEALTHY_S, STALL_RESTART_S = 15, 15  # the stack's workers' --unhealthy-timeout, --stall-restart-timeout


@pytest.fixture(scope="module")
def stack(redis_url: str) -> Iterator[UpStack]:
    """`pdserve up`: store, no prefill, two decode workers discovered through Redis, router."""
    folder = log_dir() / f"up-supervision-{time.time_ns()}"
    folder.mkdir(parents=True)
    port, decode_port = free_port(), free_port()
    while decode_port + 1 in (port, decode_port - 1):
        decode_port = free_port()
    argv = pdserve_argv(
        "up", "--num-prefill", "0", "--num-decode", "2", "--redis-url", redis_url,
        "--port", str(port), "--decode-port", str(decode_port), "--kvstore-port", str(free_port()),
        "--kvstore-http-port", str(free_port()), "--log-dir", str(folder),
        # Shorter than the workers' defaults (30 s, 60 s): the faults below wait these windows out.
        "--unhealthy-timeout", str(UNHEALTHY_S), "--stall-restart-timeout", str(STALL_RESTART_S),
    )
    with running_up(argv, port, decode_port, folder, 3 * ENGINE_START_TIMEOUT_S) as up:
        yield up


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _child_of(parent: int, *words: str) -> int:
    """The one direct child of parent whose command line holds every word."""
    found = [pid for pid in descendants(parent)
             if Path(f"/proc/{pid}/stat").exists() and _ppid(pid) == parent
             and all(w in _cmdline(pid) for w in words)]
    assert len(found) == 1, f"children of {parent} with {words}: {[(p, _cmdline(p)) for p in descendants(parent)]}"
    return found[0]


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _engine_core(vllm_pid: int) -> int:
    """vLLM's engine-core process (it renames itself VLLM::EngineCore) under an API server."""
    cores = [pid for pid in descendants(vllm_pid) if "EngineCore" in _cmdline(pid) or "spawn_main" in _cmdline(pid)]
    assert len(cores) == 1, [(p, _cmdline(p)) for p in descendants(vllm_pid)]
    return cores[0]


def _ready(up: UpStack) -> dict:
    try:
        return httpx.get(f"{up.url}/ready", timeout=5).json()
    except (httpx.HTTPError, json.JSONDecodeError):
        return {}


def _wait(what: str, cond, up: UpStack, timeout: float = 2 * ENGINE_START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert up.popen.poll() is None, f"pdserve up exited while waiting for {what}:\n{up.stderr_tail()}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s\n{up.stderr_tail()}"
        time.sleep(0.5)


class Load:
    """Chat requests through the router, one after another on a thread, each with its outcome."""

    def __init__(self, up: UpStack) -> None:
        self.up = up
        self.results: list[tuple[float, int]] = []  # (start, HTTP status or 0 for a transport error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": self.up.model, "messages": [{"role": "user", "content": "count the stones"}],
                "max_tokens": 8, "ignore_eos": True}
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    status = client.post(f"{self.up.url}/v1/chat/completions", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                self.results.append((start, status))

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(HANG_S)


def _fault_under_load(stack: UpStack, index: int, fault: Callable[[int], None]) -> str:
    """Apply fault to decode-<index>'s vLLM server while chat requests flow through the router;
    check that the other worker serves every request meanwhile, that this one is restarted and
    re-admitted, and that `up` reported it down and kept running. Returns the worker's log."""
    assert _ready(stack)["decode"] == {"healthy": 2, "known": 2}
    name, other = f"decode-{index}", 1 - index
    supervisor = _child_of(stack.popen.pid, "decode", f"--port {stack.decode_port + index} ")
    vllm = _child_of(supervisor, "vllm.entrypoints.openai.api_server")
    other_vllm = _child_of(_child_of(stack.popen.pid, "decode", f"--port {stack.decode_port + other} "),
                           "vllm.entrypoints.openai.api_server")
    worker_log = stack.log_dir / f"{name}.log"
    with Load(stack) as load:
        _wait("a first answer", lambda: any(s == 200 for _, s in load.results), stack)
        fault(vllm)
        _wait(f"the router dropping {name}", lambda: _ready(stack).get("decode", {}).get("healthy") == 1, stack)
        down_at = time.monotonic()
        _wait(f"a new vLLM for {name}", lambda: re.search(
            rf"started vLLM \(pid (?!{vllm}\b)\d+\)", worker_log.read_text(errors="replace")), stack)
        _wait(f"the router re-admitting {name}",
              lambda: _ready(stack).get("decode") == {"healthy": 2, "known": 2}, stack)
        back_at = time.monotonic()
        _wait("an answer after re-admission", lambda: any(t > back_at and s == 200 for t, s in load.results), stack)
    while_down = [status for start, status in load.results if down_at <= start < back_at]
    assert while_down and set(while_down) == {200}, f"requests while {name} was down: {while_down}"
    assert stack.popen.poll() is None, stack.stderr_tail()
    assert os.path.exists(f"/proc/{other_vllm}"), "the healthy worker's vLLM was touched"
    assert f"down: {name};" in stack.stderr_tail(20000)
    return worker_log.read_text(errors="replace")


@pytest.mark.engine
def test_killed_decode_engine_is_restarted_and_readmitted_while_the_other_serves(stack: UpStack) -> None:
    log = _fault_under_load(stack, 1, lambda vllm: os.kill(_engine_core(vllm), signal.SIGKILL))
    assert "restarting it in 1.0 s (1 of 5 restarts" in log


@pytest.mark.engine
def test_hung_decode_server_is_restarted_after_failing_health(stack: UpStack) -> None:
    """A stopped (not dead) server: only its failing /health shows it; the worker restarts it."""
    log = _fault_under_load(stack, 0, lambda vllm: os.kill(vllm, signal.SIGSTOP))
    assert f"vLLM has failed /health for {UNHEALTHY_S} s; restarting it" in log
    assert "vLLM was killed by SIGKILL; restarting it in" in log


@pytest.mark.engine
def test_stalled_decode_engine_is_restarted_on_the_routers_reports(stack: UpStack) -> None:
    """A stopped engine core under a server that still answers /health: the router, whose requests there are
    whole (non-streamed) answers, sees in the engine's /metrics that it no longer steps, and reports it stalled
    in Redis; the worker restarts vLLM once that lasted and its own request went unanswered too."""
    log = _fault_under_load(stack, 1, lambda vllm: os.kill(_engine_core(vllm), signal.SIGSTOP))
    router_log = (stack.log_dir / "router.log").read_text(errors="replace")
    assert re.search(r"decode worker decode-\S+ sent nothing it owed for [\d.]+ s", router_log), router_log[-3000:]
    assert "a router reports vLLM stalled (decode worker" in log
    assert re.search(r"routers have reported vLLM stalled for \d+ s \(decode worker .* sent nothing on its "
                     r"requests for [\d.]+ s\) and it answered no request of the worker's own in 15 s; restarting "
                     r"it", log), log[-3000:]


@pytest.mark.engine
def test_killed_store_is_restarted_in_place_and_workers_reconnect(stack: UpStack) -> None:
    store = _child_of(stack.popen.pid, "pdserve.deploy.cli kvstore ")
    argv = _cmdline(store).split()
    http_port = int(argv[argv.index("--http-port") + 1])
    os.kill(store, signal.SIGKILL)
    _wait("the store's restart", lambda: "kvstore restarted" in stack.stderr_tail(20000), stack)
    new_store = _child_of(stack.popen.pid, "pdserve.deploy.cli kvstore ")
    assert new_store != store
    _wait("the new store listening", lambda: listens_on(new_store, http_port), stack)
    assert "kvstore was killed by SIGKILL; restarting it" in stack.stderr_tail(20000)

    def store_requests() -> float:
        metrics = httpx.get(f"http://127.0.0.1:{http_port}/stats", timeout=5).json()["metrics"]
        return sum(v for k, v in metrics.items() if k.startswith("requests_total"))

    assert store_requests() == 0
    prompt = "tell me about the river and the old stone bridge " * 40  # several full store chunks
    body = {"model": stack.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}

    def answered_and_store_used() -> bool:
        # A connector's first request after the restart may fail its store call (and recompute).
        assert httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=300).status_code == 200
        return store_requests() > 0

    _wait("a connector reaching the new store", answered_and_store_used, stack)
    assert stack.popen.poll() is None


@pytest.mark.engine
def test_ctrl_c_after_the_faults_stops_every_child(stack: UpStack) -> None:
    """Runs last: the stack that survived the kills still stops cleanly."""
    children = stack.children()
    assert stack.interrupt() == 0, stack.stderr_tail()
    assert [pid for pid in children if os.path.exists(f"/proc/{pid}")] == []
