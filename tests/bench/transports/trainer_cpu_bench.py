#!/usr/bin/env python3
"""The trainer's per-tensor CPU costs of a push of many small tensors, without a GPU (issue 7:
10,000 x 2 KiB BF16 in one bucket, target <= 5 us per tensor end to end).

    /usr/bin/python3 tests/bench/transports/trainer_cpu_bench.py [--tensors 10000] [--reps 7]
        [--python-root protocol/python] [--json out.json]

Per tensor, best of `reps`:
- plan: plan_buckets over TensorInfo (what push_weights does after describe);
- encode / decode: wire.encode of the bucket's update_weights (a CUDA IPC source), what each
  send costs the trainer, and wire.decode of it (the Python side of the wire tests and fakes);
- describe / pack: push_weights' describe of (name, tensor) pairs and the packing of one bucket
  into staging, with fake torch and CuPy (tests/unit/protocol/python/fake_gpu.py): the Python
  around the torch calls, not torch itself, which only the GPU host measures
  (tests/bench/transports/bench_push.py). `torch_calls` counts the calls into (fake) torch per
  tensor, the part that costs ~0.1-1 us each with the real torch.

With --daemon BIN (a CPU build's daemon/rolloutd; --python-root must then hold the built _native,
e.g. BUILD/python):
- e2e: one update_weights of the 10,000 tensors from POSIX shared memory into a CPU daemon started
  with --synthetic-small-params, send to reply (the Python encode, the daemon's decode,
  validation and copies, the reply), best of `reps`; `e2e_encode_us` is the encode alone. The
  daemon stages an shm bucket in host memory and copies on the host where the GPU path makes
  one cudaMemcpyAsync per copy: the CPU figure shows the protocol and validation, not the copies.

--python-root selects the rolloutd package (an older checkout's protocol/python, to compare).
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def best_us(fn, n, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) / n * 1e6, 3)


class _Counting:
    """Wraps fake torch tensors' methods to count the calls made into them."""

    def __init__(self, cls):
        self.count = 0
        for name in ("detach", "numel", "element_size", "is_contiguous", "data_ptr", "dim", "reshape", "view",
                     "get_device"):
            fn = getattr(cls, name, None)
            if fn is None:
                continue

            def wrapper(*a, _fn=fn, **k):
                self.count += 1
                return _fn(*a, **k)

            setattr(cls, name, wrapper)
        for name in ("device", "is_cuda"):
            prop = getattr(cls, name)

            def getter(t, _prop=prop):
                self.count += 1
                return _prop.fget(t)

            setattr(cls, name, property(getter))


