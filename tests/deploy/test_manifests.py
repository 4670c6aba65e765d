"""The launchers' manifests agree with the daemon: every flag they pass exists, the probes hit
the daemon's health paths on its HTTP port, the grace periods cover the drain. Where the
machine allows, the daemon is run with the manifest's own arguments and probed."""
import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import time

import pytest
import yaml

import rolloutd

from conftest import BIN, SOURCE_ROOT, daemon_env_names, daemon_flags, links_systemd, read_json, wait_for

DEPLOY = os.path.join(SOURCE_ROOT, "deploy")


def flag_values(args):
    """{'--flag': 'value'} from ['--flag=value', '--flag', 'value', ...]."""
    out, i = {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
        elif a.startswith("--"):
            out[a] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            i += 1 if out[a] is not None else 0
        i += 1
    return out


def assert_known_flags(args, where):
    known = daemon_flags()
    unknown = [f for f in flag_values(args) if f not in known]
    assert not unknown, f"{where} passes flags rolloutd does not have: {unknown}"


def default_seconds(flag):
    return float(daemon_flags()[flag])


# ---------------------------------------------------------------- Kubernetes --
@pytest.fixture(scope="module")
def k8s():
    with open(os.path.join(DEPLOY, "k8s", "rolloutd.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert {"Service", "StatefulSet"} <= set(by_kind), set(by_kind)
    return by_kind


def container_of(sts):
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return c


def test_k8s_probes_hit_the_daemon_health_paths_on_its_http_port(k8s):
    c = container_of(k8s["StatefulSet"])
    args = c["args"]
    assert_known_flags(args, "the StatefulSet")
    flags = flag_values(args)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(flags["--http-port"])
    assert ports["control"] == int(flags["--control-port"])
    # Reachable from other pods: both sockets bind every interface.
    assert flags["--bind"] == "0.0.0.0" and flags["--http-bind"] == "0.0.0.0"
    expected = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
    for probe, path in expected.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        port = get["port"]
        assert (ports[port] if isinstance(port, str) else port) == ports["http"], probe
    # Loading weights takes long: the startup probe must allow minutes before liveness applies.
    s = c["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] >= 300
    # Liveness must tolerate the daemon's own stale-heartbeat window before killing it.
    l = c["livenessProbe"]
    assert l["periodSeconds"] * l["failureThreshold"] >= float(flags.get("--stale-heartbeat-s") or 10)


def test_k8s_one_gpu_per_container_and_grace_covers_the_drain(k8s):
    sts = k8s["StatefulSet"]
    c = container_of(sts)
    res = c["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
    flags = flag_values(c["args"])
    assert flags["--device"] == "cuda"
    drain = float(flags.get("--drain-timeout-s") or default_seconds("--drain-timeout-s"))
    flush = float(flags.get("--flush-timeout-s") or default_seconds("--flush-timeout-s"))
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + flush


def test_k8s_control_port_requires_curve_with_mounted_keys(k8s):
    """Reachable from other pods, so the control socket requires CURVE: the key file lies in a
    mounted Secret (owner-only mode), the allowlist in a mounted volume; no --insecure-bind-any."""
    sts = k8s["StatefulSet"]
    c = container_of(sts)
    flags = flag_values(c["args"])
    assert "--insecure-bind-any" not in flags
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}

    def volume_of(path):
        (mount,) = [m for m in mounts if path.startswith(m.rstrip("/") + "/") or path == m]
        return volumes[mounts[mount]]

    key = volume_of(flags["--curve-key-file"])
    assert "secret" in key and key["secret"]["defaultMode"] & 0o077 == 0, key
    assert flags["--curve-key-file"].endswith(".key_secret")
    assert volume_of(flags["--curve-allow"])


def test_k8s_headless_service_selects_the_pods(k8s):
    svc, sts = k8s["Service"], k8s["StatefulSet"]
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert all(labels.get(k) == v for k, v in sts["spec"]["selector"]["matchLabels"].items())
    c = container_of(sts)
    names = {p["name"] for p in c["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in names


def test_k8s_container_arguments_really_serve_the_probe_paths(k8s, netns):
    """The manifest's arguments, unchanged but for --device cpu and the key paths (keys made here),
    in a namespace of their own (the fixed ports cannot collide): every probe path answers 200 on
    the probe's port."""
    c = container_of(k8s["StatefulSet"])
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    with tempfile.TemporaryDirectory() as d:
        # The mounted Secret and ConfigMap, made here with rolloutctl keygen.
        rolloutctl = os.environ.get("ROLLOUTCTL_BIN", "rolloutctl")
        os.mkdir(os.path.join(d, "clients"))
        for base in (os.path.join(d, "daemon"), os.path.join(d, "clients", "trainer")):
            subprocess.run([rolloutctl, "keygen", "--out", base], check=True, capture_output=True, timeout=30)
        local = {"--device": "cpu", "--curve-key-file": os.path.join(d, "daemon.key_secret"),
                 "--curve-allow": os.path.join(d, "clients")}
        args = [f"{a.split('=', 1)[0]}={local[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in local else a
                for a in c["args"]]
        ep_file = os.path.join(d, "ep.json")
        log = open(os.path.join(d, "log"), "wb")
        proc = subprocess.Popen(["ip", "netns", "exec", netns, BIN, *args, "--endpoints-file", ep_file],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            wait_for(lambda: read_json(ep_file) or proc.poll() is not None, 30, "the daemon to listen")
            assert proc.poll() is None, open(os.path.join(d, "log")).read()
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                get = c[probe]["httpGet"]
                port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
                url = f"http://127.0.0.1:{port}{get['path']}"
                code = subprocess.run(["ip", "netns", "exec", netns, "/usr/bin/python3", "-c",
                                       "import sys, urllib.request as u;"
                                       "print(u.urlopen(sys.argv[1], timeout=5).status)", url],
                                      capture_output=True, text=True, timeout=30)
                assert code.stdout.strip() == "200", (probe, url, code.stderr)
            assert read_json(ep_file)["control"] == f"tcp://0.0.0.0:{ports['control']}"
        finally:
            proc.send_signal(15)
            assert proc.wait(timeout=30) == 0
            log.close()


# ------------------------------------------------------------------ systemd --
def parse_unit(path):
    """{section: [(key, value), ...]}: systemd's format (repeated keys, '\\' line continuations)."""
    sections, current, pending = {}, None, ""
    with open(path) as f:
        for raw in f:
            line = pending + raw.rstrip("\n")
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            s = line.strip()
            if not s or s[0] in "#;":
                continue
            if s.startswith("[") and s.endswith("]"):
                current = sections.setdefault(s[1:-1], [])
                continue
            k, _, v = s.partition("=")
            current.append((k.strip(), v.strip()))
    return sections


def unit_value(section, key):
    values = [v for k, v in section if k == key]
    return values[-1] if values else None


def systemd_seconds(v):
    m = re.fullmatch(r"(\d+)(s|min)?", v)
    assert m, v
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def test_systemd_unit_is_notify_restarts_on_failure_and_waits_for_the_drain():
    unit = parse_unit(os.path.join(DEPLOY, "systemd", "rolloutd@.service"))
    svc = unit["Service"]
    assert unit_value(svc, "Type") == "notify"
    assert unit_value(svc, "Restart") == "on-failure"
    assert "64" in unit_value(svc, "RestartPreventExitStatus").split()
    assert systemd_seconds(unit_value(svc, "WatchdogSec")) > 0
    assert systemd_seconds(unit_value(svc, "TimeoutStopSec")) >= \
        default_seconds("--drain-timeout-s") + default_seconds("--flush-timeout-s")
    assert systemd_seconds(unit_value(svc, "TimeoutStartSec")) >= 300
    exec_start = shlex.split(unit_value(svc, "ExecStart"))
    assert_known_flags(exec_start[1:], "rolloutd@.service")
    assert "%i" in flag_values(exec_start[1:])["--local-index"]
    envs = daemon_env_names()
    for k, v in svc:
        if k == "Environment":
            name = v.split("=", 1)[0]
            assert name in envs, f"{name} is not a daemon setting"
    assert unit_value(unit["Unit"], "PartOf") == "rolloutd.target"
    assert unit_value(unit["Install"], "WantedBy") == "rolloutd.target"
    target = parse_unit(os.path.join(DEPLOY, "systemd", "rolloutd.target"))
    assert unit_value(target["Install"], "WantedBy") == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    # Point ExecStart at the built daemon: verify checks that the binary exists.
    for name in ("rolloutd@.service", "rolloutd.target"):
        text = open(os.path.join(DEPLOY, "systemd", name)).read()
        (tmp_path / name).write_text(text.replace("/opt/rolloutd/bin/rolloutd", os.path.abspath(BIN)))
    shutil.copy(tmp_path / "rolloutd@.service", tmp_path / "rolloutd@0.service")
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "rolloutd@0.service"),
                        str(tmp_path / "rolloutd.target")], capture_output=True, text=True, timeout=60)
    # Without a running systemd (containers) verify cannot connect to the bus; that is not the units' fault.
    if r.returncode != 0 and ("Failed to connect to bus" in r.stderr or "System has not been booted" in r.stderr
                              or "Failed to initialize manager" in r.stderr):
        pytest.skip("systemd-analyze verify needs a running systemd: " + r.stderr.strip()[:200])
    problems = [l for l in r.stderr.splitlines() if "rolloutd" in l]
    assert r.returncode == 0 and not problems, r.stderr


def test_daemon_talks_to_systemd_ready_watchdog_stopping(tmp_path):
    """Type=notify as systemd does it: a datagram socket in NOTIFY_SOCKET, WATCHDOG_USEC set.
    READY=1 once listening, WATCHDOG=1 every half interval, STOPPING=1 when the drain starts."""
    if not links_systemd():
        pytest.skip("this rolloutd was built without libsystemd")
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    endpoints = str(tmp_path / "endpoints.json")
    proc = subprocess.Popen([BIN, "--control-port", "0", "--http-port", "0", "--drain-timeout-s", "60",
                             "--endpoints-file", endpoints], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = []
    client = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (sum(m == "WATCHDOG=1" for m in got) < 3 or "READY=1" not in got):
            try:
                got.extend(sock.recv(4096).decode().split("\n"))
            except socket.timeout:
                pass
        assert "READY=1" in got and got.count("WATCHDOG=1") >= 3, got
        # A request keeps the drain open: STOPPING=1 must come when the drain starts, not when
        # it ends (it came after the drain until 2026-12-02).
        client = rolloutd.Client(read_json(endpoints)["control"])
        rid = client.submit([1, 2], max_new_tokens=4000, temperature=1.0, seed=1)
        proc.send_signal(15)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "STOPPING=1" not in got:
            try:
                got.extend(sock.recv(4096).decode().split("\n"))
            except socket.timeout:
                pass
        assert "STOPPING=1" in got, got
        finals = []
        while (ev := client.next_event(0.0)) is not None:
            finals += [ev] if not isinstance(ev, rolloutd.TokensEvent) else []
        assert finals == [], "STOPPING=1 came after the drain had ended the request"
        time.sleep(1.2)  # a second signal counts from 1 s after the first
        proc.send_signal(15)  # the second signal ends the drain now
        while (ev := client.next_event(10.0)) is not None and isinstance(ev, rolloutd.TokensEvent):
            pass
        assert ev is not None and ev.rid == rid and ev.abort_reason == "shutdown", ev
        assert proc.wait(timeout=30) == 0
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        sock.close()


def test_no_watchdog_pings_without_watchdog_usec(tmp_path):
    if not links_systemd():
        pytest.skip("this rolloutd was built without libsystemd")
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_USEC", "WATCHDOG_PID")}
    env["NOTIFY_SOCKET"] = path
    proc = subprocess.Popen([BIN, "--control-port", "0", "--http-port", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "READY=1" not in got:
            try:
                got.extend(sock.recv(4096).decode().split("\n"))
            except socket.timeout:
                pass
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            try:
                got.extend(sock.recv(4096).decode().split("\n"))
            except socket.timeout:
                pass
        assert "READY=1" in got and "WATCHDOG=1" not in got, got
    finally:
        proc.send_signal(15)
        proc.wait(timeout=30)
        sock.close()


# -------------------------------------------------------------------- Slurm --
def test_slurm_example_runs_one_task_per_gpu_and_kills_the_step_on_a_bad_exit():
    text = open(os.path.join(DEPLOY, "slurm", "rolloutd.sbatch")).read()
    srun = " ".join(l.strip().rstrip("\\") for l in text.split("srun ", 1)[1].splitlines()[:3])
    for want in ("--ntasks-per-node=", "--gpus-per-task=1", "--kill-on-bad-exit=1"):
        assert want in srun, srun
    assert "#SBATCH --gpus-per-task=1" in text
    task = open(os.path.join(DEPLOY, "slurm", "srun-task.sh")).read()
    exec_line = " ".join(l.strip().rstrip("\\") for l in task.split("\nexec ", 1)[1].splitlines()[:2])
    args = [a for a in shlex.split(exec_line.replace('"$bin"', "rolloutd")) if a.startswith("--")]
    assert_known_flags(args, "srun-task.sh")


def test_slurm_task_runs_the_daemon_on_cuda_with_a_per_task_endpoints_file(tmp_path):
    """srun-task.sh as Slurm runs it (SLURM_LOCALID=3, one visible device), with a fake daemon
    that prints its arguments: no --gpu, so the daemon picks ordinal 0 itself."""
    fake = tmp_path / "fake.sh"
    fake.write_text("#!/bin/bash\necho \"$@\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "ROLLOUTD_BIN": str(fake), "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "5",
           "ROLLOUTD_RUN_DIR": str(tmp_path), "ROLLOUTD_BIND": "127.0.0.1"}
    out = subprocess.run([os.path.join(DEPLOY, "slurm", "srun-task.sh"), "--", "--drain-timeout-s", "60"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    args = flag_values(out.stdout.split())
    assert args["--device"] == "cuda" and "--gpu" not in args
    assert args["--endpoints-file"].endswith("-3.json") and args["--drain-timeout-s"] == "60"


def test_daemon_under_slurm_env_listens_on_base_plus_localid(netns, tmp_path):
    """The real daemon with Slurm's environment and port bases (what srun-task.sh leaves it):
    SLURM_LOCALID=3 puts it on 7603 / 7703. In a namespace of its own: fixed ports are free."""
    ep_file = str(tmp_path / "ep.json")
    env = {**os.environ, "SLURM_LOCALID": "3", "LOCAL_RANK": "1"}
    proc = subprocess.Popen(["ip", "netns", "exec", netns, BIN, "--device", "cpu", "--control-port", "7600",
                             "--http-port", "7700", "--endpoints-file", ep_file], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ep = wait_for(lambda: read_json(ep_file), 30, "the daemon's endpoints file")
        assert ep["control"] == "tcp://127.0.0.1:7603" and ep["http"] == "http://127.0.0.1:7703"
        assert ep["gpu"] == -1
    finally:
        proc.send_signal(15)
        assert proc.wait(timeout=30) == 0


def test_scripts_parse():
    for rel in ("launch-node.sh", "bundle.sh", "slurm/rolloutd.sbatch", "slurm/srun-task.sh", "systemd/install.sh"):
        r = subprocess.run(["bash", "-n", os.path.join(DEPLOY, rel)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (rel, r.stderr)
