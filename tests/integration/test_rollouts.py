"""Rollouts end to end: real daemons, the Python client, loopback sockets."""
import threading
import time

import numpy as np
import pytest

import rolloutd
from conftest import final_events, wait_queue


def test_hello_status_and_health(daemon):
    with daemon.client() as c:
        h = c.hello()
        assert h.version == 1 and h.daemon == "rolloutd"
        assert h.model.num_experts == 16 and h.model.top_k == 4 and h.model.routed_experts_dtype == "uint8"
        s = c.status()
        assert s.ready and s.state == "ready"
    assert daemon.get("/livez")[0] == 200
    assert daemon.get("/readyz")[0] == 200
    code, body = daemon.get("/v1/status")
    assert code == 200 and '"weight_version"' in body
    code, body = daemon.get("/metrics")
    assert code == 200 and "rolloutd_requests_total" in body
    assert daemon.get("/livez", method="POST")[0] == 405
    assert daemon.get("/nope")[0] == 404


def test_generate_returns_tokens_logprobs_versions_and_records(daemon):
    with daemon.client() as c:
        prompt = [1, 2, 3, 4, 5]
        r = c.generate(prompt, max_new_tokens=12, temperature=0.7, seed=3, return_logprob=True,
                       return_routed_experts=True)
        assert r.ok and r.finish_reason == "length"
        assert len(r.token_ids) == 12 and all(0 <= t < 256 for t in r.token_ids)
        assert len(r.logprobs) == 12 and all(lp <= 0.0 for lp in r.logprobs)
        assert r.weight_versions == [0] * 12
        assert r.prompt_tokens == 5 and r.completion_tokens == 12
        re = r.routed_experts
        # One row per forwarded token: prompt + generated - 1.
        assert re.dtype == "uint8" and tuple(re.shape) == (5 + 12 - 1, 4, 4) and re.start_pos == 0
        arr = re.to_numpy()
        assert arr.dtype == np.uint8 and arr.max() < 16
        # Top-k ids of one token in one layer are distinct experts.
        assert all(len(set(arr[t, l])) == 4 for t in range(arr.shape[0]) for l in range(4))


def test_greedy_matches_the_numpy_reference(daemon):
    import json, os
    golden = json.load(open(os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"],
                                         "tests/reference/tiny_moe_golden.json")))
    with daemon.client() as c:
        for case in golden["cases"]:
            r = c.generate(case["prompt"], max_new_tokens=len(case["greedy_tokens"]), temperature=0.0,
                           return_routed_experts=True)
            assert r.token_ids == case["greedy_tokens"]
            assert r.routed_experts.to_numpy().tolist() == case["routed_experts"]


def test_top_logprobs_match_the_numpy_reference_and_the_sampled_tokens(daemon):
    import json, os
    golden = json.load(open(os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"],
                                         "tests/reference/tiny_moe_golden.json")))
    with daemon.client() as c:
        for case in golden["cases"]:
            r = c.generate(case["prompt"], max_new_tokens=6, temperature=0.0, return_logprob=True,
                           top_logprobs_num=5, stream=True)
            assert len(r.top_token_ids) == len(r.top_logprobs) == 6
            # The first token's list: the NumPy model's last prompt logits, sorted here.
            logits = np.asarray(case["prompt_logits"][-1], dtype=np.float64)
            order = np.argsort(-logits, kind="stable")[:5]
            log_softmax = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            assert r.top_token_ids[0] == order.tolist()
            assert np.allclose(r.top_logprobs[0], log_softmax[order], atol=1e-4)
            for tok, lp, ids, lps in zip(r.token_ids, r.logprobs, r.top_token_ids, r.top_logprobs):
                assert ids[0] == tok and lps[0] == lp  # greedy: the token heads its own list, same value
                assert all(a >= b for a, b in zip(lps, lps[1:]))
        sampled = c.generate([3, 1, 4], max_new_tokens=8, temperature=1.0, seed=5, return_logprob=True,
                             top_logprobs_num=20, stream=False)
        assert [len(x) for x in sampled.top_token_ids] == [20] * 8
        for tok, lp, ids, lps in zip(sampled.token_ids, sampled.logprobs, sampled.top_token_ids,
                                     sampled.top_logprobs):
            if tok in ids:
                assert lps[ids.index(tok)] == lp
            else:
                assert lp <= lps[-1]
        plain = c.generate([3, 1, 4], max_new_tokens=2, temperature=0.0)
        assert plain.top_token_ids == [] and plain.top_logprobs == []
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.generate([3], max_new_tokens=2, top_logprobs_num=21)
        assert (e.value.code, e.value.field) == ("out_of_range", "body.top_logprobs_num")
        # One event for 20,000 tokens with 20 entries each would pass the 4 MiB envelope limit.
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.generate([3], max_new_tokens=20000, top_logprobs_num=20, stream=False)
        assert (e.value.code, e.value.field) == ("too_large", "body.top_logprobs_num")


