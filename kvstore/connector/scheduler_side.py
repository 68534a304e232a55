"""The scheduler half of PDServeConnector: decides what to load and what to save.

It sees whole requests (token ids, kv_transfer_params, block tables) but no KV bytes.
Each step it hands the workers a `StepMeta` listing the objects to load into which
blocks and the objects to copy out of which blocks.

Loads are asynchronous (vLLM's waiting-for-remote-KV path): `get_num_new_matched_tokens`
answers (n, True), vLLM allocates blocks, and the request waits until the workers
report it received.

Stores are named by id, not URL: every host's store may be tcp://127.0.0.1:5556. A
producer publishes its store's id and advertised URL in kv_transfer_params; a decode
loads from its own store only when both name it. A store that is marked down
(kvstore/client/health.py) is not asked at all: lookups find nothing, tails expire by their TTL.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdserve.kvstore.client.client import KVStoreClient, KVStoreError
from pdserve.kvstore.client.health import StoreDown, health_of
from pdserve.kvstore.client.keys import adapter_identity, chunk_keys, prompt_digest
from pdserve.kvstore.connector import vllm_compat
from pdserve.kvstore.connector.handoff import HandoffWatch, handoff_id, handoff_tail_id, handoff_wait
from pdserve.kvstore.connector.plan import GroupGeometry, TransferJob, plan_objects

log = logging.getLogger("pdserve.connector")

PARAMS_TAG = "pdserve"
# An idle step (nothing scheduled) while handoffs are held waits this long for one to land,
# instead of spinning (and holding the GIL the watch threads need).
HOLD_WAIT_S = 0.005


@dataclass
class StepMeta(KVConnectorMetadata):
    """What the workers move in one step."""

    loads: list[TransferJob] = field(default_factory=list)
    saves: list[TransferJob] = field(default_factory=list)
    idle: bool = False  # no tokens run this step: the worker may wait for loads in flight


@dataclass
class LoadPlan:
    """What get_num_new_matched_tokens promised for one request."""

    num_chunks: int
    load_end: int  # tokens loadable from the store (prompt length - 1 at most)
    tail_id: str | None
    wait_s: float
    store_url: str | None = None  # the producer's store, when it is not ours
    store_id: str | None = None  # the id the producer's store announced
    tail_end: int | None = None  # where the tail ends, when the producer's prompt is a prefix of ours


@dataclass
class ReqState:
    """Scheduler-side bookkeeping of one live request."""

    prompt: list[int]
    keys: list[bytes]
    remote_decode: bool
    salt: str | None = None
    adapter: str | None = None  # the request's LoRA adapter: part of what its KV is
    by_tokens: bool = True  # its KV follows from its token ids (`_keyed_by_tokens`); else never saved or loaded
    handoff_tail: str | None = None  # the tail's name when the router overlaps the legs
    chunks_in_store: int = 0
    chunks_saved: int = 0
    tail_id: str | None = None
    tail_saved: bool = False
    load_issued: bool = False
    block_ids: list[list[int]] = field(default_factory=list)


def _adapter(request: Any) -> str | None:
    """The request's LoRA adapter as the keys know it (`adapter_identity`), or None."""
    lora = getattr(request, "lora_request", None)
    name, path = getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)
    return adapter_identity(name, path if isinstance(path, str) else None) if isinstance(name, str) and name else None


def _keyed_by_tokens(request: Any) -> bool:
    """Whether token ids (with the salt and the adapter) say what the request's KV is. Not for images,
    audio or video: their placeholder tokens are the same for any picture of a size, so two requests
    would share keys for different KV (vLLM's own prefix cache hashes the media into its blocks). Nor for
    prompt embeddings, which have no real token ids. Such requests are neither saved nor loaded."""
    media = getattr(request, "mm_features", None) or getattr(request, "mm_positions", None)
    return not media and getattr(request, "prompt_embeds", None) is None


