"""`pdserve bench router` and its stub upstream: real processes, real HTTP, no engine.

The stub must look like vLLM to the router (streams, unary answers, prefill legs, /tokenize),
and the bench must count a request that lost tokens or failed as an error, not a sample.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import aiohttp
import httpx
import pytest

from pdserve.bench import cpu_stalls, processes
from pdserve.bench.router import RouterBenchConfig, _one, config_from_args, main


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    with processes.router_stub(3) as url:
        yield url


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_stub_streams_completions_and_chat_like_vllm(stub: str) -> None:
    body = {"model": "stub", "prompt": "hello there", "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{stub}/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    events = _events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == " t0 t1 t2"
    assert events[-1]["usage"]["completion_tokens"] == 3 and r.text.endswith("data: [DONE]\n\n")
    chat = httpx.post(f"{stub}/v1/chat/completions", json={"model": "stub", "stream": True,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    deltas = [e["choices"][0]["delta"] for e in _events(chat.text)]
    assert deltas[0]["role"] == "assistant" and "".join(d["content"] for d in deltas) == " t0 t1 t2"


def test_stub_answers_a_prefill_leg_and_tokenize(stub: str) -> None:
    leg = httpx.post(f"{stub}/v1/completions", json={"model": "stub", "prompt": [5, 6, 7], "max_tokens": 1,
                                                    "kv_transfer_params": {"do_remote_decode": True}}).json()
    assert leg["prompt_token_ids"] == [5, 6, 7] and leg["choices"][0]["text"] == " t0"
    assert isinstance(leg["kv_transfer_params"], dict)
    assert httpx.post(f"{stub}/tokenize", json={"prompt": "x" * 40}).json()["count"] == 10
    assert httpx.post(f"{stub}/v1/completions", content=b"{not json").status_code == 400
    assert httpx.get(f"{stub}/nowhere").status_code == 404


def test_a_request_that_lost_tokens_is_not_a_sample(stub: str) -> None:
    async def go(tokens: int) -> float | None:
        async with aiohttp.ClientSession() as session:
            body = json.dumps({"model": "stub", "prompt": "p", "stream": True}).encode()
            return await _one(session, f"{stub}/v1/completions", body, tokens, b'"text":" t')

    assert asyncio.run(go(3)) is not None
    assert asyncio.run(go(4)) is None  # the stub sends 3


def test_the_bench_measures_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "rows.json"
    code = main(["--concurrency", "1", "4", "--requests", "40", "--warmup", "5", "--route", "chat",
                 "--stall-probe-s", "0.3", "--result", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [c["cpu"] for c in result["cpu_stalls"]] == sorted(os.sched_getaffinity(0))
    rows = result["rows"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["errors"] == 0
        for key in ("direct_ttft_p50_ms", "router_ttft_p99_ms", "direct_rps", "router_rps"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        # a difference of two medians: on a busy machine the router's side may come out no slower
        assert math.isfinite(r["new_connection_added_p50_ms"]), r
        assert r["router_cpu_ms_per_request"] > 0  # the router's process did the work
    printed = capsys.readouterr().out
    assert "router CPU ms/req" in printed and "of routed requests meet such a stall" in printed


def test_the_stall_probe_sees_a_core_taken_away() -> None:
    """A second busy process on one core takes it away from the probe for whole time slices."""
    cpu = min(os.sched_getaffinity(0))
    rival = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        cores = {c.cpu: c for c in cpu_stalls.probe(1.0)}
    finally:
        rival.kill()
        rival.wait()
    taken = cores[cpu]
    assert taken.per_second > 10 and taken.lost_fraction > 0.2, cpu_stalls.describe([taken])
    assert cpu_stalls.share_met([taken], 0.0) > 0
    assert cpu_stalls.share_met([], 1.0) == 0.0


def test_router_flags_pass_through_and_bad_ones_fail_clearly(capsys: pytest.CaptureFixture) -> None:
    assert config_from_args(["--", "--max-queue", "5"]).router_args == ("--max-queue", "5")
    assert main(["--requests", "4", "--warmup", "0", "--concurrency", "1", "--stall-probe-s", "0", "--",
                 "--no-such-flag"]) == 1
    assert "router" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_args(["--concurrency", "0"])
    with pytest.raises(ValueError):
        RouterBenchConfig(rounds=0)
    with pytest.raises(ValueError):
        RouterBenchConfig(stall_probe_s=-1)
