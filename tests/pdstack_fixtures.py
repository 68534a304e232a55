"""One `pdserve up` stack a test session, shared by the `up` and `bench serve` tests.

Loaded with `pytest_plugins = ["pdstack_fixtures"]` so both test modules get the same
session-scoped stack: two engines start once, not twice. The stack runs exactly as a
user starts it (a subprocess on free ports); `UpStack.interrupt()` is the Ctrl-C a
user would press, and test_up's last test calls it to check that nothing survives.
The tests that use the stack run one after the other (see the collection hook), so its
engines are gone once the last of them has run, not held idle through the session.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from procs import ENGINE_START_TIMEOUT_S, free_port, log_dir, pdserve_argv

DEMO_LINE = re.compile(r"^demo reply \((\d+) tokens, TTFT (\d+) ms\)")


def descendants(pid: int) -> set[int]:
    """pid's children, grandchildren, ... read from /proc now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


@dataclass
class UpStack:
    popen: subprocess.Popen
    port: int
    decode_port: int
    log_dir: Path
    model: str = "tiny-deepseek-v3"
    stdout: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{self.decode_port}"

    def children(self) -> set[int]:
        return descendants(self.popen.pid)

    def text(self) -> str:
        return "".join(self.stdout)

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.stdout.append(line)

    def wait_for_demo(self, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.stdout):
                if found := DEMO_LINE.match(line):
                    return found
            if self.popen.poll() is not None:
                break
            time.sleep(1.0)
        raise AssertionError(f"no demo reply from pdserve up (exit {self.popen.poll()}); stdout:\n{self.text()}\n"
                             f"stderr tail:\n{self.stderr_tail()}")

    def stderr_tail(self, chars: int = 3000) -> str:
        path = self.log_dir / "up.stderr"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def interrupt(self, timeout: float = 180.0) -> int:
        """Ctrl-C: SIGINT to `pdserve up` alone, then wait for it to exit."""
        self.popen.send_signal(signal.SIGINT)
        code = self.popen.wait(timeout)
        if self._reader is not None:
            self._reader.join(10)
        return code

    def kill(self) -> None:
        """Last-resort cleanup: every process the stack started, by id."""
        for pid in descendants(self.popen.pid) | {self.popen.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(10)


@contextmanager
def running_up(argv: list[str], port: int, decode_port: int, folder: Path, timeout: float) -> Iterator[UpStack]:
    """Start `pdserve up` (argv) as a user would, wait for its demo reply, and kill whatever is left at exit."""
    with open(folder / "up.stderr", "wb") as stderr:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                 env={**os.environ, "XDG_CACHE_HOME": str(folder / "cache")}, start_new_session=True)
    stack = UpStack(popen=popen, port=port, decode_port=decode_port, log_dir=folder)
    stack._reader = threading.Thread(target=stack._read, daemon=True)
    stack._reader.start()
    try:
        stack.wait_for_demo(timeout)
        yield stack
    finally:
        if stack.popen.poll() is None:
            stack.kill()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The up_stack tests together, where the first of them was, in their own order."""
    users = [item for item in items if "up_stack" in getattr(item, "fixturenames", ())]
    if users:
        first = items.index(users[0])
        using = set(users)
        rest = [item for item in items if item not in using]
        items[:] = rest[:first] + users + rest[first:]


@pytest.fixture(scope="session")
def up_stack() -> Iterator[UpStack]:
    """`pdserve up` with its defaults (tiny DeepSeek-V3, KV store, connector) on free ports."""
    folder = log_dir() / f"up-{time.time_ns()}"
    folder.mkdir(parents=True)
    port, decode_port = free_port(), free_port()
    argv = pdserve_argv(
        "up", "--port", str(port), "--prefill-port", str(free_port()), "--decode-port", str(decode_port),
        "--kvstore-port", str(free_port()), "--kvstore-http-port", str(free_port()), "--log-dir", str(folder),
    )
    with running_up(argv, port, decode_port, folder, 2 * ENGINE_START_TIMEOUT_S) as stack:
        yield stack
