"""pdserve.router.flow: one completion request through both legs, by job.

pd_flow.py runs a request; paths.py plans it (P/D or decode-only), prefill_leg.py and
decode_leg.py send its legs, relay.py streams the answer back, call.py holds the request
as the flow sees it.
"""
