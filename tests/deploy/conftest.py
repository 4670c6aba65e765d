"""Helpers for the deploy tests: the launcher, manifests, systemd notify, the bundle.

ctest sets ROLLOUTD_BIN, ROLLOUTCTL_BIN, ROLLOUTD_BUILD_DIR, ROLLOUTD_SOURCE_ROOT and
PYTHONPATH (tests/CMakeLists.txt, rd_add_pytest). Every wait here is bounded.
"""
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest

SOURCE_ROOT = os.environ.get("ROLLOUTD_SOURCE_ROOT", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BIN = os.environ.get("ROLLOUTD_BIN", "rolloutd")
LAUNCHER = os.path.join(SOURCE_ROOT, "deploy", "launch-node.sh")


def http_get(url, timeout=5.0):
    """(status, body) of a GET; raises OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_for(predicate, timeout, what, interval=0.05):
    """Polls predicate() until it returns something truthy; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _help_lines():
    out = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=30).stdout
    lines = [l for l in out.splitlines() if re.match(r"\s+--[a-z]", l)]
    assert any(l.strip().startswith("--http-port") for l in lines), out
    return lines


def daemon_flags():
    """{flag: default or None} for every long flag `rolloutd --help` lists
    ("  --drain-timeout-s FLOAT:FLOAT in [0 - 3600]=30 (Env:ROLLOUTD_DRAIN_TIMEOUT_S)")."""
    flags = {}
    for line in _help_lines():
        head = line.split("(Env:")[0]
        default = re.search(r"=(\S+)\s*$", head)
        flags[re.match(r"\s+(--[a-z0-9-]+)", head).group(1)] = default.group(1) if default else None
    return flags


def daemon_env_names():
    """{ROLLOUTD_*: flag}: the environment twin of every flag."""
    out = {}
    for line in _help_lines():
        m = re.match(r"\s+(--[a-z0-9-]+).*\(Env:(\w+)\)", line)
        if m:
            out[m.group(2)] = m.group(1)
    return out


def links_systemd():
    out = subprocess.run(["ldd", BIN], capture_output=True, text=True, timeout=30).stdout
    return "libsystemd" in out


class Launcher:
    """deploy/launch-node.sh in a subprocess (optionally inside a network namespace)."""

    def __init__(self, tmp_path, args=(), env=None, netns=None, name="node", node_file=None):
        self.dir = tmp_path / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node_file = str(node_file or self.dir / "endpoints.json")
        self.log_path = str(self.dir / "launcher.log")
        cmd = [LAUNCHER, "--run-dir", str(self.dir / "run"), "--log-dir", str(self.dir / "logs"),
               "--endpoints-file", self.node_file, *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def node(self):
        return read_json(self.node_file)

    def daemons(self):
        n = self.node()
        return [] if n is None else n["daemons"]

    def wait_running(self, n, timeout=60.0):
        def running():
            if self.proc.poll() is not None:
                pytest.fail(f"launcher exited {self.proc.returncode}:\n{self.read_log()}")
            ds = self.daemons()
            return ds if len(ds) == n and all(d["state"] == "running" for d in ds) else None
        return wait_for(running, timeout, f"{n} running daemon(s)")

    def daemon_log(self, index):
        try:
            with open(self.dir / "logs" / f"daemon-{index}.log", "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def daemon_log_lines(self, index):
        out = []
        for line in self.daemon_log(index).splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def read_log(self):
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-20000:]

    def terminate(self, timeout=60.0):
        if self.proc.poll() is None:
            self.proc.send_signal(15)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"launcher did not exit within {timeout} s of SIGTERM:\n{self.read_log()}")

    def kill(self):
        """Last resort (test teardown): the launcher and, as they are orphaned then, its daemons.
        A launcher that exited by itself has stopped its daemons already."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            for d in self.daemons():
                if d.get("pid") and d["state"] in ("starting", "running"):
                    try:
                        os.kill(d["pid"], 9)
                    except OSError:
                        pass
        self._log.close()


@pytest.fixture
def launcher_factory(tmp_path):
    started = []

    def start(*args, **kwargs):
        kwargs.setdefault("name", f"node{len(started)}")
        launcher = Launcher(tmp_path, *args, **kwargs)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()


def netns_unavailable_reason():
    """None when this process may create network namespaces (root with iproute2), else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the tests as root)"
    probe = f"rdprobe{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run `ip netns add` ({e}); install iproute2"
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def ip(*args, netns=None):
    cmd = ["ip", *args] if netns is None else ["ip", "-n", netns, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


@pytest.fixture
def netns():
    """A fresh network namespace with loopback up (its own port space); removed afterwards."""
    why = netns_unavailable_reason()
    if why:
        pytest.skip(f"cannot create a network namespace: {why}")
    name = f"rdt{os.getpid()}"
    ip("netns", "add", name)
    try:
        ip("link", "set", "lo", "up", netns=name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
