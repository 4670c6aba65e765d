"""Fault injection with real processes (issue 10): a trainer killed mid-session, a
coordinator gone while its events stream, a consumer that stops reading, half-open and
garbage connections and a flood of hellos, a daemon SIGKILLed during rollouts and during a
session. Each test prints its figures (RELIABILITY lines) for tests/bench/NOTES.md."""
import os
import threading
import time
import zlib

import pytest

import rolloutd
from rolloutd import wire
from rolloutd.messages import GenerateRequest, StatusRequest
from rel_common import numpy_weights
from rel_zmtp import RawDealer
from rel_harness import (SANITIZER, SLOW, LivezProbe, assert_livez_bound, free_port, livez_less_host_wait, percentile,
                         report, vm_rss_bytes, wait_until)
from rel_harness import children, daemon_factory, shm_cleanup  # noqa: F401 (pytest fixtures)


def final_event(client, rid, timeout_s):
    """The final event (finished / failed) of `rid`, reading at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ev = client.next_event(max(0.0, deadline - time.monotonic()))
        if ev is not None and ev.rid == rid and isinstance(ev, (rolloutd.FinishedEvent, rolloutd.FailedEvent)):
            return ev
    raise AssertionError(f"no final event for {rid} within {timeout_s} s")


def first_tokens(client, rid, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ev = client.next_event(max(0.0, deadline - time.monotonic()))
        if isinstance(ev, rolloutd.TokensEvent) and ev.rid == rid and ev.token_ids:
            return ev
    raise AssertionError(f"{rid} produced no tokens within {timeout_s} s")


@pytest.mark.parametrize("via", ["inline", "shm"])
def test_trainer_killed_mid_session_expires_fails_closed_then_recovers(daemon_factory, children, shm_cleanup, via):
    d = daemon_factory()
    idle_s = 2.0
    shm_name = f"rolloutd-rel-{os.getpid()}-{via}"
    shm_cleanup.append(shm_name)
    with d.client(timeout_s=10 * SLOW) as c:
        c.hello()
        # A request in flight when the session opens is held by it (in place).
        rid = c.submit([7, 7, 7], max_new_tokens=4000, temperature=1.0, seed=3)
        first_tokens(c, rid, 30 * SLOW)
        trainer = children("trainer_child.py", d.control, via, idle_s, shm_name)
        wrote = trainer.expect("wrote", 60 * SLOW)
        st = c.status()
        assert st.state == "updating" and st.update_session == wrote["wrote"]
        killed_at = time.monotonic()
        trainer.kill()
        # Idle deadline: counted from the trainer's last bucket, which came before the kill.
        wait_until(lambda: c.status().state == "not_ready", idle_s + 10 * SLOW, "the session to expire")
        expired_after_s = time.monotonic() - killed_at
        assert expired_after_s <= idle_s + 2.0 * SLOW
        st = c.status()
        assert not st.ready and st.update_session == 0
        assert "model.layers.0." in st.reason or "model.norm.weight" in st.reason, st.reason
        code, body = d.get("/readyz")
        assert code == 503 and st.reason.split(":")[0][:20] in body
        assert d.metric("rolloutd_weight_update_sessions_total", result="expired") == 1
        # The held request is failed with the reason, never served by a half-written model.
        final = final_event(c, rid, 10 * SLOW)
        assert isinstance(final, rolloutd.FailedEvent) and final.error.code == "not_ready"
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.generate([1, 2], max_new_tokens=2)
        assert e.value.code == "not_ready"
        # The next complete session makes the daemon whole again.
        new = numpy_weights(4242)
        c.push_weights(list(new.items()), weight_version=11, via=via, bucket_bytes=256 << 10)
        wait_until(lambda: c.status().ready, 10 * SLOW, "ready after the next session")
        sums = c.weights_checksum()
        assert dict(sums) == {n: zlib.crc32(w.tobytes()) for n, w in new.items()}
        r = c.generate([1, 2], max_new_tokens=3, temperature=0.0)
        assert r.finish_reason == "length" and r.weight_versions == [11, 11, 11]
        assert d.metric("rolloutd_weight_update_sessions_total", result="completed") == 1
    assert d.terminate() == 0
    report(f"trainer_killed_mid_session[{via}]", idle_deadline_s=idle_s, expired_after_kill_s=round(expired_after_s, 3),
           faults_injected=1, faults_survived=1, requests_lost=0)


def test_client_gone_aborts_its_requests_and_others_go_on(daemon_factory, children):
    d = daemon_factory()
    n = 8
    with d.client(timeout_s=10 * SLOW) as other:
        other.hello()
        keep = other.submit([4, 4], max_new_tokens=300, temperature=0.0, rid="keep")
        child = children("stream_child.py", d.control, n, 4000)
        streaming = child.expect("streaming", 60 * SLOW)
        assert len(streaming["streaming"]) == n and streaming["with_tokens"] == n
        killed_at = time.monotonic()
        child.kill()
        wait_until(lambda: d.metric("rolloutd_stream_aborts_total", reason="client_gone") >= n, 15 * SLOW,
                   "client_gone aborts")
        detected_s = time.monotonic() - killed_at
        assert d.metric("rolloutd_stream_aborts_total", reason="client_gone") == n
        # Its requests stop using the engine; the other client's request is untouched.
        wait_until(lambda: other.status().num_running + other.status().num_waiting <= 1, 10 * SLOW,
                   "the gone client's requests to leave the engine")
        r = other.collect(keep, timeout_s=120 * SLOW)
        assert r.finish_reason == "length" and len(r.token_ids) == 300
        assert other.generate([9], max_new_tokens=4).finish_reason == "length"
    assert d.terminate() == 0
    report("client_gone_while_streaming", requests_aborted=n, detected_after_s=round(detected_s, 3),
           faults_injected=1, faults_survived=1, requests_lost=0)


def _raw_generate(rid, msg_id, n_tokens=4000, seed=0):
    return wire.encode(msg_id, GenerateRequest(rid=rid, input_ids=[5, 6, seed % 256], max_new_tokens=n_tokens,
                                               temperature=1.0, seed=seed, return_logprob=True,
                                               return_routed_experts=True))


def _delivered_tokens(events):
    """Tokens in a request's `tokens` events after its last `retracted` (SPEC §4.3)."""
    n = 0
    for ev in events:
        if type(ev).__name__ == "RetractedEvent":
            n = 0
        elif type(ev).__name__ == "TokensEvent":
            n += len(ev.token_ids)
    return n