def test_routed_experts_start_len_and_stream_false(daemon):
    with daemon.client() as c:
        a = c.generate([9] * 10, max_new_tokens=6, temperature=0.0, return_routed_experts=True,
                       routed_experts_start_len=4, return_logprob=True)
        b = c.generate([9] * 10, max_new_tokens=6, temperature=0.0, return_routed_experts=True,
                       routed_experts_start_len=4, return_logprob=True, stream=False)
        assert a.routed_experts.start_pos == 4 and a.routed_experts.shape[0] == 10 + 6 - 1 - 4
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.routed_experts.data == b.routed_experts.data
        full = c.generate([9] * 10, max_new_tokens=6, temperature=0.0, return_routed_experts=True)
        assert full.routed_experts.to_numpy()[4:].tobytes() == a.routed_experts.data


@pytest.mark.parametrize("stream", [True, False])
def test_every_tokens_event_of_a_routed_request_carries_the_map(daemon, stream):
    # SPEC 4.4: rows or not, each tokens event of a return_routed_experts request carries the map
    # (dtype and shape always known); one without rows states where the next row will be, and
    # the rows that do come start at routed_experts_start_len with no gaps.
    with daemon.client() as c:
        for start_len in (10, 50):
            rid = c.submit([1, 2, 3], max_new_tokens=20, temperature=0.0, return_routed_experts=True,
                           routed_experts_start_len=start_len, stream=stream)
            tokens = []
            for ev in c.events(timeout_s=30.0):
                assert ev.rid == rid
                if not isinstance(ev, rolloutd.TokensEvent):
                    break
                tokens.append(ev)
            assert tokens and all(ev.routed_experts is not None for ev in tokens), start_len
            pos = start_len
            for ev in tokens:
                r = ev.routed_experts
                assert r.start_pos == pos and len(r.data) == r.num_tokens * r.shape[1] * r.shape[2] * {
                    "uint8": 1, "uint16": 2, "int32": 4}[r.dtype]
                pos += r.num_tokens
            # 3 prompt tokens + 20 generated, the last never fed back: rows at positions 0..21.
            assert pos == max(start_len, 22), start_len


def test_a_top_p_below_floats_range_is_accepted_and_keeps_the_top_token(daemon):
    # SPEC 3: any top_p in (0, 1]; 1e-50 rounded to 0.0f and was refused. It keeps the top token.
    with daemon.client() as c:
        greedy = c.generate([7, 7], max_new_tokens=8, temperature=0.0).token_ids
        assert c.generate([7, 7], max_new_tokens=8, temperature=1.0, top_p=1e-50, seed=3).token_ids == greedy


def test_streaming_yields_tokens_then_one_final_event(daemon):
    with daemon.client() as c:
        events = list(c.generate_stream([5, 6], max_new_tokens=5, temperature=0.0))
        assert isinstance(events[-1], rolloutd.FinishedEvent)
        assert all(isinstance(e, rolloutd.TokensEvent) for e in events[:-1])
        assert sum(len(e.token_ids) for e in events[:-1]) == 5


def test_stream_interval_batches_tokens_without_changing_the_result(daemon, daemon_factory):
    """--stream-interval N: a streamed request's tokens come in events of N (the last may be
    shorter), and what the client ends up with -- tokens, log-probs, versions, routed rows --
    equals the one-event-per-step stream of a default daemon."""
    batched = daemon_factory(args=["--stream-interval", "5"])
    kw = dict(max_new_tokens=23, temperature=0.0, return_logprob=True, return_routed_experts=True)
    with daemon.client() as c1, batched.client() as c2:
        ref = c1.generate([7, 8, 9], **kw)
        events = list(c2.generate_stream([7, 8, 9], **kw))
        got = c2.generate([7, 8, 9], **kw)
    assert isinstance(events[-1], rolloutd.FinishedEvent) and events[-1].completion_tokens == 23
    sizes = [len(e.token_ids) for e in events[:-1]]
    assert sizes == [5, 5, 5, 5, 3], sizes
    rows = sum(e.routed_experts.shape[0] for e in events[:-1])
    assert rows == 3 + 23 - 1
    assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs
    assert got.weight_versions == ref.weight_versions
    assert got.routed_experts.data == ref.routed_experts.data and got.routed_experts.start_pos == 0


