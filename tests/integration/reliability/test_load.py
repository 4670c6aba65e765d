"""Load (issue 10): N clients x M outstanding requests on two CPU daemons for a bounded
time, with a weight session every few seconds alternating the retract and in_place pause
modes. Every request must end with exactly one final event, versions never decrease within
an attempt, no request is lost, and the daemons' RSS does not grow after warm-up.

Scale with the environment (the CI defaults fit its time budget):
  ROLLOUTD_LOAD_CLIENTS (8)  ROLLOUTD_LOAD_OUTSTANDING (64)  ROLLOUTD_LOAD_SECONDS (30)
  ROLLOUTD_LOAD_SESSION_PERIOD_S (3)
"""
import json
import os
import threading
import time

from rel_harness import SANITIZER, SLOW, percentile, report, vm_rss_bytes
from rel_harness import children, daemon_factory  # noqa: F401 (pytest fixtures)

CLIENTS = int(os.environ.get("ROLLOUTD_LOAD_CLIENTS", "8"))
OUTSTANDING = int(os.environ.get("ROLLOUTD_LOAD_OUTSTANDING", "64"))
SECONDS = float(os.environ.get("ROLLOUTD_LOAD_SECONDS", "30"))
PERIOD_S = float(os.environ.get("ROLLOUTD_LOAD_SESSION_PERIOD_S", "3"))
# RSS after warm-up may exceed its warm-up peak by at most this (allocator slack, not a trend).
RSS_SLACK = (1.10, 16 << 20)


def sample_rss(daemons, samples, stop):
    t0 = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - t0, [vm_rss_bytes(d.proc.pid) for d in daemons]))
        stop.wait(0.25)


def test_clients_by_outstanding_on_two_daemons_with_weight_sessions(daemon_factory, children, tmp_path):
    daemons = [daemon_factory(), daemon_factory()]
    drain_s = 60 * SLOW
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=sample_rss, args=(daemons, samples, stop), daemon=True)
    sampler.start()
    trainer_out = tmp_path / "trainer.json"
    trainer = children("load_trainer.py", ",".join(d.control for d in daemons), PERIOD_S, SECONDS, trainer_out)
    outs = [tmp_path / f"client{i}.json" for i in range(CLIENTS)]
    clients = [children("load_client.py", daemons[i % 2].control, i, OUTSTANDING, SECONDS, drain_s, outs[i])
               for i in range(CLIENTS)]
    t0 = time.monotonic()
    for ch in clients + [trainer]:
        assert ch.wait(SECONDS + drain_s + 120 * SLOW) == 0, ch.stderr()
    wall_s = time.monotonic() - t0
    stop.set()
    sampler.join(5)
    results = [json.loads(p.read_text()) for p in outs]
    tr = json.loads(trainer_out.read_text())

    submitted = sum(r["counts"]["submitted"] for r in results)
    finished = sum(r["counts"]["finished"] for r in results)
    failed = sum(r["counts"]["failed"] for r in results)
    lost = sum(r["num_lost"] for r in results)
    tokens = sum(r["counts"]["tokens"] for r in results)
    retracted = sum(r["counts"]["retracted"] for r in results)
    switches = sum(r["counts"]["version_switches"] for r in results)
    violations = [v for r in results for v in r["violations"]]
    submit_lat = [x for r in results for x in r["submit_latencies_s"]]
    status_lat = tr["status_latencies_s"]
    sessions = tr["sessions"]
    modes = {s["mode"] for s in sessions}

    # RSS: the peak after warm-up (the last quarter) against the peak of the warm-up's end
    # (second quarter), per daemon.
    duration = samples[-1][0] if samples else 0
    rss = {}
    for i in range(len(daemons)):
        warm = [s[1][i] for s in samples if duration * 0.25 <= s[0] <= duration * 0.5]
        late = [s[1][i] for s in samples if s[0] >= duration * 0.75]
        rss[i] = (max(warm), max(late)) if warm and late else (0, 0)

    figures = dict(clients=CLIENTS, outstanding_per_client=OUTSTANDING, daemons=len(daemons), seconds=SECONDS,
                   wall_s=round(wall_s, 1), requests=submitted, finished=finished, failed=failed, lost=lost,
                   requests_per_s=round(finished / max(1e-9, max(r["total_s"] for r in results)), 1),
                   tokens=tokens, tokens_per_s=round(tokens / max(1e-9, max(r["total_s"] for r in results)), 1),
                   weight_sessions=len(sessions), session_modes=sorted(modes), retracted_events=retracted,
                   in_place_version_switches=switches,
                   submit_p50_ms=round(1e3 * percentile(submit_lat, 50), 2),
                   submit_p99_ms=round(1e3 * percentile(submit_lat, 99), 2),
                   status_p50_ms=round(1e3 * percentile(status_lat, 50), 2),
                   status_p99_ms=round(1e3 * percentile(status_lat, 99), 2),
                   session_push_p50_s=round(percentile([s["push_s"] for s in sessions], 50), 3),
                   rss_mib={i: [round(a / 2**20, 1), round(b / 2**20, 1)] for i, (a, b) in rss.items()},
                   violations=len(violations), trainer_errors=len(tr["errors"]))
    report("load", **figures)

    assert violations == [], violations[:10]
    assert tr["errors"] == [], tr["errors"]
    assert lost == 0 and failed == 0 and finished == submitted and submitted > 0
    assert all(s["checksum_ok"] for s in sessions)
    if SECONDS >= 4 * PERIOD_S:
        assert modes == {"retract", "in_place"}, "both pause modes ran"
    # Sanitizer runtimes grow on their own (ASan's quarantine, TSan's shadow and history):
    # their RSS is reported, not judged.
    for i, (warm, late) in rss.items():
        if not SANITIZER:
            assert late <= warm * RSS_SLACK[0] + RSS_SLACK[1], f"daemon {i} RSS grew from {warm} to {late} bytes"
    for d in daemons:
        assert d.terminate() == 0
