"""Simulated hosts on one machine: network namespaces joined by veth pairs.

    coordinator namespace            host namespaces (one CPU daemon each, under launch-node.sh)
    <tag>c  10.77.0.1/24 ── veth ── 10.77.0.2/24  <tag>h0
            10.77.1.1/24 ── veth ── 10.77.1.2/24  <tag>h1
            10.77.2.1/24 ── veth ── 10.77.2.2/24  <tag>h2

Each daemon binds only its host's address, so the coordinator reaches it the way it would
reach another machine, and, as a fleet on a real network should, requires CURVE: the daemons
share one key pair and allow one trainer key (made by `rolloutctl keygen`), and the scenarios'
coordinator finds its keys in ROLLOUTD_CURVE_SERVER_KEY / ROLLOUTD_CURVE_CLIENT_KEY_FILE. The
test creates and removes everything itself and skips, saying why, where it cannot create
namespaces (it needs root and iproute2).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.environ.get("ROLLOUTD_SOURCE_ROOT", os.path.abspath(os.path.join(HERE, "..", "..", "..")))

# The deploy tests' helpers (launcher wrapper, namespace probe), loaded under another name:
# both directories have a conftest.py.
_spec = importlib.util.spec_from_file_location("rolloutd_deploy_helpers",
                                               os.path.join(SOURCE_ROOT, "tests", "deploy", "conftest.py"))
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)


def pytest_collection_modifyitems(config, items):
    """These tests run on their own (ctest -R fleet, or pytest tests/integration/fleet): when
    pytest was pointed at a parent directory, they are skipped rather than run twice."""
    asked_here = any(os.path.abspath(str(a).split("::")[0]).startswith(HERE) for a in config.args)
    if asked_here:
        return
    skip = pytest.mark.skip(reason="fleet tests run on their own: ctest -R fleet, or pytest tests/integration/fleet")
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)


def make_fleet_keys(directory):
    """One daemon key pair for the fleet and one allowed trainer key, as `rolloutctl keygen` makes them."""
    directory.mkdir()
    (directory / "clients").mkdir()
    rolloutctl = os.environ.get("ROLLOUTCTL_BIN", "rolloutctl")
    for base in (directory / "daemon", directory / "clients" / "trainer"):
        subprocess.run([rolloutctl, "keygen", "--out", str(base)], check=True, capture_output=True, timeout=60)
    return {"daemon_env": {"ROLLOUTD_CURVE_KEY_FILE": str(directory / "daemon.key_secret"),
                           "ROLLOUTD_CURVE_ALLOW": str(directory / "clients")},
            "client_env": {"ROLLOUTD_CURVE_SERVER_KEY": str(directory / "daemon.key"),
                           "ROLLOUTD_CURVE_CLIENT_KEY_FILE": str(directory / "clients" / "trainer.key_secret")}}


class Fleet:
    def __init__(self, tmp_path, num_hosts):
        self.keys = make_fleet_keys(tmp_path / "keys")
        tag = f"rdf{os.getpid() % 100000}"
        self.coord_ns = f"{tag}c"
        self.host_ns = [f"{tag}h{i}" for i in range(num_hosts)]
        self.addresses = [f"10.77.{i}.2" for i in range(num_hosts)]
        self.nodes_dir = tmp_path / "nodes"
        self.nodes_dir.mkdir()
        self.tmp_path = tmp_path
        self.launchers = []
        self._made = []
        try:
            for ns in [self.coord_ns, *self.host_ns]:
                helpers.ip("netns", "add", ns)
                self._made.append(ns)
                helpers.ip("link", "set", "lo", "up", netns=ns)
            for i, ns in enumerate(self.host_ns):
                a, b = f"{tag}c{i}", f"{tag}h{i}"
                helpers.ip("link", "add", a, "netns", self.coord_ns, "type", "veth", "peer", "name", b, "netns", ns)
                helpers.ip("addr", "add", f"10.77.{i}.1/24", "dev", a, netns=self.coord_ns)
                helpers.ip("addr", "add", f"10.77.{i}.2/24", "dev", b, netns=ns)
                helpers.ip("link", "set", a, "up", netns=self.coord_ns)
                helpers.ip("link", "set", b, "up", netns=ns)
        except Exception:
            self.remove_namespaces()
            raise

    def start_launchers(self, extra_daemon_args=()):
        for i, ns in enumerate(self.host_ns):
            args = ["--num-daemons", "1", "--device", "cpu", "--bind", self.addresses[i], "--advertise",
                    self.addresses[i], "--control-port", "7600", "--http-port", "7700", "--backoff-s", "0.3",
                    "--stop-timeout-s", "30", "--", "--drain-timeout-s", "5", *extra_daemon_args]
            self.launchers.append(helpers.Launcher(self.tmp_path, args, netns=ns, name=f"host{i}",
                                                   node_file=self.nodes_dir / f"host{i}.json",
                                                   env=self.keys["daemon_env"]))
        for launcher in self.launchers:
            launcher.wait_running(1, timeout=90)

    def run_scenario(self, name, timeout=300, **params):
        """Runs fleet_scenarios.py <name> in the coordinator's namespace; returns its JSON report."""
        cmd = ["ip", "netns", "exec", self.coord_ns, sys.executable, os.path.join(HERE, "fleet_scenarios.py"), name,
               json.dumps({"nodes_dir": str(self.nodes_dir), **params})]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **self.keys["client_env"]})
        if r.returncode != 0:
            logs = "\n".join(f"--- host{i} launcher ---\n{l.read_log()[-3000:]}" for i, l in enumerate(self.launchers))
            pytest.fail(f"scenario {name} failed (exit {r.returncode}):\n{r.stdout[-5000:]}\n{r.stderr[-8000:]}\n{logs}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def remove_namespaces(self):
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._made = []


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    why = helpers.netns_unavailable_reason()
    if why:
        pytest.skip(f"simulated hosts need network namespaces, and this machine cannot make them: {why}")
    f = Fleet(tmp_path_factory.mktemp("fleet"), num_hosts=3)
    try:
        f.start_launchers()
        yield f
    finally:
        for launcher in f.launchers:
            launcher.kill()
        f.remove_namespaces()