def test_determinism_by_seed_across_daemons_and_batches(daemon_factory):
    d1, d2 = daemon_factory(), daemon_factory()
    kw = dict(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=777, return_logprob=True)
    with d1.client() as c1, d2.client() as c2:
        a = c1.generate([3, 1, 4, 1, 5], **kw)
        # The same request inside a busy batch on the other daemon.
        busy = [c2.submit([i, i + 1, i + 2], max_new_tokens=40, temperature=1.0, seed=i) for i in range(8)]
        b = c2.generate([3, 1, 4, 1, 5], **kw)
        c = c1.generate([3, 1, 4, 1, 5], **{**kw, "seed": 778})
        for rid in busy:
            c2.abort(rid)
    assert a.token_ids == b.token_ids
    assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert a.token_ids != c.token_ids


def test_stop_token(daemon):
    with daemon.client() as c:
        r = c.generate([17, 42, 99], max_new_tokens=16, temperature=0.0, stop_token_ids=[244])
        assert r.finish_reason == "stop" and r.token_ids == [127, 157, 244]


def test_two_clients_concurrently(daemon):
    results, errors = {}, []

    def worker(name):
        try:
            with daemon.client() as c:
                rids = [c.submit([i % 200 + 1, 7], max_new_tokens=10 + i, temperature=0.5, seed=i,
                                 rid=f"{name}-{i}") for i in range(6)]
                finals = {}
                while len(finals) < len(rids):
                    ev = c.next_event(30.0)
                    assert ev is not None, "no event within 30 s"
                    assert ev.rid.startswith(name), "an event reached the wrong client"
                    if not isinstance(ev, rolloutd.TokensEvent):
                        assert ev.rid not in finals, "two final events for one request"
                        finals[ev.rid] = ev
                results[name] = finals
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for name in ("alice", "bob"):
        assert len(results[name]) == 6
        for i in range(6):
            f = results[name][f"{name}-{i}"]
            assert f.reason == "length" and f.completion_tokens == 10 + i


def test_abort_one_and_all(daemon):
    with daemon.client() as c:
        rids = [c.submit([1, 2, 3], max_new_tokens=2000, temperature=1.0, seed=i) for i in range(4)]
        assert c.abort(rids[0]).num_aborted == 1
        assert c.abort("no-such-request").num_aborted == 0  # idempotent
        assert c.abort(rids[0]).num_aborted == 0
        assert c.abort_all().num_aborted == 3
        finals = final_events(c, rids, timeout_s=5.0)  # each rid once, and every one of them
        assert all(f.reason == "abort" and f.abort_reason == "client" for f in finals.values())
        # Still serving.
        assert c.generate([1], max_new_tokens=2).ok


def test_duplicate_rid_is_rejected_while_in_flight(daemon):
    with daemon.client() as c:
        c.submit([1], max_new_tokens=3000, rid="same")
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.submit([2], max_new_tokens=5, rid="same")
        assert e.value.code == "duplicate_rid"
        c.abort("same")


def test_client_that_vanishes_mid_stream_is_aborted_and_counted(daemon):
    c = daemon.client()
    c.submit([4, 4, 4], max_new_tokens=3000, temperature=1.0, seed=1)
    c.close()  # gone while its request streams
    with daemon.client() as other:
        import time
        deadline = time.monotonic() + 20
        while daemon.metric("rolloutd_stream_aborts_total", reason="client_gone") < 1:
            assert time.monotonic() < deadline, "the vanished client's request was not aborted"
            time.sleep(0.05)
        s = other.status()
        assert s.num_running == 0 and s.num_waiting == 0
        assert other.generate([1, 2], max_new_tokens=3).ok


