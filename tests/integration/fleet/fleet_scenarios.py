#!/usr/bin/python3
"""The coordinator's side of the fleet tests. conftest.Fleet.run_scenario runs one scenario in
the coordinator's network namespace:

    fleet_scenarios.py NAME '{"nodes_dir": ..., ...}'

A scenario drives rolloutd.Coordinator against the simulated hosts, asserts what it must, and
prints one JSON line (its report) for the test to check. Killing a daemon happens here, so it
lands while the requests are in flight (pids come from the launchers' files; the namespaces
share the pid space).
"""
import json
import os
import signal
import sys
import time

import rolloutd

SOURCE_ROOT = os.environ.get("ROLLOUTD_SOURCE_ROOT",
                             os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
sys.path.insert(0, os.path.join(SOURCE_ROOT, "tests", "reference"))
import tiny_moe_reference as ref  # noqa: E402


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def weights(seed):
    old = ref.SEED
    ref.SEED = seed
    try:
        return ref.build_weights(ref.CONFIG)
    finally:
        ref.SEED = old


def coordinator(params, **options):
    opts = dict(heartbeat_interval_s=0.3, heartbeat_timeout_s=1.0, dead_after_s=3.0, timeout_s=20.0, log=log)
    opts.update(options)
    c = rolloutd.Coordinator.from_file(params["nodes_dir"], **opts)
    c.wait_ready(3, timeout_s=60)
    return c


def requests_total(coord):
    """num_requests_total per daemon, fresh from each one."""
    out = {}
    for name, reply in coord.status().items():
        assert not isinstance(reply, Exception), (name, reply)
        out[name] = reply.num_requests_total
    return out


def launcher_pid_of(params, name):
    """The pid launch-node.sh recorded for daemon `name` ("host/index")."""
    host, index = name.rsplit("/", 1)
    for f in os.listdir(params["nodes_dir"]):
        if not f.endswith(".json"):
            continue
        with open(os.path.join(params["nodes_dir"], f)) as fh:
            doc = json.load(fh)
        if doc["host"] == host:
            return doc["daemons"][int(index)]["pid"]
    raise AssertionError(f"no launcher file names {name}")


def finals_of(coord, rids, timeout_s, on_event=None):
    """Reads the fleet's event stream until every rid has its final event; fails on a second one."""
    finals, seen = {}, {}
    deadline = time.monotonic() + timeout_s
    want = set(rids)
    while not want <= set(finals):
        assert time.monotonic() < deadline, f"no final event for {sorted(want - set(finals))[:5]} in {timeout_s} s"
        ev = coord.next_event(0.5)
        if ev is None:
            continue
        seen.setdefault(ev.rid, []).append(type(ev).__name__)
        if on_event:
            on_event(ev)
        if isinstance(ev, (rolloutd.FinishedEvent, rolloutd.FailedEvent)):
            assert ev.rid not in finals, f"two final events for {ev.rid}: {finals[ev.rid]} and {ev}"
            finals[ev.rid] = ev
    return finals, seen


def no_more_finals(coord, rids, seconds):
    """Nothing more arrives for requests that have ended (no duplicate, no straggler)."""
    end = time.monotonic() + seconds
    rids = set(rids)
    while time.monotonic() < end:
        ev = coord.next_event(0.2)
        assert ev is None or ev.rid not in rids, f"event after the final one: {ev}"


# ------------------------------------------------------------------ scenarios --
def weights_and_spread(params):
    """A weight session fanned out to every host, then rollouts spread across them."""
    with coordinator(params) as coord:
        names = [h.name for h in coord.daemons()]
        tensors = weights(4242)
        t0 = time.monotonic()
        update = coord.push_weights(list(tensors.items()), weight_version=1, bucket_bytes=256 << 10,
                                    checksum=True, pause_mode="retract")
        push_s = time.monotonic() - t0
        update.raise_for_error()
        assert sorted(update.completed) == sorted(names), update
        assert all(r.weight_version == 1 and r.num_buckets > 1 for r in update.completed.values())
        expected = rolloutd.model_checksum({n: rolloutd.crc32_of(a) for n, a in tensors.items()})
        sums = coord.weights_checksum()
        assert {n: s.model_checksum for n, s in sums.items()} == {n: expected for n in names}
        assert all(h.weight_version == 1 and h.routable for h in coord.daemons())

        before = requests_total(coord)
        prompts = [[1 + i, 2, 3] for i in range(24)]
        results = coord.generate_many(prompts, max_new_tokens=8, temperature=1.0, seed=7, return_logprob=True,
                                      timeout_s=120)
        assert all(r.ok and r.finish_reason == "length" for r in results)
        assert all(r.weight_versions == [1] * 8 and len(r.logprobs) == 8 for r in results)
        after = requests_total(coord)
        spread = {n: after[n] - before[n] for n in names}
        assert sum(spread.values()) == 24 and all(v >= 4 for v in spread.values()), spread

        # The same weights everywhere: one greedy prompt gives the same tokens and experts on every host.
        rids = {n: coord.submit([3, 1, 4, 1, 5], daemon=n, max_new_tokens=8, temperature=0.0,
                                return_routed_experts=True) for n in names}
        got = coord.collect(rids.values(), timeout_s=60)
        outs = {n: (got[r].token_ids, got[r].routed_experts.data) for n, r in rids.items()}
        assert len(set(map(repr, outs.values()))) == 1, outs
        return {"daemons": names, "spread": spread, "push_s": push_s, "versions": [h.weight_version for h in
                                                                                  coord.daemons()]}


def daemon_lost(params):
    """A daemon killed mid-rollout: each of its requests ends with one failed event, the others are
    untouched; its launcher restarts it; with old weights it takes no rollouts until a new push."""
    with coordinator(params) as coord:
        names = [h.name for h in coord.daemons()]
        tensors = weights(4242)
        coord.push_weights(list(tensors.items()), weight_version=2, bucket_bytes=256 << 10).raise_for_error()
        rids = coord.submit_many([[1 + i, 2] for i in range(9)], max_new_tokens=3000, temperature=1.0, seed=11)
        where = {rid: coord.daemon_of(rid) for rid in rids}
        victim = where[rids[0]]
        victim_rids = [r for r in rids if where[r] == victim]
        assert len(victim_rids) >= 2 and len(set(where.values())) == 3, where
        # Let the victim's requests produce tokens first: these are the ones that must not vanish.
        produced = set()

        def watch(ev):
            if isinstance(ev, rolloutd.TokensEvent) and ev.token_ids:
                produced.add(ev.rid)
        deadline = time.monotonic() + 30
        while not set(victim_rids) <= produced:
            assert time.monotonic() < deadline, "the victim's requests produced nothing"
            ev = coord.next_event(0.5)
            if ev is not None:
                watch(ev)
                assert not isinstance(ev, (rolloutd.FinishedEvent, rolloutd.FailedEvent)), ev
        pid = launcher_pid_of(params, victim)
        log(f"killing {victim} (pid {pid}) with {len(victim_rids)} request(s) in flight")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # The survivors' requests are ended by the client; the victim's by the coordinator.
        for r in rids:
            if r not in victim_rids:
                coord.abort(r)
        finals, _ = finals_of(coord, rids, timeout_s=60)
        detect_s = time.monotonic() - killed_at
        for r in victim_rids:
            f = finals[r]
            assert isinstance(f, rolloutd.FailedEvent) and f.error.code == "unavailable", f
            assert victim in f.error.message, f
        for r in rids:
            if r not in victim_rids:
                assert isinstance(finals[r], rolloutd.FinishedEvent) and finals[r].reason in ("abort", "length"), \
                    finals[r]
        no_more_finals(coord, rids, 1.5)
        assert coord.num_outstanding == 0

        # The launcher restarts it; the coordinator sees a new incarnation with stale weights.
        def restarted():
            h = next(h for h in coord.daemons() if h.name == victim)
            return h if h.incarnation >= 1 and h.ready and h.pid != pid else None
        deadline = time.monotonic() + 60
        while not restarted():
            assert time.monotonic() < deadline, [h for h in coord.daemons() if h.name == victim]
            time.sleep(0.1)
        h = restarted()
        assert h.stale and not h.routable and h.weight_version == 0, h
        restart_s = time.monotonic() - killed_at

        before = requests_total(coord)
        coord.generate_many([[5, 6, 7]] * 6, max_new_tokens=4, timeout_s=60)
        after = requests_total(coord)
        assert after[victim] == before[victim], "a rollout went to a daemon with stale weights"

        # A new push brings it back into rotation.
        update = coord.push_weights(list(tensors.items()), weight_version=3, bucket_bytes=256 << 10)
        update.raise_for_error()
        assert victim in update.completed
        coord.wait_ready(3, timeout_s=30)
        before = requests_total(coord)
        coord.generate_many([[5, 6, 7, 8]] * 9, max_new_tokens=4, timeout_s=60)
        after = requests_total(coord)
        assert after[victim] > before[victim]
        return {"victim": victim, "victim_requests": len(victim_rids), "detect_s": detect_s,
                "restart_s": restart_s, "dropped_events": coord.num_dropped_events, "names": names}


def resubmit(params):
    """With resubmit=True the requests of a killed daemon run again elsewhere and finish; the
    stream shows a RetractedEvent(daemon_lost) that voids what the dead daemon had produced."""
    with coordinator(params, resubmit=True) as coord:
        n_new = 2000
        rids = coord.submit_many([[9, 8, 7 + i] for i in range(6)], max_new_tokens=n_new, temperature=1.0, seed=5,
                                 return_logprob=True)
        where = {rid: coord.daemon_of(rid) for rid in rids}
        victim = where[rids[0]]
        victim_rids = [r for r in rids if where[r] == victim]
        assert victim_rids and all(where.values()), where
        time.sleep(0.3)  # accepted and running
        pid = launcher_pid_of(params, victim)
        log(f"killing {victim} (pid {pid}); its {len(victim_rids)} request(s) should be resubmitted")
        os.kill(pid, signal.SIGKILL)
        results = coord.collect(rids, timeout_s=120)
        for r in rids:
            res = results[r]
            assert res.ok and res.finish_reason == "length", res
            # What stands is one whole run: nothing of the dead daemon's tokens.
            assert len(res.token_ids) == n_new and len(res.logprobs) == n_new
            assert res.num_retractions == 0 or r in victim_rids, res
        # A victim's request that had finished before the kill has nothing to resubmit.
        resubmitted = [r for r in victim_rids if results[r].num_retractions >= 1]
        assert resubmitted, "no request was in flight on the killed daemon"
        assert coord.num_outstanding == 0
        return {"victim": victim, "resubmitted": len(resubmitted),
                "retractions": {r: results[r].num_retractions for r in resubmitted}}


def curve_required(params):
    """Every daemon requires CURVE across the simulated network: the coordinator's keys (from the
    environment) work, a plain client and a client with an unknown key are refused at once."""
    docs = [json.load(open(os.path.join(params["nodes_dir"], f))) for f in sorted(os.listdir(params["nodes_dir"]))
            if f.endswith(".json")]
    controls = [d["control"] for doc in docs for d in doc["daemons"] if d.get("control")]
    assert len(controls) == 3, docs
    keys = rolloutd.CurveKeys.from_env()
    assert keys is not None, "the fleet test sets ROLLOUTD_CURVE_SERVER_KEY / ROLLOUTD_CURVE_CLIENT_KEY_FILE"
    stranger_pub, _, stranger_secret = rolloutd.keygen(os.path.join(params["nodes_dir"], "..", "stranger"),
                                                       overwrite=True)
    stranger = rolloutd.CurveKeys.load(keys.server_key, stranger_secret)
    refused = {}
    for control in controls:
        with rolloutd.Client(control, timeout_s=20) as c:
            assert c.status().ready
        for label, curve in (("plain", False), ("stranger", stranger)):
            t0 = time.monotonic()
            with rolloutd.Client(control, timeout_s=20, curve=curve) as c:
                try:
                    c.status()
                    raise AssertionError(f"{label} client was served by {control}")
                except rolloutd.RolloutdError as e:
                    assert e.code == "unauthenticated", (label, control, e)
            refused[f"{control} {label}"] = round(time.monotonic() - t0, 3)
    return {"daemons": controls, "refused_s": refused}


if __name__ == "__main__":
    name, params = sys.argv[1], json.loads(sys.argv[2])
    report = globals()[name](params)
    print(json.dumps(report))
