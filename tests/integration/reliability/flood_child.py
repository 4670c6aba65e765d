"""Misbehaving peers of a daemon's control port, for the responsiveness test.

    flood_child.py MODE ENDPOINT SECONDS [N]

MODE
  halfopen  N TCP connections that never finish the ZMTP handshake: half send nothing,
            half send the first bytes of a ZMTP greeting and stall; held for SECONDS.
  garbage   for SECONDS, connections that send random bytes (a non-ZMTP peer), each
            closed after its burst; N at a time.
  badmsg    a real ZeroMQ connection sending random envelopes and frames (the decoder's
            refusal path at wire speed); counts the error replies.
  hello     N connections, each sending hellos as fast as it can for SECONDS (pipelined, at
            most 64 outstanding), plus connection churn (connect, hello, close).
Reports one JSON line {"done": MODE, ...counts} at the end."""
import os
import random
import socket
import sys
import threading
import time

from rel_common import say

mode, endpoint, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
n = int(sys.argv[4]) if len(sys.argv) > 4 else 1
host, port = endpoint.replace("tcp://", "").rsplit(":", 1)
port = int(port)
rng = random.Random(os.getpid())
end = time.monotonic() + seconds
# The signature and the start of a ZMTP 3.0 greeting (RFC 23): stop before the mechanism.
ZMTP_PREFIX = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL"


def halfopen():
    socks = []
    for i in range(n):
        s = socket.create_connection((host, port), timeout=5)
        if i % 2:
            s.sendall(ZMTP_PREFIX)
        socks.append(s)
    say(opened=len(socks))
    while time.monotonic() < end:
        time.sleep(0.1)
    for s in socks:
        s.close()
    return {"connections": len(socks)}


def garbage():
    sent = conns = 0
    while time.monotonic() < end:
        batch = []
        for _ in range(n):
            try:
                s = socket.create_connection((host, port), timeout=2)
                payload = rng.randbytes(rng.randint(1, 4096))
                if rng.random() < 0.3:
                    payload = ZMTP_PREFIX[:rng.randint(1, len(ZMTP_PREFIX))] + payload
                s.sendall(payload)
                sent += len(payload)
                conns += 1
                batch.append(s)
            except OSError:
                pass  # the daemon closed it first: fine
        time.sleep(0.05)
        for s in batch:
            s.close()
    return {"connections": conns, "bytes": sent}


def badmsg():
    import rolloutd
    c = rolloutd.Client(endpoint, timeout_s=10)
    sent = errors = 0
    while time.monotonic() < end:
        frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:  # a map that looks like an envelope, with a random tail
            frames[0] = b"\x84\xa1v\x01\xa2id" + rng.randbytes(rng.randint(0, 40))
        c.send_raw(frames)
        sent += 1
        reply = c.recv_raw(5.0)
        if reply is not None:
            errors += 1
    c.close()
    return {"sent": sent, "error_replies": errors}


def hello():
    import rolloutd
    from rolloutd import wire
    from rolloutd.messages import HelloRequest
    counts = {"hellos": 0, "replies": 0, "churn_connections": 0, "connect_retries": 0, "errors": []}
    lock = threading.Lock()

    def connected():
        """A client whose connection is up (its first hello answered). The client library
        gives up on a connection not made within 2 s; under floods, ASan and a busy CI host
        the daemon's handshakes can take longer (a CI run's 16 flood threads all failed so at
        their first send), and a load generator should keep trying rather than die."""
        while time.monotonic() < end:
            c = rolloutd.Client(endpoint, timeout_s=10)
            try:
                c.hello()
                return c
            except rolloutd.RolloutdError as e:
                c.close()
                if e.code != "unavailable":
                    raise
                with lock:
                    counts["connect_retries"] += 1
        return None

    # A thread that fails still reports what it did, and why it stopped: a silent thread
    # would show as "0 hellos" with nothing to go on.
    def pipelined():
        sent = got = 0
        try:
            c = connected()
            if c is None:
                raise RuntimeError("no connection before the end")
            next_id, outstanding = 1, 0
            while time.monotonic() < end:
                while outstanding < 64:
                    c.send_raw(wire.encode(next_id, HelloRequest(client="flood", versions=[1])))
                    next_id += 1
                    outstanding += 1
                    sent += 1
                if c.recv_raw(5.0) is not None:
                    outstanding -= 1
                    got += 1
            while outstanding and c.recv_raw(5.0) is not None:
                outstanding -= 1
                got += 1
            c.close()
        except Exception as e:  # noqa: BLE001 -- reported to the test, which fails on it
            with lock:
                counts["errors"].append(f"pipelined after {sent} sent, {got} replies: {type(e).__name__}: {e}")
        with lock:
            counts["hellos"] += sent
            counts["replies"] += got

    def churn():
        k = 0
        try:
            while time.monotonic() < end:
                c = connected()
                if c is None:
                    break
                c.close()
                k += 1
        except Exception as e:  # noqa: BLE001
            with lock:
                counts["errors"].append(f"churn after {k} connections: {type(e).__name__}: {e}")
        with lock:
            counts["churn_connections"] += k

    threads = [threading.Thread(target=pipelined) for _ in range(n)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


result = {"halfopen": halfopen, "garbage": garbage, "badmsg": badmsg, "hello": hello}[mode]()
say(done=mode, **result)
