"""pdserve.bench: the `pdserve bench ...` benchmarks, in one place that nothing in the product imports.

kvstore_throughput.py (store/load GB/s), connector_ttft.py (TTFT recomputed vs loaded),
connector_tpot.py with noop_connector.py (what a connector costs decode steps),
kernels.py (GPU gather/scatter and codecs), serve.py (TTFT/TPOT/ITL of an endpoint, P/D
vs colocated), faults.py with fault_stack.py (faults under load, soak); engine_counters.py
reads the connector's counters off an engine's /metrics for them and the tests.
"""
