"""pdserve.deploy.ports: ports for local stacks come from below the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve.deploy import ports


def test_free_ports_are_bindable_and_not_ephemeral() -> None:
    low, _ = ports._ephemeral_range()
    picked = {ports.free_port() for _ in range(20)}
    assert all(ports._LOWEST <= p < low for p in picked)
    for port in picked:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        monkeypatch.setattr(ports.random, "choice", lambda span: busy)  # every try hits the busy port
        assert ports.free_port() != busy  # falls back to the kernel's pick


def test_unreadable_range_falls_back_to_linux_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ports, "_EPHEMERAL", tmp_path / "missing")
    assert ports._ephemeral_range() == (32768, 60999)
