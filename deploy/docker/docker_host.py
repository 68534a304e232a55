"""The Docker engine for `make test-compose`: installed, started and given back as found.

Why this exists: the compose test must run on a CI machine that may have no Docker, no
daemon and no Docker Hub. So it installs Debian's docker.io when `dockerd` is missing,
starts a private daemon when none answers (its own data root, exec root and socket, so
nothing of a user's Docker state is touched, and all of it is deleted afterwards), and
undoes what that daemon did to the host's networking (iptables rules, forwarding, the
bridges it created), which dockerd itself leaves behind when it stops.

When Docker Hub cannot be reached, `local_base_image` builds the base images instead:
`debootstrap --variant=minbase` from the host's own Debian mirror, imported with
`docker import`, with Python in a venv on PATH (as in python:3.11-slim), redis-server for
the redis service, and the host's CA bundle, so pip works behind a TLS-inspecting proxy.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

SUITE = "bookworm"  # Debian 12: Python 3.11, as in python:3.11-slim
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TRUST_KEY = Path("/etc/docker/key.json")  # dockerd 20.10 writes it there whatever its data root
IMAGE_CA_BUNDLE = "/etc/ssl/certs/host-ca-bundle.crt"  # apart from the image's own, which apt may rewrite
LOCAL_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1", "redis-server", "redis-tools")
VENV = "/opt/venv"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class DockerHostError(RuntimeError):
    """A step on the host failed; the message says which and why."""


def run(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600,
        check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run a command with captured output; on failure raise with its stderr tail."""
    out = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout, input=stdin)
    if check and out.returncode != 0:
        tail = (out.stderr or out.stdout).strip()[-2000:]
        raise DockerHostError(f"`{' '.join(argv)}` exited {out.returncode}: {tail}")
    return out


# Wait for another apt on this host (a test installing iptables meanwhile) rather than fail on its lock.
APT_WAIT = ("-o", "DPkg::Lock::Timeout=900")


def apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", *APT_WAIT, "update", "-q"], env=env, timeout=900)
    run(["apt-get", *APT_WAIT, "install", "-y", "-q", "--no-install-recommends", *packages], env=env, timeout=1800)


def dockerd_binary() -> str | None:
    return shutil.which("dockerd") or next((p for p in ("/usr/sbin/dockerd", "/usr/bin/dockerd") if os.access(p, os.X_OK)), None)


def ensure_docker() -> bool:
    """Install Debian's docker.io (daemon, client, containerd, runc) when dockerd is missing; True if installed."""
    if dockerd_binary() and shutil.which("docker"):
        return False
    apt_install("docker.io")
    if not dockerd_binary():
        raise DockerHostError("docker.io is installed but no dockerd binary was found")
    return True


def daemon_answers(env: dict[str, str]) -> bool:
    return run(["docker", "version", "--format", "{{.Server.Version}}"], env=env, timeout=30, check=False).returncode == 0


# ---------------------------------------------------------------- the host's networking


@dataclass
class NetworkState:
    """What a Docker daemon changes on the host: links, forwarding sysctls, iptables rules."""

    links: set[str]
    sysctls: dict[str, str]
    iptables: dict[str, str]  # command (iptables, ip6tables) -> its *-save output

    SYSCTLS = ("/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding",
               "/proc/sys/net/bridge/bridge-nf-call-iptables", "/proc/sys/net/bridge/bridge-nf-call-ip6tables")

    @classmethod
    def read(cls) -> "NetworkState":
        links = set(re.findall(r"^\d+: ([^:@]+)", run(["ip", "-o", "link", "show"]).stdout, re.M))
        sysctls = {p: Path(p).read_text().strip() for p in cls.SYSCTLS if Path(p).exists()}
        tables = {}
        for cmd in ("iptables", "ip6tables"):
            if shutil.which(f"{cmd}-save"):
                tables[cmd] = run([f"{cmd}-save"], check=False).stdout
        return cls(links, sysctls, tables)

    def differences(self, now: "NetworkState") -> list[str]:
        """What differs between this state and `now` (empty: the networking is as it was)."""
        diffs = [f"link {name} appeared" for name in sorted(now.links - self.links)]
        diffs += [f"link {name} vanished" for name in sorted(self.links - now.links)]
        diffs += [f"{p}: {v} -> {now.sysctls.get(p)}" for p, v in self.sysctls.items() if now.sysctls.get(p) != v]
        diffs += [f"{p} appeared ({v})" for p, v in now.sysctls.items() if p not in self.sysctls]
        for cmd in set(self.iptables) | set(now.iptables):
            if rules(self.iptables.get(cmd, "")) != rules(now.iptables.get(cmd, "")):
                diffs.append(f"{cmd} rules differ")
        return diffs


