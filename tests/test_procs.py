"""tests/procs.py: the helpers every other test relies on to start and, above all, stop processes."""

from __future__ import annotations

import os
import sys
import time

import pytest
import redis

from procs import ProcessDied, free_port, listens_on, start_on_port, start_process


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); its state letter is Z.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_redis_fixture_is_a_private_working_server(redis_url: str) -> None:
    assert not redis_url.startswith("redis://127.0.0.1:6379/")
    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    client.set("pdserve:test", b"v")
    assert client.get("pdserve:test") == b"v"
    assert client.config_get("save")["save"] == ""


def test_stop_kills_the_whole_process_group(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"import subprocess,time; p=subprocess.Popen(['sleep','600']); open({str(pid_file)!r},'w').write(str(p.pid)); time.sleep(600)"
    proc = start_process([sys.executable, "-c", script], lambda _p: pid_file.exists() and pid_file.read_text() != "")
    child = int(pid_file.read_text())
    assert proc.alive() and not _gone(child)
    proc.stop(timeout=5)
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not proc.alive() and _gone(child)


def test_a_process_that_dies_raises_with_its_log() -> None:
    argv = [sys.executable, "-c", "import sys; print('bad flag --frobnicate'); sys.exit(3)"]
    with pytest.raises(ProcessDied, match=r"(?s)exited with code 3.*bad flag --frobnicate"):
        start_process(argv, f"http://127.0.0.1:{free_port()}/health", name="dies")


def test_a_process_never_ready_is_stopped_after_timeout() -> None:
    with pytest.raises(ProcessDied, match="not ready after") as exc:
        start_process(["sleep", "600"], lambda _p: False, name="never-ready", timeout=1.0)
    assert not exc.value.proc.alive()


def test_ready_needs_our_own_listening_socket() -> None:
    def http_server(port: int):
        argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        return start_process(argv, f"http://127.0.0.1:{port}/", name="http", port=port, timeout=30)

    with start_on_port(http_server) as first:
        assert listens_on(first.pid, first.port) and not listens_on(first.pid, free_port())
        # A second server on the same port: the first one answers the URL, but it is not ours.
        with pytest.raises(ProcessDied, match="(?i)address already in use"):
            http_server(first.port)
