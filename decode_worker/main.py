"""`pdserve decode`: a decode worker (vLLM's OpenAI server, PDServeConnector as kv_both).

A decode worker is the shared worker supervisor (pdserve/worker/: flags, vLLM child,
Redis registration, restarts, drain) run with the role fixed to "decode". Inside its vLLM,
the connector's scheduler side (kvstore/connector/scheduler_side.py) decides what it loads (and, as kv_both, what it saves)
and the worker side (kvstore/connector/worker_side.py) moves the bytes from and to the store.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from pdserve.worker.config import build_parser as _build_parser
from pdserve.worker.supervisor import run_worker


def build_parser() -> argparse.ArgumentParser:
    return _build_parser("decode")


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker("decode", argv)
