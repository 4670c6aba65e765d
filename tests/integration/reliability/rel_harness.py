"""Helpers and fixtures of the reliability tests (issue 10): child processes, probes,
figures.

Builds on tests/integration/conftest.py (loaded here under its own module name, since
pytest keeps every conftest as a module called "conftest"). There is no conftest.py in this
directory, for the same reason: a second module named "conftest" would shadow the suite's
for tests that import from it. Test modules import the fixtures below by name. Every wait
is bounded.

Environment:
  ROLLOUTD_BIN, ROLLOUTD_SOURCE_ROOT, PYTHONPATH   as for the other integration tests
  ROLLOUTD_SANITIZER=tsan|asan   the daemon is sanitizer-built: latency bounds are reported,
                                 not asserted, and time budgets grow
  ROLLOUTD_RELIABILITY_REPORT=F  append one JSON line of figures per test to F
"""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("rolloutd_integration_conftest",
                                              os.path.join(os.path.dirname(_HERE), "conftest.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
Daemon = _base.Daemon
BIN = _base.BIN
# The suite's daemon fixture, also available when pytest is pointed at this directory alone.
daemon_factory = _base.daemon_factory

SOURCE_ROOT = os.environ.get("ROLLOUTD_SOURCE_ROOT", os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
SANITIZER = os.environ.get("ROLLOUTD_SANITIZER", "")
# Sanitized daemons run several times slower: bounded waits scale with this.
SLOW = {"tsan": 6.0, "asan": 3.0}.get(SANITIZER, 1.0)
LIVEZ_BOUND_S = 0.100

sys.path.insert(0, os.path.join(SOURCE_ROOT, "tests", "reference"))
sys.path.insert(0, _HERE)


def report(name, **figures):
    """Prints the figures of one test (pytest -s shows them; ctest keeps them on failure)
    and appends them as a JSON line to $ROLLOUTD_RELIABILITY_REPORT."""
    line = json.dumps({"test": name, "sanitizer": SANITIZER or "none", **figures}, sort_keys=True)
    print("RELIABILITY " + line, flush=True)
    path = os.environ.get("ROLLOUTD_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s, what, interval_s=0.05):
    """Polls predicate() until it returns a true value (returned) or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(interval_s)


def vm_rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def percentile(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    k = min(len(v) - 1, max(0, int(round(q / 100.0 * (len(v) - 1)))))
    return v[k]


class Child:
    """A Python child process running tests/integration/reliability/<script>.py, talking
    lines of JSON on stdout. Killed (SIGKILL) by the test or at teardown."""

    def __init__(self, script, *args, nice=0):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_HERE, os.path.join(SOURCE_ROOT, "tests", "reference"),
                                            env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, "-u", os.path.join(_HERE, script), *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self._lines = []
        self._cv = threading.Condition()
        self._eof = False
        self._stderr = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self):
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                msg = {"raw": raw.decode(errors="replace")}
            with self._cv:
                self._lines.append(msg)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def _pump_err(self):
        for raw in self.proc.stderr:
            self._stderr.append(raw.decode(errors="replace"))

    def stderr(self):
        return "".join(self._stderr[-200:])

    def expect(self, key, timeout_s):
        """The first message with `key` (waiting up to timeout_s for it)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for m in self._lines:
                    if key in m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(f"child {self.proc.args[2:]} sent no '{key}' "
                                         f"(exit {self.proc.poll()}):\n{self.stderr()}")
                self._cv.wait(left)

    def messages(self):
        with self._cv:
            return list(self._lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def wait(self, timeout_s):
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"child {self.proc.args[2:]} did not finish within {timeout_s} s:\n{self.stderr()}")


def livez_less_host_wait(latencies, host_waits):
    """What the daemon is answerable for: each /livez latency less the time the probe and
    the daemon's HTTP thread sat runnable without a CPU (other tests share CI's two cores)."""
    return [max(0.0, t - w) for t, w in zip(latencies, host_waits)]


def assert_livez_bound(latencies, host_waits):
    """Every probe answered within LIVEZ_BOUND_S of the daemon's own time (issue 10)."""
    own = livez_less_host_wait(latencies, host_waits)
    worst = max(range(len(own)), key=own.__getitem__)
    assert own[worst] < LIVEZ_BOUND_S, (f"/livez took {latencies[worst] * 1e3:.1f} ms, of which the host held "
                                        f"{host_waits[worst] * 1e3:.1f} ms")


class LivezProbe:
    """Runs probe_livez.py in its own process (so this process's GIL and the load
    generators cannot delay it), GETting /livez every interval; stop() returns the
    latencies in seconds, the host's share of each (run-queue waits of the probe and of
    the daemon's HTTP thread, see probe_livez.py) and the non-200 answers."""

    def __init__(self, children, daemon, interval_s=0.02):
        self.child = children("probe_livez.py", daemon.http, interval_s, daemon.proc.pid)
        self.schedstat = self.child.expect("started", 10)["schedstat"]

    def stop(self):
        self.child.proc.send_signal(signal.SIGTERM)
        self.child.wait(10)
        done = self.child.expect("latencies_s", 5)
        return done["latencies_s"], done["host_wait_s"], done["failures"]



@pytest.fixture
def children():
    """Starts Child processes; kills whatever is left at teardown."""
    started = []

    def start(script, *args, **kwargs):
        c = Child(script, *args, **kwargs)
        started.append(c)
        return c

    yield start
    for c in started:
        c.kill()


@pytest.fixture
def shm_cleanup():
    """Names (without the leading '/') of POSIX shm objects a killed trainer may leave."""
    names = []
    yield names
    for n in names:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except FileNotFoundError:
            pass
