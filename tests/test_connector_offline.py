"""PDServeConnector through vLLM's offline LLM API, and its start-up check on a real engine.

Each test runs one engine in a child process; the refusing engine's start begins with the
module (see `refusal`), so the two engines share the machine's two cores instead of taking
turns.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from procs import ENGINE_ENV, BackgroundRun, free_port, pdserve_argv, start_process

pytestmark = pytest.mark.engine  # both tests start a vLLM engine

OFFLINE_SCRIPT = textwrap.dedent(
    """
    import inspect, json, random, sys, time, urllib.request
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    def store_objects(stats_url):
        with urllib.request.urlopen(stats_url) as r:
            return json.load(r)["metrics"].get("tier_objects{tier=l1}", 0)

    if __name__ == "__main__":
        model, url, stats_url = sys.argv[1], sys.argv[2], sys.argv[3]
        llm = LLM(
            model=model, load_format="dummy", max_model_len=2048, max_num_seqs=4, enforce_eager=True,
            kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,  # the store is the only reuse path
            kv_transfer_config=KVTransferConfig(
                kv_connector="PDServeConnector", kv_role="kv_both",
                kv_connector_extra_config={"kvstore_url": url, "kvstore_shm": False},
            ),
        )
        rng = random.Random(0)
        prompt = {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(600)]}
        params = SamplingParams(max_tokens=8, temperature=0)
        first = llm.generate(prompt, params)[0]
        # The connector uploads a step's chunks on a background thread while the engine goes on
        # decoding, so the first prompt can return before its chunks have landed (on a loaded
        # 2-core host it did, and the second prompt then rightly recomputed). Reuse needs them there.
        deadline = time.monotonic() + 300  # a hang guard, not a measurement
        while (stored := store_objects(stats_url)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        second = llm.generate(prompt, params)[0]
        result = {
            "first": list(first.outputs[0].token_ids), "second": list(second.outputs[0].token_ids),
            "first_cached": first.num_cached_tokens, "second_cached": second.num_cached_tokens,
            "stored_before_second": stored,
        }
        if "reset_connector" in inspect.signature(llm.reset_prefix_cache).parameters:  # not in vLLM 0.27
            # what a weight update calls: the connector drops this model's KV from the store
            result["reset"] = llm.reset_prefix_cache(reset_connector=True)
            result["stored_after_reset"] = store_objects(stats_url)
            third = llm.generate(prompt, params)[0]
            result |= {"third": list(third.outputs[0].token_ids), "third_cached": third.num_cached_tokens}
        print("RESULT " + json.dumps(result))
    """
)


def _env() -> dict[str, str]:
    import os

    return {**os.environ, **ENGINE_ENV}


def test_offline_llm_reuses_prefix_from_the_store(tiny_one_group: Path, tmp_path: Path) -> None:
    """Over TCP (kvstore_shm false): the path a worker takes to a store on another host. Then vLLM's reset of
    external caches (what a weight update calls) drops the model's KV from the store."""
    port, http_port = free_port(), free_port()
    store = start_process(
        [*pdserve_argv("kvstore"), "--port", str(port), "--http-port", str(http_port), "--l1-size-gb", "0.25"],
        f"http://127.0.0.1:{http_port}/health",
        name="kvstore",
    )
    try:
        script = tmp_path / "offline.py"
        script.write_text(OFFLINE_SCRIPT)
        run = subprocess.run(
            [sys.executable, str(script), str(tiny_one_group), f"tcp://127.0.0.1:{port}",
             f"http://127.0.0.1:{http_port}/stats"],
            capture_output=True, text=True, timeout=900, env=_env(),
        )
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        assert run.returncode == 0 and lines, run.stderr[-3000:]
        result = json.loads(lines[0].removeprefix("RESULT "))
        assert result["first_cached"] == 0
        connector_log = "\n".join(ln for ln in run.stderr.splitlines() if "kvstore" in ln or "pdserve" in ln)
        assert result["stored_before_second"] >= 2, connector_log  # the first prompt's two whole chunks
        # both came from the store (else the log names why: e.g. a store marked down)
        assert result["second_cached"] >= 512, connector_log
        assert result["second"] == result["first"]
        if "reset" in result:  # vLLM's reset of external caches: nothing left to load, the same answer computed
            assert result["reset"] is True and result["stored_after_reset"] == 0
            assert result["third_cached"] == 0 and result["third"] == result["first"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/stats") as r:
            moved = json.load(r)["metrics"]
        assert moved.get("bytes_in_total{path=tcp}", 0) > 0 and moved.get("bytes_out_total{path=tcp}", 0) > 0
        assert moved.get("bytes_in_total{path=shm}", 0) == 0 and moved.get("bytes_out_total{path=shm}", 0) == 0
    finally:
        store.stop()


REFUSAL_TEST = "test_engine_refuses_to_start_without_its_store"


@pytest.fixture(scope="module", autouse=True)
def refusal(request: pytest.FixtureRequest, tiny_one_group: Path) -> Iterator[tuple[str, BackgroundRun] | None]:
    """(dead store URL, the engine started against it) when the refusal test is selected: begun with the
    module, so it runs beside the offline test's engine."""
    if not any(getattr(item, "originalname", "") == REFUSAL_TEST for item in request.session.items):
        yield None
        return
    dead = f"tcp://127.0.0.1:{free_port()}"
    config = {"kv_connector": "PDServeConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"kvstore_url": dead, "timeout_s": 2}}
    run = BackgroundRun(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_one_group),
         "--load-format", "dummy", "--port", str(free_port()), "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager", "--kv-transfer-config", json.dumps(config)],
        env=_env(), timeout=600,
    )
    try:
        yield dead, run
    finally:
        run.stop()


def test_engine_refuses_to_start_without_its_store(refusal: tuple[str, BackgroundRun] | None) -> None:
    assert refusal is not None
    dead, started = refusal
    run = started.result()
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert f"cannot reach the KV store at {dead}" in output
    assert "pdserve kvstore" in output  # the message names the fix
