"""pdserve.deploy"""
