"""rolloutd.Client against a scripted fake daemon (zmtp_peer.ZmtpPeer)."""
import socket
import time

import pytest

from rolloutd import Client, RolloutdError
from rolloutd.messages import (AbortReply, AbortRequest, ErrorInfo, FailedEvent, FinishedEvent, GenerateReply,
                               GenerateRequest, HelloReply, HelloRequest, ModelInfo, RetractedEvent, RoutedExperts,
                               ShutdownReply, StatusReply, StatusRequest, TokensEvent)


def rows(start_pos, num_tokens, first=0):
    """uint8 rows [num_tokens, 2, 2] counting up from `first`."""
    return RoutedExperts("uint8", (num_tokens, 2, 2), start_pos, bytes(range(first, first + num_tokens * 4)))


def tokens(rid, ids, routed=None):
    return TokensEvent(rid, list(ids), [-0.5] * len(ids), [7] * len(ids), routed)


def test_hello_round_trip(daemon):
    def script(d):
        m = d.recv()
        assert m.type == "hello" and m.body == HelloRequest(client="py-test", versions=[1])
        d.send(m.id, HelloReply(build="b", model=ModelInfo(name="tiny-moe", num_experts=8), weight_version=3))

    peer = daemon(script)
    with Client(peer.endpoint, client_name="py-test") as c:
        r = c.hello()
    assert (r.build, r.model.name, r.model.num_experts, r.weight_version) == ("b", "tiny-moe", 8, 3)


def test_error_reply_raises_typed_error(daemon):
    def script(d):
        m = d.recv()
        d.send(m.id, ErrorInfo("out_of_range", "token id 999 >= vocab 128", "body.input_ids[2]"))

    peer = daemon(script)
    with Client(peer.endpoint) as c, pytest.raises(RolloutdError) as e:
        c.submit([1, 2, 999], rid="r")
    assert (e.value.code, e.value.message, e.value.field) == ("out_of_range", "token id 999 >= vocab 128",
                                                              "body.input_ids[2]")


def test_missing_reply_is_deadline_exceeded_and_late_reply_is_dropped(daemon):
    def script(d):
        hello = d.recv()
        status = d.recv()
        assert status.type == "status"
        d.send(hello.id, HelloReply())  # late: must not answer status()
        d.send(status.id, StatusReply(state="ready", ready=True))

    peer = daemon(script)
    with Client(peer.endpoint, timeout_s=0.2) as c:
        start = time.monotonic()
        with pytest.raises(RolloutdError) as e:
            c.hello()
        assert e.value.code == "deadline_exceeded"
        assert 0.19 <= time.monotonic() - start < 3.0
        c.timeout_s = 5.0
        assert c.status().state == "ready"


def test_events_received_during_a_call_are_queued_in_order(daemon):
    def script(d):
        gen = d.recv()
        d.send(gen.id, GenerateReply(gen.body.rid))
        status = d.recv()
        d.send(gen.id, tokens("a", [5, 6]))
        d.send(gen.id, FinishedEvent("a", "length", "", 3, 2))
        d.send(status.id, StatusReply())

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        assert c.submit([1, 2, 3], rid="a", max_new_tokens=2) == "a"
        c.status()
        got = list(c.events(timeout_s=0.05))
    assert [type(e) for e in got] == [TokensEvent, FinishedEvent]
    assert got[0].token_ids == [5, 6] and got[1].reason == "length"