def through_daemon(binary, n, reps):
    """us per tensor of one shm bucket of n small BF16 tensors, send to reply, through a CPU daemon."""
    import subprocess
    import tempfile
    from multiprocessing import shared_memory

    import numpy as np

    from rolloutd import Client, wire
    from rolloutd.messages import BucketEntry, ShmSource, UpdateWeightsRequest

    tmp = tempfile.mkdtemp(prefix="rolloutd-bench-")
    endpoints = os.path.join(tmp, "endpoints.json")
    log = open(os.path.join(tmp, "daemon.log"), "wb")
    proc = subprocess.Popen([binary, "--control-port", "0", "--http-port", "0", "--endpoints-file", endpoints,
                             "--synthetic-small-params", str(n)], stdout=log, stderr=subprocess.STDOUT)
    shm = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(endpoints):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start (log: {log.name})")
            time.sleep(0.05)
        time.sleep(0.1)  # the file is written atomically; give the loop a moment
        with open(endpoints) as f:
            control = json.load(f)["control"]
        client = Client(control, timeout_s=120)
        client.hello()
        entries = [BucketEntry(f"synthetic_small.{i}.weight", "bfloat16", [1024], i * 2048, 2048) for i in range(n)]
        shm = shared_memory.SharedMemory(create=True, size=n * 2048, name=f"rolloutd-bench-{os.getpid()}")
        np.frombuffer(shm.buf, dtype=np.uint8)[:] = np.random.default_rng(1).integers(0, 256, n * 2048,
                                                                                         dtype=np.uint8)
        name = "/" + shm.name.lstrip("/")
        best, version = None, 1
        for _ in range(reps + 1):
            session = client.begin_weight_update().session
            t0 = time.perf_counter()
            client.update_weights_shm(session, entries, name, 0, n * 2048)
            dt = time.perf_counter() - t0
            client.end_weight_update(session, version)
            version += 1
            best = dt if best is None else min(best, dt)
        req = UpdateWeightsRequest(session=1, entries=entries, source=ShmSource(name, 0, n * 2048))
        encode = best_us(lambda: wire.encode(5, req), n, reps)
        client.close()
        return {"e2e_us": round(best / n * 1e6, 3), "e2e_encode_us": encode}
    finally:
        if shm is not None:
            shm.close()
            shm.unlink()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--python-root", default=os.path.join(ROOT, "protocol", "python"))
    ap.add_argument("--json")
    ap.add_argument("--daemon", help="a CPU build's daemon binary: also time one bucket end to end through it")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.python_root))
    sys.path.insert(0, os.path.join(ROOT, "tests", "unit", "protocol", "python"))
    import fake_gpu
    import numpy as np

    trainer = fake_gpu.install()
    import torch  # the fake

    from rolloutd import wire
    from rolloutd.messages import CudaIpcSource, UpdateWeightsRequest

    n, reps = args.tensors, args.reps
    out = {"tensors": n, "tensor_bytes": 2048, "python_root": os.path.abspath(args.python_root)}

    # ---- plan, encode, decode ----
    items = [trainer.TensorInfo(f"synthetic_small.{i}.weight", "bfloat16", [1024], 2048, None, None, None)
             for i in range(n)]
    out["plan_us"] = best_us(lambda: trainer.plan_buckets(items, 64 << 20), n, reps)
    bucket = trainer.plan_buckets(items, 64 << 20)[0]
    req = UpdateWeightsRequest(session=1, entries=bucket.entries,
                               source=CudaIpcSource(bytes(64), 0, bucket.size, bytes(16)))
    out["encode_us"] = best_us(lambda: wire.encode(5, req), n, reps)
    frames = wire.encode(5, req)
    out["envelope_bytes"] = len(frames[0])
    out["decode_us"] = best_us(lambda: wire.decode(frames), n, reps)

    # ---- describe and pack, fake torch ----
    counting = _Counting(torch.Tensor)
    flat = torch.from_numpy(np.arange(n * 1024, dtype=np.float32)).to("cuda:1")
    # Separate tensors on the staging buffer's device, as bench_push.py's small tensors.
    tensors = [(f"synthetic_small.{i}.weight", flat[i * 1024:(i + 1) * 1024].view(torch.bfloat16)[:1024])
               for i in range(n)]
    named = trainer._named(tensors)
    describe_all = getattr(trainer, "_describe_all_torch", None)
    if describe_all is not None:
        describe = lambda: describe_all(named)  # noqa: E731
    else:
        describe = lambda: [trainer._describe_torch(i, name, t) for i, (name, t) in enumerate(named)]  # noqa: E731
    counting.count = 0
    described = describe()
    out["describe_torch_calls"] = round(counting.count / n, 2)
    out["describe_us"] = best_us(describe, n, reps)
    planned = trainer.plan_buckets(described, 64 << 20)[0]
    staging = torch.zeros(planned.size + 4096, dtype=torch.uint8, device="cuda:1")
    counting.count = 0
    trainer._pack_into(staging, planned)
    out["pack_torch_calls"] = round(counting.count / n, 2)
    # Timed without the fakes' data movement (numpy copies standing in for the device's): the
    # Python that packing runs per tensor.
    torch._foreach_copy_ = lambda dsts, srcs, non_blocking=False: None
    if hasattr(fake_gpu, "RawKernel"):
        fake_gpu.RawKernel.__call__ = lambda self, grid, block, args, shared_mem=0: None
    out["pack_us"] = best_us(lambda: trainer._pack_into(staging, planned), n, reps)
    if args.daemon:
        out.update(through_daemon(args.daemon, n, reps))
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
