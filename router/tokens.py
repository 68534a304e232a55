"""Prompt token ids on the router, for the decisions that depend on them.

Two decisions need the prompt's tokens before any worker has seen it: whether the
prompt is long enough to be worth a prefill leg (`--pd-min-prompt-tokens`) and how
much of it the KV store already holds (prefix-aware routing, skipping prefill for a
cached prompt). The tokenizer is loaded locally (transformers, from the model folder
the workers serve) once, off the event loop; until it is loaded, or when it cannot
be, a worker's /tokenize answers instead. Either way the ids only steer routing: the
prompt a worker runs is always the one it renders itself.

Prompts are tokenized on worker threads, each with its own copy of the tokenizer: one
fast tokenizer used from two threads at once fails ("Already borrowed"), and a lock around
one copy made concurrent long prompts queue for it (on the H200 host at 8k tokens and 8
concurrent requests the router spent 119 ms before its first call, against 34 ms at one).
The copies encode in parallel, since the tokenizer releases the GIL while it works. They
encode without the per-token offsets transformers' `encode` computes and drops, once that is
checked to count probe text alike (2k tokens: 2.5-3.2 ms instead of 5.4-6.5 here).

When neither can count a prompt (the tokenizer still loading and the worker not
answering: a stopped prefill engine's /tokenize hangs), the count is estimated from
the request body's size at the body bytes per token of the prompts counted so far.
A fixed 4 bytes per token was 2.6x short for the random-word prompts of the tests,
which made a stuck prefill worker's backlog look small enough to queue behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
import queue
import threading
from typing import Any, Iterator

import aiohttp
import msgspec

from pdserve.router.requests import Route, token_ids
from pdserve.router.upstream import SIDE_REQUEST_ERRORS, describe

log = logging.getLogger("pdserve.router.tokens")

_TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
_BYTES_PER_TOKEN_PRIOR = 4.0  # until a prompt has been counted: about what English text takes
_ALPHA = 0.2  # weight of the newest counted prompt in the bytes-per-token average

# Request fields that change how a chat prompt renders, as vLLM's /tokenize accepts them.
_CHAT_RENDER_FIELDS = ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                       "documents", "chat_template")


def _brings_template(route: Route, body: dict[str, Any]) -> bool:
    """A chat request with a chat template of its own (`chat_template`, also inside `chat_template_kwargs`).

    The router never renders one: a template is a program (Jinja), and a client's can loop for good
    in a router thread: a nested loop of `range(100000)` kept a router at 94% CPU after its client had
    gone, holding a tokenizer copy (2026-12-07). The worker's /tokenize counts it instead, which is
    vLLM's to allow (`--trust-request-chat-template`) or refuse (400), as it does for the request itself."""
    if route != "chat":
        return False
    kwargs = body.get("chat_template_kwargs")
    return body.get("chat_template") is not None or (isinstance(kwargs, dict) and "chat_template" in kwargs)


# Tokenizer copies at most: prompts tokenized at once (a copy costs a few ms and a few MB).
MAX_ENCODERS = min(8, os.cpu_count() or 1)
# How long a prompt waits for a free copy before the worker's /tokenize counts it instead: a
# 15 MB prompt (under the default --max-request-bytes) keeps a copy busy for ~15 s here, so a
# few such requests must not hold every other prompt's routing for that long.
BORROW_WAIT_S = 0.25


# Text the fast path must count exactly as the tokenizer's own encode does before it is used:
# spaces, digits, punctuation, accents, CJK, newlines; the tokenizer's special tokens are added.
_PROBE = "Hello world,  12345 6.78e9 -- naive cafe\u0301 \u4f60\u597d\u4e16\u754c\n\n\tx'y \"z\" end. "


def _encode(tok: Any, text: str, add_special_tokens: bool, fast: bool) -> list[int]:
    """`text`'s token ids; `fast`: by the tokenizer's Rust encode without the per-token offsets that
    transformers' `encode` computes and then discards (half the time of a 2k-token prompt here)."""
    if fast:
        return list(tok.backend_tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)
    return list(tok.encode(text, add_special_tokens=add_special_tokens))


def fast_encode_matches(tok: Any) -> bool:
    """Whether the fast encode counts probe text (and the tokenizer's special tokens) exactly as the
    tokenizer's own `encode` does, with and without special tokens added."""
    if not hasattr(getattr(tok, "backend_tokenizer", None), "encode_batch_fast"):
        return False
    probe = _PROBE + " ".join(str(t) for t in getattr(tok, "all_special_tokens", []))
    try:
        return all(_encode(tok, probe, add, True) == _encode(tok, probe, add, False) for add in (True, False))
    except Exception as exc:
        log.debug("no fast encode for this tokenizer: %s", exc)
        return False


class Encoders:
    """Copies of one tokenizer, lent one per thread at a time; made as concurrency asks for them,
    each from the loaded tokenizer, which is never lent (so a copy is never made from one in use)."""

    def __init__(self, tokenizer: Any, limit: int = MAX_ENCODERS) -> None:
        self._template = tokenizer
        self.fast = fast_encode_matches(tokenizer)  # checked once, on the template: copies encode alike
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free.put(copy.deepcopy(tokenizer))
        self._made = 1
        self._limit = max(1, limit)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self, wait_s: float | None = None) -> Iterator[Any]:
        """A copy of the tokenizer for this thread alone; queue.Empty when every copy stays busy
        for `wait_s` (None: wait as long as it takes)."""
        tok = self._take(wait_s)
        try:
            yield tok
        finally:
            self._free.put(tok)

    def _take(self, wait_s: float | None) -> Any:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = self._made < self._limit
            self._made += int(make)
        if not make:
            return self._free.get(timeout=wait_s)
        try:
            return copy.deepcopy(self._template)
        except BaseException:
            with self._lock:
                self._made -= 1
            raise

    @property
    def made(self) -> int:
        return self._made


