"""A worker on the LMCache backend: LMCache's own vLLM connector against an `lmcache server`.

The engine gets exactly what LMCache users run today (LMCacheMPConnector from
`lmcache.integration.vllm.lmcache_mp_connector`, `lmcache.mp.host` / `lmcache.mp.port`),
with the role pdserve gives each worker: a prefill worker stores (kv_producer; LMCache
0.5.6 stores only for producer roles, 0.5.3 for every role) and a decode worker loads
and stores (kv_both), so it also keeps what it prefills itself. It asks for LMCache's
server-driven copy (`lmcache.mp.mp_transfer_mode: lmcache_driven`): CUDA IPC on a GPU,
shared memory on a CPU. The alternative, engine-driven, pickles KV tensors over ZMQ by
default, and on a CPU LMCache would pick it unless told.

Sliding-window models need vLLM's `--prefix-cache-retention-interval` to divide
LMCache's chunk size (LMCache restores a window's state only at a chunk boundary), so
the worker sets it to the server's chunk size when the model has sliding windows and
the user did not set it, and refuses a value that does not divide it.

Nothing here imports lmcache: vLLM loads the connector by module path, and the
server's chunk size comes over LMCache's own wire (kvstore/client/lmcache_mp.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from pdserve.kvstore.client.lmcache_mp import LMCacheKey, parse_url

CONNECTOR = "LMCacheMPConnector"
CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
RETENTION_FLAG = "--prefix-cache-retention-interval"


def kv_transfer_config(lmcache_url: str, kv_role: str) -> dict[str, Any]:
    host, port = parse_url(lmcache_url)
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port, "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        },
    }


def model_config(model: str) -> dict[str, Any] | None:
    """The model's config.json when `model` is a local folder (None for a hub name: not looked up)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The config and its text config (multimodal models keep the language model's there)."""
    text = config.get("text_config")
    return [config, *([text] if isinstance(text, dict) else [])]


def has_sliding_window(config: dict[str, Any]) -> bool:
    for c in _configs(config):
        if "sliding_attention" in (c.get("layer_types") or ()):
            return True
        if c.get("sliding_window") and c.get("use_sliding_window", True):
            return True
    return False


def is_mla(config: dict[str, Any]) -> bool:
    return any(c.get("kv_lora_rank") for c in _configs(config))


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last of `names` in vLLM's arguments (`--flag V` or `--flag=V`)."""
    found = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def retention_args(model: str, vllm_args: Sequence[str], chunk_size: int) -> list[str]:
    """The retention flag to add (none when not needed or already given); ValueError for a bad one."""
    given = flag_value(vllm_args, RETENTION_FLAG)
    if given is not None:
        if not given.isdigit() or int(given) <= 0 or chunk_size % int(given):
            raise ValueError(f"{RETENTION_FLAG} {given} must divide the LMCache server's chunk size {chunk_size}")
        return []
    config = model_config(model)
    if config is not None and has_sliding_window(config):
        return [RETENTION_FLAG, str(chunk_size)]
    return []


def cache_key(model: str, vllm_args: Sequence[str]) -> LMCacheKey:
    """What LMCache keys this engine's chunks by, for the router's lookups: vLLM's model and the KV
    world size (LMCache 0.5.x, one server per engine: the pipeline stages for MLA, whose KV every
    tensor-parallel rank holds whole, else tensor x pipeline ranks). A wrong guess costs only the
    router's prefix hint, never a load."""
    tp = int(flag_value(vllm_args, "--tensor-parallel-size", "-tp") or 1)
    pp = int(flag_value(vllm_args, "--pipeline-parallel-size", "-pp") or 1)
    config = model_config(model)
    mla = config is not None and is_mla(config)
    return LMCacheKey(model_name=model, world_size=pp if mla else tp * pp)
