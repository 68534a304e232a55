"""Which path a request takes: both legs (P/D) or decode-only, and why.

Decode-only when the request cannot share one prefill (a batch of prompts, n > 1 or beam
search: vLLM would fork child requests that all claim the prefill's one tail), when it asks
for the prompt's own logprobs (the decode engine then reads no cached KV), when it carries
images, audio, video or prompt embeddings (the KV store keys KV by token ids), when no
prefill worker is available, when the prompt is short (`--pd-min-prompt-tokens`), when
the KV store already holds most of it (`--pd-max-cached-fraction`), when max_tokens alone
exceeds the decode workers' context (their engine refuses it at once), or
when the prefill workers' queue would delay it longer than a decode worker takes to
recompute it (`--pd-queue-aware`, figures from prefill_estimate.py); else P/D. The token count and the
store's prefix hits found on the way go to the workers' policies. "The KV store" is each
backend's: pdserve's stores (store_view.py) and the LMCache servers of the prefill workers
on that backend (lmcache_view.py), asked together.

Counting a long prompt and asking the store sit in front of the first call, so with
`--pd-early-prefill` a body long enough, and not likely stored, goes P/D at once and the count
runs beside the prefill leg as `call.verdict`; pd_flow.py cancels the leg if the count finds the
prompt short after all. Such a request is not looked up in the store (see `_early`). The queue
check then goes by the body's estimated count: it needs no exact one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import msgspec

from pdserve.router.config import RouterConfig
from pdserve.router.flow.call import Call
from pdserve.router.lmcache_view import LMCacheView
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Pool, RouteContext, Worker
from pdserve.router.prefill_estimate import QueueEstimate
from pdserve.router.store_view import StoreView
from pdserve.router.tokens import PromptTokens, given_ids

log = logging.getLogger("pdserve.router.paths")

# How far a body's estimated token count must clear --pd-min-prompt-tokens for the prefill leg to go out
# before the count (the estimate is the bytes per token of the prompts counted so far).
EARLY_MARGIN = 2
MIN_PREFIX_CHARS = 64  # the shortest text prefix whose hash the router keeps
PREFIXES_KEPT = 1 << 16  # prefix hashes kept, newest first (a 8k-character prompt leaves 8; about 6 MB in all)


def _is_batch(body: dict[str, Any], given: list[int] | None) -> bool:
    """Several prompts in one request; `given` is the prompt as token ids, if it is that (one prompt)."""
    prompt = body.get("prompt")
    return given is None and isinstance(prompt, list) and len(prompt) > 1


def _forks(body: dict[str, Any]) -> bool:
    """n > 1 (or beam search) makes vLLM fork child requests that would all claim the prefill's one tail."""
    return (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1 or bool(body.get("use_beam_search"))


def _scores_prompt(call: Call) -> bool:
    """The request asks for its prompt's logprobs: `prompt_logprobs`, or `echo` with a completion's
    `logprobs` (lm-eval's loglikelihood) or a chat's `top_logprobs`, which vLLM turns into prompt logprobs.
    vLLM computes those only over tokens it runs itself: 0.32 skips every prefix hit for such a request,
    the connector's included, so the prefill leg's KV would go unread (its tail waiting out its TTL) and
    the decode leg would recompute the prompt after waiting for it; an engine without that rule would
    load the KV and have no logprobs for the loaded tokens."""
    body = call.body
    if body.get("prompt_logprobs") is not None:
        return True
    logprobs = body.get("logprobs" if call.route == "completions" else "top_logprobs")
    return bool(body.get("echo")) and logprobs is not None


# Chat content parts that are text; any other part (image_url, input_audio, video_url, ...) is media.
_TEXT_PARTS = frozenset(("text", "input_text", "output_text", "refusal", "thinking"))


def _has_media(call: Call) -> bool:
    """Images, audio or video in a chat's messages, or a completion's prompt embeddings: the connector neither
    saves nor loads such a prompt's KV (its token ids do not say what it is), so a prefill leg is wasted."""
    if call.route == "completions":
        return call.body.get("prompt_embeds") is not None
    messages = call.body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") not in _TEXT_PARTS
                                             for part in content):
            return True
    return False


