"""`pdserve up`: the whole stack from one command, used through the OpenAI SDK, gone after Ctrl-C.

The stack (KV store, one prefill and one decode worker on the tiny DeepSeek-V3, the
router) is the session fixture in pdstack_fixtures.py, shared with the bench test.
The last test here interrupts it, so it must stay the last user of the fixture.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import openai
import pytest

from pdserve.deploy.local import build_components, parse_up_args

if TYPE_CHECKING:
    from pdstack_fixtures import UpStack

# Imported as a plugin (not by name) so its session stack is shared and its asserts are rewritten.
pytest_plugins = ["pdstack_fixtures"]


def test_default_stack_is_store_workers_router_with_connector() -> None:
    cfg, _ = parse_up_args(["--model", "m", "--num-prefill", "2", "--port", "9000", "--kvstore-port", "9100"])
    comps = {c.name: c for c in build_components(cfg)}
    assert list(comps) == ["kvstore", "prefill-0", "prefill-1", "decode-0", "router"]
    assert "--no-connector" not in comps["decode-0"].argv
    assert comps["prefill-1"].argv[comps["prefill-1"].argv.index("--kvstore-url") + 1] == "tcp://127.0.0.1:9100"
    router = comps["router"].argv
    assert router[router.index("--prefill") + 1 : router.index("--decode")] == [
        "http://127.0.0.1:8100", "http://127.0.0.1:8101"]


def test_redis_mode_and_api_key_reach_workers_and_router() -> None:
    cfg, _ = parse_up_args(["--model", "m", "--no-connector", "--redis-url", "redis://127.0.0.1:1/0", "--api-key", "k"])
    comps = {c.name: c for c in build_components(cfg)}
    assert "kvstore" not in comps
    decode = comps["decode-0"].argv
    assert decode[decode.index("--api-key") + 1] == "k" and "--redis-url" in decode
    router = comps["router"].argv
    assert "--decode" not in router and router[router.index("--api-key") + 1] == "k"


def test_supervision_windows_reach_every_worker_and_bad_ones_are_refused() -> None:
    cfg, _ = parse_up_args(["--model", "m", "--num-decode", "2", "--unhealthy-timeout", "10",
                            "--stall-restart-timeout", "15"])
    workers = [c for c in build_components(cfg) if c.name.startswith(("prefill-", "decode-"))]
    assert len(workers) == 3
    for comp in workers:
        ours = comp.argv[:comp.argv.index("--")]  # the worker's own flags, not vLLM's
        assert ours[ours.index("--unhealthy-timeout") + 1] == "10.0"
        assert ours[ours.index("--stall-restart-timeout") + 1] == "15.0"
    cfg, _ = parse_up_args(["--model", "m"])  # unset: each worker keeps its own default
    assert not any("--unhealthy-timeout" in c.argv or "--stall-restart-timeout" in c.argv for c in build_components(cfg))
    for bad in (["--unhealthy-timeout", "0"], ["--unhealthy-timeout", "nan"], ["--stall-restart-timeout", "-1"]):
        with pytest.raises(SystemExit):
            parse_up_args(["--model", "m", *bad])


def test_gpus_place_one_worker_each_in_turn_and_shared_ones_split_the_memory() -> None:
    def placed(*argv: str) -> dict[str, tuple[str | None, list[str]]]:
        cfg, _ = parse_up_args(["--model", "m", "--no-connector", *argv])
        return {c.name: (c.env.get("CUDA_VISIBLE_DEVICES"), c.argv[c.argv.index("--") + 1:])
                for c in build_components(cfg) if c.name != "router"}

    assert placed("--gpus", "0,1") == {"prefill-0": ("0", []), "decode-0": ("1", [])}
    share = ["--gpu-memory-utilization", "0.45"]
    assert placed("--gpus", "3", "--num-decode", "1") == {"prefill-0": ("3", share), "decode-0": ("3", share)}
    assert placed("--gpus", "0,1", "--num-decode", "3") == {  # GPU 0: prefill-0, decode-1; GPU 1: decode-0, -2
        "prefill-0": ("0", share), "decode-0": ("1", share), "decode-1": ("0", share), "decode-2": ("1", share)}
    # The user's own split wins; without --gpus nothing is placed.
    own = ["--gpu-memory-utilization", "0.3"]
    assert placed("--gpus", "0", "--", *own) == {"prefill-0": ("0", own), "decode-0": ("0", own)}
    assert placed() == {"prefill-0": (None, []), "decode-0": (None, [])}
    with pytest.raises(SystemExit):
        parse_up_args(["--model", "m", "--gpus", "0,gpu1"])


@pytest.mark.engine
def test_up_printed_url_curl_line_and_demo_reply(up_stack: UpStack) -> None:
    text = up_stack.text()
    assert f"ready: {up_stack.url}/v1" in text
    assert f"curl {up_stack.url}/v1/chat/completions" in text
    match = up_stack.wait_for_demo(1)
    assert int(match.group(1)) > 0


@pytest.mark.engine
def test_openai_sdk_chat_through_up_streamed_and_not(up_stack: UpStack) -> None:
    client = openai.OpenAI(base_url=f"{up_stack.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [up_stack.model]
    # Long enough (> the router's 256-token default) to take the prefill leg, then decode.
    messages = [{"role": "user", "content": "tell me about the river and the old stone bridge " * 40}]
    full = client.chat.completions.create(model=up_stack.model, messages=messages, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens > 256 and full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=up_stack.model, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content


@pytest.mark.engine
def test_ctrl_c_stops_every_child(up_stack: UpStack) -> None:
    """Runs last: SIGINT to `pdserve up` must leave no process of the stack alive."""
    children = up_stack.children()
    assert len(children) >= 4, "expected store, two workers with their engines, and the router"
    assert up_stack.interrupt() == 0, up_stack.stderr_tail()
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}")]
    assert alive == [], f"still running after Ctrl-C: {alive}"
    assert "stopped" in up_stack.text()
