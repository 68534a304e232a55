"""pdserve.kvstore.client: the store's wire protocol and its clients (the ground floor).

What every part that talks to a store imports: the messages (protocol.py), KV layouts and
their namespaces (layout.py), chunk keys (keys.py), payload checksums (checksum.py), the
shared-memory arena (shm.py), the token flag (auth.py), malloc tuning for large messages
(malloc.py), the blocking and asyncio clients (client.py) and a store's up/down state as a
fault domain (health.py). Nothing here imports the server, the connector or vLLM.
"""
