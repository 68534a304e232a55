"""The vLLM plugin applies PDSERVE_VLLM_SPIN_S to vLLM's message-queue readers (idle_spin.py).

Checked in fresh processes that load vLLM's general plugins as its engine processes do: a reader
made before the plugins load (a worker's queues may be) and one made after both spin as long as the
variable says; without it, vLLM's own second stays, and so it does when the plugin's function meets a
value that is not a number of seconds (checked in the unset process, two vLLM imports in all).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.deploy.tiny_model import TINY_ENGINE_ENV
from pdserve.kvstore.connector.idle_spin import ENV

pytestmark = pytest.mark.slow  # imports vLLM in a child

# Prints the spin of a reader made before vLLM's plugins load and of one made after; then, for each refused value
# given as arguments, the spin a reader has after the plugin's function is applied again with that value.
PROBE = textwrap.dedent(
    """
    import os, sys
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.plugins import load_general_plugins
    from pdserve.kvstore.connector.idle_spin import ENV, limit_idle_spin

    context = zmq.Context()
    before = SpinCondition(True, context, "inproc://pdserve-spin-before")
    load_general_plugins()
    after = SpinCondition(True, context, "inproc://pdserve-spin-after")
    print(before.busy_loop_s, after.busy_loop_s)
    for i, bad in enumerate(sys.argv[1:]):
        os.environ[ENV] = bad
        limit_idle_spin()
        print(SpinCondition(True, context, f"inproc://pdserve-spin-bad-{i}").busy_loop_s)
    """
)


def _spins(value: str | None, *refused: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    out = subprocess.run([sys.executable, "-c", PROBE, *refused], capture_output=True, text=True, timeout=300,
                         env=env, check=True)
    return [float(x) for x in out.stdout.split()[-2 - len(refused):]]


def test_the_plugin_sets_every_readers_spin_from_the_environment() -> None:
    assert TINY_ENGINE_ENV[ENV] == "0.05"
    assert _spins("0.05") == [0.05, 0.05]
    # Unset, vLLM's own second stays (the probe would not tell otherwise); values that are not a number of
    # seconds are refused and leave it too.
    assert _spins(None, "soon", "-1", "nan") == [1.0, 1.0, 1.0, 1.0, 1.0]
