"""Child processes that never outlive their parent: own process group, parent-death signal.

Why both: a process group lets us stop a child together with everything it spawned
(vLLM's engine core) in one `killpg`, and keeps the terminal's Ctrl-C away from it so
the parent decides the order of shutdown (drain first, then stop). The parent-death
signal (Linux `PR_SET_PDEATHSIG`) covers the case no handler can: the parent being
killed with SIGKILL, which would otherwise leave a whole engine running as an orphan.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

log = logging.getLogger("pdserve.deploy.children")

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
