"""engine_counters reads the connector's counters off an engine's Prometheus page (no vLLM needed)."""

import pytest

from pdserve.bench.engine_counters import delta, parse_counters

PAGE = """\
# HELP vllm:pdserve_loads_total KV loads from the pdserve store
# TYPE vllm:pdserve_loads_total counter
vllm:pdserve_loads_total{engine="0",model_name="m"} 3.0
vllm:pdserve_loads_total{engine="1",model_name="m"} 2.0
vllm:pdserve_loads_created{engine="0",model_name="m"} 1.7e+09
vllm:pdserve_load_seconds_total{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_counters_are_summed_over_engines_and_skip_other_series():
    counts = parse_counters(PAGE)
    assert counts == {"loads": 5.0, "load_seconds": 0.25}


def test_delta_counts_what_each_counter_gained():
    assert delta({"loads": 2.0}, {"loads": 5.0, "load_seconds": 0.25}) == {"loads": 3.0, "load_seconds": 0.25}


def test_load_phases_are_means_per_load_between_two_readings():
    from pdserve.bench.engine_counters import describe_load_phases, load_phase_means

    before = {"loads": 2.0, "load_seconds": 0.1}
    after = {"loads": 6.0, "load_seconds": 0.14, "load_queue_seconds": 0.004, "load_fetch_seconds": 0.02,
             "scatter_seconds": 0.008, "load_fetch_waits": 2.0}
    means = load_phase_means(before, after)
    assert means["load_ms"] == pytest.approx(10.0) and means["load_fetch_ms"] == pytest.approx(5.0)
    assert means["load_scatter_ms"] == pytest.approx(2.0) and means["load_waits"] == pytest.approx(0.5)
    assert "engine noticing it 2.0" in describe_load_phases(means)
    assert "GPU" not in describe_load_phases(means)  # the CPU engine has no GPU time to tell apart
    on_gpu = load_phase_means(before, {**after, "scatter_gpu_seconds": 0.002})
    assert "copy into the paged cache 2.0 (of it 0.5 on the GPU" in describe_load_phases(on_gpu)
    assert load_phase_means(after, after) == {} and load_phase_means(None, after) == {}


def test_engine_times_are_vllm_request_histograms_per_request_between_two_readings():
    from pdserve.bench.engine_counters import engine_time_means

    page = PAGE + (
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5\n'
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0\n'
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.2\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4.0\n'
    )
    after = parse_counters(page)
    assert after["engine_ttft_sum"] == 0.5 and after["loads"] == 5.0
    before = {"engine_ttft_sum": 0.1, "engine_ttft_count": 2.0, "engine_queue_sum": 0.2, "engine_queue_count": 4.0}
    assert engine_time_means(before, after) == pytest.approx({"engine_ttft_ms": 200.0})  # no request queued in between
    assert engine_time_means(None, after) == {}


def test_saves_are_means_per_copy_out_between_two_readings():
    from pdserve.bench.engine_counters import describe_saves, save_means

    before = {"gathers": 1.0, "gather_seconds": 0.5, "gather_bytes": 1e6}
    after = {"gathers": 5.0, "gather_seconds": 0.54, "gather_gpu_seconds": 0.008, "gather_bytes": 41e6}
    means = save_means(before, after)
    assert means["saves"] == 4 and means["save_ms"] == pytest.approx(10.0)
    assert means["save_gpu_ms"] == pytest.approx(2.0) and means["save_mb"] == pytest.approx(10.0)
    assert describe_saves(means) == ("4 copies out of the paged cache, 10.0 MB and 10.0 ms each "
                                     "(of it 2.0 on the GPU, after the step's forward)")
    assert save_means(after, after) == {} and describe_saves({}) == "no saves"
