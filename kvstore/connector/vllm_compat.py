"""What differs between the vLLM releases PDServeConnector runs in, found by feature.

Users run the seeds' fork (vLLM 0.23 base), GPU vLLM 0.23-0.34 and the CPU build 0.27-0.32.
The connector interface moved in between; each difference is read here from what the
installed vLLM has, once, so the connector itself is written against one shape:

- Transfer results. Newer vLLM asks `get_transfer_results()` for one snapshot of finished
  sends, receives and per-request receive failures (`KVConnectorTransferResults`). Older
  vLLM asks `get_finished()`, then `get_block_ids_with_load_errors()`: failures only as
  block ids, which its scheduler maps back to requests through a single KV cache group.
  So on older vLLM a model with several KV cache groups cannot report a failed load, and
  the connector does not load for it (it still saves); see `loads_supported`.
- Hit-source accounting (`CacheHitSource`): newer only.
- `--prefix-cache-retention-interval`: upstream vLLM 0.32+ and the seeds' fork; absent in
  stock 0.23-0.27 (there the sliding-window retention check has nothing to check).
- Resumed requests. Up to 0.33 a request resumed after preemption comes back among the
  step's cached requests, named in `resumed_req_ids`, with its whole new block list; 0.34
  re-sends it in full among the new requests and drops that field (`resumed_ids`).

The supported release range lives in `vllm_release` (launchers read it without importing vLLM).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

@dataclass
class _TransferResults:
    """Stand-in for KVConnectorTransferResults on vLLM releases that predate it."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


TransferResults: Any = getattr(_base, "KVConnectorTransferResults", _TransferResults)
# True when vLLM takes failed receives per request (get_transfer_results).
PER_REQUEST_LOAD_FAILURES = hasattr(_base, "KVConnectorTransferResults")

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:
    HOST_HIT_SOURCE = None


def loads_supported(num_kv_groups: int) -> bool:
    """Whether a failed load can be reported to this vLLM for a model with this many groups."""
    return PER_REQUEST_LOAD_FAILURES or num_kv_groups == 1


def resumed_ids(cached_reqs: Any) -> Collection[str]:
    """The step's cached requests whose `new_block_ids` replace their block lists instead of
    extending them; none on releases that re-send resumed requests as new ones."""
    return getattr(cached_reqs, "resumed_req_ids", ())


def retention_interval(cache_config: Any) -> int | None:
    """`--prefix-cache-retention-interval`, or None where this vLLM has no such setting."""
    return getattr(cache_config, "prefix_cache_retention_interval", None)
