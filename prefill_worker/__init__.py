"""pdserve.prefill_worker"""
