"""GETs <http>/livez every INTERVAL seconds until SIGTERM, over a fresh connection each
time (what a kubelet does), each bounded by a 2 s timeout; then prints one JSON line
{"latencies_s": [...], "host_wait_s": [...], "failures": [...]}. Run by
rel_harness.LivezProbe.

    probe_livez.py URL INTERVAL [DAEMON_PID]

host_wait_s[i] is how long, during probe i, the two threads on the request's path sat
runnable but without a CPU: this probe's thread and the daemon's HTTP thread (named
"rolloutd-http"), from their scheduler statistics (/proc/.../schedstat, field 2). On a
shared 2-core machine (CI runs other tests beside this one) that wait is the host's, not
the daemon's; latency minus it is what the daemon is answerable for. Where schedstat is
missing the waits are 0, and the raw latency is judged."""
import glob
import http.client
import json
import os
import signal
import sys
import time
import urllib.parse

url = urllib.parse.urlparse(sys.argv[1])
interval = float(sys.argv[2])
daemon_pid = int(sys.argv[3]) if len(sys.argv) > 3 else None
stop = False


def on_term(*_):
    global stop
    stop = True


def http_thread_schedstat(pid):
    for comm in glob.glob(f"/proc/{pid}/task/*/comm"):
        try:
            with open(comm) as f:
                if f.read().strip() == "rolloutd-http":
                    return os.path.join(os.path.dirname(comm), "schedstat")
        except OSError:
            pass
    return None


def wait_ns(path):
    """Run-queue wait of one thread so far (0 when unreadable)."""
    if path is None:
        return 0
    try:
        with open(path) as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0


signal.signal(signal.SIGTERM, on_term)
try:
    os.nice(-5)  # measure the daemon, not this process's place in the run queue (needs privilege)
except OSError:
    pass
own = "/proc/thread-self/schedstat" if os.path.exists("/proc/thread-self/schedstat") else None
daemon_thread = http_thread_schedstat(daemon_pid) if daemon_pid else None
latencies, host_waits, failures = [], [], []
print(json.dumps({"started": True, "schedstat": own is not None and daemon_thread is not None}), flush=True)
give_up = time.monotonic() + 600  # bounded even if the test that should stop it is gone
while not stop and time.monotonic() < give_up:
    w0 = wait_ns(own) + wait_ns(daemon_thread)
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=2)
        conn.request("GET", "/livez")
        r = conn.getresponse()
        r.read()
        conn.close()
        dt = time.perf_counter() - t0
        latencies.append(dt)
        host_waits.append((wait_ns(own) + wait_ns(daemon_thread) - w0) / 1e9)
        if r.status != 200:
            failures.append({"status": r.status, "at_s": round(dt, 4)})
    except Exception as e:  # noqa: BLE001 - every failure is a finding
        failures.append({"error": repr(e), "after_s": round(time.perf_counter() - t0, 4)})
    time.sleep(interval)
print(json.dumps({"latencies_s": latencies, "host_wait_s": host_waits, "failures": failures}), flush=True)
