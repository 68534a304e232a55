"""`pdserve bench serve`: metrics arithmetic, and real runs against the `pdserve up` stack.

The engine tests use the session stack from pdstack_fixtures.py (shared with
test_up.py): one run through the router (prompts above the P/D threshold, so both
legs) and one straight at its decode worker, each checked for exact token counts,
the JSON fields and a readable PNG.
"""

from __future__ import annotations

import asyncio
import json
import math
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

import httpx
import matplotlib.image
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench import processes
from pdserve.bench import serve as bench_serve
from pdserve.bench.engine_counters import load_phase_means
from pdserve.bench.serve import (CACHED_FLOOR_LABEL, COLOCATED_LABELS, DECODE_DIRECT_LABEL, ENGINE_WARMUP_ROUNDS,
                                 FLOOR_LABELS, StackUp, warm_engines,
                                 OVERLAP_AT, PHASES, PLAN_STEPS, PromptSource, RequestResult, Run, Target, add_readings, comparison, config_from_args,
                                 floor_and_phase_lines, load_tokenizer, main, paired_differences, paired_schedule,
                                 path_counts, print_summary, ttft_by_path, TTFT_BY_PATH, router_means, router_sums, run_load, run_paired,
                                 summarize, warmups)
from pdserve.router.flow.call import Call
from pdserve.router.flow.decode_leg import DecodeLeg, pd_phases
from pdserve.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from pdstack_fixtures import UpStack

# Imported as a plugin (not by name) so its session stack is shared and its asserts are rewritten.
pytest_plugins = ["pdstack_fixtures"]

T = TypeVar("T")


