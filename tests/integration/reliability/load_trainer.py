"""The load test's trainer: every PERIOD_S seconds a weight session on every daemon,
alternating pause modes (retract, in_place) and bucket sources (inline, shm) and two sets
of weights, with increasing versions; between sessions it samples `status` round trips
(control latency). Stops after SECONDS.

    load_trainer.py ENDPOINTS(comma-separated) PERIOD_S SECONDS OUT_JSON

After each session it checks the daemon's checksum against the weights it pushed."""
import json
import sys
import time
import zlib

import rolloutd
from rel_common import numpy_weights

endpoints, period, seconds, out_path = sys.argv[1].split(","), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
weight_sets = []
for seed in (4242, 20261130):
    w = numpy_weights(seed)
    weight_sets.append((list(w.items()), rolloutd.weights.model_checksum({n: zlib.crc32(a.tobytes()) for n, a in w.items()})))
clients = [rolloutd.Client(ep, timeout_s=60) for ep in endpoints]
for c in clients:
    c.hello()
sessions, status_latencies, errors = [], [], []
started = time.monotonic()
next_session = started + period
k = 0
while time.monotonic() < started + seconds:
    if time.monotonic() < next_session:
        for c in clients:
            t0 = time.perf_counter()
            c.status()
            status_latencies.append(time.perf_counter() - t0)
        time.sleep(0.1)
        continue
    mode = ("retract", "in_place")[k % 2]
    via = ("inline", "shm")[(k // 2) % 2]
    tensors, checksum = weight_sets[k % 2]
    version = k + 1
    for i, c in enumerate(clients):
        t0 = time.perf_counter()
        try:
            p = c.pause_generation(mode)
            t1 = time.perf_counter()
            end = c.push_weights(tensors, weight_version=version, via=via, bucket_bytes=512 << 10)
            t2 = time.perf_counter()
            resumed = c.continue_generation().num_resumed
            t3 = time.perf_counter()
            ok = c.weights_checksum().model_checksum == checksum
            sessions.append({"daemon": i, "version": version, "mode": mode, "via": via,
                             "num_retracted": p.num_retracted, "num_paused": p.num_paused,
                             "num_aborted": p.num_aborted, "num_resumed": resumed,
                             "num_buckets": end.num_buckets, "pause_s": t1 - t0, "push_s": t2 - t1,
                             "continue_s": t3 - t2, "checksum_ok": ok})
        except rolloutd.RolloutdError as e:
            errors.append(f"daemon {i} session {version}: {e.code} {e}")
    k += 1
    next_session = time.monotonic() + period
for c in clients:
    c.close()
with open(out_path, "w") as f:
    json.dump({"sessions": sessions, "errors": errors, "status_latencies_s": status_latencies}, f)
