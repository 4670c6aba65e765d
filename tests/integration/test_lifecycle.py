"""Drain on SIGTERM, shutdown by message, restart on the same port."""
import time

import pytest

import rolloutd
from conftest import final_events


def test_sigterm_drains_every_accepted_request_gets_one_final_event(daemon):
    c = daemon.client()
    rids = [c.submit([i + 1, 2, 3], max_new_tokens=30 + i, temperature=0.8, seed=i) for i in range(10)]
    daemon.proc.send_signal(15)
    # New work is refused while draining (or the socket is already closed).
    finals = {}
    deadline = time.monotonic() + 30
    while len(finals) < len(rids) and time.monotonic() < deadline:
        ev = c.next_event(1.0)
        if ev is None:
            continue
        if not isinstance(ev, rolloutd.TokensEvent):
            assert ev.rid not in finals, "two final events"
            finals[ev.rid] = ev
    assert set(finals) == set(rids)
    # Drain deadline is 30 s by default: these short requests finish normally.
    assert all(f.reason == "length" for f in finals.values())
    assert daemon.terminate() == 0
    c.close()
    lines = daemon.log_lines()
    assert any(l.get("msg") == "drain started" for l in lines)
    stopped = [l for l in lines if l.get("msg") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["exit_code"] == 0


def test_drain_deadline_aborts_long_requests_with_reason_shutdown(daemon_factory):
    d = daemon_factory(args=["--drain-timeout-s", "0.3"])
    c = d.client()
    rids = [c.submit([1, 2], max_new_tokens=4000, temperature=1.0, seed=i) for i in range(3)]
    d.proc.send_signal(15)
    finals = final_events(c, rids, 10.0)
    assert all(f.reason == "abort" and f.abort_reason == "shutdown" for f in finals.values())
    assert d.terminate() == 0
    c.close()


def test_second_sigterm_cuts_the_drain_short_and_every_request_still_ends_once(daemon_factory):
    # A drain of 60 s that an operator (or launch-node.sh's stop) cuts short with a second signal.
    d = daemon_factory(args=["--drain-timeout-s", "60"])
    c = d.client()
    rids = [c.submit([1, 2], max_new_tokens=4000, temperature=1.0, seed=i) for i in range(3)]
    d.proc.send_signal(15)
    # The first signal has been taken once /readyz says draining; then the second one.
    deadline = time.monotonic() + 10
    while d.get("/readyz")[0] == 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(1.2)  # a second signal counts from 1 s after the first (one Ctrl-C can give two)
    started = time.monotonic()
    d.proc.send_signal(15)
    finals = final_events(c, rids, 10.0)
    assert all(f.reason == "abort" and f.abort_reason == "shutdown" for f in finals.values())
    assert d.proc.wait(timeout=15) == 0
    assert time.monotonic() - started < 15  # not the 60 s drain
    c.close()
    assert any(l.get("msg") == "second signal; drain deadline cut to zero" for l in d.log_lines())


def test_two_signals_at_once_are_one_stop_and_the_drain_runs_its_course(daemon_factory):
    # A Ctrl-C reaches the daemon and the launcher that forwards a SIGTERM: two signals at once
    # must not cut the drain short.
    d = daemon_factory(args=["--drain-timeout-s", "60"])
    c = d.client()
    rids = [c.submit([1, 2], max_new_tokens=300, temperature=1.0, seed=i) for i in range(3)]
    d.proc.send_signal(2)
    d.proc.send_signal(15)
    finals = final_events(c, rids, 30.0)
    assert all(f.reason == "length" for f in finals.values()), [(f.reason, f.abort_reason) for f in finals.values()]
    assert d.proc.wait(timeout=30) == 0
    c.close()


def test_generate_while_draining_is_refused(daemon_factory):
    d = daemon_factory(args=["--drain-timeout-s", "60"])
    c = d.client()
    c.submit([1], max_new_tokens=4000, temperature=1.0, seed=1)  # keeps the drain open
    d.proc.send_signal(15)
    deadline = time.monotonic() + 10
    while d.get("/readyz")[0] == 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(rolloutd.RolloutdError) as e:
        c.submit([2], max_new_tokens=2)
    assert e.value.code == "draining"
    # The long request finishes on its own (well inside the 60 s drain) and the daemon exits 0.
    assert d.terminate() == 0
    c.close()


def test_shutdown_message_and_immediate_restart_on_the_same_port(daemon_factory):
    d = daemon_factory()
    port = d.control_port
    with d.client() as c:
        assert c.shutdown(drain=True, deadline_s=5.0).accepted
    assert d.proc.wait(timeout=30) == 0
    d2 = daemon_factory(control_port=port)
    with d2.client() as c:
        assert c.generate([1, 2, 3], max_new_tokens=3).ok
    assert d2.terminate() == 0


def test_bad_flags_exit_with_usage_code(tmp_path):
    import os, subprocess
    r = subprocess.run([os.environ["ROLLOUTD_BIN"], "--control-port", "99999"], capture_output=True, timeout=30)
    assert r.returncode == 64
    r = subprocess.run([os.environ["ROLLOUTD_BIN"], "--help"], capture_output=True, timeout=30)
    assert r.returncode == 0 and b"--control-port" in r.stdout


def test_port_in_use_is_a_startup_failure(daemon_factory):
    import os, subprocess
    d = daemon_factory()
    r = subprocess.run([os.environ["ROLLOUTD_BIN"], "--control-port", str(d.control_port), "--http-port", "0"],
                       capture_output=True, timeout=30)
    assert r.returncode == 2
    assert b"bind" in r.stdout
