"""A KV connector that moves nothing: what vLLM itself costs an engine that runs with any connector.

`pdserve bench connector-tpot` starts an engine with it (`kv_connector_module_path`
pdserve.bench.noop_connector) beside one without a connector and one with PDServeConnector,
so the decode cost it measures splits into vLLM's part (this one against none) and
pdserve's (PDServeConnector against this one). Benchmark only: it loads and saves nothing.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