class SchedulerSide:
    def __init__(
        self,
        client_args: dict[str, Any],
        namespace: str,
        chunk_size: int,
        geometries: list[GroupGeometry],
        saves: bool,
        loads: bool,
        handoff_wait_s: float,
    ):
        self.url = client_args["url"]
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.geometries = geometries
        self.groups = list(range(len(geometries)))
        self.saves = saves
        self.loads = loads
        self.handoff_wait_s = handoff_wait_s
        self.client_args = client_args
        self.client = KVStoreClient(**{**client_args, "shm": False})  # lookups and tail drops move no payload
        self.health = health_of(client_args)
        info = self.client.info()
        self.store_id = info.store_id or None
        # what a decode elsewhere dials; the URL we use when the store binds a wildcard address
        self.advertise_url = info.advertise_url or self.url
        self.reqs: dict[str, ReqState] = {}
        self.plans: dict[str, LoadPlan] = {}
        self.pending_loads: list[TransferJob] = []
        self.watches: dict[str, HandoffWatch] = {}  # overlapped handoffs held until their KV has landed
        self.wake = threading.Event()  # set when a watch ends
        # The namespace's generation as the store last reported it (lookups, resets): saves planned now
        # name it, so one still uploading when a reset clears the namespace is refused, not stored.
        self.generation: int | None = None

    # matching ---------------------------------------------------------------
    def _state(self, request: Any) -> ReqState:
        state = self.reqs.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            params = request.kv_transfer_params or {}
            salt = getattr(request, "cache_salt", None)
            adapter = _adapter(request)
            by_tokens = _keyed_by_tokens(request)
            remote_decode = bool(params.get("do_remote_decode"))
            handoff = handoff_id(params) if remote_decode else None
            state = ReqState(
                prompt=prompt,
                keys=chunk_keys(self.namespace, prompt, self.chunk_size, salt, adapter) if by_tokens else [],
                remote_decode=remote_decode,
                salt=salt,
                adapter=adapter,
                by_tokens=by_tokens,
                handoff_tail=handoff_tail_id(handoff, prompt, salt, adapter) if handoff and by_tokens else None,
            )
            self.reqs[request.request_id] = state
        return state

    def _lookup(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        try:
            with self.health.guard():
                found = self.client.lookup_with_generation(self.namespace, keys, self.groups)
            self.generation = found.generation
            return found.count
        except StoreDown:
            return 0
        except KVStoreError as exc:
            log.warning("store lookup failed, recomputing: %s", exc)
            return 0

    def _overlap_plan(self, req_id: str, state: ReqState, params: dict) -> LoadPlan | None:
        """A handoff whose prefill may still be running: plan the whole prompt (its full chunks and,
        unless chunk-aligned, the tail named after the handoff and this prompt) and watch the store
        for the last object the producer uploads (the tail, else the last chunk's)."""
        handoff = handoff_id(params)
        if params.get(PARAMS_TAG) != 1 or handoff is None or len(state.prompt) < 2:
            return None
        tail_id = (handoff_tail_id(handoff, state.prompt, state.salt, state.adapter)
                   if len(state.prompt) % self.chunk_size else None)
        if tail_id is None and not state.keys:
            return None
        end = len(state.prompt) if tail_id else len(state.keys) * self.chunk_size
        store_url, store_id = self._producer_store(params)
        last = [] if tail_id else [(g, state.keys[-1]) for g in self.groups]
        args = self.client_args if store_url is None else {**self.client_args, "url": store_url}
        wait_s = handoff_wait(params, self.handoff_wait_s)
        self.watches[req_id] = HandoffWatch(args, self.namespace, last, tail_id, wait_s, self.wake)
        return LoadPlan(len(state.keys), min(end, len(state.prompt) - 1), tail_id, self.handoff_wait_s, store_url, store_id)

    def _handoff_plan(self, state: ReqState, params: dict) -> LoadPlan | None:
        """The producer's promise, if it was made in our namespace for this prompt, or for the start of it:
        a router that streams the prefill's first token sends the decode leg the prompt plus that token,
        whose KV the decode engine computes. A prompt that only starts with the producer's needs the
        producer's whole-prompt digest to match its start (chunk keys cover whole chunks only)."""
        if params.get(PARAMS_TAG) != 1 or params.get("namespace") != self.namespace:
            return None
        promised = [bytes.fromhex(k) for k in params.get("chunk_keys", [])]
        count = params.get("num_tokens")
        made_for: int = count if type(count) is int else -1  # the producer's prompt length
        digest = params.get("prompt_digest")  # absent from producers before it: keys and length decide
        whole = made_for == len(state.prompt)
        start = 0 < made_for < len(state.prompt) and digest is not None
        if (not (whole or start) or promised != state.keys[: len(promised)]
                or (digest is not None and digest != prompt_digest(state.prompt[:made_for], state.salt, state.adapter))):
            log.warning("kv_transfer_params do not match this prompt; ignoring them")
            return None
        tail_id = params.get("tail_id")
        end = len(promised) * self.chunk_size
        if tail_id:
            end = made_for
        store_url, store_id = self._producer_store(params)
        return LoadPlan(len(promised), min(end, len(state.prompt) - 1), tail_id, self.handoff_wait_s, store_url, store_id,
                        tail_end=made_for if tail_id else None)

    def _producer_store(self, params: dict) -> tuple[str | None, str | None]:
        """(URL, id) of the store the producer wrote to; URL None when that is our own store."""
        url, store_id = params.get("kvstore_url"), params.get("kvstore_id")
        url = url if isinstance(url, str) and url else None
        store_id = store_id if isinstance(store_id, str) and store_id else None
        ours = url is None or url in (self.url, self.advertise_url)
        if ours and (store_id is None or self.store_id is None or store_id == self.store_id):
            return None, store_id
        return url or self.url, store_id

    def reset_cache(self) -> bool:
        """vLLM's reset of external caches (`/reset_prefix_cache?reset_external=true`, and vLLM 0.34's
        sleep): the store's KV for this model may come from weights that are gone (a weight update), so
        this namespace is dropped for every engine that shares it. False, which vLLM reports as a failed
        reset, when the store does not answer."""
        try:
            with self.health.guard():
                cleared = self.client.clear(self.namespace)
        except (StoreDown, KVStoreError) as exc:
            log.warning("store reset failed: %s", exc)
            return False
        self.generation = cleared.generation
        log.info("store reset: %d objects of namespace %s dropped", cleared.objects, self.namespace)
        return True

    def may_load_async(self, request: Any) -> bool:
        """Whether its load may start while the running batch is full (vLLM 0.34+, with
        --max-num-inflight-kv-loads; vLLM asks as the request is queued, so it must be cheap): P/D decode
        legs, which carry our params (vLLM's default looks for NIXL's `do_remote_prefill`). A prefix found
        by lookup is not known this cheaply; it loads when a running slot frees, as without the flag."""
        params = request.kv_transfer_params
        return self.loads and isinstance(params, dict) and params.get(PARAMS_TAG) == 1

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state.load_issued or not state.by_tokens:
            # One load attempt per request: vLLM asks again only after a failed load,
            # and then it must recompute rather than wait on the store again. And none
            # for a request whose tokens do not say what its KV is.
            return 0, False
        if request.request_id in self.plans:
            plan = self.plans[request.request_id]
        else:
            params = request.kv_transfer_params or {}
            promised = None
            if self.loads:
                promised = self._overlap_plan(request.request_id, state, params) or self._handoff_plan(state, params)
            if promised is None:
                found = self._lookup(state.keys)
                state.chunks_in_store = found
                plan = LoadPlan(found, min(found * self.chunk_size, len(state.prompt) - 1), None, 0.0)
            else:
                plan = promised
                state.chunks_in_store = plan.num_chunks
            if not self.loads:
                plan = LoadPlan(0, 0, None, 0.0)
            self.plans[request.request_id] = plan
        watch = self.watches.get(request.request_id)
        if watch is not None:
            if not watch.done.is_set():
                return None, False  # the producer is still at it: vLLM asks again on a later step
            del self.watches[request.request_id]
            if not watch.ready:  # aborted, timed out or store unreachable: recompute
                plan = self.plans[request.request_id] = LoadPlan(0, 0, None, 0.0)
        new = plan.load_end - num_computed
        return (new, True) if new > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[list[int]], num_external: int) -> None:
        if num_external <= 0:
            return
        plan = self.plans[request.request_id]
        state = self._state(request)
        state.load_issued = True
        num_computed = plan.load_end - num_external
        tail_end = (plan.tail_end or len(state.prompt)) if plan.tail_id else None
        objects = plan_objects(
            self.geometries,
            block_ids,
            state.keys,
            self.chunk_size,
            first_chunk=num_computed // self.chunk_size,
            num_chunks=plan.num_chunks,
            tail_end=tail_end,
            computed_tokens=num_computed,
            last_only_for_sliding=True,
            allow_short_table=True,
        )
        self.pending_loads.append(
            TransferJob(request.request_id, objects, plan.tail_id, plan.wait_s, plan.store_url, plan.store_id)
        )

    # saving -----------------------------------------------------------------
    def _save_job(self, req_id: str, state: ReqState, computed_end: int) -> TransferJob | None:
        """Objects that became complete by `computed_end` and that the store lacks."""
        if not state.by_tokens:
            return None
        prompt_len = len(state.prompt)
        done = min(computed_end, prompt_len) // self.chunk_size
        first = max(state.chunks_saved, state.chunks_in_store)
        needs_tail = (
            state.remote_decode
            and not state.tail_saved
            and computed_end >= prompt_len
            and prompt_len % self.chunk_size != 0
        )
        if done <= first and not needs_tail:
            return None
        tail_id = (state.handoff_tail or f"{req_id}-{uuid.uuid4().hex[:8]}") if needs_tail else None
        objects = plan_objects(
            self.geometries,
            state.block_ids,
            state.keys,
            self.chunk_size,
            first_chunk=first,
            num_chunks=max(done, first),
            tail_end=prompt_len if needs_tail else None,
        )
        state.chunks_saved = max(done, first)
        if needs_tail:
            state.tail_saved, state.tail_id = True, tail_id
        return TransferJob(req_id, objects, tail_id, handoff=state.remote_decode, generation=self.generation)

    def build_meta(self, scheduler_output: Any) -> StepMeta:
        meta = StepMeta(loads=self.pending_loads, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self.pending_loads = []
        if meta.idle and self.watches:
            if not any(w.done.is_set() for w in self.watches.values()):
                self.wake.wait(HOLD_WAIT_S)
            self.wake.clear()
        if not self.saves:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self.reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            job = self._save_job(new.req_id, state, new.num_computed_tokens + scheduled[new.req_id])
            if job:
                meta.saves.append(job)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = vllm_compat.resumed_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            state = self.reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed:
                    state.block_ids = [list(ids) for ids in new_ids]
                else:
                    for group, ids in enumerate(new_ids):
                        state.block_ids[group].extend(ids)
            job = self._save_job(req_id, state, cached.num_computed_tokens[i] + scheduled[req_id])
            if job:
                meta.saves.append(job)
        return meta

    # finishing --------------------------------------------------------------
    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """Forget the request; for a P/D prefill return the params the decode side needs."""
        state = self.reqs.pop(request.request_id, None)
        self.plans.pop(request.request_id, None)
        watch = self.watches.pop(request.request_id, None)
        if watch is not None:
            watch.cancel()
        if state is None or not state.remote_decode or not state.by_tokens or not self.saves:
            return None
        if request.is_finished() and str(request.status).endswith("ABORTED"):
            if state.tail_id:
                self._drop_tail(state.tail_id)
            return None
        return {
            PARAMS_TAG: 1,
            "kvstore_url": self.advertise_url,
            "kvstore_id": self.store_id,
            "namespace": self.namespace,
            "chunk_size": self.chunk_size,
            "chunk_keys": [k.hex() for k in state.keys],
            "num_tokens": len(state.prompt),
            # the whole prompt, tail included: the chunk keys cover only its whole chunks
            "prompt_digest": prompt_digest(state.prompt, state.salt, state.adapter),
            "tail_id": state.tail_id,
        }

    def _drop_tail(self, tail_id: str) -> None:
        try:
            with self.health.guard():
                self.client.drop_tail(self.namespace, tail_id)
        except StoreDown:
            return
        except KVStoreError as exc:
            log.warning("could not drop tail %s (the store's TTL will): %s", tail_id, exc)
