"""pdserve.kvstore.server: `pdserve kvstore`, the KV store service.

main.py wires it: config.py (flags), store.py (namespaces, L1/L2, leases, tails; no
transport), l1.py and l2.py (the tiers), transport.py (the ZMQ loop), waiters.py (Await
requests parked until what they wait for is stored), http.py and metrics.py (/health,
/metrics, /stats). It speaks the protocol of pdserve.kvstore.client.
"""