def save_sections(text: str) -> dict[str, list[str]]:
    """iptables-save output by table: {"filter": [":INPUT ACCEPT [0:0]", "-A ...", ...]}."""
    tables: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:], [])
        elif current is not None and line and not line.startswith(("#", "COMMIT")):
            current.append(re.sub(r" \[\d+:\d+\]$", "", line))
    return tables


def rules(text: str) -> dict[str, list[str]]:
    """The meaningful part of iptables-save output: rules, user chains and non-ACCEPT policies.

    A table with none of these behaves as no table at all, which is how an nf_tables host
    shows a table that a daemon created and we emptied again.
    """
    out = {}
    for table, lines in save_sections(text).items():
        kept = [rule for rule in lines if rule.startswith("-A") or (rule.startswith(":") and not rule.endswith(" ACCEPT"))]
        if kept:
            out[table] = kept
    return out


def undo_iptables(cmd: str, before: str, now: str) -> None:
    """Take out only what was added since `before`: rules, then user chains, then policies.

    Rules are deleted one by one rather than whole tables restored, so a change that
    someone else made meanwhile stays.
    """
    old, new = save_sections(before), save_sections(now)
    for table, lines in new.items():
        kept = list(old.get(table, []))
        added = []
        for line in lines:
            if line in kept:
                kept.remove(line)
            else:
                added.append(line)
        for line in reversed([rule for rule in added if rule.startswith("-A ")]):
            run([cmd, "-t", table, "-D", *shlex.split(line)[1:]], check=False)
        for line in added:
            if line.startswith(":") and line.endswith(" -"):  # a user chain, now empty
                run([cmd, "-t", table, "-X", line[1:].split()[0]], check=False)
        policies = {rule[1:].split()[0]: rule.split()[1] for rule in old.get(table, []) if rule.startswith(":")}
        for line in added:
            chain, policy = line[1:].split()[:2] if line.startswith(":") else ("", "-")
            if policy != "-":
                run([cmd, "-t", table, "-P", chain, policies.get(chain, "ACCEPT")], check=False)


def restore_network(before: NetworkState) -> list[str]:
    """Undo a stopped daemon's changes: its links, sysctls and iptables rules; returns what still differs."""
    now = NetworkState.read()
    for name in sorted(now.links - before.links):
        run(["ip", "link", "delete", name], check=False)
    for path, value in before.sysctls.items():
        if now.sysctls.get(path) != value:
            Path(path).write_text(value + "\n")
    for cmd, saved in before.iptables.items():
        undo_iptables(cmd, saved, now.iptables.get(cmd, ""))
    return before.differences(NetworkState.read())


# ---------------------------------------------------------------- a private daemon