def _load(path: str) -> Encoders:
    from transformers import AutoTokenizer  # heavy import, done once in a worker thread

    return Encoders(AutoTokenizer.from_pretrained(path))


def given_ids(route: Route, body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids: counted without a tokenizer."""
    prompt = body.get("prompt")
    if route == "completions" and token_ids(prompt):
        return prompt
    return None


class PromptTokens:
    def __init__(self, http: aiohttp.ClientSession, headers: dict[str, str], tokenizer_path: str | None) -> None:
        self.http = http
        self.headers = headers
        self.tokenizer_path = tokenizer_path
        self._loading: dict[str, asyncio.Task] = {}
        self._bytes_per_token = _BYTES_PER_TOKEN_PRIOR
        self._counted = 0

    def estimate(self, body_size: int) -> int:
        """A prompt's token count when nothing could count it, from its request body's size."""
        return int(body_size / self._bytes_per_token)

    def learn(self, body_size: int, tokens: int) -> None:
        """A prompt of `tokens` tokens came in a body of `body_size` bytes (the first one replaces the prior)."""
        if tokens <= 0 or body_size <= 0:
            return
        ratio = body_size / tokens
        self._bytes_per_token = ratio if not self._counted else self._bytes_per_token + _ALPHA * (
            ratio - self._bytes_per_token)
        self._counted += 1

    def _path_for(self, model: str | None) -> str | None:
        if self.tokenizer_path:
            return self.tokenizer_path
        if model and os.path.isdir(model):
            return model
        return None

    def prepare(self, model: str | None) -> None:
        """Start loading the tokenizer for `model` in the background (idempotent)."""
        path = self._path_for(model)
        if path and path not in self._loading:
            task = asyncio.create_task(asyncio.to_thread(_load, path), name=f"tokenizer:{path}")
            task.add_done_callback(functools.partial(self._loaded, path))
            self._loading[path] = task

    @staticmethod
    def _loaded(path: str, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("no local tokenizer from %s (workers' /tokenize counts instead): %s", path, task.exception())
        else:
            log.info("local tokenizer loaded from %s", path)

    def _local(self, model: str | None) -> Encoders | None:
        path = self._path_for(model)
        task = self._loading.get(path) if path else None
        if task is None or not task.done() or task.cancelled():
            self.prepare(model)
            return None
        if task.exception() is not None:
            return None
        return task.result()

    async def ids(self, route: Route, body: dict[str, Any], worker_url: str, body_size: int = 0) -> list[int] | None:
        """The prompt's token ids, or None when neither the local tokenizer nor the worker can say.
        A tokenized prompt whose request body had `body_size` bytes teaches `estimate` (token-id prompts,
        which need no tokenizer, do not: their bytes per token say nothing of a text prompt's)."""
        if (given := given_ids(route, body)) is not None:
            return given
        ids = await self._tokenize(route, body, worker_url)
        if ids is not None:
            self.learn(body_size, len(ids))
        return ids

    async def _tokenize(self, route: Route, body: dict[str, Any], worker_url: str) -> list[int] | None:
        encoders = None if _brings_template(route, body) else self._local(body.get("model"))
        if encoders is not None:
            try:
                # off the event loop: a 2k-token prompt takes milliseconds that other streams' relays need
                return await asyncio.to_thread(self._encode_borrowed, encoders, route, body)
            except queue.Empty:
                log.debug("every local tokenizer busy for %.2f s, asking the worker", BORROW_WAIT_S)
            except Exception as exc:  # a template may reject fields; the worker's /tokenize then decides
                log.debug("local tokenization failed, asking the worker: %s", exc)
        return await self._remote(route, body, worker_url)

    def _encode_borrowed(self, encoders: Encoders, route: Route, body: dict[str, Any]) -> list[int]:
        with encoders.borrow(BORROW_WAIT_S) as tok:
            return self._encode_locally(tok, encoders.fast, route, body)

    @staticmethod
    def _encode_locally(tok: Any, fast: bool, route: Route, body: dict[str, Any]) -> list[int]:
        if route == "completions":
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]  # a batch of one prompt is that prompt (encode would nest its ids)
            return _encode(tok, prompt, body.get("add_special_tokens", True), fast)
        kwargs = dict(body.get("chat_template_kwargs") or {})
        text = tok.apply_chat_template(
            body["messages"],
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tokenize=False,
            **kwargs,
        )
        return _encode(tok, text, body.get("add_special_tokens", False), fast)

    async def _remote(self, route: Route, body: dict[str, Any], worker_url: str) -> list[int] | None:
        req: dict[str, Any] = {"model": body.get("model")}
        if route == "completions":
            req["prompt"] = body["prompt"]
        else:
            req["messages"] = body["messages"]
            req.update({k: body[k] for k in _CHAT_RENDER_FIELDS if k in body})
        try:
            async with self.http.post(
                worker_url + "/tokenize", data=msgspec.json.encode(req), headers=self.headers, timeout=_TOKENIZE_TIMEOUT
            ) as resp:
                if resp.status != 200:
                    return None
                tokens = msgspec.json.decode(await resp.read()).get("tokens")
            return tokens if isinstance(tokens, list) else None
        except SIDE_REQUEST_ERRORS as exc:
            log.debug("worker /tokenize failed: %s", describe(exc))
            return None

    async def stop(self) -> None:
        for task in self._loading.values():
            task.cancel()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
