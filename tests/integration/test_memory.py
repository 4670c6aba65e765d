"""Memory release and resume end to end (SPEC §12) with real CPU daemons.

release(weights, kv_cache) -> not ready, sessions and reads refused -> resume -> push the same
weights as a trainer would -> greedy tokens and routed experts equal a fresh daemon's, static
state bit-identical (its CRC in /v1/status), no reserved range and no parameter moved.
"""
import json
import os
import sys

import pytest

import rolloutd

sys.path.insert(0, os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"], "tests", "reference"))
import tiny_moe_reference as ref  # noqa: E402

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def greedy(c, n=16):
    r = c.generate(PROMPT, max_new_tokens=n, temperature=0.0, return_logprob=True, return_routed_experts=True)
    return r.token_ids, r.routed_experts.data


def status(d):
    code, body = d.get("/v1/status")
    assert code == 200
    return json.loads(body)


def memory_view(d):
    """What must not change across a release/resume: ranges, static state, parameter addresses."""
    m = status(d)["memory"]
    return {tag: (m[tag]["ranges"], m[tag]["static_state"]["crc32"], m[tag]["static_state"]["entries"])
            for tag in ("weights", "kv_cache", "cuda_graph", "scratch")}, m["parameters_address_digest"]


def test_release_resume_push_equals_a_fresh_daemon(daemon_factory):
    fresh, d = daemon_factory(), daemon_factory()
    with fresh.client() as b, d.client() as a:
        expected = greedy(b)
        assert greedy(a) == expected
        before, digest = memory_view(d)
        st = status(d)["memory"]
        assert st["weights"]["state"] == "resident" and st["weights"]["resident_bytes"] > 0
        assert st["weights"]["static_state"]["entries"] == 4  # one expert map per MoE layer
        weights_bytes, kv_bytes = st["weights"]["backed_bytes"], st["kv_cache"]["backed_bytes"]

        r = a.release_memory(["weights", "kv_cache"])
        assert r.tags == ["weights", "kv_cache"]
        assert r.num_bytes >= weights_bytes + kv_bytes and r.duration_s >= 0
        st = status(d)
        assert st["state"] == "not_ready" and "released" in st["reason"]
        assert st["memory"]["weights"]["state"] == "released"
        assert st["memory"]["weights"]["resident_bytes"] == 0
        assert st["memory"]["kv_cache"]["resident_bytes"] == 0
        assert st["memory"]["scratch"]["state"] == "resident"
        assert st["memory"]["weights"]["last_release"]["size_bytes"] >= weights_bytes
        assert d.get("/readyz")[0] == 503
        assert d.metric("rolloutd_memory_released_bytes", tag="weights") == weights_bytes
        assert d.metric("rolloutd_memory_resident_bytes", tag="weights") == 0
        assert not a.status().ready

        with pytest.raises(rolloutd.RolloutdError) as e:
            a.generate(PROMPT, max_new_tokens=4, temperature=0.0)
        assert e.value.code == "not_ready"
        with pytest.raises(rolloutd.RolloutdError) as e:
            a.begin_weight_update()
        assert e.value.code == "failed_precondition" and "resume_memory" in e.value.message
        with pytest.raises(rolloutd.RolloutdError) as e:
            a.weights_checksum()
        assert e.value.code == "failed_precondition"
        # Idempotent: a second release changes nothing.
        again = a.release_memory(["weights"])
        assert again.tags == [] and again.num_bytes == 0
        assert memory_view(d) == (before, digest), "static state and ranges while released"

        r = a.resume_memory()  # nil = every tag; cuda_graph was never released
        assert r.tags == ["weights", "kv_cache"] and r.num_bytes >= weights_bytes + kv_bytes
        st = status(d)
        assert st["state"] == "not_ready" and "push weights" in st["reason"], st["reason"]
        assert a.resume_memory().tags == []

        weights = ref.build_weights(ref.CONFIG)  # the daemon's own starting weights
        reply = a.push_weights(list(weights.items()), weight_version=5, bucket_bytes=256 << 10)
        assert reply.num_parameters_updated == len(weights)
        assert a.status().ready
        assert greedy(a) == expected
        assert a.weights_checksum().model_checksum == b.weights_checksum().model_checksum
        assert memory_view(d) == (before, digest), "static state bit-identical, nothing moved"
        st = status(d)["memory"]
        assert st["weights"]["releases"] == 1 and st["weights"]["resumes"] == 1
        assert d.metric("rolloutd_memory_released_bytes", tag="weights") == 0
        assert d.metric("rolloutd_memory_release_duration_seconds_count", tag="weights") == 1
        assert d.metric("rolloutd_memory_resume_duration_seconds_count", tag="kv_cache") == 1


def test_release_is_refused_unless_idle(daemon):
    with daemon.client() as c:
        c.pause_generation("in_place")
        rid = c.submit(PROMPT, max_new_tokens=8, temperature=0.0)
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.release_memory()
        assert e.value.code == "failed_precondition" and "in flight" in e.value.message
        assert status(daemon)["memory"]["weights"]["state"] == "resident"
        c.abort(rid)
        c.continue_generation()
        s = c.begin_weight_update()
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.release_memory(["kv_cache"])
        assert e.value.code == "failed_precondition" and "session" in e.value.message
        c.abort_weight_update(s.session)
        assert c.release_memory(["kv_cache"]).tags == ["kv_cache"]
        with pytest.raises(rolloutd.RolloutdError) as e:
            c.generate(PROMPT, max_new_tokens=2)
        assert e.value.code == "not_ready"
        assert c.resume_memory(["kv_cache"]).tags == ["kv_cache"]
        assert c.status().ready, "kv_cache alone needs no weight push"
        assert len(c.generate(PROMPT, max_new_tokens=4, temperature=0.0).token_ids) == 4


def test_bad_tags_are_refused_with_the_field(daemon):
    with daemon.client() as c:
        for tags, field in ((["weights", "activations"], "body.tags[1]"), ([], "body.tags"),
                            (["kv_cache", "kv_cache"], "body.tags[1]")):
            with pytest.raises(rolloutd.RolloutdError) as e:
                c.release_memory(tags)
            assert e.value.code == "invalid_argument" and e.value.field == field
        assert status(daemon)["memory"]["kv_cache"]["state"] == "resident"


def test_coordinator_releases_and_resumes_every_daemon(daemon_factory):
    daemons = [daemon_factory(), daemon_factory()]
    coord = rolloutd.Coordinator([d.control for d in daemons], timeout_s=30)
    try:
        coord.wait_ready(timeout_s=30)
        released = coord.release_memory(["kv_cache"])
        assert len(released) == 2 and all(r.tags == ["kv_cache"] for r in released.values())
        assert all(status(d)["memory"]["kv_cache"]["state"] == "released" for d in daemons)
        resumed = coord.resume_memory(["kv_cache"])
        assert all(r.tags == ["kv_cache"] for r in resumed.values())
        assert all(status(d)["state"] == "ready" for d in daemons)
        coord.wait_ready(timeout_s=30)  # the daemons were not_ready meanwhile: routable again
    finally:
        coord.close()


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_cpu_release_gives_the_pages_back(daemon_factory):
    """On the CPU backend a release really returns memory: the daemon's RSS drops by the weights."""
    d = daemon_factory(args=["--synthetic-params", str(64 << 20)])  # 64 MiB of BF16 parameters
    with d.client() as c:
        # Synthetic parameters are not written at start: write them once so their pages exist.
        c.push_weights([("synthetic.0.weight", "bfloat16", [32 << 20], b"\x01" * (64 << 20))], weight_version=1)
        before = rss_bytes(d.proc.pid)
        r = c.release_memory(["weights"])
        assert r.num_bytes >= 64 << 20
        after = rss_bytes(d.proc.pid)
        assert before - after >= 60 << 20, f"RSS {before >> 20} -> {after >> 20} MiB"
        c.resume_memory(["weights"])
        # Resumed pages are zero and untouched: RSS grows only as weights are written again.
        assert rss_bytes(d.proc.pid) - after < 16 << 20
        assert not c.status().ready
