"""vLLM general plugin: makes `"kv_connector": "PDServeConnector"` resolvable in stock vLLM.

Registered as the `pdserve` entry point of the `vllm.general_plugins` group, which
vLLM loads in every process (API server, engine core, workers) before it builds
connectors. Registration is lazy: vLLM imports the connector module only when a
kv-transfer config names it.
"""

from __future__ import annotations

CONNECTOR_NAME = "PDServeConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "pdserve.kvstore.connector.connector", CONNECTOR_NAME)