def test_generate_collects_tokens_and_routed_rows(daemon):
    def script(d):
        gen = d.recv()
        req = gen.body
        assert isinstance(req, GenerateRequest) and len(req.rid) == 32  # uuid4 hex
        assert (req.input_ids, req.max_new_tokens, req.seed, req.return_routed_experts) == ([1, 2, 3], 3, 11, True)
        d.send(gen.id, GenerateReply(req.rid))
        d.send(99, tokens("other", [1]))  # another request's event stays queued
        d.send(gen.id, tokens(req.rid, [10], rows(0, 4)))
        d.send(gen.id, tokens(req.rid, [], rows(4, 0)))  # no rows, states where the next starts
        d.send(gen.id, tokens(req.rid, [11, 12], rows(4, 2, first=16)))
        d.send(gen.id, FinishedEvent(req.rid, "length", "", 3, 3))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        r = c.generate([1, 2, 3], max_new_tokens=3, seed=11, return_logprob=True, return_routed_experts=True)
        other = c.next_event(1.0)
    assert r.ok and r.error is None
    assert (r.token_ids, r.logprobs, r.weight_versions) == ([10, 11, 12], [-0.5] * 3, [7] * 3)
    assert (r.finish_reason, r.prompt_tokens, r.completion_tokens) == ("length", 3, 3)
    re = r.routed_experts
    assert (re.dtype, re.shape, re.start_pos, re.data) == ("uint8", (6, 2, 2), 0, bytes(range(24)))
    assert re.to_list()[5] == [[20, 21], [22, 23]]
    assert isinstance(other, TokensEvent) and other.rid == "other"


def test_generate_splits_top_logprobs_per_token_and_drops_them_on_retraction(daemon):
    def script(d):
        gen = d.recv()
        rid = gen.body.rid
        assert gen.body.top_logprobs_num == 2
        d.send(gen.id, GenerateReply(rid))
        d.send(gen.id, TokensEvent(rid, [5], [-0.1], [1], None, 2, [5, 6], [-0.1, -2.5]))
        d.send(gen.id, RetractedEvent(rid, 1, "weight_update"))
        d.send(gen.id, TokensEvent(rid, [7, 8], [-0.2, -0.3], [2, 2], None, 2, [7, 1, 8, 7], [-0.2, -1.0, -0.3, -3.0]))
        d.send(gen.id, FinishedEvent(rid, "length", "", 1, 2))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        r = c.generate([1], max_new_tokens=2, return_logprob=True, top_logprobs_num=2)
    assert r.token_ids == [7, 8]
    assert r.top_token_ids == [[7, 1], [8, 7]]
    assert r.top_logprobs == [[-0.2, -1.0], [-0.3, -3.0]]


def test_generate_refuses_events_without_the_asked_top_logprobs(daemon):
    def script(d):
        gen = d.recv()
        d.send(gen.id, GenerateReply(gen.body.rid))
        d.send(gen.id, TokensEvent(gen.body.rid, [5], [], [1]))  # a daemon that ignores the key
        d.recv()  # the client aborts the request

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        with pytest.raises(RolloutdError) as e:
            c.generate([1], max_new_tokens=2, top_logprobs_num=3)
    assert (e.value.code, e.value.field) == ("bad_message", "body.top_logprobs_num")


def test_generate_discards_what_a_retracted_request_had_received(daemon):
    def script(d):
        gen = d.recv()
        rid = gen.body.rid
        d.send(gen.id, GenerateReply(rid))
        d.send(gen.id, tokens(rid, [10], rows(0, 4)))
        d.send(gen.id, tokens(rid, [11], rows(4, 1, first=16)))
        d.send(gen.id, RetractedEvent(rid, 2, "weight_update"))
        # Restarted from the prompt under new weights: rows start again at position 0.
        d.send(gen.id, TokensEvent(rid, [20, 21], [-0.25, -0.75], [8, 8], rows(0, 5, first=100)))
        d.send(gen.id, FinishedEvent(rid, "length", "", 3, 2))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        r = c.generate([1, 2, 3], max_new_tokens=2, return_logprob=True, return_routed_experts=True)
    assert (r.token_ids, r.logprobs, r.weight_versions) == ([20, 21], [-0.25, -0.75], [8, 8])
    assert r.num_retractions == 1 and r.finish_reason == "length"
    assert (r.routed_experts.shape, r.routed_experts.start_pos) == ((5, 2, 2), 0)
    assert r.routed_experts.data == bytes(range(100, 120))


