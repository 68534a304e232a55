"""The compose `cpu` stack for real: `make test-compose`'s script, run and its report checked.

The script (deploy/docker/compose_test.py) installs Docker if missing, starts a private
daemon if none runs, builds the images (from local base images when Docker Hub is out of
reach), brings the stack up with two decode replicas, sends chat and completion requests
through the router, checks in the router's and the store's metrics that a long prompt
went prefill -> store -> decode, stops one decode container and checks the stack still
answers; then it takes everything down and puts the host back as it found it. This test
runs it as a user would and asserts every one of its checks, including the cleanup's. The
script starts with the session (tests/compose_fixtures.py), so its install and build overlap
the other tests; the stack itself starts when this test, the session's last, releases it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from compose_fixtures import ROOT, SCRIPT, ComposeRun

# Measured here from a machine without Docker: 9-20 minutes, as the engines compete for 2 cores.
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


@pytest.mark.engine  # three vLLM engines, in containers
@pytest.mark.compose
@pytest.mark.timeout(LIMIT_S + 600)
def test_compose_cpu_stack_builds_serves_p_d_and_survives_a_decode_loss(compose_run: ComposeRun) -> None:
    """The script has been installing and building since the session began (compose_fixtures); it
    starts the stack now, the last test, and the checks are its report's."""
    compose_run.release()
    try:
        compose_run.proc.wait(timeout=LIMIT_S)
    finally:
        compose_run.stop()  # SIGTERM if it still runs: the script still takes its stack and daemon down
    tail = compose_run.log_path.read_text(errors="replace")[-6000:]
    assert compose_run.report_path.exists(), tail
    report = json.loads(compose_run.report_path.read_text())
    assert report["error"] is None, report["error"] + "\n" + tail
    checks = report["checks"]
    expected = list(STACK_CHECKS)
    if checks["docker available"]["detail"]["daemon started"]:
        expected.append("daemon stopped, networking as found")
    failed = {name: checks.get(name, "missing") for name in expected if not checks.get(name, {}).get("ok")}
    assert not failed, json.dumps(failed, indent=2) + "\n" + tail
    assert report["ok"] and compose_run.proc.returncode == 0, tail
    print(json.dumps(report["phases"]))  # the phases' seconds, shown with -s


def test_a_daemons_iptables_changes_are_undone_and_others_kept() -> None:
    """The networking restore, against real iptables in a private network namespace.

    After the snapshot a "daemon" adds Docker's kind of rules, chains and a DROP policy,
    and someone else removes a rule the snapshot holds (seen here: another daemon's cleanup).
    Undoing removes exactly the daemon's additions and never puts back what others took out
    (restoring whole tables from the snapshot did: it revived the other daemon's stale rules).
    """
    script = f"""
import subprocess, sys
sys.path.insert(0, {str(SCRIPT.parent)!r})
import docker_host as host
ipt = lambda *a: subprocess.run(["iptables", *a], check=True)
ipt("-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT")  # the host's own rule
ipt("-A", "OUTPUT", "-p", "udp", "--dport", "53", "-m", "comment", "--comment", "someone else's", "-j", "ACCEPT")
before = host.NetworkState.read()
for table, chain in (("filter", "DOCKER"), ("nat", "DOCKER")):
    ipt("-t", table, "-N", chain)
ipt("-A", "FORWARD", "-o", "docker0", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT")
ipt("-A", "FORWARD", "-o", "docker0", "-j", "DOCKER")
ipt("-P", "FORWARD", "DROP")
ipt("-t", "nat", "-A", "POSTROUTING", "-s", "172.17.0.0/16", "!", "-o", "docker0", "-j", "MASQUERADE")
ipt("-t", "nat", "-A", "PREROUTING", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "DOCKER")
daemon_made = host.NetworkState.read()
ipt("-D", "OUTPUT", "-p", "udp", "--dport", "53", "-m", "comment", "--comment", "someone else's", "-j", "ACCEPT")
host.undo_iptables("iptables", before.iptables["iptables"], host.NetworkState.read().iptables["iptables"])
after = host.rules(host.NetworkState.read().iptables["iptables"])
assert host.rules(daemon_made.iptables["iptables"]) != host.rules(before.iptables["iptables"])
assert after == {{"filter": ["-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT"]}}, after
print("undone")
"""
    if not shutil.which("iptables"):  # Docker's dependency; the stack test's script may be installing it now
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "-q", "iptables"], check=True,
                       capture_output=True, timeout=1200)
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "undone" in out.stdout, out.stdout + out.stderr
