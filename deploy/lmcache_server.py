"""`lmcache server` as a pdserve stack runs it in place of `pdserve kvstore` (`--kv-backend lmcache`).

The command line is LMCache's own CLI with the flags LMCache users run beside vLLM today
(--chunk-size, --separate-object-groups, --l1-size-gb, --eviction-policy LRU,
--max-workers), bound to loopback (its HTTP API has no authentication and can clear the
cache; LMCache 0.5.3 binds it to 0.0.0.0 unless told). LMCache runs in its own process
and pdserve never imports it: `runnable()` asks a throwaway interpreter whether the
server's modules load, so `pdserve up` can say why not before starting anything.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Quiet and offline: no banner, no usage telemetry (LMCache reports usage to lmcache.ai by default).
ENV: dict[str, str] = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
                       "PYTHONUNBUFFERED": "1"}
DEFAULT_CHUNK_SIZE = 256  # LMCache's default; a multiple of every KV block size pdserve's tiny models use

_CHECK = "import lmcache.cli.main, lmcache.v1.multiprocess.http_server"


def server_argv(port: int, http_port: int, *, host: str = "127.0.0.1", chunk_size: int = DEFAULT_CHUNK_SIZE,
                l1_size_gb: float = 1.0, eviction_policy: str = "LRU", max_workers: int = 4,
                l2_adapter: str | None = None) -> list[str]:
    argv = [
        sys.executable, "-m", "lmcache.cli.main", "server", "--host", host, "--port", str(port),
        "--http-host", host, "--http-port", str(http_port), "--chunk-size", str(chunk_size),
        "--separate-object-groups", "--l1-size-gb", str(l1_size_gb), "--eviction-policy", eviction_policy,
        "--max-workers", str(max_workers),
    ]
    return argv + (["--l2-adapter", l2_adapter] if l2_adapter else [])


def health_url(http_port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{http_port}/healthcheck"


def runnable() -> str | None:
    """None when `lmcache server` can start with this Python, else why not (one line)."""
    result = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, check=False,
                            env={**os.environ, **ENV})
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    why = lines[-1] if lines else f"exit code {result.returncode}"
    if "No module named 'lmcache'" in why:
        return "lmcache is not installed (pip install pdserve[lmcache])"
    return f"lmcache server cannot run here: {why}"
