"""`pdserve bench connector-tpot`: the paired ratio, its argument checks, and one short run on real engines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.bench.connector_tpot import ENGINES, RATIOS, main, paired_ratio


def test_paired_ratio_is_the_median_of_each_rounds_ratio() -> None:
    # Round by round the first is 10% slower; the medians of each side alone would say 2.0 / 1.5.
    a, b = [1.1, 2.2, 4.4], [1.0, 2.0, 4.0]
    assert paired_ratio(a, b) == pytest.approx(1.1)
    assert paired_ratio([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--output-len", "1"], ["--input-len", "0"]])
def test_bad_arguments_are_usage_errors(flags: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2 and "at least" in capsys.readouterr().err


@pytest.mark.engine
def test_three_engines_are_timed_round_by_round(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "tpot.json"
    assert main(["--rounds", "2", "--output-len", "48", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures["tpot_ms_by_round"]) == set(ENGINES)
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in figures["tpot_ms_by_round"].values())
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in figures["ttft_ms_by_round"].values())
    assert set(figures["ttft_p50_ms"]) == set(ENGINES)
    assert set(figures["paired_ratio"]) == {f"{a}/{b}" for a, b in RATIOS}
    assert all(math.isfinite(r) and r > 0 for r in figures["paired_ratio"].values())
    assert "pdserve/noop" in capsys.readouterr().out
