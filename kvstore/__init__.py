"""pdserve.kvstore: the KV store, in three parts.

client/ is the wire protocol and the clients (what everything else imports), server/ is
the store service (`pdserve kvstore`), connector/ is PDServeConnector inside vLLM engines.
"""
