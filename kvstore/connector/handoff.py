"""Overlapped handoffs: the decode leg arrives before (or while) the prefill leg runs.

The router sends both legs at once with one handoff id. The producer names the tail of
the prompt's KV (its partial last chunk) after that id *and a digest of the prompt it
ran*; the consumer derives the same name from the prompt *it* was given. So a decode leg
can only ever load the KV of its own prompt: a different prompt names a tail that never
arrives, and the consumer recomputes.

On the consumer, vLLM is told "not yet" (get_num_new_matched_tokens answers None) while a
`HandoffWatch` waits in the store (an Await the store answers when the last object has
landed; no polling), so no blocks are held and no load thread is tied up while the
prefill runs. Once the watch says ready, vLLM allocates blocks and the load finds
everything in place. A watch ends early when the request is aborted (client gone,
router gave up on the prefill), and gives up after the handoff wait; the request is
then recomputed.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from pdserve.kvstore.client.client import KVStoreClient, KVStoreError
from pdserve.kvstore.client.keys import prompt_digest

log = logging.getLogger("pdserve.connector")

# The key in kv_transfer_params: on a prefill leg it names the tail to write, on a
# decode leg the tail (and chunks) to wait for.
HANDOFF_KEY = "pdserve_handoff"
# On an overlapped decode leg: how long to wait for the prefill (it covers the prefill's queue and
# compute, not only its upload); bounded by MAX_HANDOFF_WAIT_S.
HANDOFF_WAIT_KEY = "pdserve_handoff_wait_s"
MAX_HANDOFF_WAIT_S = 600.0
_HANDOFF_RE = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
# An Await is held by the store at most this long at a time, so an abort (or a dead store)
# is noticed within about this much (plus the reply deadline).
WATCH_SLICE_S = 0.25


def handoff_id(params: dict[str, Any]) -> str | None:
    """The handoff id in kv_transfer_params, if it is a well-formed one."""
    value = params.get(HANDOFF_KEY)
    return value if isinstance(value, str) and _HANDOFF_RE.match(value) else None


def handoff_wait(params: dict[str, Any], default_s: float) -> float:
    """How long an overlapped decode leg may be held: the router's figure, bounded; else `default_s`."""
    value = params.get(HANDOFF_WAIT_KEY)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return min(float(value), MAX_HANDOFF_WAIT_S)
    return default_s


def handoff_tail_id(handoff: str, prompt: list[int], salt: str | None, adapter: str | None = None) -> str:
    """The tail's name in the store: the handoff id bound to the prompt (and adapter) it was computed for."""
    return f"h-{handoff}-{prompt_digest(prompt, salt, adapter)}"


class HandoffWatch:
    """Waits in the store, on a thread of its own, until a handoff's objects have all landed."""

    def __init__(self, client_args: dict[str, Any], namespace: str, items: list[tuple[int, bytes]],
                 tail_id: str | None, wait_s: float, wake: threading.Event) -> None:
        self.client_args = client_args
        self.namespace = namespace
        self.items = items
        self.tail_id = tail_id
        self.deadline = time.monotonic() + wait_s
        self.wake = wake  # set when this watch ends, so an idle engine looks again at once
        self.ready = False
        self.done = threading.Event()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="pdserve-handoff-watch", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled = True

    def _run(self) -> None:
        try:
            with KVStoreClient(**{**self.client_args, "shm": False}) as client:
                while not self._cancelled:
                    left = self.deadline - time.monotonic()
                    ready = client.await_ready(self.namespace, self.items, self.tail_id,
                                               max(0.0, min(left, WATCH_SLICE_S)))
                    if ready.tail_gone:  # another engine loaded it (a retried leg), or it was dropped
                        log.info("handoff %s is gone from the store; recomputing", self.tail_id)
                        return
                    if ready.settled(self.tail_id):
                        self.ready = True
                        return
                    if left <= WATCH_SLICE_S:
                        log.warning("handoff %s not complete after the handoff wait; recomputing", self.tail_id)
                        return
        except KVStoreError as exc:
            log.warning("waiting for handoff %s failed, recomputing: %s", self.tail_id, exc)
        except Exception:  # never leave the request waiting on a dead watch
            log.exception("handoff watch failed")
        finally:
            self.done.set()
            self.wake.set()
