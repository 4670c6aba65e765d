"""Weight hot reload end to end: real daemons, the Python client, inline and shm buckets.

New weights come from the independent NumPy re-implementation of the embedded model's
initialisation (tests/reference/tiny_moe_reference.py) with another seed, so a daemon that
takes them must behave exactly like a daemon started with --model-seed of that seed.
"""
import os
import sys
import threading
import time
import zlib

import numpy as np
import pytest

import rolloutd
from conftest import final_events, wait_queue

sys.path.insert(0, os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"], "tests", "reference"))
import tiny_moe_reference as ref  # noqa: E402

NEW_SEED = 4242


def numpy_weights(seed):
    old = ref.SEED
    ref.SEED = seed
    try:
        return ref.build_weights(ref.CONFIG)
    finally:
        ref.SEED = old


@pytest.fixture(scope="module")
def new_weights():
    return numpy_weights(NEW_SEED)


def greedy(c, prompt=(3, 1, 4, 1, 5), n=12):
    r = c.generate(list(prompt), max_new_tokens=n, temperature=0.0, return_logprob=True,
                   return_routed_experts=True)
    return r.token_ids, r.routed_experts.data, r.weight_versions


def test_push_equals_a_daemon_started_with_those_weights(daemon_factory, new_weights):
    pushed, fresh = daemon_factory(), daemon_factory(args=["--model-seed", str(NEW_SEED)])
    with pushed.client() as a, fresh.client() as b:
        a.hello()
        reply = a.push_weights(list(new_weights.items()), weight_version=7, bucket_bytes=256 << 10)
        assert reply.weight_version == 7 and reply.num_buckets > 1
        assert reply.num_parameters_updated == len(new_weights)
        sums = a.weights_checksum()
        expected = {name: zlib.crc32(np.ascontiguousarray(w).tobytes()) for name, w in new_weights.items()}
        assert dict(sums) == expected
        assert sums.model_checksum == rolloutd.weights.model_checksum(expected)
        assert sums.model_checksum == b.weights_checksum().model_checksum
        ta, ra, va = greedy(a)
        tb, rb, _ = greedy(b)
        assert ta == tb and ra == rb
        assert va == [7] * len(ta)
        assert pushed.metric("rolloutd_weight_update_sessions_total", result="completed") == 1
        assert pushed.metric("rolloutd_weight_update_bytes_total") >= sum(w.nbytes for w in new_weights.values())
        got = a.get_weights_by_name("model.layers.2.mlp.experts.gate_up_proj", truncate=50)
        assert got.dtype == "float32" and list(got.shape) == [16, 64, 64]
        assert np.array_equal(np.array(got.values, dtype=np.float32),
                              new_weights["model.layers.2.mlp.experts.gate_up_proj"].reshape(-1)[:50])


def test_bf16_push_and_its_fp32_export_are_identical(daemon_factory, new_weights):
    d1, d2 = daemon_factory(), daemon_factory()
    w = new_weights["model.layers.0.mlp.gate.weight"]
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact bf16 values
    as_f32 = (bf16.astype(np.uint32) << 16).view(np.float32)
    with d1.client() as a, d2.client() as b:
        a.hello()
        b.hello()
        a.push_weights([("model.layers.0.mlp.gate.weight", "bfloat16", w.shape, bf16.tobytes())], 1)
        b.push_weights([("model.layers.0.mlp.gate.weight", as_f32)], 1)
        assert a.weights_checksum().model_checksum == b.weights_checksum().model_checksum


def test_shm_and_inline_buffers_may_be_scribbled_right_after_each_reply(daemon, new_weights):
    from multiprocessing import shared_memory
    names = sorted(new_weights)[:10]
    entries, data = rolloutd.weights.pack_bucket([(n, new_weights[n]) for n in names])
    shm = shared_memory.SharedMemory(name=f"rolloutd-test-{os.getpid()}", create=True, size=len(data))
    try:
        with daemon.client() as c:
            s = c.begin_weight_update().session
            shm.buf[:len(data)] = data
            c.update_weights_shm(s, entries, "/" + shm.name, 0, len(data), checksum=zlib.crc32(data))
            shm.buf[:len(data)] = bytes(len(data))  # the trainer reuses its buffer at once
            payload = bytearray(data)
            c.update_weights_inline(s, entries, payload)
            payload[:] = b"\xff" * len(payload)
            c.end_weight_update(s, 3)
            sums = c.weights_checksum(names)
            for n in names:
                assert sums[n] == zlib.crc32(new_weights[n].tobytes()), n
    finally:
        shm.close()
        shm.unlink()


def test_a_selector_may_name_the_checkpoint_names_it_pushes(daemon):
    # A per-expert checkpoint name selects the stacked parameter it writes (it matched stored
    # names only: the push was refused bucket by bucket); a prefix naming nothing is refused.
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    with daemon.client() as c:
        s = c.begin_weight_update([name]).session
        entries, data = rolloutd.weights.pack_bucket([(name, np.ones((32, 64), dtype=np.float32))])
        assert c.update_weights_inline(s, entries, data).num_entries == 1
        assert c.end_weight_update(s, 1).num_parameters_updated == 1
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.begin_weight_update(["model.nope."])
        assert (e.value.code, e.value.field) == ("not_found", "body.selector[0]")
        assert c.status().ready


def test_a_push_below_the_serving_version_is_refused_before_anything_is_written(daemon, new_weights):
    # end_weight_update refuses a version below the serving one; the helper finds out at begin,
    # so the daemon stays ready with its weights (it sent every bucket, then left it not_ready).
    with daemon.client() as c:
        c.push_weights(list(new_weights.items()), weight_version=5)
        before = c.weights_checksum().model_checksum
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.push_weights(list(new_weights.items()), weight_version=3)
        assert (e.value.code, e.value.field) == ("invalid_argument", "weight_version")
        st = c.status()
        assert st.ready and st.weight_version == 5 and c.weights_checksum().model_checksum == before
        assert c.push_weights(list(new_weights.items()), weight_version=6).weight_version == 6


def test_a_session_that_expired_answers_deadline_exceeded(daemon):
    # SPEC 11: requests naming a session that expired get deadline_exceeded (the trainer was too
    # slow), others failed_precondition; the model was untouched, so the daemon stays ready.
    with daemon.client() as c:
        s = c.begin_weight_update(timeout_s=0.2).session
        deadline = time.monotonic() + 10
        while c.status().update_session:
            assert time.monotonic() < deadline, "the session never expired"
            time.sleep(0.05)
        for call in (lambda: c.end_weight_update(s, 1), lambda: c.abort_weight_update(s)):
            with pytest.raises(rolloutd.RolloutdError) as e:
                call()
            assert (e.value.code, e.value.field) == ("deadline_exceeded", "body.session"), e.value
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.end_weight_update(s + 1, 1)
        assert (e.value.code, e.value.field) == ("failed_precondition", "body.session")
        assert c.status().ready


def test_fail_closed_errors_name_the_entry_and_change_nothing(daemon, new_weights):
    name = "model.norm.weight"
    good = [(name, new_weights[name])]
    with daemon.client() as c:
        before = c.weights_checksum().model_checksum
        s = c.begin_weight_update().session
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.begin_weight_update()
        assert e.value.code == "failed_precondition"
        entries, data = rolloutd.weights.pack_bucket([("model.nope.weight", new_weights[name])] + good)
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_inline(s, entries, data)
        assert (e.value.code, e.value.field) == ("not_found", "body.entries[0].name")
        entries, data = rolloutd.weights.pack_bucket([(name, new_weights[name].reshape(2, 32))])
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_inline(s, entries, data)
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.entries[0].shape")
        entries, data = rolloutd.weights.pack_bucket(good)
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_inline(s, entries, data, checksum=zlib.crc32(data) ^ 1)
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.checksum")
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_inline(s + 100, entries, data)
        assert (e.value.code, e.value.field) == ("failed_precondition", "body.session")
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_shm(s, entries, "/not-ours", 0, len(data))
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.source.name")
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_shm(s, entries, "/rolloutd-does-not-exist", 0, len(data))
        assert (e.value.code, e.value.field) == ("not_found", "body.source")
        # SPEC 11.2's order: the table before the object. An unknown name or a wrong shape is
        # named as itself, even when the object is missing or outside the prefix too.
        bad, bad_data = rolloutd.weights.pack_bucket([("model.nope.weight", new_weights[name])] + good)
        for shm_name in ("/rolloutd-does-not-exist", "/not-ours"):
            with pytest.raises(rolloutd.RolloutdError) as e:
                c.update_weights_shm(s, bad, shm_name, 0, len(bad_data))
            assert (e.value.code, e.value.field) == ("not_found", "body.entries[0].name"), shm_name
        bad, bad_data = rolloutd.weights.pack_bucket([(name, new_weights[name].reshape(2, 32))])
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.update_weights_shm(s, bad, "/rolloutd-does-not-exist", 0, len(bad_data))
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.entries[0].shape")
        # Nothing was written: aborting leaves the model whole and unchanged.
        assert c.abort_weight_update(s).state == "ready"
        assert c.weights_checksum().model_checksum == before
        assert c.status().ready


def test_idle_session_expires_and_a_half_written_model_is_refused(daemon, new_weights):
    with daemon.client() as c:
        c.hello()
        long_rid = c.submit([1, 2], max_new_tokens=3000, temperature=1.0, seed=1)
        c.pause_generation("in_place")
        s = c.begin_weight_update(timeout_s=0.5).session
        entries, data = rolloutd.weights.pack_bucket([("model.norm.weight", new_weights["model.norm.weight"])])
        c.update_weights_inline(s, entries, data)
        deadline = time.monotonic() + 10
        while c.status().state != "not_ready":
            assert time.monotonic() < deadline, "the session did not expire"
            time.sleep(0.05)
        st = c.status()
        assert not st.ready and "model.norm.weight" in st.reason
        assert daemon.metric("rolloutd_weight_update_sessions_total", result="expired") == 1
        code, body = daemon.get("/readyz")
        assert code == 503 and "model.norm.weight" in body
        # The request that was in flight is failed with the reason, never served half-updated.
        final = None
        for ev in c.events(timeout_s=5.0):
            if ev.rid == long_rid and not isinstance(ev, (rolloutd.TokensEvent, rolloutd.RetractedEvent)):
                final = ev
                break
        assert isinstance(final, rolloutd.FailedEvent) and final.error.code == "not_ready"
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.generate([1], max_new_tokens=2)
        assert e.value.code == "not_ready"
        # A completed session that rewrites what the failed one touched makes it whole again.
        c.push_weights(list(new_weights.items()), weight_version=2)
        c.continue_generation()
        assert c.status().ready
        assert c.generate([1], max_new_tokens=2, temperature=0.0).weight_versions == [2, 2]


@pytest.mark.parametrize("stream_interval", [1, 7])
def test_pause_retract_restarts_under_the_new_weights(daemon_factory, new_weights, stream_interval):
    # With --stream-interval 7 the daemon holds up to 6 tokens; they go out before the
    # retraction, so num_tokens_discarded still counts exactly what the client received.
    d = daemon_factory(args=["--stream-interval", str(stream_interval)])
    fresh = daemon_factory(args=["--model-seed", str(NEW_SEED)])
    with d.client() as c, fresh.client() as f:
        c.hello()
        want = f.generate([9, 8, 7], max_new_tokens=2000, temperature=0.0).token_ids
        stream = c.generate_stream([9, 8, 7], max_new_tokens=2000, temperature=0.0, rid="r1")
        first = next(stream)
        assert isinstance(first, rolloutd.TokensEvent)
        with d.client() as trainer:
            trainer.hello()
            p = trainer.pause_generation("retract")
            assert p.num_retracted == 1
            trainer.push_weights(list(new_weights.items()), weight_version=5)
            trainer.continue_generation()
        events = [first] + list(stream)
        kinds = [type(e).__name__ for e in events]
        assert "RetractedEvent" in kinds and kinds[-1] == "FinishedEvent"
        retracted = events[kinds.index("RetractedEvent")]
        before = events[:kinds.index("RetractedEvent")]
        assert retracted.num_tokens_discarded == sum(len(e.token_ids) for e in before) > 0
        assert all(len(e.token_ids) == stream_interval for e in before[:-1])
        after = events[kinds.index("RetractedEvent") + 1:-1]
        tokens = [t for e in after for t in e.token_ids]
        versions = [v for e in after for v in e.weight_versions]
        assert tokens == want and set(versions) == {5}
        # The collector of generate() resets on retracted too.


def test_pause_retract_of_a_stream_false_request_sends_retracted_with_nothing_discarded(daemon_factory,
                                                                                       new_weights):
    # SPEC 11.6: the retracted event goes to stream=false requests too (num_tokens_discarded 0:
    # they had received nothing), then their one tokens event and the final one.
    d = daemon_factory()
    fresh = daemon_factory(args=["--model-seed", str(NEW_SEED)])
    with d.client() as c, fresh.client() as f, d.client() as trainer:
        trainer.hello()
        # 1,000 tokens run ~0.5 s in a release build: long enough to be caught running.
        want = f.generate([9, 8, 7], max_new_tokens=1000, temperature=0.0, timeout_s=240.0).token_ids
        rid = c.submit([9, 8, 7], max_new_tokens=1000, temperature=0.0, stream=False)
        deadline = time.monotonic() + 10
        while trainer.status().num_running != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        assert trainer.pause_generation("retract").num_retracted == 1
        trainer.push_weights(list(new_weights.items()), weight_version=5)
        trainer.continue_generation()
        events = []
        # stream=false: nothing comes until the whole generation is done, so the idle bound is
        # the generation's (ASan on a 2-core CI machine took over 60 s for 3,000 tokens).
        for ev in c.events(timeout_s=240.0):
            assert ev.rid == rid
            events.append(ev)
            if isinstance(ev, (rolloutd.FinishedEvent, rolloutd.FailedEvent)):
                break
        assert [type(e).__name__ for e in events] == ["RetractedEvent", "TokensEvent", "FinishedEvent"]
        assert events[0].num_tokens_discarded == 0 and events[0].reason == "weight_update"
        assert events[1].token_ids == want and set(events[1].weight_versions) == {5}


def test_pause_abort_ends_waiting_requests_too(daemon_factory):
    # SPEC 11.6: abort ends every request, queued ones included, so the daemon is idle after it
    # (release_memory's precondition); one running at a time here, two wait.
    d = daemon_factory(args=["--max-running", "1"])
    with d.client() as c, d.client() as trainer:
        rids = [c.submit([4, 4], max_new_tokens=3000, temperature=1.0, seed=i) for i in range(3)]
        wait_queue(trainer, running=1, waiting=2)
        assert trainer.pause_generation("abort").num_aborted == 3
        finals = final_events(c, rids, 10.0)
        assert all((f.reason, f.abort_reason) == ("abort", "weight_update") for f in finals.values())
        st = trainer.status()
        assert st.num_running == 0 and st.num_waiting == 0
        trainer.continue_generation()


def test_pause_and_continue_count_only_the_requests_they_hold(daemon_factory):
    # SPEC 11.6: in_place holds the in-flight requests (waiting ones stay queued and are not
    # counted); continue resumes those; when not paused it answers num_resumed 0.
    d = daemon_factory(args=["--max-running", "1"])
    with d.client() as c, d.client() as trainer:
        assert trainer.continue_generation().num_resumed == 0
        rids = [c.submit([4, 4], max_new_tokens=3000, temperature=1.0, seed=i) for i in range(3)]
        wait_queue(trainer, running=1, waiting=2)
        assert trainer.pause_generation("in_place").num_paused == 1
        assert trainer.continue_generation().num_resumed == 1
        assert trainer.continue_generation().num_resumed == 0
        for rid in rids:
            c.abort(rid)


def test_pause_in_place_versions_show_the_switch(daemon, new_weights):
    with daemon.client() as c, daemon.client() as trainer:
        trainer.hello()
        rid = c.submit([5, 5], max_new_tokens=2000, temperature=0.0)
        first = c.next_event(10.0)  # generation is under way with version 0
        assert isinstance(first, rolloutd.TokensEvent) and first.rid == rid
        p = trainer.pause_generation("in_place")
        assert p.num_paused == 1
        trainer.push_weights(list(new_weights.items()), weight_version=9)
        trainer.continue_generation()
        r = c.collect(rid, timeout_s=60)
        versions = list(first.weight_versions) + r.weight_versions
        assert r.finish_reason == "length" and len(versions) == 2000
        assert versions[0] == 0 and versions[-1] == 9
        assert versions == sorted(versions), "versions never go back"


def test_pause_abort_ends_requests_with_reason_weight_update(daemon):
    with daemon.client() as c, daemon.client() as trainer:
        rid = c.submit([5], max_new_tokens=3000, temperature=1.0, seed=2)
        assert trainer.pause_generation("abort").num_aborted == 1
        r = c.collect(rid, timeout_s=30)
        assert r.finish_reason == "abort" and r.abort_reason == "weight_update"
        # Paused: new requests queue until continue.
        rid2 = c.submit([5], max_new_tokens=2)
        assert c.next_event(0.3) is None
        trainer.continue_generation()
        assert c.collect(rid2, timeout_s=30).finish_reason == "length"


def test_a_checksum_in_slices_lets_generation_run_and_sees_one_set_of_weights(daemon_factory, new_weights):
    # --checksum-slice-ms 0: one parameter a loop turn. A long request keeps stepping meanwhile;
    # pushes from another client (one bucket each: all 39 parameters in one command), sent while
    # checksums are in progress, wait for their replies: every checksum is of the old weights or
    # of the new ones, never of a mix. (A session of several buckets is seen between buckets, as
    # it always was: SPEC, weights_checksum.)
    d = daemon_factory(args=["--checksum-slice-ms", "0"])
    old_weights = numpy_weights(ref.SEED)
    old = {name: zlib.crc32(np.ascontiguousarray(w).tobytes()) for name, w in old_weights.items()}
    new = {name: zlib.crc32(np.ascontiguousarray(w).tobytes()) for name, w in new_weights.items()}
    with d.client() as a, d.client() as b, d.client() as g:
        a.hello()
        b.hello()
        g.hello()
        first = a.weights_checksum()
        assert dict(first) == old and first.weight_version == 0
        rid = g.submit([3, 1, 4, 1, 5], max_new_tokens=4000, temperature=0.0)  # ~1 s here: 100 x the checksum
        wait_queue(g, 1, 0)
        a.weights_checksum()
        deadline = time.monotonic() + 10
        while len(lines := [x for x in d.log_lines() if x.get("msg") == "weights checksummed"]) < 2:
            assert time.monotonic() < deadline, "no log line for the second checksum"
            time.sleep(0.01)
        line = lines[1]
        assert line["parameters"] == len(old) and line["turns"] == len(old), line
        # The first turn in the loop turn that took the request, the next in that turn's device
        # work, then a step after each turn but the last: a step between any two turns but one.
        assert line["engine_steps"] >= len(old) - 2, f"the request stepped while the checksum ran: {line}"
        g.abort(rid)
        assert final_events(g, [rid], 30)[rid].reason in ("abort", "length")

        seen, done = [], threading.Event()

        def checksums():
            while not done.is_set():
                s = a.weights_checksum()
                seen.append((s.weight_version, s.model_checksum))

        t = threading.Thread(target=checksums)
        t.start()
        try:
            for version in (2, 4, 6):  # new weights at even versions, the old ones back at odd
                assert b.push_weights(list(new_weights.items()), weight_version=version,
                                      bucket_bytes=16 << 20).num_buckets == 1
                assert b.push_weights(list(old_weights.items()), weight_version=version + 1,
                                      bucket_bytes=16 << 20).num_buckets == 1
        finally:
            done.set()
            t.join(timeout=60)
        assert not t.is_alive()
        want_old, want_new = rolloutd.weights.model_checksum(old), rolloutd.weights.model_checksum(new)
        assert all(total in (want_old, want_new) for _, total in seen), (want_old, want_new, seen)
        assert len(seen) >= 2, seen