def test_padded_decode_steps_match_eager_on_cpu(daemon_factory):
    """--cuda-graph-max-batch on the CPU pads decode steps to buckets (1, 2, 4, 8) without graphs:
    concurrent greedy requests (decode batches of several sizes as they start and finish) return
    exactly what an eager daemon returns, routed-expert records included (padding rows never)."""
    import json
    padded = daemon_factory(args=["--cuda-graph-max-batch", "8"])
    eager = daemon_factory()
    prompts = [[1, 2, 3], [7, 100, 42, 9], [200], [5, 6, 7, 8, 9, 10], [250, 3, 99]]

    def run(d):
        results = [None] * len(prompts)

        def one(i):
            with d.client() as c:
                r = c.generate(prompts[i], max_new_tokens=8 + 3 * i, temperature=0.0, return_logprob=True,
                               return_routed_experts=True)
                results[i] = (r.token_ids, r.routed_experts.to_numpy().tolist(), r.logprobs)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert all(r is not None for r in results)
        return results

    for i, (got, want) in enumerate(zip(run(padded), run(eager))):
        assert got[0] == want[0], f"tokens of request {i}"
        assert got[1] == want[1], f"routed experts of request {i}"
        assert np.allclose(got[2], want[2], atol=1e-5), f"log-probs of request {i}"
    code, body = padded.get("/v1/status")
    st = json.loads(body)["cuda_graphs"]
    assert st["max_batch"] == 8 and st["buckets"] == 4 and st["graphs"] == 0
    assert st["graph_steps_total"] > 0 and st["eager_steps_total"] > 0
    code, body = padded.get("/metrics")
    assert 'rolloutd_forward_steps_total{mode="graph"}' in body


def test_deadline_ends_running_and_paused_requests_with_the_tokens_so_far(daemon):
    with daemon.client() as c:
        t0 = time.monotonic()
        r = c.generate([1, 2, 3], max_new_tokens=3000, temperature=1.0, seed=1, return_logprob=True,
                       deadline_s=0.3, timeout_s=60.0)
        elapsed = time.monotonic() - t0
        assert (r.finish_reason, r.abort_reason) == ("abort", "deadline")
        assert 0 < len(r.token_ids) < 3000 and r.completion_tokens == len(r.token_ids) == len(r.logprobs)
        assert 0.3 <= elapsed < 30.0
        # Paused, a queued request's deadline still ends it; one without a deadline waits.
        c.pause_generation("in_place")
        timed = c.submit([5, 6], max_new_tokens=4, deadline_s=0.2)
        patient = c.submit([5, 6], max_new_tokens=4)
        finals = final_events(c, [timed], timeout_s=10.0)
        assert (finals[timed].reason, finals[timed].abort_reason) == ("abort", "deadline")
        assert finals[timed].completion_tokens == 0
        wait_queue(c, running=0, waiting=1)
        c.continue_generation()
        assert final_events(c, [patient], timeout_s=10.0)[patient].reason == "length"
        # A deadline far away changes nothing.
        assert c.generate([1], max_new_tokens=5, deadline_s=60.0).finish_reason == "length"
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.submit([1], max_new_tokens=5, deadline_s=86401.0)
        assert (e.value.code, e.value.field) == ("out_of_range", "body.deadline_s")


def test_requests_preempted_when_the_kv_cache_runs_out_end_as_on_a_roomy_daemon(daemon_factory):
    # 8 blocks of 16 tokens. Each request (8 + 100 tokens: 7 blocks at its end) fits alone; they
    # are admitted by their prompts (1 block each), so four run at once and, as they grow, the
    # youngest go back to the queue and compute their KV again later. Clients see nothing of it:
    # every request ends once, with the tokens, log-probs and expert records of a daemon whose
    # cache holds them all, and every block comes back.
    tight = daemon_factory(["--kv-blocks", "8", "--kv-block-size", "16", "--max-blocks-per-seq", "8"])
    roomy = daemon_factory()
    prompts = [[3 + i, 40, 41, 42, 43, 44, 45, 7 * i] for i in range(4)]
    results = {}
    for name, d in (("tight", tight), ("roomy", roomy)):
        with d.client() as c:
            rids = [c.submit(p, max_new_tokens=100, temperature=0.0 if i < 3 else 0.8, seed=11,
                             return_logprob=True, return_routed_experts=True, routed_experts_start_len=i,
                             rid=f"r{i}") for i, p in enumerate(prompts)]
            results[name] = {rid: c.collect(rid, timeout_s=60.0) for rid in rids}
            st = c.status()
            assert st.num_running == 0 and st.num_waiting == 0
    assert tight.metric("rolloutd_preemptions_total") > 0
    assert tight.metric("rolloutd_recomputed_tokens_total") > 0
    assert roomy.metric("rolloutd_preemptions_total") == 0
    for i in range(4):
        a, b = results["tight"][f"r{i}"], results["roomy"][f"r{i}"]
        assert a.finish_reason == "length" and a.num_retractions == 0, i
        assert a.token_ids == b.token_ids, i
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4), i
        assert a.routed_experts.start_pos == i and a.routed_experts.shape[0] == 8 + 100 - 1 - i
        assert a.routed_experts.data == b.routed_experts.data, i
    # Every block back: a request needing the whole cache still runs.
    with tight.client() as c:
        assert c.generate([1], max_new_tokens=127).finish_reason == "length"