def _catch_up(raw, rids, timeout_s, error_ids=(), daemon=None, read_before=()):
    """Reads everything `raw` has coming (after the messages `read_before`, already read) until
    every rid in `rids` has its final event and every envelope id in `error_ids` its error
    reply; returns ({rid: final body}, {rid: [events]}, {envelope id: error code}). Fails on an
    event after a final one; a failure quotes the daemon's warnings when `daemon` is given."""
    finals, events, errors = {}, {}, {}
    deadline = time.monotonic() + timeout_s
    n_messages, last_message = 0, time.monotonic()
    before = list(read_before)
    while set(finals) != set(rids) or set(errors) != set(error_ids):
        if time.monotonic() >= deadline:
            warnings = [] if daemon is None else [l for l in daemon.log_lines() if l.get("level") in ("warn", "error")]
            raise AssertionError(f"no final event for {len(set(rids) - set(finals))} requests "
                                 f"({sorted(set(rids) - set(finals))[:5]}...), no error for "
                                 f"{sorted(set(error_ids) - set(errors))}; {n_messages} messages read, the last "
                                 f"{time.monotonic() - last_message:.1f} s ago; daemon warnings: {warnings[-10:]}")
        frames = before.pop(0) if before else raw.recv(1.0)
        if frames is None:
            continue
        n_messages, last_message = n_messages + 1, time.monotonic()
        msg = wire.decode(frames)
        if msg.type == "error":
            errors[msg.id] = msg.body.code
            continue
        rid = getattr(msg.body, "rid", None)
        if rid is None or not msg.type in ("tokens", "retracted", "finished", "failed"):
            continue  # replies (generate.ok)
        assert rid not in finals, f"{msg.type} after the final event of {rid}"
        events.setdefault(rid, []).append(msg.body)
        if msg.type in ("finished", "failed"):
            finals[rid] = msg.body
    return finals, events, errors


