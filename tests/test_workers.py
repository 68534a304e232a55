"""`pdserve prefill|decode`: argument handling, the connector check, and one real worker's life.

The engine tests run one real decode worker (vLLM on the tiny DeepSeek-V3) against a
real redis-server: it registers with its load, advertises a running request, and on
SIGTERM deregisters before it finishes the in-flight request, then exits 0 leaving no
process behind. --no-connector keeps these tests independent of the KV store; the
connector path is exercised by the P/D stack tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from pdserve.worker.children import group_alive
from pdserve.worker.config import WorkerConfig, WorkerError, config_from_args
from pdserve.worker.registration import WorkerRecord, worker_key
from procs import ENGINE_ARGS, ENGINE_ENV, ENGINE_START_TIMEOUT_S, Proc, free_port, pdserve_argv, start_process

# ---------------------------------------------------------------- argument handling (no engine)


def test_unknown_and_trailing_args_pass_to_vllm_unchanged() -> None:
    cfg = config_from_args(
        "decode",
        ["--model", "m", "--kvstore-url", "tcp://h:1", "--max-num-seqs", "4", "--", "--served-model-name", "ds", "--port-x"],
    )
    argv = cfg.vllm_argv()
    assert argv[argv.index("--model") + 1] == "m"
    assert argv[-5:] == ["--max-num-seqs", "4", "--served-model-name", "ds", "--port-x"]
    assert cfg.served_model_name == "ds"


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_both")])
def test_kv_transfer_config_per_role(role: str, kv_role: str) -> None:
    cfg = config_from_args(role, ["--model", "m", "--kvstore-url", "tcp://127.0.0.1:5556"])
    argv = cfg.vllm_argv()
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "PDServeConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"kvstore_url": "tcp://127.0.0.1:5556"},
    }


def test_no_connector_leaves_kv_config_to_the_user() -> None:
    cfg = config_from_args("prefill", ["--model", "m", "--no-connector", "--kv-transfer-config", "{}"])
    assert cfg.vllm_argv().count("--kv-transfer-config") == 1
    assert cfg.served_model_name == "m"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "m"], "--kvstore-url is required"),
        (["--model", "m", "--kvstore-url", "tcp://h:1", "--kv-transfer-config", "{}"], "builds --kv-transfer-config"),
        (["--model", "m", "--no-connector", "--", "--port", "1"], "pass --port to pdserve"),
        (["--model", "m", "--no-connector", "--heartbeat-ttl", "0"], "must be positive"),
        (["--model", "m", "--no-connector", "--stall-restart-timeout", "-1"], "must not be negative"),
        (["--model", "m", "--no-connector", "--stall-restart-timeout", "nan"], "must not be negative"),
        (["--model", "m", "--no-connector", "--unhealthy-timeout", "0"], "--unhealthy-timeout must be positive"),
    ],
)
def test_bad_combinations_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(WorkerError, match=re.escape(message)):
        config_from_args("decode", argv)


def test_advertised_url_defaults_to_a_reachable_address() -> None:
    cfg: WorkerConfig = config_from_args("decode", ["--model", "m", "--no-connector", "--host", "0.0.0.0", "--port", "9"])
    assert cfg.url == "http://127.0.0.1:9"


@pytest.mark.slow  # the worker's connector check imports vLLM in a child
def test_missing_connector_fails_at_start_with_a_clear_message(tiny_one_group: Path) -> None:
    """With vLLM's plugins filtered out, PDServeConnector is unknown: exit 2 before any engine starts."""
    result = subprocess.run(
        pdserve_argv("prefill", "--model", str(tiny_one_group), "--kvstore-url", "tcp://127.0.0.1:1"),
        env={**os.environ, **ENGINE_ENV, "VLLM_PLUGINS": "no-such-plugin"},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "PDServeConnector" in result.stderr and "--no-connector" in result.stderr
    assert "started vLLM" not in result.stderr


# ---------------------------------------------------------------- one real worker


def _record(client: redis.Redis, worker_id: str) -> WorkerRecord | None:
    raw = client.get(worker_key(worker_id))
    return None if raw is None else msgspec.json.decode(raw, type=WorkerRecord)


class Worker:
    def __init__(self, proc: Proc, worker_id: str, model: str, redis_client: redis.Redis) -> None:
        self.proc, self.id, self.model, self.redis = proc, worker_id, model, redis_client

    def vllm_pid(self) -> int:
        found = re.search(r"started vLLM \(pid (\d+)\)", self.proc.log_tail(10**6))
        assert found, self.proc.log_tail()
        return int(found.group(1))


@pytest.fixture(scope="module")
def worker(tiny_one_group: Path, redis_url: str):
    client = redis.Redis.from_url(redis_url)
    worker_id = f"decode-test-{free_port()}"
    port = free_port()
    proc = start_process(
        pdserve_argv(
            "decode", "--model", str(tiny_one_group), "--no-connector", "--redis-url", redis_url,
            "--port", str(port), "--worker-id", worker_id, "--heartbeat-ttl", "3",
            "--", "--load-format", "dummy", *ENGINE_ARGS,
        ),
        lambda _p: client.exists(worker_key(worker_id)) == 1,
        name="pdserve-decode", port=port, env=ENGINE_ENV, timeout=ENGINE_START_TIMEOUT_S, poll_s=0.25,
    )
    try:
        yield Worker(proc, worker_id, str(tiny_one_group), client)
    finally:
        proc.stop()
        client.close()


def _long_completion(worker: Worker, max_tokens: int, first_token: threading.Event, out: dict) -> None:
    """Stream one ignore_eos completion; record its usage and when it ended."""
    body = {
        "model": worker.model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{worker.proc.url}/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                first_token.set()
                out["finish_reason"] = chunk["choices"][0].get("finish_reason") or out.get("finish_reason")
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
    out["ended_at"] = time.monotonic()


@pytest.mark.engine
def test_registers_with_role_url_model_and_ttl(worker: Worker) -> None:
    rec = _record(worker.redis, worker.id)
    assert rec is not None
    assert (rec.role, rec.url, rec.model, rec.kvstore_url) == ("decode", worker.proc.url, worker.model, None)
    assert set(rec.load) == {"running", "waiting"}
    assert 0 < worker.redis.pttl(worker_key(worker.id)) <= 3000


@pytest.mark.engine
def test_sigterm_deregisters_then_finishes_in_flight_request_and_leaves_nothing(worker: Worker) -> None:
    """One long request: its load shows in Redis; SIGTERM removes the key while it still
    streams, the request still completes in full, and the worker exits 0 with vLLM gone."""
    # Long enough to outlast, on a loaded 2-core machine, the wait for the load heartbeat and the
    # deregistration: with 400 tokens a full-suite run once saw the stream end 0.24 s before the key went.
    max_tokens = 1500
    first_token, out = threading.Event(), {}
    client = threading.Thread(target=_long_completion, args=(worker, max_tokens, first_token, out), daemon=True)
    client.start()
    assert first_token.wait(120), "no token streamed"

    while (rec := _record(worker.redis, worker.id)) is not None and rec.load.get("running") != 1:
        assert client.is_alive(), f"request finished before its load was advertised: {out}"
        time.sleep(0.2)
    assert rec is not None and rec.load["running"] == 1

    vllm_pid = worker.vllm_pid()
    os.kill(worker.proc.pid, signal.SIGTERM)
    while worker.redis.exists(worker_key(worker.id)):
        time.sleep(0.05)
    deregistered_at = time.monotonic()

    client.join(300)
    assert not client.is_alive()
    assert out["usage"]["completion_tokens"] == max_tokens and out["finish_reason"] == "length", out
    assert deregistered_at < out["ended_at"], "the worker stayed registered until its last request ended"
    assert worker.proc.popen.wait(120) == 0, worker.proc.log_tail()
    assert not group_alive(vllm_pid), "vLLM's process group outlived the worker"
