"""The store's shared secret as its clients take it: one environment variable, one flag.

Every process that talks to stores (workers, router) and the store itself read the token
from the same place, so a deployment sets it once (`$PDSERVE_KVSTORE_TOKEN`) and keeps it off
command lines.
"""

from __future__ import annotations

import argparse
import os

TOKEN_ENV = "PDSERVE_KVSTORE_TOKEN"


def add_client_token_flag(parser: argparse.ArgumentParser, used_for: str) -> None:
    """`--kvstore-auth-token` for a process that talks to stores (workers, router), defaulting to
    $PDSERVE_KVSTORE_TOKEN so deployments can keep the token off command lines; "" means none."""
    parser.add_argument("--kvstore-auth-token", default=os.environ.get(TOKEN_ENV), type=lambda s: s or None,
                        help=f"the store's --auth-token, {used_for} (default: ${TOKEN_ENV})")
