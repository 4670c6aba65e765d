"""The control plane's security (SPEC §1.2) with real daemons: CURVE keys made by `rolloutctl keygen`,
an allowed client that works, unknown and plain clients refused at once with `unauthenticated` and
counted by the daemon, loopback-only binding without keys, a read-only HTTP endpoint, and the bounds
on shared-memory buckets."""
import json
import os
import socket
import stat
import subprocess
import time
from multiprocessing import shared_memory

import numpy as np
import pytest

import rolloutd
from conftest import BIN, Daemon

ROLLOUTCTL = os.environ.get("ROLLOUTCTL_BIN", "rolloutctl")


def rolloutctl(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_CURVE_")}
    return subprocess.run([ROLLOUTCTL, *args], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def keygen(base):
    r = rolloutctl("keygen", "--out", str(base))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def keys(tmp_path):
    """A daemon key pair, an allowed client ("trainer") and a stranger, as files."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    k = {"daemon": keygen(tmp_path / "daemon"), "trainer": keygen(allowed / "trainer"),
         "stranger": keygen(tmp_path / "stranger"), "dir": tmp_path, "allowed": allowed}
    return k


def curve_keys(keys, who):
    return rolloutd.CurveKeys.load(server_key=keys["daemon"]["public_file"], client_key_file=keys[who]["secret_file"])


@pytest.fixture
def secured(daemon_factory, keys):
    d = daemon_factory(args=["--curve-key-file", keys["daemon"]["secret_file"], "--curve-allow", str(keys["allowed"])])
    return d


def expect_unauthenticated(call, within_s=5.0):
    t0 = time.monotonic()
    with pytest.raises(rolloutd.RolloutdError) as e:
        call()
    took = time.monotonic() - t0
    assert e.value.code == "unauthenticated", (e.value.code, e.value.message)
    assert took < within_s, f"refusal took {took:.1f} s: it must not wait for the call's deadline"
    return e.value


def wait_log(d, pred, timeout=5.0):
    """Log lines matching pred, waiting for the daemon's once-a-second flush of info lines."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [l for l in d.log_lines() if pred(l)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def wait_metric(d, name, at_least, **labels):
    deadline = time.monotonic() + 5
    while d.metric(name, **labels) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return d.metric(name, **labels)


# ------------------------------------------------------------------------- keygen --
def test_keygen_writes_a_usable_pair_with_a_private_secret(tmp_path):
    out = keygen(tmp_path / "node")
    assert out["public_file"] == str(tmp_path / "node.key") and out["secret_file"] == str(tmp_path / "node.key_secret")
    assert len(out["public_key"]) == 40
    assert stat.S_IMODE(os.stat(out["secret_file"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out["public_file"]).st_mode) == 0o644
    secret_text = open(out["secret_file"]).read()
    public_text = open(out["public_file"]).read()
    assert out["public_key"] in public_text and "secret-key" not in public_text
    assert "secret-key" in secret_text
    # The pair loads in Python as the same keys (pyzmq-style certificates).
    loaded = rolloutd.CurveKeys.load(server_key=out["public_file"], client_key_file=out["secret_file"])
    assert loaded.server_key == loaded.public_key == out["public_key"]
    assert loaded.secret_key not in repr(loaded)
    # Never overwrites a key by accident.
    again = rolloutctl("keygen", "--out", str(tmp_path / "node"))
    assert again.returncode == 2 and json.loads(again.stderr)["error"]["code"] == "failed_precondition"
    assert open(out["secret_file"]).read() == secret_text
    assert rolloutctl("keygen", "--out", str(tmp_path / "node"), "--force").returncode == 0
    assert open(out["secret_file"]).read() != secret_text
    # The Python twin.
    pub, pub_path, sec_path = rolloutd.keygen(str(tmp_path / "py"))
    assert stat.S_IMODE(os.stat(sec_path).st_mode) == 0o600 and pub in open(pub_path).read()


# --------------------------------------------------------------- a CURVE daemon --
def test_allowed_key_connects_and_works(secured, keys):
    with rolloutd.Client(secured.control, timeout_s=30, curve=curve_keys(keys, "trainer")) as c:
        hello = c.hello()
        assert hello.daemon == "rolloutd"
        r = c.generate([1, 2, 3], max_new_tokens=4, temperature=0.0, return_routed_experts=True)
        assert r.ok and len(r.token_ids) == 4 and r.routed_experts is not None
    assert secured.metric("rolloutd_auth_accepted_total") >= 1
    assert secured.metric("rolloutd_auth_denied_total", reason="unknown_key") == 0
    _, body = secured.get("/v1/status")
    sec = json.loads(body)["security"]
    assert sec["curve"] is True and sec["clients_allowed"] == 1
    assert sec["curve_public_key"] == keys["daemon"]["public_key"]
    assert sec["auth_accepted_total"] >= 1
    with open(secured.endpoints_file) as f:
        assert json.load(f)["curve_public_key"] == keys["daemon"]["public_key"]
    listening = wait_log(secured, lambda l: l.get("msg") == "listening")
    assert listening and listening[0]["security"]["curve"] is True
    # The secret key appears nowhere in the daemon's output.
    secret = open(keys["daemon"]["secret_file"]).read().split("secret-key = ")[1].split('"')[1]
    assert secret not in secured.read_log()


def test_unknown_key_is_refused_at_once_and_counted(secured, keys):
    with rolloutd.Client(secured.control, timeout_s=30, curve=curve_keys(keys, "stranger")) as c:
        err = expect_unauthenticated(c.hello)
        assert "--curve-allow" in err.message
        expect_unauthenticated(c.status)  # still refused, still fast
    assert wait_metric(secured, "rolloutd_auth_denied_total", 1, reason="unknown_key") >= 1
    refused = wait_log(secured, lambda l: l.get("msg") == "control connection refused")
    assert refused and refused[0]["reason"] == "unknown_key"
    assert refused[0]["client_public_key"] == keys["stranger"]["public_key"]
    # The daemon keeps serving its own clients.
    with rolloutd.Client(secured.control, timeout_s=30, curve=curve_keys(keys, "trainer")) as c:
        assert c.status().ready


def test_plain_client_is_refused_when_keys_are_configured(secured, keys):
    with rolloutd.Client(secured.control, timeout_s=30, curve=False) as c:
        err = expect_unauthenticated(c.hello)
        assert "requires CURVE" in err.message
    # not_curve, or handshake_aborted when the client reset the connection before the daemon read
    # its greeting: which one depends on who reads first, and both are counted refusals.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (secured.metric("rolloutd_auth_denied_total", reason="not_curve") +
                                           secured.metric("rolloutd_auth_denied_total", reason="handshake_aborted")) < 1:
        time.sleep(0.05)
    assert (secured.metric("rolloutd_auth_denied_total", reason="not_curve") +
            secured.metric("rolloutd_auth_denied_total", reason="handshake_aborted")) >= 1
    # A wrong server key (a client configured for another daemon) is refused too.
    wrong = rolloutd.CurveKeys.load(server_key=keys["stranger"]["public_file"],
                                    client_key_file=keys["trainer"]["secret_file"])
    with rolloutd.Client(secured.control, timeout_s=30, curve=wrong) as c:
        expect_unauthenticated(c.hello)
    assert wait_metric(secured, "rolloutd_auth_denied_total", 1, reason="handshake_failed") >= 1
    _, body = secured.get("/v1/status")
    assert json.loads(body)["security"]["auth_denied_total"] >= 2


def test_rolloutctl_and_environment_keys(secured, keys):
    env = {"ROLLOUTD_ENDPOINT": secured.control}
    plain = rolloutctl("status", env=env)
    assert plain.returncode == 2 and json.loads(plain.stderr)["error"]["code"] == "unauthenticated"
    ok = rolloutctl("--server-key", keys["daemon"]["public_key"], "--client-key-file", keys["trainer"]["secret_file"],
                    "status", env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ready"] is True
    env_keys = {**env, "ROLLOUTD_CURVE_SERVER_KEY": keys["daemon"]["public_file"],
                "ROLLOUTD_CURVE_CLIENT_KEY_FILE": keys["trainer"]["secret_file"]}
    assert rolloutctl("status", env=env_keys).returncode == 0
    half = rolloutctl("status", env={**env, "ROLLOUTD_CURVE_SERVER_KEY": keys["daemon"]["public_key"]})
    assert half.returncode == 2 and json.loads(half.stderr)["error"]["field"] == "client_key_file"
    # The Python client reads the same variables when not given keys.
    code = ("import rolloutd, sys; c = rolloutd.Client(sys.argv[1], timeout_s=10); "
            "print(c.status().ready, c.curve is not None)")
    r = subprocess.run(["/usr/bin/python3", "-c", code, secured.control], capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env_keys})
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stderr


def test_coordinator_passes_keys_to_every_daemon(daemon_factory, keys):
    args = ["--curve-key-file", keys["daemon"]["secret_file"], "--curve-allow", str(keys["allowed"])]
    a, b = daemon_factory(args=args), daemon_factory(args=args)
    with rolloutd.Coordinator([a.control, b.control], curve=curve_keys(keys, "trainer"),
                              heartbeat_interval_s=0.2) as fleet:
        fleet.wait_ready(timeout_s=30)
        rids = fleet.submit_many([[1, 2, 3]] * 4, max_new_tokens=3, temperature=0.0)
        results = fleet.collect(rids, timeout_s=60)
        assert all(results[r].ok and len(results[r].token_ids) == 3 for r in rids)
    assert a.metric("rolloutd_auth_denied_total", reason="unknown_key") == 0


def test_daemon_key_from_the_environment(daemon_factory, keys, tmp_path):
    secret = open(keys["daemon"]["secret_file"]).read().split("secret-key = ")[1].split('"')[1]
    allow = tmp_path / "allow.txt"
    allow.write_text("# the trainer\n" + keys["trainer"]["public_key"] + "\n")
    d = daemon_factory(args=["--curve-allow", str(allow)], env={"ROLLOUTD_CURVE_SECRET_KEY": secret})
    with rolloutd.Client(d.control, timeout_s=30, curve=curve_keys(keys, "trainer")) as c:
        assert c.status().ready
    config = wait_log(d, lambda l: l.get("msg") == "configuration")[0]
    assert secret not in json.dumps(config) and secret not in d.read_log()


# ------------------------------------------------------------ start-up refusals --
def run_daemon(*args, env=None):
    return subprocess.run([BIN, "--control-port", "0", "--http-port", "0", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_no_keys_refuses_a_non_loopback_bind_with_exit_64():
    r = run_daemon("--bind", "0.0.0.0")
    assert r.returncode == 64
    assert "--insecure-bind-any" in r.stderr and "--curve-key-file" in r.stderr and "0.0.0.0" in r.stderr


def test_insecure_bind_any_is_allowed_and_says_so(daemon_factory):
    d = daemon_factory(args=["--bind", "0.0.0.0", "--insecure-bind-any"])
    _, body = d.get("/v1/status")
    sec = json.loads(body)["security"]
    assert sec == {**sec, "curve": False, "insecure_bind_any": True, "clients_allowed": 0}
    assert wait_log(d, lambda l: "WITHOUT AUTHENTICATION" in l.get("msg", "") and l["level"] == "warn")
    port = d.control.rsplit(":", 1)[1]
    with rolloutd.Client(f"tcp://127.0.0.1:{port}", timeout_s=30) as c:
        assert c.status().ready


def test_loopback_default_says_so(daemon):
    _, body = daemon.get("/v1/status")
    sec = json.loads(body)["security"]
    assert sec["curve"] is False and sec["insecure_bind_any"] is False
    assert daemon.control.startswith("tcp://127.0.0.1:") and daemon.http.startswith("http://127.0.0.1:")
    assert wait_log(daemon, lambda l: "loopback only" in l.get("msg", ""))


@pytest.mark.parametrize("extra, needle", [
    (["--curve-key-file", "/nonexistent/daemon.key_secret", "--curve-allow", "/tmp"], "nonexistent"),
    (["--curve-key-file", "{public}"], "--curve-allow"),
    (["--curve-allow", "{allowed}"], "--curve-key-file"),
    (["--curve-key-file", "{public}", "--curve-allow", "{allowed}"], "key_secret"),
    (["--curve-key-file", "{secret}", "--curve-allow", "{empty}"], "no public key"),
])
def test_bad_security_configuration_exits_64(keys, extra, needle):
    empty = keys["dir"] / "empty"
    empty.mkdir(exist_ok=True)
    subst = {"public": keys["daemon"]["public_file"], "secret": keys["daemon"]["secret_file"],
             "allowed": str(keys["allowed"]), "empty": str(empty)}
    r = run_daemon(*[a.format(**subst) for a in extra])
    assert r.returncode == 64, r.stdout[-2000:]
    assert needle in r.stderr, r.stderr


# ------------------------------------------------------------------------- HTTP --
def test_http_is_read_only(daemon):
    with daemon.client() as c:
        before = c.status()
    for path in ("/livez", "/readyz", "/metrics", "/v1/status", "/v1/shutdown", "/"):
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            code, _ = daemon.get(path, method=method)
            assert code == 405, (method, path, code)
    assert daemon.get("/v1/status")[0] == 200
    with daemon.client() as c:
        after = c.status()
        assert after.ready and after.weight_version == before.weight_version
    assert daemon.proc.poll() is None


def test_http_binds_where_the_operator_says(daemon_factory):
    d = daemon_factory(args=["--http-bind", "127.0.0.2"])
    assert d.http.startswith("http://127.0.0.2:")
    assert d.get("/livez")[0] == 200


def _ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("bind, http_bind", [("localhost", "localhost"), ("::1", "::1"), ("[::1]", "127.0.0.1")])
def test_every_loopback_form_the_docs_name_binds_and_serves(daemon_factory, bind, http_bind):
    # SPEC: plain mode binds 127.0.0.0/8, ::1 and localhost; these passed validation and then
    # failed to bind (exit 2), and the client could not connect to an IPv6 endpoint.
    if ":" in bind + http_bind and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    d = daemon_factory(args=["--bind", bind, "--http-bind", http_bind])
    assert d.control.startswith("tcp://[::1]:" if ":" in bind else "tcp://127.0.0.1:")
    with d.client() as c:
        assert c.generate([1, 2], max_new_tokens=3).finish_reason == "length"
    assert d.get("/livez")[0] == 200


# ---------------------------------------------------- shared-memory bucket bounds --
def test_shm_buckets_are_confined_to_the_prefix_and_bounded_in_size(daemon_factory):
    d = daemon_factory(args=["--shm-prefix", "/rolloutd_tenant_a", "--max-shm-bucket-bytes", str(1 << 20)])
    name = f"rolloutd_tenant_b_{os.getpid()}"
    with d.client() as c:
        c.hello()
        param = c.weights_checksum().parameters[0]
        w = np.zeros(param.shape, dtype=np.float32)  # bfloat16 parameters take float32 too
        entries, data = rolloutd.weights.pack_bucket([(param.name, w)])
        s = c.begin_weight_update().session
        # Another tenant's prefix (it starts with the same letters) is not ours.
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_shm(s, entries, "/" + name, 0, len(data))
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.source.name")
        # A size over the bound is refused before anything is opened: no such object exists.
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_shm(s, entries, f"/rolloutd_tenant_a_missing_{os.getpid()}", 0, 2 << 20)
        assert (e.value.code, e.value.field) == ("too_large", "body.source.size")
        # ...and a sparse object of any size costs its maker nothing, so its size is no bound.
        big = shared_memory.SharedMemory(name=f"rolloutd_tenant_a_{os.getpid()}", create=True, size=4 << 30)
        try:
            with pytest.raises(rolloutd.RolloutdError) as e:
                c.update_weights_shm(s, entries, "/" + big.name, 0, 4 << 30)
            assert (e.value.code, e.value.field) == ("too_large", "body.source.size")
        finally:
            big.close()
            big.unlink()
        assert c.abort_weight_update(s).state == "ready"
        assert c.status().ready
