"""Child processes that never outlive their parent, restarts with backoff, and a safe stop signal.

Why both: a process group lets us stop a child together with everything it spawned
(vLLM's engine core) in one `killpg`, and keeps the terminal's Ctrl-C away from it so
the parent decides the order of shutdown (drain first, then stop). The parent-death
signal (Linux `PR_SET_PDEATHSIG`) covers the case no handler can: the parent being
killed with SIGKILL, which would otherwise leave a whole engine running as an orphan.

`Supervised` restarts a child that exits, with doubling delays and a cap, so one
crashed engine or store does not take the rest of a stack down. `StopFlag` is the
SIGINT/SIGTERM handling of every long-running pdserve parent: its handler only stores
the signal number, because a handler that takes a lock (`threading.Event.set`) hangs
forever when a second signal arrives while the first is being handled.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Collection, Literal, Mapping, Sequence

log = logging.getLogger("pdserve.worker.children")

# What every child pdserve's launchers start gets in its environment: no usage reports, no
# tokenizer thread pools fighting the engine's.
QUIET_ENV: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM us when the parent thread dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def spawn(
    argv: Sequence[str],
    *,
    stdout: IO[bytes] | int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.Popen:
    """Start argv as the leader of a new session; it gets SIGTERM if we die.

    Call from the main thread: the parent-death signal fires when the *thread* that
    forked exits, so spawning from a short-lived worker thread would kill the child.
    """
    return subprocess.Popen(
        [str(a) for a in argv],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def open_log(path: Path) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")


def signal_group(popen: subprocess.Popen, sig: signal.Signals) -> None:
    """Send sig to the child's whole process group (the child leads it, see spawn)."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """True while any process (a zombie included) is left in the process group."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(popen: subprocess.Popen, timeout_s: float, name: str = "") -> int | None:
    """SIGTERM the group, SIGKILL it after timeout_s; always SIGKILL leftovers. Idempotent.

    The final SIGKILL is unconditional because a leader can exit on SIGTERM while a
    grandchild (an engine core) that ignored it still runs in the group. Returns only
    once the group is empty (or 10 s after SIGKILL), so a caller that exits next
    leaves nothing behind.
    """
    if popen.poll() is None:
        signal_group(popen, signal.SIGTERM)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) still running %.0f s after SIGTERM; killing it", name or "child", popen.pid, timeout_s)
    signal_group(popen, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while popen.poll() is None or group_alive(popen.pid):
        if time.monotonic() > deadline:
            log.error("%s (pid %d): processes survived SIGKILL", name or "child", popen.pid)
            break
        time.sleep(0.05)
    return popen.returncode


def describe_exit(code: int | None) -> str:
    """'exited with code 1' or 'was killed by SIGKILL' (Popen reports a signal as -signum)."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class Backoff:
    """When to restart a child that exited, and when to stop trying.

    The delay doubles from first_s (capped at max_s) with each exit inside window_s,
    and an exit that would be restart number max_restarts + 1 inside window_s is final.
    A sliding window rather than "exits in a row" so that an engine which crashes a
    minute after every start still runs out of restarts, while one crash a day is
    always restarted after first_s.
    """

    first_s: float = 1.0
    max_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 900.0

    def __post_init__(self) -> None:
        if self.first_s < 0 or self.max_s < self.first_s or self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError(f"invalid backoff {self}")

    def delay(self, recent_exits: int) -> float:
        """Seconds to wait before the restart that follows the recent_exits-th exit in the window."""
        return min(self.max_s, self.first_s * 2 ** (recent_exits - 1))


@dataclass(frozen=True)
class Change:
    """What `Supervised.poll` just did, with a line for the log."""

    kind: Literal["exited", "restarted", "gave_up"]
    message: str


class Supervised:
    """One child, restarted after it exits, with `Backoff`, until the cap is reached.

    Driven by `poll()` from the owner's loop (never a thread: `spawn` must run on the
    main thread, see there). poll() only looks and, when a restart is due, starts the
    child again; it never sleeps. Exit codes in `final_codes` are not restarted: they
    mean the child gave up on purpose (a worker whose engine ran out of restarts).
    """

    def __init__(self, name: str, start: Callable[[], subprocess.Popen], backoff: Backoff,
                 final_codes: Collection[int] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.backoff = backoff
        self.final_codes = frozenset(final_codes)
        self.popen: subprocess.Popen | None = None
        self.restarts = 0
        self.gave_up: str | None = None  # why, once final
        self._start = start
        self._clock = clock
        self._exits: list[float] = []
        self._restart_at: float | None = None

    def start(self) -> subprocess.Popen:
        self.popen = self._start()
        return self.popen

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def poll(self) -> Change | None:
        """Notice an exit (schedule a restart or give up) or perform a due restart."""
        if self.gave_up is not None or self.popen is None:
            return None
        now = self._clock()
        if self._restart_at is not None:
            if now < self._restart_at:
                return None
            self._restart_at = None
            self.restarts += 1
            popen = self.start()
            return Change("restarted", f"{self.name} restarted (pid {popen.pid}, restart {self.restarts})")
        code = self.popen.poll()
        if code is None:
            return None
        # The leader is gone, but what it spawned (an engine core) may still hold ports and memory.
        stop_group(self.popen, timeout_s=0.0, name=self.name)
        how = describe_exit(code)
        if code in self.final_codes:
            self.gave_up = f"{self.name} {how}, which means it gave up; not restarting it"
            return Change("gave_up", self.gave_up)
        self._exits = [t for t in self._exits if now - t < self.backoff.window_s] + [now]
        recent = len(self._exits)
        if recent > self.backoff.max_restarts:
            self.gave_up = (f"{self.name} {how}; that is exit {recent} within {self.backoff.window_s:.0f} s, "
                            f"over the cap of {self.backoff.max_restarts} restarts: giving up")
            return Change("gave_up", self.gave_up)
        delay = self.backoff.delay(recent)
        self._restart_at = now + delay
        return Change("exited", f"{self.name} {how}; restarting it in {delay:.1f} s "
                                f"({recent} of {self.backoff.max_restarts} restarts within {self.backoff.window_s:.0f} s)")

    def stop(self, timeout_s: float) -> None:
        """Stop the child (no restart follows: the owner stops polling)."""
        self._restart_at = None
        if self.popen is not None:
            stop_group(self.popen, timeout_s=timeout_s, name=self.name)


class StopFlag:
    """Set by SIGINT or SIGTERM; wait() wakes as soon as one arrives.

    The handler only stores the signal number: no lock, no call, so a signal that
    arrives while another is being handled cannot deadlock, and nothing is interrupted
    half-way (no exception is raised into the running code). The main loop notices the
    flag instead. wait() sleeps in select() on a pipe that the interpreter writes a byte
    to for every signal (signal.set_wakeup_fd), so a stop is seen at once, not after a
    poll interval. Install from the main thread (Python runs handlers only there).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._signals: tuple[signal.Signals, ...] = ()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def install(self, signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> "StopFlag":
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._signals = tuple(signals)
        for sig in signals:
            signal.signal(sig, self._on_signal)
        return self

    def ignore_from_now(self) -> None:
        """The stop is done and the process only exits: ignore further stop signals.

        While the interpreter shuts down it puts the default handlers back, so one more
        signal of a burst (a second Ctrl-C, a supervisor repeating SIGTERM) arriving then
        would kill a process that had stopped cleanly, and its exit status would say
        "killed by SIGTERM" instead of its own code. Python leaves an ignored signal
        ignored. Call it only once nothing more will be spawned: children inherit it.
        """
        for sig in self._signals:
            signal.signal(sig, signal.SIG_IGN)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signum = signum

    def is_set(self) -> bool:
        return self.signum is not None

    def wait(self, timeout: float) -> bool:
        """Sleep up to timeout seconds, less if a signal arrives; True once the flag is set."""
        if self.signum is None and timeout > 0:
            select.select([self._read_fd], [], [], timeout)
            try:
                while os.read(self._read_fd, 512):
                    pass
            except BlockingIOError:
                pass
        return self.signum is not None
