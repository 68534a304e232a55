"""`pdserve prefill`: a prefill worker (vLLM's OpenAI server, PDServeConnector as kv_producer).

A prefill worker is the shared worker supervisor (pdserve/worker/: flags, vLLM child,
Redis registration, restarts, drain) run with the role fixed to "prefill". Inside its vLLM,
the connector's scheduler side (kvstore/connector/scheduler_side.py) decides what it saves
and the worker side (kvstore/connector/worker_side.py) moves the bytes to the store.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from pdserve.worker.config import build_parser as _build_parser
from pdserve.worker.supervisor import run_worker


def build_parser() -> argparse.ArgumentParser:
    return _build_parser("prefill")


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker("prefill", argv)