def test_collect_and_stream_see_retracted_as_not_final(daemon):
    def script(d):
        gen = d.recv()
        d.send(gen.id, GenerateReply("q"))
        status = d.recv()
        d.send(gen.id, tokens("q", [5]))  # queued while status() waits
        d.send(gen.id, RetractedEvent("q", 1, "weight_update"))
        d.send(status.id, StatusReply(paused=True, update_session=2))
        d.send(gen.id, tokens("q", [6, 7]))
        d.send(gen.id, RetractedEvent("q", 2, "weight_update"))
        d.send(gen.id, tokens("q", [8]))
        d.send(gen.id, FinishedEvent("q", "stop", "", 1, 1))
        gen = d.recv()
        d.send(gen.id, GenerateReply("s"))
        d.send(gen.id, RetractedEvent("s", 0, "weight_update"))
        d.send(gen.id, FinishedEvent("s", "abort", "weight_update", 1, 0))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        c.submit([1], rid="q")
        st = c.status()
        assert (st.paused, st.update_session) == (True, 2)
        r = c.collect("q", timeout_s=5.0)
        assert (r.token_ids, r.weight_versions, r.num_retractions) == ([8], [7], 2)
        events = list(c.generate_stream([1], rid="s"))
    assert [type(e) for e in events] == [RetractedEvent, FinishedEvent]
    assert events[1].abort_reason == "weight_update"


def test_generate_reports_failed_event(daemon):
    def script(d):
        gen = d.recv()
        d.send(gen.id, GenerateReply(gen.body.rid))
        d.send(gen.id, FailedEvent(gen.body.rid, ErrorInfo("not_ready", "weight update failed", "")))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        r = c.generate([1], rid="f")
    assert not r.ok and r.finish_reason is None
    assert (r.error.code, r.error.message) == ("not_ready", "weight update failed")
    with pytest.raises(RolloutdError):
        r.raise_for_error()


def test_generate_rejects_gap_in_routed_rows_and_aborts(daemon):
    def script(d):
        gen = d.recv()
        d.send(gen.id, GenerateReply("gap"))
        d.send(gen.id, tokens("gap", [10], rows(0, 4)))
        d.send(gen.id, tokens("gap", [11], rows(5, 1)))
        abort = d.recv()
        assert abort.body == AbortRequest(rid="gap")

    peer = daemon(script)
    with Client(peer.endpoint) as c, pytest.raises(RolloutdError) as e:
        c.generate([1, 2, 3], rid="gap", return_routed_experts=True)
    assert (e.value.code, e.value.field) == ("bad_message", "body.routed_experts.start_pos")


def test_generate_timeout_aborts_and_drops_late_events(daemon):
    def script(d):
        gen = d.recv()
        d.send(gen.id, GenerateReply("slow"))
        abort = d.recv()
        assert abort.body == AbortRequest(rid="slow")
        d.send(abort.id, AbortReply(1))
        d.send(gen.id, FinishedEvent("slow", "abort", "client", 1, 0))
        d.send(8, tokens("next", [1]))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        with pytest.raises(RolloutdError) as e:
            c.generate([1], rid="slow", timeout_s=0.3)
        assert e.value.code == "deadline_exceeded"
        event = c.next_event(5.0)
    assert isinstance(event, TokensEvent) and event.rid == "next"


def test_unanswered_submission_is_aborted_but_rejected_one_is_not(daemon):
    def script(d):
        d.recv()  # accepted, perhaps, but the reply never comes
        assert d.recv().body == AbortRequest(rid="lost")
        dup = d.recv()
        d.send(dup.id, ErrorInfo("duplicate_rid", "in flight", "body.rid"))
        assert d.expect_closed_or_silent(0.3)  # no abort: "taken" belongs to the request in flight

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        with pytest.raises(RolloutdError) as e:
            c.generate([1], rid="lost", timeout_s=0.2)
        assert e.value.code == "deadline_exceeded"
        with pytest.raises(RolloutdError) as e:
            c.generate([1], rid="taken")
        assert e.value.code == "duplicate_rid"
        time.sleep(0.4)  # keep the connection open while the daemon listens for an abort


