"""router/flow/first_token.py alone (fast tier): which requests may stream the prefill's token, what the
prefill must have answered, the decode leg's body and the first event's shape."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pdserve.router.flow import first_token
from pdserve.router.flow.call import Call

BASE = {"model": "m", "prompt": "hello there", "max_tokens": 8, "stream": True, "temperature": 0.7}


def _call(body: dict[str, Any], route: str = "completions", ids: list[int] | None = (5, 6, 7)) -> Call:  # type: ignore[assignment]
    call = Call(route, msgspec.json.encode(body), body, "req1")  # type: ignore[arg-type]
    call.prompt_ids = list(ids) if ids is not None else None
    return call


@pytest.mark.parametrize("extra", [{}, {"n": 1}, {"stop": []}, {"logprobs": None}, {"presence_penalty": 0},
                                   {"repetition_penalty": 1.0}, {"top_k": 5, "ignore_eos": True},
                                   {"stop_token_ids": [3]}, {"max_tokens": 2}, {"cache_salt": "s"},
                                   {"stream_options": {"include_usage": True}},
                                   {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}])
def test_plain_streamed_completions_are_eligible(extra: dict[str, Any]) -> None:
    assert first_token.eligible(_call({**BASE, **extra}))


@pytest.mark.parametrize("extra", [{"stream": False}, {"n": 2}, {"logprobs": 1}, {"echo": True}, {"stop": ["x"]},
                                   {"presence_penalty": 0.5}, {"seed": 3}, {"min_tokens": 2}, {"max_tokens": 1},
                                   {"max_tokens": True}, {"n": True}, {"echo": 0}, {"logit_bias": {"5": 1}},
                                   {"stream_options": {"include_usage": 1}}, {"stream_options": {"other": True}},
                                   {"stream_options": "yes"}, {"response_format": {"type": "json"}},
                                   {"structured_outputs": {"regex": "a+"}}, {"return_token_ids": True},
                                   {"kv_transfer_params": {"x": 1}}, {"some_new_field": 1}])
def test_anything_a_handed_token_could_change_keeps_the_default_flow(extra: dict[str, Any]) -> None:
    assert not first_token.eligible(_call({**BASE, **extra}))


def test_chat_and_anything_but_one_prompt_keep_the_default_flow() -> None:
    assert not first_token.eligible(_call({**BASE, "messages": []}, route="chat"))
    for prompt in (["a", "b"], [], [[1, 2], [3]], 7, None, [1, "a"]):
        assert not first_token.eligible(_call({**BASE, "prompt": prompt}, ids=None)), prompt
    # A prompt the router has not counted yet (an early prefill leg: paths.py) takes it: the decode leg gets the
    # prompt's ids from the prefill's answer.
    for prompt in ("hello there", ["hello there"], [1, 2, 3]):
        assert first_token.eligible(_call({**BASE, "prompt": prompt}, ids=None)), prompt


def _prefill(finish: str | None = "length", ids: Any = (42,), text: Any = " hi") -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish, "prompt_token_ids": [5, 6, 7],
              "token_ids": list(ids) if isinstance(ids, tuple) else ids}
    return {"choices": [choice], "kv_transfer_params": {"pdserve": 1}}


def test_the_handed_token_is_the_prefills_when_the_answer_goes_on() -> None:
    assert first_token.handed_token(_prefill()) == (42, " hi")
    assert first_token.handed_token(_prefill(finish="stop")) is None  # the answer ends at that token
    assert first_token.handed_token(_prefill(ids=None)) is None  # an engine that does not report it
    assert first_token.handed_token(_prefill(ids=(1, 2))) is None
    assert first_token.handed_token(_prefill(ids=[True])) is None
    assert first_token.handed_token(_prefill(text=None)) is None
    assert first_token.handed_token(_prefill(text="")) is None  # a token inside a UTF-8 character
    assert first_token.handed_token(_prefill(text="a\ufffd")) is None
    assert first_token.handed_token(None) is None  # the prefill failed
    assert first_token.handed_token({"choices": []}) is None


def test_decode_body_is_the_prompt_plus_the_token_one_fewer_to_go() -> None:
    call = _call(BASE)
    call.kv_params = {"pdserve": 1, "num_tokens": 3}
    body = msgspec.json.decode(first_token.decode_body(call, _prefill(), 42))
    assert body["prompt"] == [5, 6, 7, 42] and body["max_tokens"] == 7
    assert body["kv_transfer_params"] == {"pdserve": 1, "num_tokens": 3}
    assert body["stream"] is True and body["temperature"] == 0.7
    unbounded = msgspec.json.decode(first_token.decode_body(_call({**BASE, "max_tokens": None}), _prefill(), 42))
    assert unbounded["max_tokens"] is None  # the engine's own limit: one fewer left after a longer prompt


def test_a_leg_fits_when_prompt_and_max_tokens_fit_the_known_context() -> None:
    call = _call(BASE)  # 3 prompt tokens (the prefill's ids), max_tokens 8
    assert first_token.fits(call, _prefill(), 11) and not first_token.fits(call, _prefill(), 10)
    assert not first_token.fits(call, _prefill(), None)  # a worker has not said
    unbounded = _call({**BASE, "max_tokens": None})  # vLLM fills the context: room for one more token needed
    assert first_token.fits(unbounded, _prefill(), 5) and not first_token.fits(unbounded, _prefill(), 4)


def test_the_first_event_looks_like_vllms_chunks() -> None:
    chunk = first_token.first_chunk(_call(BASE), " hi")
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    event = msgspec.json.decode(chunk[len(b"data: "):])
    assert event["id"] == "cmpl-req1" and event["object"] == "text_completion" and event["model"] == "m"
    assert event["choices"] == [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": None,
                                 "stop_reason": None}]


def _usage_event(prompt: int, completion: int) -> bytes:
    return b"data: " + msgspec.json.encode({"id": "c", "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}) + b"\n\n"


def test_usage_counts_the_handed_token_as_generated_wherever_the_chunks_cut() -> None:
    token = b'data: {"id":"c","choices":[{"index":0,"text":"x"}],"usage":null}\n\n'
    stream = token + _usage_event(601, 11) + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):  # every way one upstream read could end
        fix = first_token.UsageFix()
        out = fix.feed(stream[:cut]) + fix.feed(stream[cut:]) + fix.rest()
        events = [e for e in out.split(b"\n\n") if e]
        assert events[0] + b"\n\n" == token and events[-1] == b"data: [DONE]"
        assert msgspec.json.decode(events[1][len(b"data: "):])["usage"] == {
            "prompt_tokens": 600, "completion_tokens": 12, "total_tokens": 612}
    fix = first_token.UsageFix()
    assert fix.feed(b"data: not json with \"usage\"\n\n") == b"data: not json with \"usage\"\n\n"
