"""`pdserve prefill`: a prefill worker (vLLM's OpenAI server, PDServeConnector as kv_producer).

All behaviour lives in pdserve.deploy.worker; this module only fixes the role.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from pdserve.deploy.worker import build_parser as _build_parser
from pdserve.deploy.worker import run_worker


def build_parser() -> argparse.ArgumentParser:
    return _build_parser("prefill")


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker("prefill", argv)
