"""The Ray deployment's configuration: one typed place, read from a YAML file, checked up front.

`python -m pdserve.deploy.ray_app --config cluster.yaml` and its tests build every
service's command line from this config alone, so a mistake (an unknown key, a worker
port that collides, a retention interval that does not divide the store's chunk size)
is reported in one line before anything is placed on the cluster.

Engine flags come from a vLLM `--config` file (`vllm_config`, e.g.
deploy/settings/dsv4-flash.yaml) that docker-compose.yml passes to its engines too, so
the recommended DeepSeek-V4-Flash settings live in one place. The GPUs a worker
reserves are read from the same flags (tensor x pipeline x data parallel size).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import secrets
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

import yaml

from pdserve.deploy.tiny_model import TINY_ENGINE_ENV, TINY_SERVED_NAME, TINY_VLLM_ARGS
from pdserve.worker.children import QUIET_ENV
from pdserve.kvstore.client.auth import TOKEN_ENV

WorkerRole = Literal["prefill", "decode"]
ServiceKind = Literal["kvstore", "prefill", "decode", "router"]
ROLES: tuple[WorkerRole, ...] = ("prefill", "decode")

# Filled in by the actor on the node it runs on (see ray_app.ServiceActor).
NODE_IP = "{node_ip}"
TINY_MODEL = "{tiny_model}"

# Flags each service sets itself: in a vLLM config file they would fight the worker's own.
OWNED_VLLM_KEYS = ("model", "host", "port", "served-model-name", "kv-transfer-config")


class ConfigError(ValueError):
    """The config file is wrong; the message names the key to fix."""


@dataclass(frozen=True)
class KVStoreSpec:
    """One `pdserve kvstore` on every node that runs a worker. Its workers reach it over loopback;
    it binds `host` and advertises the node's address, so a decode worker on another node loads a
    handoff straight from the producer's store (with the stack's token, see ClusterConfig)."""

    host: str = "0.0.0.0"
    port: int = 5556
    http_port: int = 18556
    chunk_size: int = 1024
    l1_size_gb: float = 8.0
    num_cpus: float = 1.0
    args: tuple[str, ...] = ()  # more `pdserve kvstore` flags, e.g. [--l2-path, /nvme/kv, --l2-size-gb, "500"]


@dataclass(frozen=True)
class WorkerSpec:
    """Replicas of one role; replica i listens on port + i (several may share a node)."""

    replicas: int = 1
    port: int = 8100
    host: str = "0.0.0.0"
    num_cpus: float = 1.0
    vllm_args: tuple[str, ...] = ()  # engine flags for this role only, after the vllm_config file's
    args: tuple[str, ...] = ()  # more `pdserve prefill|decode` flags, e.g. [--drain-timeout, "120"]


@dataclass(frozen=True)
class RouterSpec:
    host: str = "0.0.0.0"
    port: int = 8000
    num_cpus: float = 1.0
    args: tuple[str, ...] = ()  # more `pdserve router` flags, e.g. [--prefill-policy, prefix-aware]


@dataclass(frozen=True)
class ClusterConfig:
    """A whole stack on one Ray cluster. `name` is the Ray namespace its actors live in."""

    redis_url: str
    name: str = "pdserve"
    model: str | None = None  # None: a tiny random-weight DeepSeek-V3, generated on each node (CPU clusters)
    served_model_name: str | None = None
    tokenizer: str | None = None  # router-side tokenizer; default: the tiny model's, else the worker's
    vllm_config: str | None = None  # a `vllm serve --config` YAML, relative to the working directory
    env_file: str | None = None  # KEY=VALUE lines for every engine (e.g. NCCL settings)
    env: dict[str, str] = field(default_factory=dict)
    kvstore: KVStoreSpec = KVStoreSpec()
    prefill: WorkerSpec = WorkerSpec(port=8100)
    decode: WorkerSpec = WorkerSpec(port=8200)
    router: RouterSpec = RouterSpec()
    start_timeout_s: float = 1800.0
    max_restarts: int = 3  # Ray restarts a service that crashes after it was ready, this many times
    # The stores' shared secret, given to stores, workers and the router through $PDSERVE_KVSTORE_TOKEN
    # (never on a command line): the submitting job's $PDSERVE_KVSTORE_TOKEN, else a fresh one per stack.
    kvstore_token: str = field(default_factory=lambda: os.environ.get(TOKEN_ENV) or secrets.token_hex(16),
                               repr=False)

    @property
    def tiny(self) -> bool:
        return self.model is None

    @property
    def served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return TINY_SERVED_NAME if self.model is None else self.model

    def worker(self, role: WorkerRole) -> WorkerSpec:
        return self.prefill if role == "prefill" else self.decode

    @functools.cached_property
    def vllm_settings(self) -> dict[str, Any]:
        """The vllm_config file's flags, read once: every check and every replica's spec needs them."""
        return read_vllm_config(self.vllm_config) if self.vllm_config else {}

    @functools.cached_property
    def file_env(self) -> dict[str, str]:
        """The env_file's variables, read once for all engines."""
        return read_env_file(self.env_file) if self.env_file else {}