def test_slow_consumer_is_aborted_with_backpressure_and_others_are_served(daemon_factory, children):
    # The bound is above one engine step's burst (64 running requests' events), so only
    # messages the socket refused (EAGAIN at the daemon's SNDHWM of 10000) can reach it.
    d = daemon_factory(args=["--outbox-limit", "1024"])
    # A consumer that stops reading: a raw ZMTP peer with a 4 KiB receive buffer. Before the
    # bound is hit, the daemon's kernel send buffer (autotuned to ~3 MB: ~17k events) and
    # its ZeroMQ pipe (10k messages) fill; many short requests keep the event rate high.
    n, n_tokens = 400, 300
    probe = LivezProbe(children, d)
    slow = RawDealer(d.control, rcvbuf=4096)
    stop_keepalive = threading.Event()

    def keepalive():
        # The daemon drops a peer it hears nothing from for 10 s (heartbeat): that would be
        # client_gone, not the back-pressure this test is about.
        while not stop_keepalive.wait(0.5):
            slow.keepalive()

    try:
        rids = [f"slow-{i}" for i in range(n)]
        for i, rid in enumerate(rids):
            slow.send(_raw_generate(rid, i + 1, n_tokens=n_tokens, seed=i))
        pinger = threading.Thread(target=keepalive, daemon=True)
        pinger.start()
        control, rss_peak = [], 0
        started = time.monotonic()
        with d.client(timeout_s=10 * SLOW) as other:
            other.hello()
            # Meanwhile the daemon answers others (its engine is busy with the slow client's
            # queue, so the control plane is what is measured here).
            while d.metric("rolloutd_stream_aborts_total", reason="backpressure") < 1:
                assert time.monotonic() - started < 120 * SLOW, "the slow client was never aborted"
                t0 = time.perf_counter()
                assert other.status().ready
                control.append(time.perf_counter() - t0)
                rss_peak = max(rss_peak, vm_rss_bytes(d.proc.pid))
                time.sleep(0.05)
            aborted_after_s = time.monotonic() - started
            # Every request of the slow client is aborted, running or queued; then the
            # engine is free for others at once.
            wait_until(lambda: other.status().num_running + other.status().num_waiting == 0, 30 * SLOW,
                       "the slow client's requests to leave the engine")
            assert other.generate([3, 2, 1], max_new_tokens=4, timeout_s=30 * SLOW).finish_reason == "length"
            aborted = d.metric("rolloutd_stream_aborts_total", reason="backpressure")
            # Catching up, the consumer learns why each stream ended: exactly one final
            # event per request and nothing after it; those the bound cut short end with
            # finished{abort, backpressure}.
            stop_keepalive.set()
            pinger.join(5)
            finals, events, errors = _catch_up(slow, rids, 120 * SLOW, daemon=d)
            assert errors == {}
            cut = [ev for ev in finals.values() if ev.abort_reason == "backpressure"]
            assert len(cut) == aborted > 0
            for rid, ev in finals.items():
                assert type(ev).__name__ == "FinishedEvent"
                assert (ev.reason, ev.abort_reason) in (("length", ""), ("stop", ""), ("abort", "backpressure"))
                assert ev.completion_tokens == _delivered_tokens(events[rid]), rid
            delivered = sum(len(v) for v in events.values())
            assert other.status().ready
    finally:
        stop_keepalive.set()
        slow.close()
    latencies, host_waits, failures = probe.stop()
    assert failures == []
    own = livez_less_host_wait(latencies, host_waits)
    assert d.terminate() == 0
    report("slow_consumer_backpressure", outbox_limit=1024, requests=n, requests_aborted=int(aborted),
           aborted_after_s=round(aborted_after_s, 2), events_after_catch_up=delivered,
           other_status_p99_ms=round(1e3 * percentile(control, 99), 2), daemon_rss_peak_mib=round(rss_peak / 2**20, 1),
           livez_probes=len(latencies), livez_p99_ms=round(1e3 * percentile(latencies, 99), 2),
           livez_p100_ms=round(1e3 * max(latencies), 2), livez_p100_less_host_wait_ms=round(1e3 * max(own), 2),
           faults_injected=1, faults_survived=1, requests_lost=0)
    if not SANITIZER:
        assert_livez_bound(latencies, host_waits)


