"""The prefill leg's answer (router/flow/prefill_leg.py, fast tier): the prompt's token ids are kept as
the bytes the prefill wrote and spliced into the decode leg's body; every other answer is decoded in full.
Either way the decode leg's body and the ids a path reads are what a full decode gives."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from pdserve.router.flow import first_token
from pdserve.router.flow.call import Call
from pdserve.router.flow.prefill_leg import decode_answer, decode_payload, prompt_ids

IDS = [random.Random(7).randrange(200_000) for _ in range(5000)]
PARAMS = {"kvstore_url": "tcp://s:5556", "chunks": ["ab", "cd"], "prompt_digest": "ff"}


def _completion(ids: list[int]) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "kv_transfer_params": PARAMS,
            "choices": [{"index": 0, "text": " t", "token_ids": [42], "prompt_token_ids": ids,
                         "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}}


def _chat(ids: list[int]) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "kv_transfer_params": PARAMS,
            "prompt_token_ids": ids,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": " t"}, "token_ids": [42],
                         "finish_reason": "length"}]}


def _call(answer: dict[str, Any]) -> Call:
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}
    call = Call("completions", msgspec.json.encode(body), body, "req1")
    call.kv_params = answer["kv_transfer_params"]
    return call


@pytest.mark.parametrize("shape", [_completion, _chat])
def test_ids_pass_through_as_their_bytes(shape: Any) -> None:
    answer = shape(IDS)
    content = msgspec.json.encode(answer)
    data = decode_answer(content)
    holder = data if shape is _chat else data["choices"][0]
    assert isinstance(holder["prompt_token_ids"], msgspec.Raw)  # not decoded into ints
    assert bytes(holder["prompt_token_ids"]) == msgspec.json.encode(IDS)
    assert prompt_ids(data) == IDS  # a path that needs the list still gets it
    # the rest of the answer is decoded as before
    assert {k: v for k, v in data.items() if k != "choices"} == {
        k: v for k, v in msgspec.json.decode(content).items() if k != "choices" and k != "prompt_token_ids"
    } | ({"prompt_token_ids": holder["prompt_token_ids"]} if shape is _chat else {})
    # the decode leg's body equals the one a full decode builds
    spliced = msgspec.json.decode(decode_payload(_call(answer), data))
    full = msgspec.json.decode(decode_payload(_call(answer), msgspec.json.decode(content)))
    assert spliced == full and spliced["kv_transfer_params"]["prompt_token_ids"] == IDS


def test_the_handed_token_path_reads_the_same_answer() -> None:
    data = decode_answer(msgspec.json.encode(_completion(IDS)))
    assert first_token.handed_token(data) == (42, " t")
    call = _call(_completion(IDS))
    assert msgspec.json.decode(first_token.decode_body(call, data, 42))["prompt"] == [*IDS, 42]


@pytest.mark.parametrize("content", [
    b'{"choices":[{"text":"a","prompt_token_ids": [1, 2, 3]}]}',  # not compact: decoded in full
    b'{"prompt_token_ids":[1,2],"choices":[{"prompt_token_ids":[1,2]}]}',  # twice
    b'{"choices":[{"prompt_token_ids":[1.5,2]}]}',  # not integers
    b'{"choices":[{"prompt_token_ids":[]}]}',  # empty
    b'{"choices":[{"text":"\\"prompt_token_ids\\":[9,9]","prompt_token_ids":[1,2]}]}',  # the key inside a string
    b'{"choices":[{"logprobs":{"prompt_token_ids":[3,4]}}]}',  # somewhere else: nothing to splice into
])
def test_other_answers_are_decoded_in_full(content: bytes) -> None:
    data = decode_answer(content)
    assert data == msgspec.json.decode(content) or isinstance(data["choices"][0]["prompt_token_ids"], msgspec.Raw)
    holder = data["choices"][0]
    ids = holder.get("prompt_token_ids")
    if isinstance(ids, msgspec.Raw):  # only the one compact array in its place is kept as bytes
        assert content.count(b'"prompt_token_ids":[') == 1 and bytes(ids) == b"[1,2]"
    expected = msgspec.json.decode(content)["choices"][0].get("prompt_token_ids") or None
    assert prompt_ids(data) == expected


@pytest.mark.parametrize("bad", [b"[,]", b"[1,,2]", b"[,1]", b"[1,]"])
def test_malformed_ids_are_never_spliced(bad: bytes) -> None:
    """A broken prefill worker's ids are not copied into the decode leg as they came: the full decode
    refuses them (the leg fails as any unreadable answer does)."""
    with pytest.raises(msgspec.DecodeError):
        decode_answer(b'{"choices":[{"prompt_token_ids":' + bad + b'}]}')
