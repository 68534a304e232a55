"""pdserve.kernels: paged KV gather/scatter (`paged`) and DeepSeek fp8_ds_mla codecs (`fp8_ds_mla`),
Triton kernels that run on sm80/sm86/sm89/sm90 with pure-torch references and CPU fallbacks.

Nothing is imported here, so `import pdserve.kernels` stays cheap; see kernels/README.md.
"""