def test_stream_yields_events_and_closing_early_aborts(daemon):
    def script(d):
        gen = d.recv()
        d.send(gen.id, GenerateReply("s"))
        d.send(gen.id, tokens("s", [1]))
        d.send(gen.id, tokens("s", [2]))
        abort = d.recv()
        assert abort.body == AbortRequest(rid="s")

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        stream = c.generate_stream([1], rid="s", max_new_tokens=8)
        first = next(stream)
        assert first.token_ids == [1]
        stream.close()


def test_abort_all_and_shutdown(daemon):
    def script(d):
        m = d.recv()
        assert m.body == AbortRequest(all=True)
        d.send(m.id, AbortReply(2))
        m = d.recv()
        assert (m.type, m.body.drain, m.body.deadline_s) == ("shutdown", False, 5.0)
        d.send(m.id, ShutdownReply(True))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        assert c.abort_all().num_aborted == 2
        assert c.shutdown(drain=False, deadline_s=5).accepted


def test_no_daemon_is_unavailable():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    endpoint = "tcp://127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    with Client(endpoint, timeout_s=0.2) as c, pytest.raises(RolloutdError) as e:
        c.status()
    assert e.value.code == "unavailable"


def test_closed_client_refuses_calls():
    c = Client("tcp://127.0.0.1:1", timeout_s=0.1)
    c.close()
    with pytest.raises(RolloutdError) as e:
        c.status()
    assert e.value.code == "failed_precondition"


def test_undecodable_reply_is_a_typed_error(daemon):
    def script(d):
        m = d.recv()
        d.send_frames([b"\xc1 not msgpack"])
        d.send(m.id, StatusReply())

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        with pytest.raises(RolloutdError) as e:
            c.status()
        assert e.value.code == "bad_message"


def _accept_send_a_token_and_die(d):
    """A fake daemon's script: accepts one generate request, sends one token, dies."""
    gen = d.recv()
    d.send(gen.id, GenerateReply(gen.body.rid))
    d.send(gen.id, tokens(gen.body.rid, [10], rows(0, 3)))
    d.close()


