"""The vLLM plugin asks Linux for AMX tile state on CPUs that have AMX (vllm_plugin.allow_amx_tiles).

Without it a P/D decode worker on an AMX host (vLLM-CPU picks its AMX attention kernel there)
died of SIGILL on its first forward, which ran after its prompt's KV was loaded and before any
AMX matmul had asked for the tile state. The check runs in a fresh process, so nothing this
test session did grants the permission first.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import ctypes
    import torch
    from pdserve.kvstore.connector.vllm_plugin import allow_amx_tiles

    ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1022, 18
    def granted():
        mask = ctypes.c_ulong(0)
        assert ctypes.CDLL(None).syscall(158, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0
        return bool(mask.value >> XFEATURE_XTILEDATA & 1)
    before = granted()
    allowed = allow_amx_tiles()
    print(torch.cpu._is_amx_tile_supported(), before, allowed, granted())
    """
)


def test_plugin_grants_amx_tiles_where_the_cpu_has_them() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    supported, before, allowed, after = (word == "True" for word in out.stdout.split())
    assert not before, "a fresh process already had AMX tile state: the probe proves nothing"
    assert allowed == supported and after == supported
