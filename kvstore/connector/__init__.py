"""pdserve.kvstore.connector: PDServeConnector, the store's side inside a vLLM engine.

connector.py is vLLM's KVConnectorBase_V1 interface and its start-up checks;
scheduler_side.py decides what each step loads and saves, worker_side.py moves the bytes
between the paged cache (cache.py) and the store, plan.py is the arithmetic both sides
share; handoff.py holds an overlapped decode leg until its producer's upload has landed
(the router names handoffs with its HANDOFF_KEY); stats.py exports the counters on the
engine's /metrics. vllm_plugin.py registers
the connector by name, vllm_compat.py absorbs the differences between vLLM releases and
vllm_release.py says which releases are supported. plan.py, cache.py, vllm_plugin.py and
vllm_release.py import no vLLM.
"""
