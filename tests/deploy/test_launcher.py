"""deploy/launch-node.sh: SIGTERM reaches every daemon and they drain; a daemon that keeps
crashing makes the launcher give up with a non-zero exit; a killed daemon is restarted."""
import os
import signal
import stat
import threading
import time

import pytest

import rolloutd
from conftest import http_get, read_json, wait_for

FAST = ["--backoff-s", "0.2", "--backoff-max-s", "1", "--stop-timeout-s", "30"]


def fake_daemon(tmp_path, body):
    """A stand-in for rolloutd (ROLLOUTD_BIN): a bash script that gets the daemon's flags."""
    path = tmp_path / "fake-rolloutd.sh"
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_sigterm_reaches_every_daemon_and_all_exit_0_after_draining(launcher_factory):
    node = launcher_factory(["--num-daemons", "2", "--device", "cpu", "--control-port", "0", "--http-port", "0",
                             *FAST, "--", "--drain-timeout-s", "20"])
    daemons = node.wait_running(2)
    assert [d["index"] for d in daemons] == [0, 1]
    assert len({d["control"] for d in daemons}) == 2
    clients = [rolloutd.Client(d["control"], timeout_s=10) for d in daemons]
    rids = [[c.submit([1 + i, 2, 3], max_new_tokens=1000, temperature=1.0, seed=i) for i in range(4)]
            for c in clients]
    finals = [{}, {}]

    def read(k):  # one reader per daemon, reading while it drains (a Client per thread)
        deadline = time.monotonic() + 30
        while len(finals[k]) < len(rids[k]) and time.monotonic() < deadline:
            ev = clients[k].next_event(0.5)
            if isinstance(ev, (rolloutd.FinishedEvent, rolloutd.FailedEvent)):
                assert ev.rid not in finals[k], "two final events for one request"
                finals[k][ev.rid] = ev
    readers = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in readers:
        t.start()
    node.proc.send_signal(signal.SIGTERM)
    for t in readers:
        t.join(timeout=40)
    # Every accepted request still ends normally: the daemons drain before they exit.
    for k in range(2):
        assert set(finals[k]) == set(rids[k]), node.daemon_log(k)[-3000:]
        assert all(isinstance(f, rolloutd.FinishedEvent) and f.reason == "length" for f in finals[k].values())
        clients[k].close()
    assert node.proc.wait(timeout=60) == 0, node.read_log()
    for i in range(2):
        lines = node.daemon_log_lines(i)
        assert any(l.get("msg") == "drain started" for l in lines), node.daemon_log(i)
        assert [l["exit_code"] for l in lines if l.get("msg") == "stopped"] == [0]
    assert all(d["state"] == "stopped" for d in node.daemons())


def test_daemon_that_crashes_three_times_in_a_row_makes_the_launcher_exit_nonzero(tmp_path, launcher_factory):
    starts = tmp_path / "starts"
    fake = fake_daemon(tmp_path, f'echo "$$ $*" >> {starts}\nexit 3\n')
    node = launcher_factory(["--num-daemons", "2", "--device", "cpu", *FAST], env={"ROLLOUTD_BIN": fake})
    rc = node.proc.wait(timeout=30)
    assert rc == 1, node.read_log()
    log = node.read_log()
    assert "giving up" in log
    lines = starts.read_text().splitlines()
    # Daemon 0 ran three times, each with its own local index and the launcher's flags.
    assert sum(" --local-index 0 " in l for l in lines) == 3
    assert all("--device cpu" in l and "--endpoints-file" in l for l in lines)
    assert any(d["state"] == "failed" for d in node.daemons())


def test_crashes_that_stop_are_forgiven_and_the_daemon_keeps_running(tmp_path, launcher_factory):
    # Crashes twice, then behaves: writes its endpoints file and exits 0 on SIGTERM.
    count = tmp_path / "count"
    fake = fake_daemon(tmp_path, f"""
n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}
(( n <= 2 )) && exit 3
file=""; while (( $# )); do [[ $1 == --endpoints-file ]] && file=$2; shift; done
echo '{{"control":"tcp://127.0.0.1:1","gpu":-1,"http":"http://127.0.0.1:1","pid":'$$'}}' > "$file"
trap 'exit 0' TERM
while :; do sleep 0.05; done
""")
    node = launcher_factory(["--num-daemons", "1", "--device", "cpu", *FAST], env={"ROLLOUTD_BIN": fake})
    (d,) = node.wait_running(1, timeout=30)
    assert d["restarts"] == 2
    assert node.terminate() == 0, node.read_log()


def test_usage_error_is_not_retried(tmp_path, launcher_factory):
    starts = tmp_path / "starts"
    fake = fake_daemon(tmp_path, f'echo x >> {starts}\nexit 64\n')
    node = launcher_factory(["--num-daemons", "1", "--device", "cpu", *FAST], env={"ROLLOUTD_BIN": fake})
    assert node.proc.wait(timeout=30) == 64
    assert starts.read_text().count("x") == 1


def test_killed_daemon_is_restarted_and_the_endpoints_file_follows(launcher_factory):
    node = launcher_factory(["--num-daemons", "2", "--device", "cpu", "--control-port", "0", "--http-port", "0",
                             *FAST])
    before = node.wait_running(2)
    victim = before[1]
    os.kill(victim["pid"], signal.SIGKILL)

    def restarted():
        ds = node.daemons()
        return ds if ds[1]["restarts"] == 1 and ds[1]["state"] == "running" else None
    after = wait_for(restarted, 30, "the launcher to restart daemon 1")
    assert after[1]["pid"] != victim["pid"]
    assert after[0] == before[0]  # the other one was left alone
    assert http_get(after[1]["http"] + "/livez")[0] == 200
    with rolloutd.Client(after[1]["control"], timeout_s=10) as c:
        assert c.generate([1, 2, 3], max_new_tokens=3).ok
    assert node.terminate() == 0, node.read_log()


def test_node_file_lists_fixed_ports_by_local_index(netns, launcher_factory):
    """With port bases (not 0), daemon i listens on base+i: what the daemon's --local-index does.
    In a namespace of its own, so the fixed ports cannot collide with anything."""
    base = 7600
    node = launcher_factory(["--num-daemons", "2", "--device", "cpu", "--control-port", str(base),
                             "--http-port", str(base + 10), *FAST], netns=netns)
    daemons = node.wait_running(2)
    assert [d["control"] for d in daemons] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    assert [d["http"] for d in daemons] == [f"http://127.0.0.1:{base + 10}", f"http://127.0.0.1:{base + 11}"]
    node_doc = read_json(node.node_file)
    assert node_doc["launcher_pid"] == node.proc.pid and node_doc["device"] == "cpu"
    assert node.terminate() == 0
