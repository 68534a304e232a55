"""The compose `cpu` stack for real: `make test-compose`'s script, run and its report checked.

The script (deploy/docker/compose_test.py) installs Docker if missing, starts a private
daemon if none runs, builds the images (from local base images when Docker Hub is out of
reach), brings the stack up with two decode replicas, sends chat and completion requests
through the router, checks in the router's and the store's metrics that a long prompt
went prefill -> store -> decode, stops one decode container and checks the stack still
answers; then it takes everything down and puts the host back as it found it. This test
runs it as a user would and asserts every one of its checks, including the cleanup's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy/docker/compose_test.py"
# Measured here from a machine without Docker: about 10 minutes; the engines share 2 cores.
LIMIT_S = 3600
STACK_CHECKS = (
    "docker available",
    "base images",
    "build context carries no .venv, .git or caches",
    "all services healthy",
    "chat answers",
    "completion answers",
    "long chat goes prefill -> store -> decode",
    "stack answers after a decode container stopped",
    "compose down -v",
    "images made by the test removed",
)


@pytest.mark.timeout(LIMIT_S + 600)
def test_compose_cpu_stack_builds_serves_p_d_and_survives_a_decode_loss(tmp_path: Path) -> None:
    report_path, log_path = tmp_path / "report.json", tmp_path / "compose-test.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--report", str(report_path)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=LIMIT_S)
        finally:
            if proc.poll() is None:  # SIGTERM: the script still takes its stack and daemon down
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=600)
    tail = log_path.read_text(errors="replace")[-6000:]
    assert report_path.exists(), tail
    report = json.loads(report_path.read_text())
    assert report["error"] is None, report["error"] + "\n" + tail
    checks = report["checks"]
    expected = list(STACK_CHECKS)
    if checks["docker available"]["detail"]["daemon started"]:
        expected.append("daemon stopped, networking as found")
    failed = {name: checks.get(name, "missing") for name in expected if not checks.get(name, {}).get("ok")}
    assert not failed, json.dumps(failed, indent=2) + "\n" + tail
    assert report["ok"] and proc.returncode == 0, tail
    print(json.dumps(report["phases"]))  # the phases' seconds, shown with -s
