"""A worker's configuration: its flags, the vLLM command line they make, and the KV connector config.

`pdserve prefill` and `pdserve decode` take the same flags (only the role differs); every
argument this parser does not define, and everything after `--`, goes to vLLM unchanged,
so the flags users already run (`--tensor-parallel-size`, `--kv-cache-dtype`, `--api-key`,
...) just work. The role decides the connector's kv_role: a prefill worker produces KV
(kv_producer), a decode worker loads it and may also prefill short prompts itself (kv_both).
The KV backend (`--kv-backend`) picks the connector: pdserve's own store (PDServeConnector,
`--kvstore-url`) or an LMCache server (LMCache's connector, `--lmcache-url`; see
lmcache_backend.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Literal, Sequence, get_args

from pdserve.kvstore.client.auth import add_client_token_flag
from pdserve.kvstore.client.lmcache_mp import parse_url
from pdserve.kvstore.connector.vllm_plugin import CONNECTOR_NAME
from pdserve.worker import lmcache_backend
from pdserve.worker.children import Backoff
from pdserve.worker.registration import DEFAULT_TTL_S, Role, new_worker_id

KVBackend = Literal["pdserve", "lmcache"]
KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_both"}
DEFAULT_PORTS: dict[Role, int] = {"prefill": 8100, "decode": 8200}
# Flags that the worker owns and therefore must not also appear among vLLM's arguments.
OWNED_VLLM_FLAGS = ("--model", "--host", "--port")


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split `ours -- theirs`: everything after the first `--` goes to vLLM unchanged."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


class WorkerError(RuntimeError):
    """A configuration or start-up problem, reported to the user in one line."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker needs; built from the CLI by `config_from_args`."""

    role: Role
    model: str
    kvstore_url: str | None
    kvstore_auth_token: str | None
    kv_backend: KVBackend
    lmcache_url: str | None
    redis_url: str | None
    host: str
    port: int
    advertise_url: str | None
    worker_id: str
    heartbeat_ttl: float
    connector: bool
    drain_timeout: float
    start_timeout: float
    unhealthy_timeout: float
    stall_restart_timeout: float
    backoff: Backoff
    vllm_args: tuple[str, ...]

    @property
    def local_url(self) -> str:
        """Where this supervisor reaches its own vLLM server."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The URL the router is told to use."""
        return self.advertise_url or self.local_url

    def _vllm_flag(self, flag: str) -> str | None:
        """The (first) value of one of vLLM's flags among the user's, None when absent."""
        args = list(self.vllm_args)
        for i, arg in enumerate(args):
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return None

    @property
    def served_model_name(self) -> str:
        """The name clients send as `model`: vLLM's first --served-model-name, else --model."""
        return self._vllm_flag("--served-model-name") or self.model

    @property
    def api_key(self) -> str | None:
        """The key vLLM's server wants on requests (its --api-key, else VLLM_API_KEY), for the worker's own."""
        return self._vllm_flag("--api-key") or os.environ.get("VLLM_API_KEY")

    @property
    def kv_url(self) -> str | None:
        """The URL of this worker's KV backend (what its Redis record advertises), None without a connector."""
        if not self.connector:
            return None
        return self.lmcache_url if self.kv_backend == "lmcache" else self.kvstore_url

    def kv_transfer_config(self) -> dict:
        if self.kv_backend == "lmcache":
            assert self.lmcache_url is not None
            return lmcache_backend.kv_transfer_config(self.lmcache_url, KV_ROLES[self.role])
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": KV_ROLES[self.role],
            "kv_connector_extra_config": {
                "kvstore_url": self.kvstore_url,
                **({"auth_token": self.kvstore_auth_token} if self.kvstore_auth_token else {}),
            },
        }

    def vllm_argv(self, extra: Sequence[str] = ()) -> list[str]:
        """vLLM's command line; `extra` (flags the worker worked out at start, such as the LMCache
        retention interval) goes before the user's own flags."""
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
        ]
        if self.connector:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(), separators=(",", ":"))]
        return argv + list(extra) + list(self.vllm_args)


