"""The LMCache backend without an engine: worker flags and the vLLM command line they make, the
Redis record, `pdserve up`'s components, and pdserve's LMCache wire client against a real
`lmcache server` (on this CPU machine; skipped where lmcache is not installed)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Iterator

import httpx
import msgspec
import pytest

from pdserve.bench import serve as bench_serve
from pdserve.bench.serve import RequestResult, Run, comparison, print_summary, summarize
from pdserve.deploy import lmcache_server
from pdserve.deploy.local import StackConfig, build_components, parse_up_args
from pdserve.kvstore.client import lmcache_mp
from pdserve.kvstore.client.lmcache_mp import AsyncLMCacheClient, LMCacheError, LMCacheKey
from pdserve.worker import lmcache_backend
from pdserve.worker.config import WorkerError, config_from_args
from pdserve.worker.registration import WorkerRecord, decode_record
from procs import Proc, free_port, start_process

HAS_LMCACHE = importlib.util.find_spec("lmcache") is not None
NO_LMCACHE = "lmcache is not installed (`make setup` installs it; on a CUDA host pip install pdserve[lmcache])"
needs_lmcache = pytest.mark.skipif(not HAS_LMCACHE, reason=NO_LMCACHE)


def kv_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_both")])
def test_lmcache_backend_runs_lmcaches_connector_with_the_workers_role(role: str, kv_role: str) -> None:
    cfg = config_from_args(role, ["--model", "m", "--kv-backend", "lmcache", "--lmcache-url", "tcp://10.0.0.2:5556",
                                  "--", "--enforce-eager"])
    argv = cfg.vllm_argv(["--prefix-cache-retention-interval", "256"])
    assert kv_config(argv) == {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://10.0.0.2", "lmcache.mp.port": 5556,
                                      "lmcache.mp.mp_transfer_mode": "lmcache_driven"},
    }
    assert argv[-3:] == ["--prefix-cache-retention-interval", "256", "--enforce-eager"]  # the user's flags last
    assert cfg.kv_url == "tcp://10.0.0.2:5556"


def test_the_default_backend_is_still_pdserves_store() -> None:
    cfg = config_from_args("decode", ["--model", "m", "--kvstore-url", "tcp://127.0.0.1:5556"])
    assert cfg.kv_backend == "pdserve" and kv_config(cfg.vllm_argv())["kv_connector"] == "PDServeConnector"


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-backend", "lmcache"], "needs --lmcache-url"),
    (["--kv-backend", "lmcache", "--lmcache-url", "127.0.0.1:5556"], "tcp://HOST:PORT"),
    (["--kv-backend", "lmcache", "--lmcache-url", "tcp://h:99999"], "tcp://HOST:PORT"),
    (["--kv-backend", "lmcache", "--lmcache-url", "tcp://h:1", "--kvstore-url", "tcp://h:2"], "pass --lmcache-url"),
    (["--kvstore-url", "tcp://h:2", "--lmcache-url", "tcp://h:1"], "needs --kv-backend lmcache"),
    (["--kv-backend", "lmcache", "--lmcache-url", "tcp://h:1", "--", "--enable-lora"], "do not tell adapters apart"),
])
def test_bad_backend_combinations_are_refused_clearly(argv: list[str], message: str) -> None:
    with pytest.raises(WorkerError, match=message):
        config_from_args("prefill", ["--model", "m", *argv])


def test_an_unknown_backend_is_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args("prefill", ["--model", "m", "--kv-backend", "redis"])
    assert "invalid choice: 'redis'" in capsys.readouterr().err


def test_retention_interval_is_the_chunk_size_for_sliding_window_models(
        tiny_gemma3: Path, tiny_deepseek_v3: Path) -> None:
    """LMCache restores a sliding window only at a chunk boundary: a model with sliding windows
    gets --prefix-cache-retention-interval = the server's chunk size, one without none, and a
    user's value must divide it."""
    assert lmcache_backend.retention_args(str(tiny_gemma3), (), 256) == ["--prefix-cache-retention-interval", "256"]
    assert lmcache_backend.retention_args(str(tiny_deepseek_v3), (), 256) == []
    assert lmcache_backend.retention_args("org/not-a-local-folder", (), 256) == []
    assert lmcache_backend.retention_args(str(tiny_gemma3), ("--prefix-cache-retention-interval=128",), 256) == []
    with pytest.raises(ValueError, match="must divide the LMCache server's chunk size 256"):
        lmcache_backend.retention_args(str(tiny_gemma3), ("--prefix-cache-retention-interval", "100"), 256)


