"""pdserve.kernels: paged KV gather/scatter (`paged`, the connector's copy path on CUDA) and DeepSeek
fp8_ds_mla codecs (`fp8_ds_mla`, a verified library for engines and tools: no pdserve path calls
them), Triton kernels that run on sm80/sm86/sm89/sm90 with pure-torch references and CPU fallbacks.

Nothing is imported here, so `import pdserve.kernels` stays cheap; see kernels/README.md.
"""