def write_sse(writer: asyncio.StreamWriter, tokens: int) -> None:
    """A whole streamed completion of `tokens` one-character tokens, usage included, as one HTTP reply."""
    events = (b'data: {"choices": [{"text": "x"}]}\n\n' * tokens
              + b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": %d}}\n\n' % tokens
              + b"data: [DONE]\n\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(events), events))



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
    assert math.isnan(row["at_start_handoff_p50_ms"])  # no such run
    [row] = comparison([run("pd", 130.0), run("pd-overlap-start", 112.0), run("colocated-router", 100.0),
                        run("colocated-direct", 99.5)])
    assert row["at_start_handoff_p50_ms"] == pytest.approx(12.0)
    assert row["handoff_ttft_ratio"] == pytest.approx(1.3)
    assert row["router_overhead_p50_ms"] == pytest.approx(0.5)


def test_router_means_are_per_request_over_the_run() -> None:
    before = {"handoff": (1.0, 10.0), "router_overhead": (0.01, 10.0)}
    after = {"handoff": (1.2, 14.0), "router_overhead": (0.014, 14.0)}
    assert router_means(before, after) == pytest.approx({"handoff_mean_ms": 50.0, "router_overhead_mean_ms": 1.0})
    assert router_means(None, after) == {}  # not a pdserve router
    assert router_means(after, after) == {}  # nothing was measured in between


def _leg(t_sent: float) -> DecodeLeg:
    return DecodeLeg(None, None, b"", None, set(), t_sent, t_sent)  # type: ignore[arg-type]  # only times are read


@pytest.mark.parametrize("t_sent, between, decode, wait", [(0.5, 0.1, 0.3, None), (0.05, 0.0, 0.4, 0.35)],
                         ids=["sequential", "overlapped"])
def test_pd_phases_own_every_second_of_the_way_to_the_first_token(
        t_sent: float, between: float, decode: float, wait: float | None) -> None:
    call = Call("completions", b"{}", {}, "r", t0=0.0, t_first_call=0.01, t_prefill_answer=0.4)
    phases = pd_phases(call, _leg(t_sent), t_token=0.8, relay_s=0.002)
    assert phases.pop("overlap_wait", None) == (None if wait is None else pytest.approx(wait))
    assert phases == pytest.approx({"before_first_call": 0.01, "prefill_leg": 0.39, "between_legs": between,
                                    "decode_first_token": decode, "relay": 0.002})
    assert set(phases) == set(PHASES) and sum(phases.values()) == pytest.approx(0.802)


_PAGE = """\
# TYPE pdserve_router_handoff_seconds histogram
pdserve_router_handoff_seconds_sum 0.5
pdserve_router_handoff_seconds_count 2.0
# TYPE pdserve_router_phase_seconds histogram
pdserve_router_phase_seconds_bucket{le="+Inf",phase="prefill_leg"} 2.0
pdserve_router_phase_seconds_count{phase="prefill_leg"} 2.0
pdserve_router_phase_seconds_sum{phase="prefill_leg"} 0.9
pdserve_router_phase_seconds_count{phase="relay"} 2.0
pdserve_router_phase_seconds_sum{phase="relay"} 0.004
# TYPE pdserve_router_plan_seconds histogram
pdserve_router_plan_seconds_count{step="tokenize"} 4.0
pdserve_router_plan_seconds_sum{step="tokenize"} 0.006
# TYPE pdserve_router_ttft_seconds histogram
pdserve_router_ttft_seconds_sum{route="completions"} 7.0
"""


def test_path_counts_read_a_routers_paths_and_when_its_overlapped_decode_legs_went_out(
    capsys: pytest.CaptureFixture,
) -> None:
    metrics = RouterMetrics()  # the router's own series, so a renamed one fails here
    metrics.paths.labels("pd").inc()
    metrics.paths.labels("pd_overlap").inc(5)
    metrics.overlap_sends.labels("estimate").inc(3)
    metrics.overlap_sends.labels("answer").inc(2)
    for route, path, seconds in (("completions", "pd_overlap", 0.1), ("chat", "pd_overlap", 0.2),
                                 ("completions", "decode_only_prefill_queue", 0.05)):
        metrics.ttft.labels(route, path).observe(seconds)
    counts = path_counts(metrics.exposition().decode())
    assert {k: v for k, v in counts.items() if not k.startswith(TTFT_BY_PATH)} == {
        "pd": 1, "pd_overlap": 5, OVERLAP_AT + "estimate": 3, OVERLAP_AT + "answer": 2}
    means = ttft_by_path(counts)
    assert {k: n for k, (_, n) in means.items()} == {"pd_overlap": 2, "decode_only_prefill_queue": 1}
    assert {k: ms for k, (ms, _) in means.items()} == pytest.approx({"pd_overlap": 150.0, "decode_only_prefill_queue": 50.0})
    runs = [Run("pd", "http://r", 1, {**summarize([_result(0.1, 0.5, 5)], 1.0, {}), "paths": counts})]
    print_summary(runs, [])
    out = capsys.readouterr().out
    assert "paths: pd 1, pd_overlap 5; overlapped decode legs sent at: answer 2, estimate 3" in out
    assert "router TTFT mean by path: decode_only_prefill_queue 50.0 ms (1), pd_overlap 150.0 ms (2)" in out


def test_router_sums_reads_each_phase_by_its_label() -> None:
    sums = router_sums(_PAGE)
    assert sums == {"handoff": (0.5, 2.0), "phase_prefill_leg": (0.9, 2.0), "phase_relay": (0.004, 2.0),
                    "plan_tokenize": (0.006, 4.0)}
    before = {"phase_prefill_leg": (0.3, 1.0)}  # the relay phase had not been seen yet
    assert router_means(before, sums) == pytest.approx(
        {"handoff_mean_ms": 250.0, "phase_prefill_leg_mean_ms": 600.0, "phase_relay_mean_ms": 2.0,
         "plan_tokenize_mean_ms": 1.5})


def _phase_run(label: str, ttft_ms: float, tpot_s: float, phases_ms: dict[str, float] | None = None) -> Run:
    metrics = summarize([_result(ttft_ms / 1000, ttft_ms / 1000 + 4 * tpot_s, 5)], 1.0, {})
    if phases_ms:
        metrics["router"] = {f"{'plan' if k in PLAN_STEPS else 'phase'}_{k}_mean_ms": v for k, v in phases_ms.items()}
    return Run(label, "http://x", 1, metrics)


def test_comparison_puts_the_handoff_beside_the_floor_and_tpot_beside_no_connector() -> None:
    ov = {"before_first_call": 0.5, "prefill_leg": 110.0, "between_legs": 0.0, "decode_first_token": 19.0,
          "relay": 0.1, "overlap_wait": 100.0, "tokenize": 0.2, "store_lookup": 0.25}
    seq = {**ov, "between_legs": 0.4, "decode_first_token": 24.0}
    del seq["overlap_wait"]
    handed = {**seq, "between_legs": 0.3, "decode_first_token": 0.0}  # the default: the prefill's token first
    runs = [_phase_run(FLOOR_LABELS["pd"], 12.0, 0.0), _phase_run(FLOOR_LABELS["colocated"], 11.0, 0.0),
            _phase_run(CACHED_FLOOR_LABEL, 15.0, 0.0), _phase_run("pd", 111.0, 0.0105, handed),
            _phase_run("pd-overlapped", 130.0, 0.0104, ov), _phase_run("pd-sequential", 135.0, 0.0110, seq),
            _phase_run("colocated-router", 100.0, 0.0100), _phase_run("colocated-direct", 99.5, 0.0100)]
    runs[5].metrics["decode_engine"] = {"engine_ttft_ms": 22.5, "engine_queue_ms": 8.0, "engine_prefill_ms": 14.5}
    [row] = comparison(runs)
    assert row["pd_floor_ttft_p50_ms"] == pytest.approx(12.0)
    assert row["colocated_floor_ttft_p50_ms"] == pytest.approx(11.0)
    assert row["pd_cached_floor_ttft_p50_ms"] == pytest.approx(15.0)
    assert row["handoff_overhead_p50_ms"] == pytest.approx(11.0)  # the defaults' run
    assert row["overlapped_handoff_p50_ms"] == pytest.approx(30.0)
    assert row["handoff_over_floor_ms"] == pytest.approx(-1.0)  # 111 - 100 - 12
    assert row["overlapped_handoff_over_floor_ms"] == pytest.approx(18.0)
    assert row["sequential_handoff_over_floor_ms"] == pytest.approx(23.0)
    assert row["tpot_connector_ratio"] == pytest.approx(1.05)
    assert row["overlapped_tpot_p50_ms"] == pytest.approx(10.4)
    assert row["phases"]["overlap"]["decode_first_token"] == 19.0
    assert row["phases"]["pd"]["decode_first_token"] == 0.0
    assert math.isnan(row["phases"]["sequential"]["overlap_wait"])
    lines = floor_and_phase_lines(row)
    text = "\n".join(lines)
    assert "P/D decode engine 12.0 ms, colocated engine 11.0 ms" in text
    assert "-1.0 ms by default, 18.0 ms overlapped, 23.0 ms in sequence" in text and "x1.050" in text
    assert "(10.40 overlapped, 11.00 in sequence)" in text
    decode_line = next(line for line in lines if PHASES["decode_first_token"] in line)
    assert decode_line.split()[5:8] == ["0.00", "19.00", "24.00"] and "floor 12.0" in decode_line
    assert "in its cache 15.0 (p50)" in decode_line and "already holds (its own prefix cache, c=1): 15.0 ms" in text
    lookup = next(line for line in lines if PLAN_STEPS["store_lookup"] in line)
    assert lookup.split()[-3:] == ["0.25", "0.25", "0.25"]  # inside before_first_call, not added again below
    total = next(line for line in lines if "sum:" in line)
    assert total.split()[6:9] == ["110.90", "129.60", "135.00"]  # the phases, added up
    seen = next(line for line in lines if "TTFT the client sees" in line)
    assert seen.split()[4:7] == ["111.00", "130.00", "135.00"]
    engine = [line for line in lines if "decode engine's own view" in line]
    assert len(engine) == 1 and "in sequence" in engine[0] and "first token 22.5, of which queued 8.0" in engine[0]


def test_phase_rows_say_so_when_the_router_timed_none() -> None:
    runs = [_phase_run("pd", 130.0, 0.01), _phase_run("colocated-router", 100.0, 0.01),
            _phase_run("colocated-direct", 99.5, 0.01)]
    [row] = comparison(runs)
    assert math.isnan(row["pd_floor_ttft_p50_ms"])  # no floor runs
    assert floor_and_phase_lines(row)[-1].startswith("  router phases: none timed")


@pytest.fixture(scope="module")
def router_on_stub() -> Iterator[str]:
    """A router whose prefill and decode workers are `bench router`'s stub: both legs, real HTTP, no engine."""
    import sys

    from procs import free_port

    port = free_port()
    stub = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pdserve.bench.router_stub", "--port", str(port), "--tokens", "3"]
    with processes.service(argv, f"{stub}/health", "stub"), \
            processes.router("--prefill", stub, "--decode", stub, "--pd-min-prompt-tokens", "0",
                             "--log-level", "warning") as (url, _proc):
        yield url


def test_the_router_times_each_phase_of_a_pd_request(router_on_stub: str) -> None:
    body = {"model": "stub", "prompt": "hello " * 50, "max_tokens": 3, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", f"{router_on_stub}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200 and "t2" in resp.read().decode()
    text = httpx.get(f"{router_on_stub}/metrics", timeout=30).text
    sums = router_sums(text)
    assert {k: v[1] for k, v in sums.items() if k.startswith("phase_")} == {f"phase_{p}": 3.0 for p in PHASES}
    ttft = next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "pdserve_router_ttft_seconds_sum")
    # the phases up to the first token are the router's TTFT, to the microsecond
    phases_to_token = sum(sums[f"phase_{p}"][0] for p in PHASES if p != "relay")
    assert phases_to_token == pytest.approx(ttft, abs=1e-6)
    assert sums["phase_prefill_leg"][0] > 0 and sums["phase_decode_first_token"][0] > 0


@asynccontextmanager
async def _listening(serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> AsyncIterator[str]:
    """A local HTTP stub whose connections `serve` handles, for as long as the block runs; yields its base URL."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _count_in_flight(concurrency: int) -> tuple[list[int], int]:
    """run_load at `concurrency` (as many warm-ups as measured prompts) against a server that holds
    each request until `concurrency` are in (bounded); returns the in-flight counts it saw."""
    seen: list[int] = []
    in_flight = 0
    arrived = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        in_flight += 1
        seen.append(in_flight)
        if in_flight >= concurrency:
            arrived.set()
        try:
            await asyncio.wait_for(arrived.wait(), 2.0)
        except asyncio.TimeoutError:
            pass
        in_flight -= 1
        write_sse(writer, tokens=1)
        await writer.drain()
        writer.close()

    async with _listening(serve) as url:
        cfg = config_from_args(["--base-url", url, "--max-concurrency", str(concurrency)])
        warm = [f"warm {i}" for i in range(warmups(cfg, concurrency))]
        await run_load(cfg, url, "m", [], warm, concurrency, "t")
    return seen, len(warm)


def test_warm_up_runs_a_whole_batch_of_the_level_before_measuring() -> None:
    """A level's warm-up is one batch of its concurrency sent together (the engines then have run
    that batch size), never more at once than the level allows."""
    seen, sent = asyncio.run(_count_in_flight(4))
    assert sent == 4 and max(seen) == 4, seen
    seen, sent = asyncio.run(_count_in_flight(1))
    assert sent == 1 and max(seen) == 1, seen


def test_a_pd_routers_first_level_warms_up_past_its_learning() -> None:
    """The P/D routers' first level warms up with enough legs to fill the overlap timing's median
    (and the first, sequential, leg); --num-warmups 0 still means none."""
    from pdserve.bench.serve import PD_ROUTER_WARMUPS
    from pdserve.router.prefill_estimate import RECENT_LEGS

    cfg = config_from_args(["--compare"])
    assert PD_ROUTER_WARMUPS > RECENT_LEGS
    assert warmups(cfg, 1, PD_ROUTER_WARMUPS) == PD_ROUTER_WARMUPS
    assert warmups(cfg, 8, PD_ROUTER_WARMUPS) == max(8, PD_ROUTER_WARMUPS)
    assert warmups(cfg, 1) == 1
    assert warmups(config_from_args(["--compare", "--num-warmups", "0"]), 1, PD_ROUTER_WARMUPS) == 0


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


@pytest.mark.parametrize("argv, why", [
    (["--paired", "--max-concurrency", "1"], "add --compare"),
    (["--compare", "--paired"], "--max-concurrency 1"),  # the default is unlimited
    (["--compare", "--paired", "--max-concurrency", "1", "4"], "--max-concurrency 1"),
    (["--compare", "--paired", "--max-concurrency", "2"], "--max-concurrency 1"),
    (["--compare", "--paired", "--max-concurrency", "1", "--request-rate", "5"], "no --request-rate"),
])
def test_paired_needs_compare_at_concurrency_one(argv: list[str], why: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2 and why in capsys.readouterr().err
    cfg = config_from_args(["--compare", "--paired", "--max-concurrency", "1"])
    assert cfg.paired and cfg.max_concurrency == (1,)
    assert not config_from_args(["--compare", "--max-concurrency", "1"]).paired


@pytest.mark.parametrize("argv, why", [
    (["--compare", "--pd-runs", "pd", "pd"], "distinct labels"),
    (["--compare", "--pd-runs", "pd-nonesuch"], "invalid choice"),
    (["--pd-runs", "pd"], "add --compare"),
])
def test_pd_runs_takes_known_labels_once_with_compare(argv: list[str], why: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2 and why in capsys.readouterr().err
    assert config_from_args(["--compare"]).pd_runs == ()
    assert config_from_args(["--compare", "--pd-runs", "pd-early-prefill", "pd"]).pd_runs == ("pd-early-prefill", "pd")


def test_gpus_go_to_the_stacks_compare_starts(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--gpus", "0,1"])
    assert "add --compare" in capsys.readouterr().err
    assert config_from_args(["--compare", "--gpus", "0,1"]).gpus == ("0", "1")


def test_pd_runs_start_only_their_routers_and_run_in_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """--pd-runs decides which P/D routers the stack starts and the order its labels run each level in, so
    a run can put the label that usually goes last first (the first label of a level may pay for it)."""
    started: list[tuple[str, ...]] = []

    class FakeLocal:
        def __init__(self, cfg: Any, label: str) -> None:
            pass

        @contextmanager
        def start(self, show_progress: bool) -> Iterator[None]:
            yield

    class FakeStack:
        router_url = "http://own-router"

        def worker_urls(self, role: str) -> list[str]:
            return [f"http://{role}"]

    @contextmanager
    def fake_second(stack: Any, *flags: str) -> Iterator[str]:
        started.append(flags)
        yield "http://router-" + "-".join(flags)

    import pdserve.deploy.local as local

    monkeypatch.setattr(local, "LocalStack", FakeLocal)
    monkeypatch.setattr(bench_serve, "second_router", fake_second)
    monkeypatch.setattr(bench_serve, "engine_floor", lambda *args: [])
    monkeypatch.setattr(bench_serve, "cached_floor", lambda *args: [])
    cfg = config_from_args(["--compare", "--model", "m", "--pd-runs", "pd-early-prefill", "pd"])
    with bench_serve.pd_stack(cfg, lambda **kw: FakeStack(), None, None) as up:
        assert [(t.label, t.url) for t in up.targets] == [
            ("pd-early-prefill", "http://router---pd-early-prefill"), ("pd", "http://own-router")]
        assert up.warm_urls == ["http://decode", "http://own-router"]  # its decode engine, then both legs
    assert started == [("--pd-early-prefill",)]


def test_paired_schedule_rotates_each_round_so_no_label_keeps_its_place() -> None:
    labels = ["pd", "pd-sequential", "colocated-router", "colocated-direct"]
    schedule = paired_schedule(labels, 8)
    assert len(schedule) == 8 and all(sorted(order) == sorted(labels) for order in schedule)
    assert schedule[0] == labels and schedule[1] == ["pd-sequential", "colocated-router", "colocated-direct", "pd"]
    # over a multiple of the labels, each label takes each place in a round exactly twice
    for place in range(len(labels)):
        assert sorted(order[place] for order in schedule) == sorted(labels * 2)
    assert paired_schedule(labels, 0) == []


def _ms(ttft_ms: float, tpot_ms: float, ok: bool = True) -> RequestResult:
    if not ok:
        return RequestResult(error="HTTP 500")
    return _result(ttft_ms / 1000, ttft_ms / 1000 + 4 * tpot_ms / 1000, 5)


def _paired_runs() -> list[Run]:
    """Request i of each label went out in round i; round 2 of pd failed. The machine drifts: round 1 is slow
    for everyone, which the runs' p50s mix up and the rounds' differences do not."""
    pd = [_ms(130, 11), _ms(190, 12), _ms(0, 0, ok=False), _ms(125, 10.5)]
    direct = [_ms(100, 10), _ms(150, 10), _ms(100, 10), _ms(100, 10)]
    router = [_ms(101, 10), _ms(152, 10), _ms(101, 10), _ms(104, 10)]
    floor = [_ms(12, 1)] * 4
    return [Run(label, "http://x", 1, summarize(results, 1.0, {}), results)
            for label, results in (("pd", pd), ("colocated-router", router), ("colocated-direct", direct),
                                   (FLOOR_LABELS["pd"], floor))]


def test_paired_differences_set_the_decode_engine_direct_between_pd_and_colocated() -> None:
    """P/D over its own decode engine prefilling the same kind of prompt (the P/D setting's cost), and that
    engine over the colocated one (its connector's cost): the two ratios that split P/D over colocated."""
    runs = _paired_runs()
    own = [_ms(110, 10), _ms(160, 10.5), _ms(105, 10.5), _ms(100, 10)]
    runs.append(Run(DECODE_DIRECT_LABEL, "http://x", 1, summarize(own, 1.0, {}), own))
    paired = paired_differences(runs)
    assert set(paired) == {"pd", DECODE_DIRECT_LABEL}
    assert set(paired["pd"]) == {*COLOCATED_LABELS, DECODE_DIRECT_LABEL}
    setting = paired["pd"][DECODE_DIRECT_LABEL]
    assert setting["tpot_ratio_by_round"][:2] == pytest.approx([1.1, 12 / 10.5])
    assert setting["handoff_ms_by_round"][3] == pytest.approx(25.0) and setting["rounds"] == 3
    connector = paired[DECODE_DIRECT_LABEL]
    assert set(connector) == set(COLOCATED_LABELS)  # never against itself
    assert connector["colocated-direct"]["tpot_ratio_by_round"] == pytest.approx([1.0, 1.05, 1.05, 1.0])
    assert connector["colocated-direct"]["tpot_ratio_p50"] == pytest.approx(1.025)


def test_paired_differences_line_up_each_rounds_requests() -> None:
    paired = paired_differences(_paired_runs())
    assert set(paired) == {"pd"} and set(paired["pd"]) == set(COLOCATED_LABELS)  # floors and absent labels: none
    direct = paired["pd"]["colocated-direct"]
    assert direct["handoff_ms_by_round"][:2] == pytest.approx([30.0, 40.0])
    assert math.isnan(direct["handoff_ms_by_round"][2])  # the failed request's round counts for nothing
    assert direct["handoff_ms_by_round"][3] == pytest.approx(25.0)
    assert direct["rounds"] == 3 and direct["handoff_p50_ms"] == pytest.approx(30.0)
    router = paired["pd"]["colocated-router"]
    assert router["handoff_ms_by_round"][3] == pytest.approx(21.0)
    assert router["handoff_p50_ms"] == pytest.approx(29.0)  # median of 29, 38, 21
    assert direct["tpot_ratio_by_round"][:2] == pytest.approx([1.1, 1.2])
    assert direct["tpot_ratio_p50"] == pytest.approx(1.1)  # median of 1.1, 1.2, 1.05


def test_comparison_adds_the_paired_figures_only_when_asked(capsys: pytest.CaptureFixture) -> None:
    runs = _paired_runs()
    [plain] = comparison(runs)
    assert "paired" not in plain
    [row] = comparison(runs, paired=True)
    # the p50s of the runs are unchanged by pairing (pd 130 vs direct 100), the paired median is its own figure
    assert row["handoff_overhead_p50_ms"] == pytest.approx(plain["handoff_overhead_p50_ms"])
    assert row["paired"]["pd"]["colocated-router"]["handoff_p50_ms"] == pytest.approx(29.0)
    print_summary(runs, [row])
    out = capsys.readouterr().out
    assert "pd - colocated-direct: paired handoff p50 30.0 ms, paired TPOT ratio x1.100 (3 rounds); " \
           "by round (ms): 30.0 40.0 nan 25.0" in out
    assert "pd - colocated-router: paired handoff p50 29.0 ms" in out
    print_summary(runs, [plain])
    assert "paired" not in capsys.readouterr().out


def test_add_readings_sums_what_moved_around_each_request() -> None:
    first = {"decode": {"loads": 2.0, "load_seconds": 0.2}, "prefill": None}
    before = {"decode": {"loads": 5.0, "load_seconds": 1.0}, "prefill": {"gathers": 1.0}}
    after = {"decode": {"loads": 6.0, "load_seconds": 1.03, "load_fetch_seconds": 0.01}, "prefill": {"gathers": 2.0}}
    total = add_readings(first, before, after)
    assert total["decode"] == pytest.approx({"loads": 3.0, "load_seconds": 0.23, "load_fetch_seconds": 0.01})
    assert total["prefill"] is None  # a missing reading stays missing
    # another label's load between the two requests (5 -> 6 above, 8 -> 9 here) is not this label's
    total = add_readings(total, {"decode": {"loads": 8.0, "load_seconds": 2.0, "load_fetch_seconds": 0.5}},
                         {"decode": {"loads": 9.0, "load_seconds": 2.05, "load_fetch_seconds": 0.52}})
    assert load_phase_means(first["decode"], total["decode"])["load_ms"] == pytest.approx(40.0)  # (30 + 50) / 2
    assert add_readings(first, {"decode": None}, after)["decode"] is None


class _Prompts:
    """Stands in for PromptSource: numbered prompts, never the same one twice."""

    def __init__(self) -> None:
        self.n = 0

    def take(self, count: int) -> list[str]:
        self.n += count
        return [f"prompt {i}" for i in range(self.n - count, self.n)]


async def _against_stub(action: Callable[[str], Awaitable[T]]) -> tuple[T, list[tuple[str, str]], int]:
    """`action(stub)` against one stub server that answers every base URL `<stub>/<label>`; returns what it
    returned, the (label, prompt) of every completion in arrival order and the most requests it had at once."""
    log: list[tuple[str, str]] = []
    in_flight = most = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight, most
        head = await reader.readuntil(b"\r\n\r\n")
        method, path = head.split(b" ")[:2]
        if method != b"POST":  # a router's /metrics: not a pdserve router
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        else:
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            body = json.loads(await reader.readexactly(length))
            in_flight += 1
            most = max(most, in_flight)
            log.append((path.decode().split("/")[1], body["prompt"]))
            await asyncio.sleep(0.005)
            in_flight -= 1
            write_sse(writer, tokens=3)
        await writer.drain()
        writer.close()

    async with _listening(serve) as url:
        out = await action(url)
    return out, log, most


async def _paired_against_stub(cfg: Any, targets: list[tuple[str, int]]) -> tuple[list[Run], list[tuple[str, str]], int]:
    """run_paired against the stub, each label at `<stub>/<label>`."""
    return await _against_stub(lambda stub: run_paired(
        cfg, [Target(label, f"{stub}/{label}", warm) for label, warm in targets], _Prompts()))  # type: ignore[arg-type]


def test_each_warm_up_endpoint_gets_a_closed_loop_at_the_levels_concurrency() -> None:
    """Each endpoint a stack names for warming (a P/D stack's decode engine and then its own router, the
    colocated engine) gets ENGINE_WARMUP_ROUNDS * c requests in turn, at most c at once."""
    cfg = config_from_args(["--compare", "--max-concurrency", "2", "--model", "m", "--disable-tqdm"])

    async def warm(stub: str) -> None:
        await warm_engines(cfg, [f"{stub}/decode", f"{stub}/engine"], _Prompts(), 2)  # type: ignore[arg-type]

    _, log, most = asyncio.run(_against_stub(warm))
    rounds = ENGINE_WARMUP_ROUNDS * 2
    assert [label for label, _ in log] == ["decode"] * rounds + ["engine"] * rounds
    assert most == 2 and len({prompt for _, prompt in log}) == len(log)
    no_warmups = config_from_args(["--compare", "--num-warmups", "0", "--model", "m", "--disable-tqdm"])
    _, log, _ = asyncio.run(_against_stub(lambda stub: warm_engines(
        no_warmups, [f"{stub}/engine"], _Prompts(), 2)))  # type: ignore[arg-type]
    assert log == []


def test_run_paired_sends_one_request_at_a_time_round_by_round() -> None:
    cfg = config_from_args(["--compare", "--paired", "--max-concurrency", "1", "--num-prompts", "3", "--model", "m",
                            "--disable-tqdm"])
    targets = [("pd", 3), ("colocated-router", 0), ("colocated-direct", 0)]
    runs, log, most = asyncio.run(_paired_against_stub(cfg, targets))
    assert most == 1
    # warm-ups first, label by label (a P/D router's first level needs more), then the rounds in schedule order
    labels = [label for label, _ in targets]
    assert [label for label, _ in log] == ["pd"] * 3 + labels[1:] + [x for order in paired_schedule(labels, 3) for x in order]
    assert len({prompt for _, prompt in log}) == len(log)  # every request a fresh prompt
    assert [(r.label, r.max_concurrency, r.metrics["completed"]) for r in runs] == [(label, 1, 3) for label in labels]
    measured = log[5:]
    for run in runs:  # a run's results are its own requests, in round order
        assert len(run.results) == 3 and all(r.success and r.output_tokens == 3 for r in run.results)
        assert 0 < run.metrics["duration_s"] and "router" not in run.metrics and "paths" not in run.metrics
    # rounds [pd router direct], [router direct pd], [direct pd router] after prompts 0-4 went to warm-ups
    assert [p for label, p in measured if label == "pd"] == ["prompt 5", "prompt 10", "prompt 12"]
    paired = paired_differences(runs)
    assert paired["pd"]["colocated-direct"]["rounds"] == 3


def test_paired_compare_brings_every_stack_up_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --paired each stack is up alone and measured level by level; with it all are up together
    and one paired run goes over every label."""
    events: list[str] = []

    @contextmanager
    def fake_stack(name: str, labels: tuple[str, ...]) -> Iterator[StackUp]:
        events.append(f"up {name}")
        yield StackUp([Target(label, f"http://{label}") for label in labels], [Run(f"{name} floor", "http://f", 1, {})],
                      [f"http://{name}-engine"])
        events.append(f"down {name}")

    async def fake_paired(cfg: Any, targets: list[Target], prompts: Any) -> list[Run]:
        events.append("paired " + " ".join(t.label for t in targets))
        return [Run(t.label, t.url, 1, {}) for t in targets]

    def fake_level(cfg: Any, target: Target, prompts: Any, conc: int | None, first: bool) -> list[Run]:
        events.append(f"{target.label} c={conc}{' first' if first else ''}")
        return [Run(target.label, target.url, conc, {})]

    async def fake_warm(cfg: Any, engines: list[str], prompts: Any, conc: int | None) -> None:
        events.append(f"warm c={conc}")

    monkeypatch.setattr(bench_serve, "load_tokenizer", lambda name: None)
    monkeypatch.setattr(bench_serve, "PromptSource", lambda *args: None)
    monkeypatch.setattr(bench_serve, "pd_stack", lambda *args: fake_stack("pd", ("pd", "pd-sequential")))
    monkeypatch.setattr(bench_serve, "colocated_stack", lambda *args: fake_stack("colocated", COLOCATED_LABELS))
    monkeypatch.setattr(bench_serve, "run_paired", fake_paired)
    monkeypatch.setattr(bench_serve, "measure_level", fake_level)
    monkeypatch.setattr(bench_serve, "warm_engines", fake_warm)

    runs = bench_serve.compare_stacks(config_from_args(["--compare", "--model", "m", "--max-concurrency", "1", "4"]))
    assert events == ["up pd", "warm c=1", "pd c=1 first", "pd-sequential c=1 first", "warm c=4", "pd c=4",
                      "pd-sequential c=4", "down pd", "up colocated", "warm c=1", "colocated-router c=1 first",
                      "colocated-direct c=1 first", "warm c=4", "colocated-router c=4", "colocated-direct c=4",
                      "down colocated"]
    assert [r.label for r in runs][:1] == ["pd floor"] and len(runs) == 2 + 8
    events.clear()
    runs = bench_serve.compare_stacks(config_from_args(["--compare", "--paired", "--model", "m",
                                                        "--max-concurrency", "1"]))
    assert events == ["up pd", "up colocated", "paired pd pd-sequential colocated-router colocated-direct",
                      "down colocated", "down pd"]
    assert [r.label for r in runs] == ["pd floor", "colocated floor", "pd", "pd-sequential", *COLOCATED_LABELS]


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
