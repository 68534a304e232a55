"""pdserve.kvstore"""