@pytest.mark.skipif(bool(SANITIZER), reason="a logic check, run by the plain build (slow under sanitizers)")
def test_request_after_a_backpressure_abort_is_refused_then_accepted_when_caught_up(daemon_factory):
    """SPEC §1.1 "nothing is dropped without being counted", §4.3 completion_tokens = tokens
    delivered: a client that was aborted for back-pressure and submits again before it has
    caught up is refused (its events would be withheld): `overloaded`, or, as its outbox is
    full, that reply dropped and counted; once it has read everything and every aborted
    request has ended, a new request is delivered whole."""
    d = daemon_factory(args=["--outbox-limit", "1024"])
    slow = RawDealer(d.control, rcvbuf=4096)
    try:
        for i in range(400):
            slow.send(_raw_generate(f"slow-{i}", i + 1, n_tokens=300, seed=i))
        deadline = time.monotonic() + 120 * SLOW
        while d.metric("rolloutd_stream_aborts_total", reason="backpressure") < 1:
            assert time.monotonic() < deadline, "the slow client was never aborted"
            slow.keepalive()
            time.sleep(0.2)
        slow.send(wire.encode(1000, GenerateRequest(rid="after", input_ids=[1, 2, 3], max_new_tokens=20,
                                                    temperature=0.0)))
        # Catch up: "after" is refused, never run (`overloaded`, or that reply dropped and
        # counted: the outbox is past its bound), and every aborted request ends with one
        # final event whose completion_tokens counts exactly the tokens delivered (the
        # withheld ones are not claimed).
        # Not reading meanwhile: PINGs keep the daemon's heartbeat from dropping the connection.
        wait_until(lambda: slow.keepalive() or d.metric("rolloutd_requests_total", type="generate") == 401,
                   10 * SLOW, "the daemon to read the request sent after the abort")
        dropped = d.metric("rolloutd_replies_dropped_total")
        rids = [f"slow-{i}" for i in range(400)]
        finals, events, errors = _catch_up(slow, rids, 120 * SLOW, error_ids=set() if dropped else {1000},
                                           daemon=d)
        assert "after" not in events and (errors, dropped) in (({1000: "overloaded"}, 0), ({}, 1)), (errors, dropped)
        for rid, ev in finals.items():
            assert ev.completion_tokens == _delivered_tokens(events[rid]), rid
        # Caught up: accepted again, and every token arrives.
        slow.send(wire.encode(1001, GenerateRequest(rid="again", input_ids=[1, 2, 3], max_new_tokens=20,
                                                    temperature=0.0)))
        finals, events, errors = _catch_up(slow, ["again"], 60 * SLOW, daemon=d)
        assert errors == {} and finals["again"].reason == "length"
        assert _delivered_tokens(events["again"]) == finals["again"].completion_tokens == 20
        assert d.metric("rolloutd_errors_total", code="overloaded") == 1
        assert d.metric("rolloutd_replies_dropped_total") == dropped
    finally:
        slow.close()
    assert d.terminate() == 0


@pytest.mark.skipif(bool(SANITIZER), reason="a logic check, run by the plain build")
def test_outbox_bound_counts_only_what_the_socket_refused(daemon_factory):
    """SPEC §1.1: events that meet EAGAIN wait in the bounded outbox. A client that reads
    promptly is never aborted for backpressure, however many requests it runs, even when
    one engine step produces more events than the bound."""
    d = daemon_factory(args=["--outbox-limit", "16"])
    with d.client(timeout_s=30 * SLOW) as c:
        c.hello()
        rids = [c.submit([1, 2, i], max_new_tokens=50, temperature=1.0, seed=i) for i in range(32)]
        results = [c.collect(r, timeout_s=60 * SLOW) for r in rids]
    reasons = sorted({(r.finish_reason, r.abort_reason) for r in results})
    assert d.metric("rolloutd_stream_aborts_total", reason="backpressure") == 0 and reasons == [("length", "")], reasons


