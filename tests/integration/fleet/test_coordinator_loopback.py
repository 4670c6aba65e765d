"""rolloutd.Coordinator against daemons on loopback: runs where network namespaces cannot be
made (test_fleet.py covers the same across simulated hosts). The coordinator's own
bookkeeping: endpoints files, spreading, one final event per request, a daemon's death."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import rolloutd

BIN = os.environ.get("ROLLOUTD_BIN", "rolloutd")
sys.path.insert(0, os.path.join(os.environ.get("ROLLOUTD_SOURCE_ROOT", "."), "tests", "reference"))
import tiny_moe_reference as ref  # noqa: E402


@pytest.fixture
def daemons(tmp_path):
    procs, files = [], []
    for i in range(2):
        f = tmp_path / f"d{i}.json"
        procs.append(subprocess.Popen([BIN, "--control-port", "0", "--http-port", "0", "--endpoints-file", str(f),
                                       "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        files.append(f)
    deadline = time.monotonic() + 30
    while not all(f.exists() for f in files):
        assert time.monotonic() < deadline, "daemons did not start"
        assert all(p.poll() is None for p in procs)
        time.sleep(0.02)
    yield procs, tmp_path
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def test_load_endpoints_reads_launcher_files_daemon_files_and_directories(tmp_path):
    node = {"host": "n1", "launcher_pid": 1, "device": "cpu", "daemons": [
        {"index": 0, "state": "running", "restarts": 0, "pid": 5, "gpu": -1, "control": "tcp://n1:7600",
         "http": "http://n1:7700"},
        {"index": 1, "state": "failed", "restarts": 3, "pid": 6, "gpu": -1, "control": "tcp://n1:7601",
         "http": "http://n1:7701"},
        {"index": 2, "state": "starting", "restarts": 0, "pid": 7, "gpu": -1}]}
    (tmp_path / "n1.json").write_text(json.dumps(node))
    (tmp_path / "d.json").write_text(json.dumps({"control": "tcp://n2:7600", "http": "http://n2:7700", "pid": 9,
                                                 "gpu": 0}))
    (tmp_path / "n1.json.tmp.123").write_text("{half")  # a launcher's rename in progress
    eps = rolloutd.load_endpoints(str(tmp_path))
    assert [(e.key, e.control, e.http, e.pid) for e in eps] == [
        ("tcp://n2:7600", "tcp://n2:7600", "http://n2:7700", 9), ("n1/0", "tcp://n1:7600", "http://n1:7700", 5)]


def test_spread_fan_in_and_a_dead_daemons_requests_fail_once(daemons):
    procs, run_dir = daemons
    with rolloutd.Coordinator.from_file(str(run_dir), heartbeat_interval_s=0.2, dead_after_s=2.0) as fleet:
        health = fleet.wait_ready(2, timeout_s=30)
        assert len(health) == 2
        results = fleet.generate_many([[1 + i, 2, 3] for i in range(8)], max_new_tokens=5, seed=3, timeout_s=60)
        assert [r.finish_reason for r in results] == ["length"] * 8
        totals = {n: s.num_requests_total for n, s in fleet.status().items()}
        assert sorted(totals.values()) == [4, 4], totals  # equal costs: an even spread

        rids = fleet.submit_many([[7, 8, 9 + i] for i in range(6)], max_new_tokens=3000)
        where = {r: fleet.daemon_of(r) for r in rids}
        victim = where[rids[0]]
        victim_pid = next(h.pid for h in fleet.daemons() if h.name == victim)
        os.kill(victim_pid, signal.SIGKILL)
        for r in rids:
            if where[r] != victim:
                fleet.abort(r)
        finals = {}
        deadline = time.monotonic() + 30
        while len(finals) < len(rids):
            assert time.monotonic() < deadline, (len(finals), fleet.daemons())
            ev = fleet.next_event(0.5)
            if isinstance(ev, (rolloutd.FinishedEvent, rolloutd.FailedEvent)):
                assert ev.rid not in finals, "two final events"
                finals[ev.rid] = ev
        for r in rids:
            if where[r] == victim:
                assert isinstance(finals[r], rolloutd.FailedEvent) and finals[r].error.code == "unavailable"
            else:
                assert isinstance(finals[r], rolloutd.FinishedEvent)
        assert fleet.num_outstanding == 0
        lost = next(h for h in fleet.daemons() if h.name == victim)
        assert lost.state == "lost" and not lost.routable and lost.num_lost == 1
        # The survivor takes everything now.
        assert all(r.ok for r in fleet.generate_many([[1, 2]] * 4, max_new_tokens=3, timeout_s=60))
        # A weight update completes where it can and names the daemon it could not reach.
        update = fleet.push_weights(list(ref.build_weights(ref.CONFIG).items()), weight_version=5,
                                    bucket_bytes=512 << 10)
        survivor = next(h.name for h in fleet.daemons() if h.name != victim)
        assert list(update.completed) == [survivor] and update.completed[survivor].weight_version == 5
        assert victim in update.skipped or victim in update.failed
        assert not update.ok
        with pytest.raises(rolloutd.RolloutdError):
            update.raise_for_error()
        assert fleet.weight_version == 5


def test_submit_many_when_a_daemon_died_unnoticed_places_every_request_once(daemons):
    """submit_many batches each daemon's share; a daemon SIGKILLed just before (its heartbeat has
    not noticed yet) refuses its whole batch, which is retried on the survivor: every prompt gets
    a rid, every rid exactly one final event, and the outstanding counters come back to 0."""
    procs, run_dir = daemons
    with rolloutd.Coordinator.from_file(str(run_dir), heartbeat_interval_s=5.0, dead_after_s=30.0) as fleet:
        assert len(fleet.wait_ready(2, timeout_s=30)) == 2
        victim = fleet.daemons()[0]
        os.kill(victim.pid, signal.SIGKILL)
        procs[[p.pid for p in procs].index(victim.pid)].wait(timeout=10)
        t0 = time.monotonic()
        rids = fleet.submit_many([[3, 4, 5 + i] for i in range(40)], max_new_tokens=4, temperature=0.0)
        took = time.monotonic() - t0
        assert len(rids) == len(set(rids)) == 40 and all(rids)
        assert took < fleet.timeout_s, f"submit_many took {took:.1f} s"
        results = fleet.collect(rids, timeout_s=60)
        assert all(results[r].ok and len(results[r].token_ids) == 4 for r in rids)
        assert fleet.num_outstanding == 0
        for h in fleet.daemons():
            assert (h.outstanding_requests, h.outstanding_tokens) == (0, 0), h


def test_a_submit_that_timed_out_is_never_sent_later(daemons):
    """A submit whose command waited in a busy worker past the timeout fails, and the command is
    cancelled: until 2026-12-02 it ran later anyway, so a request the caller was told had failed
    generated (a retried rid got two final events) and the outstanding counters went negative."""
    _, run_dir = daemons
    with rolloutd.Coordinator.from_file(str(run_dir), timeout_s=1.0) as fleet:
        assert len(fleet.wait_ready(2, timeout_s=30)) == 2
        for w in fleet._workers:  # fault injection: every worker busy for 3 s
            w.call(lambda c: time.sleep(3))
        with pytest.raises(rolloutd.RolloutdError) as e:
            fleet.submit([1, 2, 3], rid="r1", max_new_tokens=4, temperature=0.0)
        assert e.value.code == "deadline_exceeded"
        time.sleep(3.5)  # the workers are free again
        assert [ev for ev in fleet.events(timeout_s=1.0) if ev.rid == "r1"] == []
        for h in fleet.daemons():
            assert (h.outstanding_requests, h.outstanding_tokens) == (0, 0), h
        # The same rid submitted again runs once.
        fleet.wait_ready(2, timeout_s=30)
        r = fleet.collect([fleet.submit([1, 2, 3], rid="r1", max_new_tokens=4, temperature=0.0)], timeout_s=30)
        assert r["r1"].ok and len(r["r1"].token_ids) == 4


def test_request_timeout_counts_time_without_progress_not_queued_or_stream_false_time(tmp_path):
    """request_timeout_s catches a daemon that is alive but stuck. Queued requests and stream=false
    ones send no event while their daemon is busy or generating; until 2026-12-02 they were
    failed after request_timeout_s all the same. One request runs at a time here: the others
    queue for 1-3 s, longer than the 1 s limit, and the stream=false one is silent for ~1.5 s."""
    f = tmp_path / "d.json"
    proc = subprocess.Popen([BIN, "--control-port", "0", "--http-port", "0", "--endpoints-file", str(f),
                             "--max-running", "1", "--log-level", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not f.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the daemon did not start"
            time.sleep(0.02)
        with rolloutd.Coordinator.from_file(str(f), heartbeat_interval_s=0.2, request_timeout_s=1.0) as fleet:
            fleet.wait_ready(1, timeout_s=30)
            rids = [fleet.submit([1, 2, i], max_new_tokens=2000, temperature=1.0, seed=i) for i in range(3)]
            rids.append(fleet.submit([5, 6], max_new_tokens=3000, temperature=1.0, seed=9, stream=False))
            results = fleet.collect(rids, timeout_s=60)
            assert [(results[r].ok, results[r].finish_reason) for r in rids] == [(True, "length")] * 4, \
                [results[r].error for r in rids]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_pause_that_answers_late_is_undone(daemons):
    """push_weights(pause_mode=...) gives up on a daemon whose pause has not answered by the
    deadline; when that pause completes later it is undone (continue_generation). Until
    2026-12-02 that daemon stayed paused while its heartbeat said ready."""
    _, run_dir = daemons
    with rolloutd.Coordinator.from_file(str(run_dir), timeout_s=1.0) as fleet:
        assert len(fleet.wait_ready(2, timeout_s=30)) == 2
        late = fleet._workers[0]
        late.call(lambda c: time.sleep(2.5))  # fault injection: its worker is busy past the deadline
        fleet.push_weights([], weight_version=1, pause_mode="in_place")
        time.sleep(3.0)  # the late pause ran, and its undo after it
        with rolloutd.Client(late.endpoint.control, timeout_s=10) as c:
            st = c.status()
            assert not st.paused and st.ready, st
            assert c.generate([1, 2], max_new_tokens=3, timeout_s=10).finish_reason == "length"


def test_collect_at_its_deadline_returns_at_once_with_what_finished(daemons):
    """collect() at its deadline aborts the rest without waiting on their daemons and raises at
    once, carrying the results that did finish. Until 2026-12-02 it waited up to timeout_s + 1
    per unfinished request (one hung daemon: ~31 s at the default) and dropped the finished ones."""
    _, run_dir = daemons
    with rolloutd.Coordinator.from_file(str(run_dir), timeout_s=5.0) as fleet:
        assert len(fleet.wait_ready(2, timeout_s=30)) == 2
        a, b = (h.name for h in fleet.daemons())
        fast = fleet.submit([1, 2], daemon=a, max_new_tokens=4, temperature=0.0)
        slow = [fleet.submit([3, i], daemon=b, max_new_tokens=4000, temperature=1.0, seed=i) for i in range(3)]
        time.sleep(0.5)  # the fast one has finished
        fleet._by_key[b].call(lambda c: time.sleep(4))  # fault injection: b's worker hangs
        t0 = time.monotonic()
        with pytest.raises(rolloutd.RolloutdError) as e:
            fleet.collect([fast] + slow, timeout_s=0.5)
        took = time.monotonic() - t0
        assert e.value.code == "deadline_exceeded" and took < 2.0, took
        assert set(e.value.results) == {fast} and e.value.results[fast].ok
        # The aborted ones still end, each once, once b's worker is back.
        finals = {}
        for ev in fleet.events(timeout_s=15.0):
            if not isinstance(ev, rolloutd.TokensEvent):
                assert ev.rid not in finals
                finals[ev.rid] = ev
            if len(finals) == 3:
                break
        assert set(finals) == set(slow)


def test_a_fleet_push_below_the_serving_version_writes_nothing(daemons):
    """Coordinator.push_weights with a weight_version below what a daemon serves drops that
    daemon right after begin (session aborted, nothing written), so it stays ready; end would
    have refused it after every bucket and left it not_ready."""
    _, run_dir = daemons
    with rolloutd.Coordinator.from_file(str(run_dir)) as fleet:
        assert len(fleet.wait_ready(2, timeout_s=30)) == 2
        assert not fleet.push_weights([], weight_version=5).failed
        r = fleet.push_weights([], weight_version=3)
        assert set(r.failed) == {h.name for h in fleet.daemons()}
        assert all(e.code == "invalid_argument" and e.field == "weight_version" for e in r.failed.values())
        for h in fleet.daemons():
            with rolloutd.Client(h.control, timeout_s=10) as c:
                st = c.status()
                assert st.ready and st.weight_version == 5, st