def test_cache_key_follows_lmcaches_kv_world_size(tiny_deepseek_v3: Path, tiny_gemma3: Path) -> None:
    """MLA KV is whole on every tensor-parallel rank (LMCache keys it by pipeline stages only)."""
    v3, gemma = str(tiny_deepseek_v3), str(tiny_gemma3)
    assert lmcache_backend.cache_key(v3, ("-tp", "4", "--pipeline-parallel-size", "2")) == LMCacheKey(v3, 2)
    assert lmcache_backend.cache_key(gemma, ("--tensor-parallel-size=4",)) == LMCacheKey(gemma, 4)
    assert lmcache_backend.cache_key(gemma, ()) == LMCacheKey(gemma, 1)


def test_the_redis_record_carries_the_backend() -> None:
    record = WorkerRecord(id="p1", role="prefill", url="http://h:8100", model="m", kvstore_url="tcp://h:5556",
                          kv_backend="lmcache", lmcache_key=LMCacheKey("/models/m", 2))
    assert decode_record(msgspec.json.encode(record)) == record
    old = decode_record(b'{"id":"p1","role":"prefill","url":"http://h:8100","model":"m"}')  # a record from before
    assert old is not None and old.kv_backend == "pdserve" and old.lmcache_key is None
    assert decode_record(b'{"id":"p1","role":"prefill","url":"u","model":"m","kv_backend":"nfs"}') is None


def test_up_starts_lmcache_server_in_place_of_the_store() -> None:
    cfg = StackConfig(model="m", served_model_name="m", kv_backend="lmcache", chunk_size=512,
                      kvstore_port=6001, kvstore_http_port=6002)
    comps = build_components(cfg)
    assert [c.name for c in comps] == ["lmcache", "prefill-0", "decode-0", "router"]
    server = comps[0].argv
    assert server[1:5] == ["-m", "lmcache.cli.main", "server", "--host"]
    for flag, value in (("--port", "6001"), ("--http-port", "6002"), ("--chunk-size", "512"), ("--http-host", "127.0.0.1")):
        assert server[server.index(flag) + 1] == value
    assert "--separate-object-groups" in server and comps[0].env["LMCACHE_TRACK_USAGE"] == "false"
    for worker in comps[1:3]:
        cut = worker.argv.index("--")
        assert worker.argv[cut - 4:cut] == ["--kv-backend", "lmcache", "--lmcache-url", "tcp://127.0.0.1:6001"]
    assert "kvstore" not in " ".join(comps[1].argv)


