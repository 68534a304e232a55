"""`pdserve bench serve`: metrics arithmetic, and real runs against the `pdserve up` stack.

The engine tests use the session stack from pdstack_fixtures.py (shared with
test_up.py): one run through the router (prompts above the P/D threshold, so both
legs) and one straight at its decode worker, each checked for exact token counts,
the JSON fields and a readable PNG.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib.image
import pytest

from pdserve.bench.serve import (PromptSource, RequestResult, Run, comparison, config_from_args, load_tokenizer,
                                       main, router_means, summarize)

if TYPE_CHECKING:
    from pdstack_fixtures import UpStack

# Imported as a plugin (not by name) so its session stack is shared and its asserts are rewritten.
pytest_plugins = ["pdstack_fixtures"]


def _result(ttft: float, e2el: float, tokens: int) -> RequestResult:
    return RequestResult(success=True, prompt_tokens=10, output_tokens=tokens, ttft=ttft, e2el=e2el,
                         itl=[(e2el - ttft) / (tokens - 1)] * (tokens - 1))


def test_summary_percentiles_tpot_and_goodput() -> None:
    results = [_result(0.1, 1.1, 11), _result(0.3, 2.3, 11), RequestResult(error="HTTP 500: boom")]
    m = summarize(results, duration=2.0, goodput={"ttft": 200.0})
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert m["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)  # (1000 ms / 10 + 2000 ms / 10) / 2
    assert m["output_throughput"] == pytest.approx(11.0)
    assert m["goodput"]["good_requests"] == 1 and m["goodput"]["fraction"] == pytest.approx(1 / 3)


def test_comparison_gives_handoff_and_router_overhead() -> None:
    def run(label: str, ttft_ms: float) -> Run:
        return Run(label, "http://x", 1, summarize([_result(ttft_ms / 1000, 1.0, 5)], 1.0, {}))

    [row] = comparison([run("pd", 130.0), run("colocated-router", 100.0), run("colocated-direct", 99.5)])
    assert row["handoff_overhead_p50_ms"] == pytest.approx(30.0)
    assert row["handoff_ttft_ratio"] == pytest.approx(1.3)
    assert row["router_overhead_p50_ms"] == pytest.approx(0.5)


def test_router_means_are_per_request_over_the_run() -> None:
    before = {"handoff": (1.0, 10.0), "router_overhead": (0.01, 10.0)}
    after = {"handoff": (1.2, 14.0), "router_overhead": (0.014, 14.0)}
    assert router_means(before, after) == pytest.approx({"handoff_mean_ms": 50.0, "router_overhead_mean_ms": 1.0})
    assert router_means(None, after) == {}  # not a pdserve router
    assert router_means(after, after) == {}  # nothing was measured in between


def test_prompts_have_the_exact_token_count_and_never_repeat(tiny_deepseek_v3: Path) -> None:
    """Fresh prompts every take: reused ones would measure KV store hits, not prefill."""
    tokenizer = load_tokenizer(str(tiny_deepseek_v3))
    source = PromptSource(tokenizer, 300, seed=0)
    prompts = source.take(3) + source.take(3)
    assert len(set(prompts)) == 6
    assert [len(tokenizer(p).input_ids) for p in prompts] == [300] * 6


@pytest.mark.parametrize("argv", [["--goodput", "latency:5"], ["--goodput", "ttft"], ["--num-prompts", "0"],
                                  ["--request-rate", "0"], ["--", "--enforce-eager"]])
def test_bad_arguments_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2


def test_unreachable_endpoint_is_a_clear_failure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from procs import free_port

    code = main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1", "--disable-tqdm",
                 "--result-dir", str(tmp_path)])
    assert code == 1 and "pdserve bench serve:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _bench(tmp_path: Path, base_url: str, *extra: str) -> dict:
    code = main(["--base-url", base_url, "--num-prompts", "4", "--input-len", "300", "--output-len", "8",
                 "--result-dir", str(tmp_path), "--result-filename", "out.json", "--disable-tqdm", *extra])
    assert code == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    png = tmp_path / "out.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert height > 100 and width > 100
    return doc


@pytest.mark.engine
def test_bench_through_router_two_concurrency_levels(up_stack: UpStack, tmp_path: Path) -> None:
    doc = _bench(tmp_path, f"{up_stack.url}/v1", "--max-concurrency", "1", "2", "--goodput", "ttft:600000")
    assert doc["config"]["input_len"] == 300 and doc["comparison"] == []
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (4, 0), m["errors"]
        assert m["mean_input_tokens"] == 300 and m["mean_output_tokens"] == 8
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(m[key]) == {"mean", "p50", "p90", "p99"}
            assert all(math.isfinite(v) and v > 0 for v in m[key].values()), (key, m[key])
        assert m["ttft_ms"]["p50"] <= m["ttft_ms"]["p99"] <= m["e2el_ms"]["p99"]
        assert m["goodput"]["fraction"] == 1.0 and m["request_throughput"] > 0
        # prompts above the P/D threshold: the router reports the handoff and its own time
        assert m["router"]["handoff_mean_ms"] > 0 and m["router"]["router_overhead_mean_ms"] > 0


@pytest.mark.engine
def test_bench_straight_at_a_vllm_worker(up_stack: UpStack, tmp_path: Path) -> None:
    doc = _bench(tmp_path, up_stack.decode_url, "--max-concurrency", "2", "--request-rate", "50")
    [run] = doc["runs"]
    assert run["base_url"] == up_stack.decode_url and run["metrics"]["completed"] == 4
    assert "router" not in run["metrics"]  # a vLLM worker has no router figures
    assert run["metrics"]["mean_input_tokens"] == 300