def build_parser(role: Role) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"pdserve {role}",
        description=(
            f"Run a {role} worker: vLLM's OpenAI server with PDServeConnector or LMCache's connector "
            f"({KV_ROLES[role]}), registered in Redis. Arguments this parser does not know "
            "(or everything after `--`) go to vLLM unchanged."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("--model", required=True, help="model path or name, as for `vllm serve`")
    parser.add_argument("--kv-backend", choices=get_args(KVBackend), default="pdserve",
                        help="where KV goes: pdserve's store (--kvstore-url) or an LMCache server (--lmcache-url)")
    parser.add_argument("--kvstore-url", default=None, help="KV store address, e.g. tcp://127.0.0.1:5556")
    parser.add_argument("--lmcache-url", default=None,
                        help="with --kv-backend lmcache: the `lmcache server` address, e.g. tcp://127.0.0.1:5556")
    add_client_token_flag(parser, "for the connector")
    parser.add_argument("--redis-url", default=None, help="register here for discovery, e.g. redis://host:6379/0")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of the vLLM server")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[role], help="port of the vLLM server")
    parser.add_argument("--advertise-url", default=None, help="URL the router should use (default http://host:port)")
    parser.add_argument("--worker-id", default=None, help=f"unique id in Redis (default {role}-<random>)")
    parser.add_argument("--heartbeat-ttl", type=float, default=DEFAULT_TTL_S, help="seconds a registration lives without a heartbeat")
    parser.add_argument("--no-connector", action="store_true", help="serve without KV transfer (the decode leg recomputes the prompt)")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for in-flight requests on SIGTERM")
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="seconds to wait for vLLM to become healthy (then it is restarted)")
    parser.add_argument("--unhealthy-timeout", type=float, default=30.0,
                        help="restart a running vLLM whose /health has failed for this many seconds")
    parser.add_argument("--stall-restart-timeout", type=float, default=60.0,
                        help="restart a vLLM that routers have found answering none of its requests (its /health "
                             "notwithstanding) for this many seconds, once it fails a request of the worker's own "
                             "too; 0: never (needs --redis-url)")
    parser.add_argument("--max-restarts", type=int, default=Backoff.max_restarts,
                        help=f"give up after this many vLLM restarts within {Backoff.window_s:.0f} s")
    parser.add_argument("--restart-delay", type=float, default=Backoff.first_s,
                        help=f"seconds before the first restart; doubles with each next, up to {Backoff.max_s:.0f} s")
    return parser


def config_from_args(role: Role, argv: Sequence[str]) -> WorkerConfig:
    """Split argv into our flags and vLLM's, and validate the combination."""
    argv, explicit = split_passthrough(argv)
    args, unknown = build_parser(role).parse_known_args(argv)
    vllm_args = tuple(unknown + explicit)
    for flag in OWNED_VLLM_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in vllm_args):
            raise WorkerError(f"pass {flag} to pdserve {role} itself, not after `--`")
    connector = not args.no_connector
    if connector and any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in vllm_args):
        raise WorkerError("pdserve builds --kv-transfer-config itself; add --no-connector to pass your own")
    if args.kv_backend == "lmcache":
        if args.kvstore_url:
            raise WorkerError("--kvstore-url is pdserve's store; with --kv-backend lmcache pass --lmcache-url")
        if connector and not args.lmcache_url:
            raise WorkerError("--kv-backend lmcache needs --lmcache-url tcp://HOST:PORT (or --no-connector)")
        if args.lmcache_url:
            try:
                parse_url(args.lmcache_url)
            except ValueError as exc:
                raise WorkerError(f"--lmcache-url: {exc}") from None
        if connector and any(a == "--enable-lora" or a.startswith("--enable-lora=") for a in vllm_args):
            # LMCache 0.5.6's multiprocess keys are model, world size, worker, tokens and salt: requests on
            # different adapters would load each other's KV and answer wrong (pdserve's store keys the adapter)
            raise WorkerError("--enable-lora with --kv-backend lmcache: LMCache's cache keys do not tell "
                              "adapters apart, so they would share KV; use the pdserve backend for adapters")
    else:
        if args.lmcache_url:
            raise WorkerError("--lmcache-url needs --kv-backend lmcache")
        if connector and not args.kvstore_url:
            raise WorkerError("--kvstore-url is required (or --no-connector to serve without KV transfer)")
    if not args.unhealthy_timeout > 0:
        raise WorkerError(f"--unhealthy-timeout must be positive, got {args.unhealthy_timeout}")
    if not args.stall_restart_timeout >= 0:
        raise WorkerError(f"--stall-restart-timeout must not be negative, got {args.stall_restart_timeout}")
    if args.heartbeat_ttl <= 0:
        raise WorkerError(f"--heartbeat-ttl must be positive, got {args.heartbeat_ttl}")
    if args.max_restarts < 0 or not 0 <= args.restart_delay <= Backoff.max_s:
        raise WorkerError(f"--max-restarts must not be negative and --restart-delay must be 0-{Backoff.max_s:.0f} s")
    return WorkerConfig(
        role=role,
        model=args.model,
        kvstore_url=args.kvstore_url,
        kvstore_auth_token=args.kvstore_auth_token,
        kv_backend=args.kv_backend,
        lmcache_url=args.lmcache_url,
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        advertise_url=args.advertise_url,
        worker_id=args.worker_id or new_worker_id(role),
        heartbeat_ttl=args.heartbeat_ttl,
        connector=connector,
        drain_timeout=args.drain_timeout,
        start_timeout=args.start_timeout,
        unhealthy_timeout=args.unhealthy_timeout,
        stall_restart_timeout=args.stall_restart_timeout,
        backoff=Backoff(first_s=args.restart_delay, max_restarts=args.max_restarts),
        vllm_args=vllm_args,
    )