@dataclass(frozen=True)
class ServiceSpec:
    """What one actor runs: `pdserve <argv>` with NODE_IP / TINY_MODEL filled in on its node."""

    name: str  # the actor's name in the stack's namespace
    kind: ServiceKind
    argv: tuple[str, ...]
    health_url: str  # on the actor's own node
    env: dict[str, str]
    num_cpus: float
    num_gpus: int = 0
    url: str | None = None  # what clients (or the router) use, NODE_IP filled in on the node


# ---------------------------------------------------------------- loading


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return None
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return _convert(value, inner, where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(hint, value, where)
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return tuple(str(v) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (str, int, float) and (type(value) is not hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _read_yaml_mapping(path: str | Path, where: str = "") -> Mapping[str, Any]:
    """A YAML file that must hold a mapping; `where` (the key naming the file) prefixes errors."""
    prefix = f"{where}: " if where else ""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{prefix}cannot read {path}: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix}{path}: expected a mapping at the top level")
    return data


def load_config(path: str | Path) -> ClusterConfig:
    """Read and check a cluster config; relative file paths in it are taken from the working directory."""
    cfg = _build(ClusterConfig, _read_yaml_mapping(path), "")
    check_config(cfg)
    return cfg


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines, `#` comments; the subset of the .env format docker compose reads the same way."""
    env: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        env[key.strip()] = value.strip()
    return env


def read_vllm_config(path: str | Path) -> dict[str, Any]:
    """A `vllm serve --config` file as a dict with dashed keys (vLLM accepts both spellings)."""
    return {str(k).replace("_", "-"): v for k, v in _read_yaml_mapping(path, "vllm_config").items()}


def _engine_flags(cfg: ClusterConfig, role: WorkerRole) -> argparse.Namespace:
    """The parallel sizes and retention interval an engine of `role` will run with (role flags win)."""
    settings = cfg.vllm_settings
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=settings.get("tensor-parallel-size", 1))
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=settings.get("pipeline-parallel-size", 1))
    p.add_argument("-dp", "--data-parallel-size", type=int, default=settings.get("data-parallel-size", 1))
    p.add_argument("--prefix-cache-retention-interval", type=int,
                   default=settings.get("prefix-cache-retention-interval"))
    args, _ = p.parse_known_args(list(cfg.worker(role).vllm_args))
    return args


def gpus_per_replica(cfg: ClusterConfig, role: WorkerRole) -> int:
    """GPUs one engine of `role` uses: 0 for the tiny CPU model, else TP x PP x DP."""
    if cfg.tiny:
        return 0
    f = _engine_flags(cfg, role)
    return f.tensor_parallel_size * f.pipeline_parallel_size * f.data_parallel_size


def check_config(cfg: ClusterConfig) -> None:
    """Raise ConfigError for every combination that would only fail later, on the cluster."""
    if not cfg.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"redis_url must be a redis:// URL (workers register there), got {cfg.redis_url!r}")
    if not cfg.name or not all(c.isalnum() or c in "-_" for c in cfg.name):
        raise ConfigError(f"name must be letters, digits, - or _ (it names the Ray namespace), got {cfg.name!r}")
    if cfg.decode.replicas < 1:
        raise ConfigError("decode.replicas must be at least 1")
    if cfg.prefill.replicas < 0:
        raise ConfigError("prefill.replicas must not be negative (0: decode-only)")
    for file_key in ("vllm_config", "env_file"):
        value = getattr(cfg, file_key)
        if value is not None and not Path(value).is_file():
            raise ConfigError(f"{file_key}: no file {value!r} (paths are relative to the working directory)")
    owned = sorted(set(OWNED_VLLM_KEYS) & set(cfg.vllm_settings))
    if owned:
        raise ConfigError(f"vllm_config {cfg.vllm_config} sets {owned}: each service sets these itself")
    cfg.file_env  # a malformed line fails here, not on the cluster
    if cfg.kvstore.chunk_size <= 0:
        raise ConfigError(f"kvstore.chunk_size must be positive, got {cfg.kvstore.chunk_size}")
    for role in ROLES:
        spec = cfg.worker(role)
        if spec.num_cpus <= 0 and gpus_per_replica(cfg, role) == 0:
            raise ConfigError(f"{role}.num_cpus must be positive on a CPU-only worker")
        interval = _engine_flags(cfg, role).prefix_cache_retention_interval
        if interval is not None and (interval <= 0 or cfg.kvstore.chunk_size % interval):
            raise ConfigError(
                f"{role}: --prefix-cache-retention-interval {interval} must divide kvstore.chunk_size "
                f"{cfg.kvstore.chunk_size} (the store checkpoints sliding-window state once a chunk)"
            )
    ports: dict[int, str] = {}
    claims = [(cfg.kvstore.port, "kvstore.port"), (cfg.kvstore.http_port, "kvstore.http_port"),
              (cfg.router.port, "router.port")]
    claims += [(cfg.worker(r).port + i, f"{r} replica {i}") for r in ROLES for i in range(cfg.worker(r).replicas)]
    for port, owner in claims:
        if not 0 < port < 65536:
            raise ConfigError(f"{owner}: port {port} out of range")
        if port in ports:
            raise ConfigError(f"{owner} and {ports[port]} both want port {port} (a node may run both)")
        ports[port] = owner
    if cfg.start_timeout_s <= 0 or cfg.max_restarts < 0:
        raise ConfigError("start_timeout_s must be positive and max_restarts not negative")


# ---------------------------------------------------------------- services


def _http(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def _public_host(bind: str) -> str:
    return NODE_IP if bind in ("0.0.0.0", "::", "") else bind


def kvstore_spec(cfg: ClusterConfig, node_id: str) -> ServiceSpec:
    """The store of one node, advertised at the node's address (its id names node and port)."""
    kv = cfg.kvstore
    advertised = f"tcp://{_public_host(kv.host)}:{kv.port}"
    argv = ("kvstore", "--host", kv.host, "--port", str(kv.port), "--http-port", str(kv.http_port),
            "--advertise-url", advertised, "--chunk-size", str(kv.chunk_size), "--l1-size-gb", str(kv.l1_size_gb),
            *kv.args)
    return ServiceSpec(name=f"kvstore-{node_id[:12]}", kind="kvstore", argv=argv,
                       health_url=_http("127.0.0.1", kv.http_port) + "/health", env=_with_token(cfg, QUIET_ENV),
                       num_cpus=kv.num_cpus, url=advertised)


def _with_token(cfg: ClusterConfig, env: dict[str, str]) -> dict[str, str]:
    return {**env, TOKEN_ENV: cfg.kvstore_token}


def engine_env(cfg: ClusterConfig) -> dict[str, str]:
    env = dict(QUIET_ENV)
    if cfg.tiny:
        env.update(TINY_ENGINE_ENV)
    env.update(cfg.file_env)
    env.update(cfg.env)
    return _with_token(cfg, env)


def worker_spec(cfg: ClusterConfig, role: WorkerRole, index: int) -> ServiceSpec:
    """Replica `index` of `role`: `pdserve prefill|decode`, registered in Redis under its actor name."""
    spec = cfg.worker(role)
    port = spec.port + index
    name = f"{role}-{index}"
    url = _http(_public_host(spec.host), port)
    argv = [role, "--model", TINY_MODEL if cfg.tiny else str(cfg.model), "--host", spec.host, "--port", str(port),
            "--advertise-url", url, "--worker-id", f"{cfg.name}-{name}",
            "--kvstore-url", f"tcp://127.0.0.1:{cfg.kvstore.port}", "--redis-url", cfg.redis_url, *spec.args, "--"]
    if cfg.vllm_config:
        argv += ["--config", cfg.vllm_config]
    if cfg.tiny:
        argv += TINY_VLLM_ARGS
    if cfg.served_name != (TINY_MODEL if cfg.tiny else cfg.model):
        argv += ["--served-model-name", cfg.served_name]
    argv += spec.vllm_args
    return ServiceSpec(name=name, kind=role, argv=tuple(argv), health_url=_http("127.0.0.1", port) + "/health",
                       env=engine_env(cfg), num_cpus=spec.num_cpus, num_gpus=gpus_per_replica(cfg, role), url=url)


def router_spec(cfg: ClusterConfig) -> ServiceSpec:
    """The router follows the workers through Redis, so replicas can come and go."""
    r = cfg.router
    argv = ["router", "--host", r.host, "--port", str(r.port), "--redis-url", cfg.redis_url, "--model", cfg.served_name]
    tokenizer = TINY_MODEL if cfg.tiny else cfg.tokenizer
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    argv += r.args
    local = "127.0.0.1" if r.host in ("0.0.0.0", "::", "") else r.host
    return ServiceSpec(name="router", kind="router", argv=tuple(argv), health_url=_http(local, r.port) + "/health",
                       env=_with_token(cfg, QUIET_ENV), num_cpus=r.num_cpus, url=_http(_public_host(r.host), r.port))


def worker_specs(cfg: ClusterConfig) -> list[ServiceSpec]:
    return [worker_spec(cfg, role, i) for role in ROLES for i in range(cfg.worker(role).replicas)]
