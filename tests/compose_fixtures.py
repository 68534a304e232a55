"""The compose stack test's script, started with the session (a plugin conftest registers).

From a bare machine the script spends most of its 9-20 minutes installing Docker and
building images: downloads and disk writes that leave the cores to the other tests. So
when the compose test is selected, the script starts as soon as the tests are collected,
with `--hold-before-up`: it builds, then waits. The compose test runs last (its three
engines then have the machine to themselves), releases the hold and checks the report.
If the session ends without it (-x, Ctrl-C), the script is stopped and cleans up.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy/docker/compose_test.py"
COMPOSE_TEST = "test_compose_cpu_stack_builds_serves_p_d_and_survives_a_decode_loss"


@dataclass
class ComposeRun:
    """The script running in the background: its report, log and the file that releases its hold."""

    folder: Path
    proc: subprocess.Popen
    log: IO[bytes]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def report_path(self) -> Path:
        return self.folder / "report.json"

    @property
    def log_path(self) -> Path:
        return self.folder / "compose-test.log"

    @property
    def hold(self) -> Path:
        return self.folder / "go"

    def release(self) -> None:
        self.hold.touch()

    def stop(self, timeout: float = 600.0) -> None:
        """SIGTERM (the script unwinds and still takes its stack and daemon down), then wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        self.log.close()


def start(folder: Path) -> ComposeRun:
    log = open(folder / "compose-test.log", "wb")
    argv = [sys.executable, str(SCRIPT), "--report", str(folder / "report.json"), "--hold-before-up", str(folder / "go")]
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return ComposeRun(folder, proc, log)


_RUN = pytest.StashKey[ComposeRun]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The compose test last: its engines start when no other test's are running."""
    items.sort(key=lambda item: getattr(item, "originalname", "") == COMPOSE_TEST)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly and any(getattr(item, "originalname", "") == COMPOSE_TEST for item in session.items):
        session.config.stash[_RUN] = start(Path(tempfile.mkdtemp(prefix="pdserve-compose-test-")))


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(_RUN, None)
    if run is not None:
        run.stop()


@pytest.fixture(scope="session")
def compose_run(request: pytest.FixtureRequest) -> ComposeRun:
    """The script this session started for the compose test (the test releases and reads it)."""
    run = request.config.stash.get(_RUN, None)
    assert run is not None, "the compose script starts only when the compose test is collected and selected"
    return run
