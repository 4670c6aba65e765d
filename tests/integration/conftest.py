"""Fixtures that start real rolloutd processes on ephemeral loopback ports.

Run by ctest with Debian's /usr/bin/python3; ROLLOUTD_BIN points at the built daemon and
PYTHONPATH at the built Python package (tests/CMakeLists.txt sets both).
"""
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

import rolloutd

BIN = os.environ.get("ROLLOUTD_BIN", "rolloutd")


class Daemon:
    """One rolloutd process. Every wait is bounded."""

    def __init__(self, args=(), env=None, control_port=0):
        self.dir = tempfile.mkdtemp(prefix="rolloutd-it-")
        self.endpoints_file = os.path.join(self.dir, "endpoints.json")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.log = open(self.log_path, "wb")
        cmd = [BIN, "--control-port", str(control_port), "--http-port", "0",
               "--endpoints-file", self.endpoints_file, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 30
        while not os.path.exists(self.endpoints_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"rolloutd exited with {self.proc.returncode}:\n{self.read_log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"rolloutd did not start within 30 s:\n{self.read_log()}")
            time.sleep(0.02)
        with open(self.endpoints_file) as f:
            ep = json.load(f)
        self.control = ep["control"]
        self.http = ep["http"]
        self.control_port = int(self.control.rsplit(":", 1)[1])

    def client(self, timeout_s=30.0):
        return rolloutd.Client(self.control, timeout_s=timeout_s)

    def get(self, path, method="GET"):
        """(status, body) of an HTTP request to the daemon's health server."""
        req = urllib.request.Request(self.http + path, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name, **labels):
        """Value of one Prometheus sample (0 if absent)."""
        _, text = self.get("/metrics")
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if key == want:
                return float(value)
        return 0.0

    def terminate(self, timeout=30):
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"rolloutd did not exit within {timeout} s of SIGTERM:\n{self.read_log()}")

    def read_log(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-20000:]

    def log_lines(self):
        out = []
        for line in self.read_log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


def final_events(client, rids, timeout_s):
    """{rid: final event} of `rids`, read from client.events() (each wait at most timeout_s);
    fails on a second final event for one rid or when one never comes."""
    want, finals = set(rids), {}
    for ev in client.events(timeout_s=timeout_s):
        if not isinstance(ev, rolloutd.TokensEvent):
            assert ev.rid not in finals, f"two final events for {ev.rid}"
            finals[ev.rid] = ev
        if want <= set(finals):
            break
    assert set(finals) == want, f"no final event for {sorted(want - set(finals))}"
    return finals


def wait_queue(client, running, waiting, timeout_s=10.0):
    """Waits (bounded) until the daemon reports `running` requests running and `waiting` queued."""
    deadline = time.monotonic() + timeout_s
    while (st := client.status()).num_running != running or st.num_waiting != waiting:
        assert time.monotonic() < deadline, st
        time.sleep(0.005)


@pytest.fixture
def daemon_factory():
    started = []

    def start(*args, **kwargs):
        d = Daemon(*args, **kwargs)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(timeout=10)
        d.log.close()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()