@pytest.mark.skipif(bool(SANITIZER), reason="a logic check with an RSS bound, run by the plain build")
def test_client_that_sends_without_reading_cannot_grow_the_daemon(daemon_factory):
    """SPEC §1.1: replies to a client over its outbox bound are queued only up to the bound;
    the rest are dropped and counted, never silently: replies read + replies dropped =
    requests sent. Without the bound, 300k unread `status` replies grew the daemon by 136 MiB."""
    d = daemon_factory(args=["--outbox-limit", "1024"])
    n = 300_000
    slow = RawDealer(d.control, rcvbuf=4096)
    try:
        rss_before = vm_rss_bytes(d.proc.pid)
        batch = [wire.encode(0, StatusRequest())] * 1000
        for k in range(n // len(batch)):
            slow.send_many(batch)
            if k % 50 == 0:
                slow.keepalive()
        # Wait until the daemon has read them all (it counts each request as it decodes it).
        # (PINGs meanwhile, so the heartbeat does not drop the connection of a client not reading.)
        wait_until(lambda: slow.keepalive() or d.metric("rolloutd_requests_total", type="status") >= n, 60 * SLOW,
                   "the daemon to read every request")
        grown = vm_rss_bytes(d.proc.pid) - rss_before
        dropped = d.metric("rolloutd_replies_dropped_total")
        # Meanwhile others are served.
        with d.client(timeout_s=10 * SLOW) as other:
            assert other.status().ready
        # Catch up: every reply not dropped arrives, then the client is served again.
        replies, deadline = 0, time.monotonic() + 120 * SLOW
        while replies + dropped < n:
            assert time.monotonic() < deadline, f"{replies} read + {dropped} dropped < {n} sent"
            frames = slow.recv(2.0)
            if frames is not None:
                assert wire.decode(frames).type == "status.ok"
                replies += 1
        assert slow.recv(0.5) is None, "more replies than requests not dropped"
        slow.send(wire.encode(7, StatusRequest()))
        frames = slow.recv(10 * SLOW)
        assert frames is not None and wire.decode(frames).type == "status.ok"
        assert d.metric("rolloutd_replies_dropped_total") == dropped
    finally:
        slow.close()
    assert dropped > 0 and replies + dropped == n
    assert grown < 48 << 20, f"RSS grew {grown >> 20} MiB while {n} replies went unread"
    assert d.terminate() == 0
    report("client_sends_without_reading", requests=n, replies_read=replies, replies_dropped=int(dropped),
           rss_growth_mib=round(grown / 2**20, 1), faults_injected=1, faults_survived=1, requests_lost=0)


def test_half_open_garbage_and_hello_flood_keep_livez_fast(daemon_factory, children):
    d = daemon_factory()
    seconds = 8.0
    probe = LivezProbe(children, d)
    halfopen = children("flood_child.py", "halfopen", d.control, seconds + 2, 200, nice=10)
    halfopen.expect("opened", 30)
    floods = [children("flood_child.py", "garbage", d.control, seconds, 8, nice=10),
              children("flood_child.py", "badmsg", d.control, seconds, nice=10),
              children("flood_child.py", "hello", d.control, seconds, 16, nice=10)]
    control = []
    with d.client(timeout_s=10 * SLOW) as c:
        c.hello()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            assert c.generate([1, 2, 3], max_new_tokens=4, temperature=0.0).finish_reason == "length"
            control.append(time.perf_counter() - t0)
            time.sleep(0.1)
    results = {}
    for f in floods + [halfopen]:
        f.wait(60 * SLOW)
        done = f.expect("done", 5)
        results[done["done"]] = done
    latencies, host_waits, failures = probe.stop()
    assert failures == []
    assert len(latencies) >= seconds / 0.05, "the probe ran too rarely to mean anything"
    p100 = max(latencies)
    own = livez_less_host_wait(latencies, host_waits)
    hello = results["hello"]
    assert hello["errors"] == [] and hello["replies"] == hello["hellos"] > 0, hello
    assert results["badmsg"]["error_replies"] == results["badmsg"]["sent"]
    with d.client() as c:
        assert c.status().ready
    assert d.metric("rolloutd_errors_total", code="bad_message") > 0
    assert d.terminate() == 0
    report("half_open_garbage_hello_flood", seconds=seconds, livez_probes=len(latencies),
           livez_p50_ms=round(1e3 * percentile(latencies, 50), 2), livez_p99_ms=round(1e3 * percentile(latencies, 99), 2),
           livez_p100_ms=round(1e3 * p100, 2), livez_p100_less_host_wait_ms=round(1e3 * max(own), 2),
           livez_schedstat=probe.schedstat, half_open_connections=results["halfopen"]["connections"],
           garbage_connections=results["garbage"]["connections"], garbage_bytes=results["garbage"]["bytes"],
           bad_messages=results["badmsg"]["sent"], hellos=results["hello"]["hellos"],
           churn_connections=results["hello"]["churn_connections"], connect_retries=results["hello"]["connect_retries"],
           generate_p99_ms=round(1e3 * percentile(control, 99), 2),
           faults_injected=4, faults_survived=4, requests_lost=0)
    if not SANITIZER:
        assert_livez_bound(latencies, host_waits)


def test_daemon_sigkilled_requests_end_within_their_bound_and_restart_is_ready(daemon_factory):
    port = free_port()
    d = daemon_factory(control_port=port)
    wait_s = 1.0  # how long the coordinator waits for each request before giving up on it
    c = d.client(timeout_s=10 * SLOW)
    trainer = d.client(timeout_s=10 * SLOW)
    try:
        c.hello()
        trainer.hello()
        baseline = c.weights_checksum().model_checksum
        rids = [c.submit([3, i], max_new_tokens=4000, temperature=1.0, seed=i, rid=f"doomed-{i}") for i in range(8)]
        first_tokens(c, rids[-1], 30 * SLOW)
        new = numpy_weights(4242)
        part = [(n, w) for n, w in new.items() if n.startswith("model.layers.1.")]
        entries, data = rolloutd.weights.pack_bucket(part)
        session = trainer.begin_weight_update(timeout_s=60).session
        trainer.update_weights_inline(session, entries, data)
        d.proc.kill()  # SIGKILL: mid-rollout and mid-session
        d.proc.wait(timeout=10)
        # The coordinator's view: every request ends within its bound: as unavailable once the
        # client has seen the connection drop (and stay down 300 ms), else as a deadline.
        outcomes, waits = {}, []
        for rid in rids:
            t0 = time.monotonic()
            try:
                r = c.collect(rid, timeout_s=wait_s)
                outcomes[rid] = r.finish_reason or r.error.code
            except rolloutd.RolloutdError as e:
                outcomes[rid] = e.code
            waits.append(time.monotonic() - t0)
        assert set(outcomes) == set(rids) and set(outcomes.values()) <= {"unavailable", "deadline_exceeded"}, outcomes
        assert max(waits) < wait_s + 1.0
        trainer.timeout_s = wait_s
        t0 = time.monotonic()
        with pytest.raises(rolloutd.RolloutdError) as e:
            trainer.update_weights_inline(session, entries, data)
        assert e.value.code in ("deadline_exceeded", "unavailable") and time.monotonic() - t0 < wait_s + 1.0
        # Restarted (the launcher's job; here by hand) on the same port: ready on the embedded
        # model, and the clients' DEALERs reconnect by themselves.
        d2 = daemon_factory(control_port=port)
        c.timeout_s = 10 * SLOW
        wait_until(lambda: d2.get("/readyz")[0] == 200, 30 * SLOW, "the restarted daemon to be ready")
        st = c.status()
        assert st.ready and st.weight_version == 0 and st.update_session == 0 and st.num_running == 0
        assert c.weights_checksum().model_checksum == baseline
        assert c.abort(rids[0]).num_aborted == 0  # nothing of the old process survives
        r = c.generate([1, 2, 3], max_new_tokens=4, temperature=0.0)
        assert r.finish_reason == "length" and r.weight_versions == [0] * 4
        trainer.timeout_s = 10 * SLOW
        with pytest.raises(rolloutd.RolloutdError) as e:
            trainer.update_weights_inline(session, entries, data)
        assert e.value.code == "failed_precondition"  # the old session died with the process
        assert d2.terminate() == 0
    finally:
        c.close()
        trainer.close()
    report("daemon_sigkill_restart", requests_in_flight=len(rids), max_client_wait_s=round(max(waits), 3),
           client_timeout_s=wait_s, faults_injected=2, faults_survived=2, requests_lost=0)


def _http_down(d):
    try:
        d.get("/livez")
        return False
    except OSError:
        return True


@pytest.mark.skipif(bool(SANITIZER), reason="a logic check, run by the plain build")
def test_events_the_socket_took_before_the_loop_stopped_reach_a_client_reading_after_it(daemon_factory):
    """SPEC 1.1, nothing lost at shutdown: when the drain ends with every message handed to the
    socket, much may still sit in ZeroMQ's pipe and the kernel's send buffer (a client slow to
    read). Closing with linger 0 discarded them (a SIGTERM drain test lost 2 of 10 final events
    in CI on 2026-12-02); closing once ZeroMQ had written them lost them too when the client then
    sent anything (a PING, a PONG to the daemon's heartbeat): the kernel answers a byte to a
    closed connection with a reset that drops its send buffer. The daemon keeps the socket open
    until the client has acknowledged everything. Here the client reads nothing until the
    control loop has stopped, then reads, PINGing and PONGing as a libzmq client would."""
    d = daemon_factory(args=["--flush-timeout-s", str(60 * SLOW), "--outbox-limit", "100000"])
    slow = RawDealer(d.control, rcvbuf=4096)
    stop_keepalive = threading.Event()

    def keepalive():  # not reading: without PINGs the heartbeat would drop the connection
        while not stop_keepalive.wait(0.5):
            slow.keepalive()

    pinger = threading.Thread(target=keepalive, daemon=True)
    try:
        # ~8,000 events (below the socket's 10,000-message pipe, so the drain ends with an empty
        # outbox), 3.6 MB with top log-probs: more than the kernel buffers took here (with linger
        # 0 this test failed 3 runs of 3; a host with larger socket buffers would not notice).
        n, n_tokens = 32, 250
        rids = [f"late-{i}" for i in range(n)]
        for i, rid in enumerate(rids):
            slow.send(wire.encode(i + 1, GenerateRequest(rid=rid, input_ids=[7, 8, i], max_new_tokens=n_tokens,
                                                         temperature=1.0, seed=i, return_logprob=True,
                                                         top_logprobs_num=20, return_routed_experts=True)))
        pinger.start()
        wait_until(lambda: d.metric("rolloutd_requests_total", type="generate") == n, 10 * SLOW,
                   "the daemon to read every request")
        d.proc.send_signal(15)
        # From the loop's end on nothing more is enqueued; the socket waits for us to read.
        wait_until(lambda: any(l.get("msg") == "control loop stopped" for l in d.log_lines()), 60 * SLOW,
                   "the control loop to stop")
        stop_keepalive.set()
        pinger.join(5)
        # A client that comes now is still accepted, and refused: the daemon is going.
        with d.client(timeout_s=10.0) as late:
            with pytest.raises(rolloutd.RolloutdError) as refused:
                late.status()
        assert refused.value.code == "draining", refused.value
        # Read (answering PINGs) until the daemon has exited, then send a byte as a libzmq
        # client's heartbeat would. A daemon that closed its connection with data still in its
        # kernel's send buffer (it did, before it waited for the client) has that byte answered
        # with a reset, and the rest of the backlog is lost: this failed 3 runs of 3 so.
        read_before, deadline = [], time.monotonic() + 60 * SLOW
        while d.proc.poll() is None:
            assert time.monotonic() < deadline, "the daemon did not exit after its client had read everything"
            try:
                if (frames := slow.recv(0.05)) is not None:
                    read_before.append(frames)
                    if len(read_before) % 4 == 0:
                        time.sleep(0.001)  # slowly: the daemon is done writing well before we are
            except ConnectionError:  # its close, after the last byte it sent
                break
        d.proc.wait(timeout=30 * SLOW)
        slow.keepalive()
        finals, events, errors = _catch_up(slow, rids, 60 * SLOW, daemon=d, read_before=read_before)
        assert errors == {}
        for rid, ev in finals.items():
            assert (ev.reason, ev.completion_tokens) == ("length", n_tokens), rid
            assert _delivered_tokens(events[rid]) == n_tokens, rid
    finally:
        stop_keepalive.set()
        slow.close()
    assert d.proc.wait(timeout=30 * SLOW) == 0
    got = [l for l in d.log_lines() if l.get("msg") == "clients have received the last messages"]
    assert len(got) == 1, [l for l in d.log_lines() if l.get("subsys") == "control"][-5:]
    assert (got[0]["outcome"], got[0]["connections_lost"], got[0]["requests_refused"]) == ("received", 0, 1), got
    assert got[0]["connections_received"] >= 1, got  # ours (the late client's may count as closed)
    assert got[0]["waited_s"] > 0.5, got  # it did wait for this reader
    assert not [l for l in d.log_lines() if l.get("level") in ("warn", "error")]
