"""The `pdserve` command: a thin dispatcher to each service's own entry point.

Each command lives in the module that owns it and exposes `build_parser()` and
`main(argv)`. Dispatching on the first word keeps start-up light: `pdserve kvstore`
never imports vLLM or FastAPI, and tests can parse any service's flags with the
same parser the service uses.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

# command path (words) -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("kvstore",): ("pdserve.kvstore.server.main", "run the KV store server"),
    ("router",): ("pdserve.router.app", "run the OpenAI-compatible P/D router"),
    ("prefill",): ("pdserve.prefill_worker.main", "run a prefill worker (vLLM, kv_producer)"),
    ("decode",): ("pdserve.decode_worker.main", "run a decode worker (vLLM, kv_both)"),
    ("up",): ("pdserve.deploy.local", "run the whole stack locally (kvstore, workers, router)"),
    ("model", "tiny"): ("pdserve.deploy.tiny_model", "write a tiny random-weight model (config + tokenizer)"),
    ("bench", "kvstore"): ("pdserve.bench.kvstore_throughput", "benchmark store/load throughput against memcpy"),
    ("bench", "connector"): ("pdserve.bench.connector_ttft", "benchmark TTFT: recompute vs store vs ExampleConnector"),
    ("bench", "connector-tpot"): ("pdserve.bench.connector_tpot",
                                  "benchmark TPOT: no connector vs a no-op one vs PDServeConnector"),
    ("bench", "kernels"): ("pdserve.bench.kernels", "benchmark paged gather/scatter and fp8_ds_mla codecs on a GPU"),
    ("bench", "serve"): ("pdserve.bench.serve", "benchmark an OpenAI endpoint (TTFT, TPOT, ITL)"),
    ("bench", "router"): ("pdserve.bench.router", "benchmark what the router adds in front of a fast stub upstream"),
    ("bench", "faults"): ("pdserve.bench.faults", "break a local stack under load; soak it (RSS, TTFT)"),
    ("ray",): ("pdserve.deploy.ray_cli", "status and teardown of a pdserve stack on Ray"),
}


def resolve(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """Return (module, remaining argv) for the longest command path that prefixes argv."""
    for length in (2, 1):
        key = tuple(argv[:length])
        if key in COMMANDS:
            return COMMANDS[key][0], list(argv[length:])
    return None


def load_entry(module: str, name: str = "main") -> Callable:
    return getattr(importlib.import_module(module), name)


def usage() -> str:
    lines = ["usage: pdserve <command> [options]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<20} {help_text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    found = resolve(argv)
    if found is None:
        print(f"pdserve: unknown command {' '.join(argv[:2])!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, rest = found
    result = load_entry(module)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