@dataclass
class Daemon:
    """A dockerd this test started: private state under `root`, reached through `socket`."""

    proc: subprocess.Popen
    root: Path
    run_dir: Path
    network_before: NetworkState
    made_trust_key: bool
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.root / "dockerd.log"

    @property
    def host(self) -> str:
        return f"unix://{self.run_dir}/docker.sock"

    def stop(self) -> list[str]:
        """Stop dockerd (it stops its containerd), delete its state; returns networking left changed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        left = restore_network(self.network_before)
        mounted = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                   if line.split()[1].startswith((str(self.root), str(self.run_dir)))]
        for path in sorted(mounted, reverse=True):
            run(["umount", "-l", path], check=False)
        for folder in (self.root, self.run_dir):
            shutil.rmtree(folder, ignore_errors=True)
        if self.made_trust_key:
            TRUST_KEY.unlink(missing_ok=True)
            if not any(TRUST_KEY.parent.iterdir()):
                TRUST_KEY.parent.rmdir()
        return left


def start_daemon(timeout_s: float = 120.0) -> Daemon:
    """Start dockerd on private paths and wait until it answers."""
    binary = dockerd_binary()
    assert binary, "ensure_docker() first"
    before = NetworkState.read()
    made_trust_key = not TRUST_KEY.exists()
    root = Path(tempfile.mkdtemp(prefix="pdserve-docker-", dir="/var/tmp"))
    run_dir = Path(tempfile.mkdtemp(prefix="pdsd-", dir="/run"))  # short: socket paths are limited to 107 bytes
    log = open(root / "dockerd.log", "wb")
    argv = [binary, "--data-root", str(root / "data"), "--exec-root", str(run_dir / "exec"),
            "--pidfile", str(run_dir / "dockerd.pid"), "--host", f"unix://{run_dir}/docker.sock"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    daemon = Daemon(proc, root, run_dir, before, made_trust_key)
    env = {**os.environ, "DOCKER_HOST": daemon.host}
    deadline = time.monotonic() + timeout_s
    while not daemon_answers(env):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = daemon.log.read_text(errors="replace")[-2000:]
            daemon.stop()
            raise DockerHostError(f"dockerd did not start: {tail}")
        time.sleep(1)
    return daemon


# ---------------------------------------------------------------- base images without Docker Hub


def debian_mirror(sources: Sequence[Path] = (Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*")))) -> str:
    """The host's configured Debian mirror (one-line or deb822 sources), else deb.debian.org."""
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        found = re.findall(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", text, re.M)
        found += [(uri, "") for uri in re.findall(r"^URIs:\s*(\S+)", text, re.M)]
        for uri, _suite in found:
            if "debian" in uri and "security" not in uri:
                return uri
    return DEFAULT_MIRROR


def try_pull(image: str, env: dict[str, str]) -> bool:
    """One pull attempt (never retried in a loop: a refused registry stays refused)."""
    if run(["docker", "image", "inspect", image], env=env, check=False, timeout=60).returncode == 0:
        return True
    return run(["docker", "pull", "-q", image], env=env, check=False, timeout=600).returncode == 0


def local_base_image(tag: str, env: dict[str, str]) -> None:
    """Import a minimal Debian with Python (venv on PATH), redis-server and the host's CA bundle as `tag`."""
    if not shutil.which("debootstrap"):
        apt_install("debootstrap")
    with ExitStack() as stack:
        rootfs = Path(tempfile.mkdtemp(prefix="pdserve-rootfs-", dir="/var/tmp"))
        stack.callback(shutil.rmtree, rootfs, ignore_errors=True)
        run(["debootstrap", "--variant=minbase", f"--include={','.join(LOCAL_PACKAGES)}", SUITE, str(rootfs),
             debian_mirror()], timeout=1800)
        run(["chroot", str(rootfs), "python3", "-m", "venv", VENV], timeout=300)
        shutil.copyfile(HOST_CA_BUNDLE, rootfs / IMAGE_CA_BUNDLE.lstrip("/"))
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / cache).glob("*"):
                if item.is_file():
                    item.unlink()
        changes = [
            f"ENV PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            f"ENV PIP_CERT={IMAGE_CA_BUNDLE}",
            f"ENV SSL_CERT_FILE={IMAGE_CA_BUNDLE}",
            "CMD [\"python3\"]",
        ]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        argv = ["docker", "import"] + [a for c in changes for a in ("--change", c)] + ["-", tag]
        imported = subprocess.run(argv, stdin=tar.stdout, capture_output=True, text=True, env=env, timeout=900)
        assert tar.stdout is not None  # stdout=PIPE
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise DockerHostError(f"docker import failed: {imported.stderr.strip()[-2000:]}")
