"""pdserve.worker: what prefill_worker/ and decode_worker/ share (they only fix the role).

config.py (flags, vLLM command line, connector config), supervisor.py (the vLLM child:
start, health, restarts, drain), registration.py (the Redis record and the contract the
router reads), children.py (process groups and restart backoff, also used by deploy/).
"""
