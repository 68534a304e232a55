"""PDServeConnector: stock vLLM engines hand KV to each other through the pdserve KV store.

Loaded by name once the `pdserve` vLLM plugin is installed:

    --kv-transfer-config '{"kv_connector":"PDServeConnector","kv_role":"kv_producer",
                           "kv_connector_extra_config":{"kvstore_url":"tcp://127.0.0.1:5556"}}'

Roles: kv_producer saves every full prompt chunk the store lacks (and, for a P/D
request, the partial tail); kv_consumer loads; kv_both does both, so a decode worker
can also prefill locally and reuse prefixes. The scheduler half (scheduler_side.py)
plans, the worker half (worker_side.py) moves bytes; this module wires them into
vLLM's KVConnectorBase_V1 / SupportsHMA interface and runs the start-up checks.

Extra config keys: kvstore_url (required), auth_token, timeout_s (per store reply,
default 1: a store that misses it is marked down, see kvstore/client/health.py), handoff_wait_s
(how long a decode waits for chunks a prefill is still uploading, default 10).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec

from pdserve.kvstore.connector import vllm_compat
from pdserve.kvstore.client.client import KVStoreClient, KVStoreError
from pdserve.kvstore.connector.cache import GroupCache
from pdserve.kvstore.connector.plan import ConnectorConfigError, GroupGeometry, check_geometry
from pdserve.kvstore.connector.scheduler_side import SchedulerSide, StepMeta
from pdserve.kvstore.connector.stats import PDServePromMetrics, PDServeStats
from pdserve.kvstore.connector.worker_side import IDLE_WAIT_S, WorkerIO
from pdserve.kvstore.client.layout import KVGroupLayout, KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("pdserve.connector")

STARTUP_TIMEOUT_S = 10.0  # the start-up checks' deadline for the store's first answers


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, RuntimeError):
        return 0


def describe_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> tuple[KVLayout, bool]:
    """The KV layout that decides the namespace, and whether every TP rank holds the same bytes (MLA)."""
    groups = []
    all_mla = True
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = _scheduler_view(group.kv_cache_spec)
        all_mla &= isinstance(spec, MLAAttentionSpec)
        groups.append(
            KVGroupLayout(
                name=f"{i}:{type(spec).__name__}",
                dtype=_dtype_name(spec),
                bytes_per_token=spec.page_size_bytes // spec.block_size,
                block_size=spec.block_size,
                num_layers=len(group.layer_names),
                sliding_window=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
            )
        )
    par = vllm_config.parallel_config
    parallel = "mla" if all_mla else f"tp{par.tensor_parallel_size}-rank{_tp_rank()}"
    model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
    if isinstance(model, list):
        model = model[0]
    return KVLayout(model=str(model), groups=tuple(groups), parallel=parallel), all_mla


def _scheduler_view(spec: Any) -> Any:
    """The spec of a group as the scheduler's connector sees it.

    A group may hold layers of several sizes of one type (DeepSeek-V3.2: the fp8_ds_mla latent
    and the indexer keys): workers get all of them (UniformTypeKVCacheSpecs), the scheduler only
    the first (vLLM's generate_scheduler_kv_cache_config). Both halves must describe the same
    layout, or they compute different namespaces and the scheduler's lookups miss what the
    workers saved; so both describe the first.
    """
    inner = getattr(spec, "kv_cache_specs", None)
    return next(iter(inner.values())) if inner else spec


def _dtype_name(spec: Any) -> str:
    return getattr(spec, "cache_dtype_str", None) or str(spec.dtype).removeprefix("torch.")


class PDServeConnector(KVConnectorBase_V1, SupportsHMA):
    if vllm_compat.HOST_HIT_SOURCE is not None:
        _cache_hit_source = vllm_compat.HOST_HIT_SOURCE

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        url = ktc.get_from_extra_config("kvstore_url", None)
        if not url:
            raise ConnectorConfigError(
                'PDServeConnector needs kv_connector_extra_config {"kvstore_url": "tcp://HOST:5556"}'
            )
        token = ktc.get_from_extra_config("auth_token", None)
        timeout_s = float(ktc.get_from_extra_config("timeout_s", 1.0))
        # None: the store's shared memory when it is on this host, else TCP; false forces TCP.
        shm = ktc.get_from_extra_config("kvstore_shm", None)
        if shm not in (None, True, False):
            raise ConnectorConfigError(f"kv_connector_extra_config.kvstore_shm must be true or false, got {shm!r}")
        # A chunk that fails to load is recomputed, never served as wrong tokens and never fatal.
        ktc.kv_load_failure_policy = "recompute"
        try:
            # Start-up is no hot path: a busy store (or host) gets longer than the per-reply deadline.
            with KVStoreClient(url, auth_token=token, timeout_s=max(timeout_s, STARTUP_TIMEOUT_S), shm=shm) as client:
                chunk_size = client.info().chunk_size
                self.layout, self.is_mla = describe_layout(vllm_config, kv_cache_config)
                check_geometry(self.layout, chunk_size, vllm_compat.retention_interval(vllm_config.cache_config))
                self.namespace = client.register_layout(self.layout)
        except KVStoreError as exc:
            raise ConnectorConfigError(
                f"PDServeConnector cannot reach the KV store at {url} ({exc}): start it with "
                f"`pdserve kvstore --port PORT` or fix kv_connector_extra_config.kvstore_url"
            ) from exc
        self.chunk_size = chunk_size
        self.multi_group = len(kv_cache_config.kv_cache_groups) > 1
        saves, loads = ktc.is_kv_producer, ktc.is_kv_consumer
        if loads and not vllm_compat.loads_supported(len(kv_cache_config.kv_cache_groups)):
            loads = False
            log.warning(
                "PDServeConnector: this vLLM reports failed loads only per block, which its scheduler cannot map "
                "to a model with %d KV cache groups; loads are off for this engine (it recomputes; saves go on). "
                "Newer vLLM (with KVConnectorTransferResults) loads them.",
                len(kv_cache_config.kv_cache_groups),
            )
        log.info("PDServeConnector %s role=%s namespace=%s chunk=%d", role.name, ktc.kv_role, self.namespace, chunk_size)
        self.sched: SchedulerSide | None = None
        self.io: WorkerIO | None = None
        self._client_args = {"url": url, "auth_token": token, "timeout_s": timeout_s, "shm": shm}
        self._saves, self._loads = saves, loads
        if role == KVConnectorRole.SCHEDULER:
            geometries = [GroupGeometry(g.block_size, g.sliding_window) for g in self.layout.groups]
            wait_s = float(ktc.get_from_extra_config("handoff_wait_s", 10.0))
            self.sched = SchedulerSide(self._client_args, self.namespace, chunk_size, geometries, saves, loads, wait_s)
        self._load_errors: set[int] = set()
        self._load_started: dict[str, float] = {}  # req id -> when start_load_kv handed its load over

    # ---------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = [
            GroupCache([kv_caches[name] for name in group.layer_names])
            for group in self._kv_cache_config.kv_cache_groups
        ]
        # MLA KV is the same on every TP rank: rank 0 writes it once, every rank loads it.
        writes = self._saves and (not self.is_mla or _tp_rank() == 0)
        self.io = WorkerIO(self._client_args, self.namespace, groups, writes, reads=self._loads)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMeta) and self.io is not None
        if meta.loads:
            # The blocks a load writes may have been another request's until this step:
            # the copy waits for the work the engine queued before it.
            for group in self.io.groups:
                group.fence()
        for job in meta.loads:
            self._load_started[job.req_id] = time.perf_counter()
            self.io.load(job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are copied out once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMeta) and self.io is not None
        for job in meta.saves:
            self.io.save(job)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = vllm_compat.TransferResults()
        if self.io is None:
            return results
        idle = self.has_connector_metadata() and getattr(self._get_connector_metadata(), "idle", False)
        for outcome in self.io.finished_loads(IDLE_WAIT_S if idle else 0.0):
            results.finished_recving.add(outcome.req_id)
            started = self._load_started.pop(outcome.req_id, None)
            if started is not None:
                self.io.stats.add(load_seconds=time.perf_counter() - started)
            if outcome.ok:
                continue
            # Block ids are only unique within a group: with several groups vLLM takes
            # failures per request (recompute from scratch), with one group per block.
            if self.multi_group:
                results.failed_recving.add(outcome.req_id)
            else:
                self._load_errors |= outcome.failed_block_ids
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> PDServeStats | None:
        if self.io is None:
            return None
        for group in self.io.groups:
            self.io.stats.add(**{k: v for k, v in group.take_copy_counts().items() if v})
        counts = self.io.stats.take()
        return PDServeStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDServeStats:
        return PDServeStats(data=dict(data)) if data else PDServeStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> PDServePromMetrics:
        return PDServePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.io is not None:
            self.io.close()

    # ------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def reset_cache(self) -> bool:
        assert self.sched is not None
        return self.sched.reset_cache()

    def may_load_async(self, request: "Request") -> bool:
        assert self.sched is not None
        return self.sched.may_load_async(request)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, [list(b) for b in blocks.get_block_ids()], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.sched is not None
        return self.sched.build_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return False, self.sched.request_finished(request)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return False, self.sched.request_finished(request)