def _prompt_text(call: Call) -> str | None:
    """A text prompt, or a chat's messages' contents joined; None for any other prompt."""
    if call.route == "completions":
        prompt = call.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None
    messages = call.body.get("messages")
    if not isinstance(messages, list):
        return None
    contents = [m.get("content") if isinstance(m, dict) else m for m in messages]
    return "\x00".join(c if isinstance(c, str) else msgspec.json.encode(c).decode(errors="replace") for c in contents)


def _seconds(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.3f}"


class PathPlanner:
    def __init__(self, cfg: RouterConfig, prefill: Pool, decode: Pool, tokens: PromptTokens, store: StoreView,
                 lmcache: LMCacheView, queue: QueueEstimate, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.prefill = prefill
        self.decode = decode
        self.queue = queue
        self.tokens = tokens
        self.store = store
        self.lmcache = lmcache
        self._prefixes: OrderedDict[int, None] = OrderedDict()  # hashes of recent prompts' text prefixes, oldest first

    async def plan(self, call: Call) -> tuple[str, RouteContext]:
        """The path (a metrics label: "pd" or "decode_only_<why>") and the facts the policies use. A "pd"
        plan may leave `call.verdict` running: the prompt's count, which the flow races
        with the prefill leg (`_early`)."""
        # a rough count for load accounting where no tokenization is needed (or none answers)
        ctx = RouteContext(model=call.model, prompt_tokens=self.tokens.estimate(len(call.raw)))
        given = given_ids(call.route, call.body)
        if _is_batch(call.body, given):
            return "decode_only_batch", ctx
        if _forks(call.body):
            return "decode_only_n", ctx
        if _scores_prompt(call):
            return "decode_only_prompt_logprobs", ctx
        if _has_media(call):
            return "decode_only_media", ctx
        prefill_workers = self.prefill.candidates(call.model)
        if not prefill_workers:
            return "decode_only_no_prefill", ctx
        if self._overflows(call):  # judged on the body alone: no count, no lookup
            return "decode_only_too_long", ctx
        if given is not None:
            ctx.prompt_tokens, call.prompt_ids = len(given), given
        if self._early(call, ctx):
            call.verdict = asyncio.ensure_future(self._counted(call, ctx, prefill_workers, lookup=False))
        elif why := await self._counted(call, ctx, prefill_workers):
            return why, ctx
        if self.cfg.pd_queue_aware:
            wait = self.queue.prefill_wait(prefill_workers)
            recompute = self.queue.recompute_cost(ctx.prompt_tokens, self.decode.candidates(call.model))
            log.debug("queue-aware: %d prompt tokens, prefill wait %s s, recompute %s s",
                      ctx.prompt_tokens, _seconds(wait), _seconds(recompute))
            if wait is not None and recompute is not None and wait > recompute:
                if call.verdict is not None:
                    call.verdict.cancel()
                    call.verdict = None
                call.recompute = self.queue.start_recompute(ctx.prompt_tokens)
                return "decode_only_prefill_queue", ctx
        return "pd", ctx

    def _early(self, call: Call, ctx: RouteContext) -> bool:
        """Whether the prefill leg goes out before the router has counted the prompt (`--pd-early-prefill`):
        when its body is long enough that the count is sure to clear `--pd-min-prompt-tokens`, it is not
        likely to be in the store (`_maybe_stored`), and no policy chooses a worker by what the store holds.
        On the H200 the count took 5-7 ms of the router's 6-8 ms before its first call (2k tokens, c=4 and 8),
        and the store lookup 1-2 ms.

        Such a request is not looked up at all: a lookup sent after the leg can find the chunks this very
        prefill is storing, and its verdict would cancel a prefill that is all but done (full `make test` on
        the 2-core VM: a fresh prompt counted through a worker's /tokenize, the router's tokenizer still
        loading, got its verdict 0.34 s after its leg and went decode_only_cached). A prompt stored through
        another router thus gets a prefill leg, whose engine recomputes it (a kv_producer does not load)."""
        return (self.cfg.pd_early_prefill and "prefix-aware" not in (self.cfg.prefill_policy, self.cfg.decode_policy)
                and ctx.prompt_tokens >= EARLY_MARGIN * self.cfg.pd_min_prompt_tokens
                and not self._maybe_stored(call))

    def _maybe_stored(self, call: Call) -> bool:
        """Whether a recent prompt through this router shared enough of this one's text for the store to
        hold `--pd-max-cached-fraction` of it (then count first), remembering this one's prefixes.

        An early prefill leg that its verdict cancels has cost its engine work for nothing: on the 2-core
        VM, 1.5k-token prompts the store held had a TTFT p50 of 218 ms with the early leg against 101 ms
        counted first. The router keeps hashes of each prompt's text prefixes at powers of two; a prompt
        that shares half its text with an earlier one shares that one's prefix at the power of two below
        half its own length (a hit there may also mean a quarter: then it is counted first for nothing).
        A prompt stored through another router is missed, and then costs the early leg."""
        text = _prompt_text(call)
        if text is None:
            return True  # nothing to go by (token ids are counted at once anyway): count first
        half = len(text) // 2
        seen = half >= MIN_PREFIX_CHARS and hash(text[:1 << (half.bit_length() - 1)]) in self._prefixes
        size = MIN_PREFIX_CHARS
        while size <= len(text):
            key = hash(text[:size])
            self._prefixes[key] = None
            self._prefixes.move_to_end(key)
            size <<= 1
        while len(self._prefixes) > PREFIXES_KEPT:
            self._prefixes.popitem(last=False)
        return seen

    async def _counted(self, call: Call, ctx: RouteContext, prefill_workers: list[Worker],
                       lookup: bool = True) -> str | None:
        """Count the prompt and (with `lookup`) ask the store for it: the decode-only path this shows
        ("decode_only_short", "decode_only_cached"), or None for P/D. Sets `call.prompt_ids` and the counts
        in `ctx`."""
        t = time.perf_counter()
        ids = call.prompt_ids  # given as token ids (plan): counted already
        if ids is None:
            ids = await self.tokens.ids(call.route, call.body, prefill_workers[0].url, body_size=len(call.raw))
        self._timed("tokenize", t)
        if ids is not None:
            ctx.prompt_tokens = len(ids)
            call.prompt_ids = ids
        if ctx.prompt_tokens < self.cfg.pd_min_prompt_tokens:
            return "decode_only_short"
        if ids is not None and lookup:
            t = time.perf_counter()
            ctx.prefix_tokens = await self._prefix_tokens(ids, call.body.get("cache_salt"), call.model,
                                                          prefill_workers)
            self._timed("store_lookup", t)
            if ctx.prefix_tokens and max(ctx.prefix_tokens.values()) >= self.cfg.pd_max_cached_fraction * len(ids):
                return "decode_only_cached"
        return None

    def _overflows(self, call: Call) -> bool:
        """Whether the tokens asked for alone exceed the decode workers' context (the smallest
        `max_model_len` their /v1/models report). vLLM 0.26 and 0.32 both refuse that (max_tokens
        "cannot be greater than max_model_len"; older ones are not checked), so a prefill leg first would
        be work thrown away: max_tokens 10^12 on a 1.2k-token prompt got its 400 after a 3.2 s prefill leg
        on the 2-core VM. Sent decode-only, the engine gives its own answer at once. A prompt plus
        max_tokens over the context is not judged here: vLLM 0.26 refuses it, 0.32 shortens max_tokens
        and serves it, which P/D should still carry."""
        asked = call.body.get("max_completion_tokens") if call.route == "chat" else None
        asked = call.body.get("max_tokens") if asked is None else asked
        limit = self.decode.max_model_len(call.model)
        return type(asked) is int and limit is not None and asked > limit

    def _timed(self, step: str, t_start: float) -> None:
        """A step of the decision in `pdserve_router_plan_seconds`: the parts of the router's time before
        its first call that can grow with the prompt or wait on another process."""
        self.metrics.series(self.metrics.plan, step).observe(time.perf_counter() - t_start)

    async def _prefix_tokens(self, ids: list[int], salt: Any, model: str | None,
                             workers: list[Worker]) -> dict[str, int]:
        """Prompt tokens already stored, per KV backend URL, from every backend that can tell."""
        salt = salt if isinstance(salt, str) else None
        found = await self.store.prefix_tokens(ids, salt, self.prefill.adapter(model)) if self.store.layouts else {}
        if LMCacheView.servers(workers):
            found.update(await self.lmcache.prefix_tokens(workers, ids, salt))
        return found
