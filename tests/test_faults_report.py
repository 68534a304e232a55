"""What `pdserve bench faults` says of answers that were not full: kind and detail, so that a failing
row names the error (the suite's "no fault" row once failed in CI with 546 errors and no word of which)."""

from __future__ import annotations

import json
from collections import Counter

from pdserve.bench.faults import Row, classify_reply, format_table


def test_an_openai_error_is_classified_with_its_status_and_message() -> None:
    body = json.dumps({"error": {"message": "no healthy decode worker", "type": "ServiceUnavailable"}}).encode()
    assert classify_reply(503, body) == ("error", "503 no healthy decode worker")


def test_a_5xx_without_a_json_error_keeps_the_start_of_its_body() -> None:
    kind, detail = classify_reply(502, b"<html>bad gateway</html>")
    assert kind == "5xx_nojson" and detail.startswith("502 ") and "bad gateway" in detail
    assert classify_reply(404, b"not json")[0] == "broken"


def test_the_table_lists_what_the_answers_that_were_not_full_said() -> None:
    row = Row("no fault", counts=Counter(full=14, error=546),
              details=Counter({"error: 503 no healthy decode worker": 540, "error: 429 busy": 6}))
    lines = format_table([row]).splitlines()
    assert lines[1].split()[:4] == ["no", "fault", "14", "546"]
    assert lines[2:] == ["  no fault: 540 x error: 503 no healthy decode worker", "  no fault: 6 x error: 429 busy"]