def test_up_says_when_lmcache_is_not_installed(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where lmcache is installed (`make setup` installs it) a package first on PYTHONPATH fails its
    import as a missing one does, in the interpreter `pdserve up` asks."""
    (tmp_path / "lmcache").mkdir()
    (tmp_path / "lmcache" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'lmcache'\", name='lmcache')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(SystemExit):
        parse_up_args(["--kv-backend", "lmcache", "--model", "m"])
    assert "lmcache is not installed (pip install pdserve[lmcache])" in capsys.readouterr().err


def test_the_client_refuses_bad_urls_and_reports_a_silent_server() -> None:
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        AsyncLMCacheClient("http://127.0.0.1:5556")
    with pytest.raises(LMCacheError, match="did not answer operation 21"):
        lmcache_mp.chunk_size(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3)


# ---------------------------------------------------------------- against a real lmcache server


@pytest.fixture(scope="module")
def lmcache() -> Iterator[Proc]:
    """A real `lmcache server` (its tests carry needs_lmcache: `make setup` installs LMCache)."""
    port, http_port = free_port(), free_port()
    proc = start_process(lmcache_server.server_argv(port, http_port, chunk_size=256, l1_size_gb=0.25, max_workers=2),
                         lmcache_server.health_url(http_port), name="lmcache", port=port, env=lmcache_server.ENV,
                         timeout=120)
    proc.http_port = http_port  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def status(proc: Proc) -> dict:
    return httpx.get(f"http://127.0.0.1:{proc.http_port}/status", timeout=10).json()  # type: ignore[attr-defined]


@needs_lmcache
def test_lmcache_server_starts_on_this_machine_and_reports_its_chunk_size(lmcache: Proc) -> None:
    assert lmcache_mp.chunk_size(f"tcp://127.0.0.1:{lmcache.port}") == 256
    assert status(lmcache)["chunk_size"] == 256


@needs_lmcache
def test_a_lookup_of_an_unknown_model_finds_nothing_and_leaves_nothing_locked(lmcache: Proc) -> None:
    """Before any engine registered the model the server has no layout for it: 0 tokens, and
    the lookup's session is ended (no session or lock is left behind by the router)."""
    url = f"tcp://127.0.0.1:{lmcache.port}"
    sessions = status(lmcache)["active_sessions"]

    async def lookups() -> list[int]:
        client = AsyncLMCacheClient(url)
        try:
            return [await client.prefix_tokens(LMCacheKey("no-such-model"), list(range(3, 700))) for _ in range(3)]
        finally:
            client.close()

    assert asyncio.run(lookups()) == [0, 0, 0]
    after = status(lmcache)
    assert after["active_sessions"] == sessions
    assert after["storage_manager"]["l1_manager"]["read_locked_count"] == 0


def _run(label: str, ttft_ms: float, tpot_ms: float) -> Run:
    result = RequestResult(success=True, prompt_tokens=10, output_tokens=11, ttft=ttft_ms / 1000,
                           e2el=ttft_ms / 1000 + tpot_ms / 100, itl=[tpot_ms / 1000] * 10)
    return Run(label, "http://x", 8, summarize([result], 1.0, {}))


def test_bench_compares_the_backends_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """`--kv-backend pdserve lmcache`: TTFT, handoff (against the colocated engine) and TPOT per backend."""
    coloc = [_run("colocated-router", 100.0, 5.0), _run("colocated-direct", 99.0, 5.0)]
    [row] = comparison([_run("pd", 130.0, 4.0), _run("pd-lmcache", 150.0, 4.5), *coloc])
    assert row["backends"]["pdserve"]["handoff_overhead_p50_ms"] == pytest.approx(30.0)
    assert row["backends"]["lmcache"]["handoff_overhead_p50_ms"] == pytest.approx(50.0)
    assert row["backends"]["lmcache"]["tpot_p50_ms"] == pytest.approx(4.5)
    print_summary([], [row])
    table = capsys.readouterr().out.split("KV backend", 1)[1].splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["pdserve", "lmcache"]
    [alone] = comparison([_run("pd-lmcache", 150.0, 4.5), *coloc])  # LMCache alone still gets its row
    assert set(alone["backends"]) == {"lmcache"} and alone["handoff_overhead_p50_ms"] != alone["handoff_overhead_p50_ms"]
    argv = ["--compare", "--kv-backend", "pdserve", "lmcache"]
    assert bench_serve.config_from_args(argv).kv_backends == ("pdserve", "lmcache")
    with pytest.raises(SystemExit):
        bench_serve.config_from_args(["--compare", "--kv-backend", "mooncake"])