def _hello_once_reconnected(c, within_s: float = 10.0):
    """hello() once the client has reconnected (within its 100 ms interval; a loaded host may
    take longer): 'unavailable' is retried until within_s has passed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return c.hello()
        except RolloutdError as err:
            if err.code != "unavailable" or time.monotonic() > deadline:
                raise


def test_requests_a_daemon_took_before_it_died_fail_soon_after_the_drop(daemon):
    """Two requests sent without waiting (as a coordinator's batch sends them) reach the daemon,
    which then dies without replying: both fail 'unavailable' soon after the connection drops.
    Until 2026-12-06 each waited out its deadline (a coordinator's batch: 30 s)."""
    def script(d):
        assert [d.recv().type for _ in range(2)] == ["generate", "generate"]
        d.close()

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        t0 = time.monotonic()
        pending = [c.send_request(GenerateRequest(rid=f"r{i}", input_ids=[1, 2]), GenerateReply, timeout_s=20.0)
                   for i in range(2)]
        for p in pending:
            with pytest.raises(RolloutdError) as e:
                p.result()
            assert e.value.code == "unavailable", e.value
        assert time.monotonic() - t0 < 10.0
        assert c._disconnects() >= 1


def test_collect_of_a_submitted_request_whose_daemon_died_fails_soon_after_the_drop(daemon):
    """submit() then collect() (the pattern for many requests on one daemon): the daemon accepts,
    sends a token and dies; collect fails 'unavailable' soon after, not at its 20 s timeout."""
    peer = daemon(_accept_send_a_token_and_die)
    with Client(peer.endpoint) as c:
        rid = c.submit([1, 2], max_new_tokens=3)
        peer.join()
        t0 = time.monotonic()
        with pytest.raises(RolloutdError) as e:
            c.collect(rid, timeout_s=20.0)
        assert e.value.code == "unavailable", e.value
        assert time.monotonic() - t0 < 10.0
        assert rid not in c._submitted_since


def test_a_reply_received_before_the_drop_is_delivered_however_late_it_is_read(daemon):
    """The daemon answers and exits at once (a drain): the reply waits in the local queue and is
    returned even when it is read long after the drop was seen, never 'unavailable'."""
    def script(d):
        m = d.recv()
        d.send(m.id, StatusReply(weight_version=4))
        d.close()

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        pending = c.send_request(StatusRequest(), StatusReply, timeout_s=20.0)
        peer.join()
        deadline = time.monotonic() + 10.0
        while c._disconnects() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c._disconnects() >= 1
        time.sleep(1.0)  # the drop was seen well over 300 ms ago
        assert pending.result().weight_version == 4


def test_a_generate_whose_daemon_dies_while_it_streams_fails_soon_after_the_drop(daemon):
    peer = daemon(_accept_send_a_token_and_die)
    with Client(peer.endpoint) as c:
        t0 = time.monotonic()
        with pytest.raises(RolloutdError) as e:
            c.generate([1, 2], max_new_tokens=3, timeout_s=20.0)
        assert e.value.code == "unavailable", e.value
        assert time.monotonic() - t0 < 10.0


def test_a_request_still_queued_when_its_daemon_died_is_never_delivered_later():
    """A request queued behind a 64 MB frame the daemon never read (so it never left this host)
    fails 'unavailable' when the daemon dies, and is dropped with the connection: a daemon started
    later on the same port first receives the client's next request, not that one. Without the
    drop it arrived there after its caller (a coordinator that placed it elsewhere) had been told
    'unavailable'."""
    from zmtp_peer import ZmtpPeer
    import threading
    go = threading.Event()

    def first_script(d):
        m = d.recv()
        d.send(m.id, HelloReply(build="first"))
        assert go.wait(10)
        d.close()  # dies with most of the big frame and the status request unread

    def second_script(d):
        m = d.recv()
        assert m.type == "hello", m.type  # not the stale status request
        d.send(m.id, HelloReply(build="second"))

    first = ZmtpPeer(first_script)
    port = int(first.endpoint.rsplit(":", 1)[1])
    second = None
    try:
        with Client(first.endpoint, timeout_s=20.0) as c:
            assert c.hello().build == "first"
            c.send_raw([b"\0" * (64 << 20)], timeout_s=10.0)
            pending = c.send_request(StatusRequest(), StatusReply, timeout_s=20.0)
            t0 = time.monotonic()
            go.set()
            with pytest.raises(RolloutdError) as e:
                pending.result()
            assert e.value.code == "unavailable", e.value
            assert time.monotonic() - t0 < 10.0
            first.join()
            second = ZmtpPeer(second_script, port=port)
            assert _hello_once_reconnected(c).build == "second"
            second.join()
    finally:
        first.close()
        if second is not None:
            second.close()


def test_requests_pending_on_a_replaced_connection_fail_at_once_even_after_a_daemon_is_back():
    """Two requests pending when their daemon dies; the first wait replaces the lost connection.
    A daemon is then back on the same port and the client connected to it, yet the second
    request, sent over the old connection, cannot be answered: it fails 'unavailable' at once
    (it waited out its whole deadline when only the connection's state was looked at)."""
    from zmtp_peer import ZmtpPeer

    def first_script(d):
        assert [d.recv().type for _ in range(2)] == ["status", "status"]
        d.close()

    def second_script(d):
        m = d.recv()
        assert m.type == "hello", m.type
        d.send(m.id, HelloReply(build="second"))

    first = ZmtpPeer(first_script)
    second = None
    try:
        with Client(first.endpoint, timeout_s=20.0) as c:
            pending = [c.send_request(StatusRequest(), StatusReply, timeout_s=20.0) for _ in range(2)]
            with pytest.raises(RolloutdError) as e:
                pending[0].result()
            assert e.value.code == "unavailable", e.value
            first.join()
            second = ZmtpPeer(second_script, port=int(first.endpoint.rsplit(":", 1)[1]))
            assert _hello_once_reconnected(c).build == "second"
            t0 = time.monotonic()
            with pytest.raises(RolloutdError) as e:
                pending[1].result()
            assert e.value.code == "unavailable", e.value
            assert time.monotonic() - t0 < 2.0
            second.join()
    finally:
        first.close()
        if second is not None:
            second.close()
