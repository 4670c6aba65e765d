#!/usr/bin/env python3
"""Scale run (issue 11): weight sync to N-1 daemons and fleet rollouts over N daemons, against
same-run ceilings, on one host with N = the number of visible GPUs (N >= 2).

Python: the GPU host's python3 (torch + CuPy, the built rolloutd package on PYTHONPATH); the fleet
part alone (--cpu-daemons K) runs on any python3 with numpy and the rolloutd package (Debian's
/usr/bin/python3 with PYTHONPATH=build/ci/python), which is how it is checked off the GPU host.

The trainer is this process on GPU 0. One daemon runs on each of GPUs 1..N-1 and one more,
colocated with the trainer, on GPU 0.

- Weight sync: one NCCL group of the trainer and the N-1 daemons of GPUs 1..N-1; 8 GiB and 32 GiB
  of BF16 (fewer where memory is short: bench_push.fit_sizes) pushed in 256 MiB and 1 GiB buckets
  through rolloutd.trainer.push_weights, as BF16 parameters and with online MXFP4 quantization
  (--synthetic-params / --synthetic-mxfp4-params), timed from the first bucket to the last
  end_weight_update reply, against a raw CuPy NCCL broadcast of the same bytes in the same chunks
  from rank 0 (GPU 0) to the same N-1 GPUs, run as N processes of its own with a deadline.
  Target: >= 0.9 x raw without quantization.
- CUDA IPC push of the same bytes to the colocated daemon, against a same-run device-to-device
  copy of them on GPU 0.
- Fleet rollouts: rolloutd.Coordinator spreads --num-requests short requests over all N daemons;
  aggregate tokens/s against N x the single-daemon figure of the same run (one daemon, alone,
  given the per-daemon share of the requests, so both runs put the same load on each daemon).
  Target: >= 0.95 x linear. Every request must end with exactly one final event (exit 1 if not).

Results go to --out-json after every phase (a run stopped by its time limit keeps its figures).
Every wait is bounded; past --deadline-s a watchdog prints every thread's stack, writes what it
has, kills the processes it started and exits 3.

    tests/gpu/bench-scale.sh BUILD_DIR OUT_DIR        # the GPU host: environment, build, files
    python3 tests/bench/scale/run_scale.py --out-json X.json [--sizes-gib 8,32] [--num-requests 4096]
    PYTHONPATH=build/ci/python ROLLOUTD_BIN=build/ci/daemon/rolloutd \\
        /usr/bin/python3 tests/bench/scale/run_scale.py --out-json /tmp/s.json --cpu-daemons 2 --num-requests 256
"""
import argparse
import faulthandler
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.environ.get("ROLLOUTD_SOURCE_ROOT") or os.path.abspath(os.path.join(HERE, "..", "..", ".."))
# bench_push (the two-GPU transport bench) adds tests/gpu/transports (rdgpu) to sys.path itself.
sys.path.insert(0, os.path.join(SOURCE_ROOT, "tests", "bench", "transports"))
import bench_push as bp  # noqa: E402
from bench_push import GIB, MX_COLS, MX_FLAG, MX_NAME, MX_ROWS, SYNTHETIC_BLOCK_BYTES, SYNTHETIC_FLAG, \
    SYNTHETIC_NAME, breakdown, checkpoint, gbps, summarize  # noqa: E402

TRAINER_GPU = 0
BUCKETS = [256 << 20, 1 << 30]
TARGETS = {"nccl_vs_raw": 0.9, "nccl_mxfp4_vs_raw": bp.TARGETS["nccl_mxfp4_vs_raw"],
           "ipc_vs_copy": bp.TARGETS["ipc_vs_copy"], "fleet_vs_linear": 0.95}
# A daemon refuses an end_weight_update below the version it serves: one counter for every push.
_VERSIONS = itertools.count(1)
_STARTED = []  # processes this run started (daemons, raw ranks): the watchdog kills exactly these


# -------------------------------------------------------------------------- watchdog --
class Watchdog:
    """Past the deadline: every thread's stack, the results so far, the processes we started
    killed, exit 3. faulthandler's own timer (a C thread: works even if a thread holds the GIL in
    C code) is the backstop 30 s later."""

    def __init__(self, deadline_s, on_fire):
        self.deadline = time.monotonic() + deadline_s
        self.on_fire = on_fire
        self.stop = threading.Event()
        faulthandler.dump_traceback_later(deadline_s + 30, exit=True)
        threading.Thread(target=self._run, name="scale-watchdog", daemon=True).start()

    def left(self):
        return self.deadline - time.monotonic()

    def _run(self):
        if self.stop.wait(max(0.0, self.left())):
            return
        print(f"\n== deadline reached: stacks, results so far, killing {len(_STARTED)} process(es) ==",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        try:
            self.on_fire()
        finally:
            kill_started()
            os._exit(3)

    def cancel(self):
        self.stop.set()
        faulthandler.cancel_dump_traceback_later()


def kill_started():
    for p in _STARTED:
        if p.poll() is None:
            p.kill()


# ------------------------------------------------------------------ raw NCCL, N ways --
def raw_rank(rank, world, uid_hex, plan_json, reps, hang_s):
    """One rank of a plain CuPy NCCL group of `world` ranks, rank r on GPU r; rank 0 broadcasts.
    Every rank runs the plan [[size, chunk], ...] in lockstep, as bench_push.raw_rank does for two:
    per entry a warm-up of up to 4 chunks, then `reps` timed runs of size/chunk broadcasts, the
    stream drained every 256 (a full launch queue would block the host). Rank 0 prints one JSON
    line per entry: {"size", "chunk", "times"}."""
    faulthandler.dump_traceback_later(hang_s, exit=True)  # a hang says where, then ends the process
    try:
        import torch  # noqa: F401  (first: CuPy's NCCL then binds to PyTorch's, as the trainer's does)
    except ImportError:
        pass
    import cupy
    from cupy.cuda import nccl

    plan = json.loads(plan_json)
    cupy.cuda.Device(rank).use()
    max_chunk = max(c for _, c in plan)
    buf = cupy.random.random(max_chunk // 4, dtype=cupy.float32).view(cupy.uint8)  # not zeros
    stream = cupy.cuda.Stream(non_blocking=True)
    raw = bytes.fromhex(uid_hex)
    uid = raw if isinstance(nccl.get_unique_id(), (bytes, bytearray)) else tuple(b - 256 if b > 127 else b for b in raw)
    comm = nccl.NcclCommunicator(world, uid, rank)

    def run(chunk, count):
        for k in range(count):
            comm.bcast(buf.data.ptr, chunk, nccl.NCCL_UINT8, 0, stream.ptr)
            if k % 256 == 255:
                stream.synchronize()
        stream.synchronize()

    for size, chunk in plan:
        count = size // chunk
        run(chunk, min(count, 4))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(chunk, count)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            print(json.dumps({"size": size, "chunk": chunk, "times": times}), flush=True)
    comm.destroy()
    return 0


def raw_ceilings(world, plan, reps, timeout_s):
    """raw_rank as `world` processes; {(size, chunk): [seconds, ...]} of what completed in time.
    Times are rank 0's: each run starts when the receivers have (nearly) posted theirs, since every
    rank drains its stream between runs."""
    from cupy.cuda import nccl

    from rolloutd.trainer import daemon_env, unique_id_bytes

    uid = unique_id_bytes(nccl.get_unique_id()).hex()
    hang_s = max(30.0, timeout_s - 5.0)
    procs = []
    for r in range(world):
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--raw-rank", str(r), str(world), uid,
                              json.dumps(plan), str(reps), str(hang_s)],
                             stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True, env=daemon_env())
        procs.append(p)
        _STARTED.append(p)
    out = {}
    try:
        stdout, _ = procs[0].communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"raw NCCL ceiling: timed out after {timeout_s:.0f} s", flush=True)
        procs[0].kill()
        stdout, _ = procs[0].communicate(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    for line in (stdout or "").splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[(r["size"], r["chunk"])] = r["times"]
    return out


# --------------------------------------------------------------------------- daemons --
def start_daemons(specs, start_timeout_s):
    """rdgpu.Daemon for each (gpu, args), started together; all or none (the started ones are
    stopped if one fails)."""
    import rdgpu

    def one(index, spec):
        gpu, args = spec
        d = rdgpu.Daemon(gpu, args, start_timeout_s=start_timeout_s)
        _STARTED.append(d.proc)
        d.name = f"cpu{index}" if gpu is None else f"gpu{gpu}"
        return d

    with ThreadPoolExecutor(max_workers=len(specs)) as ex:
        futures = [ex.submit(one, i, s) for i, s in enumerate(specs)]
        daemons, error = [], None
        for f in futures:
            try:
                daemons.append(f.result(timeout=start_timeout_s + 30))
            except Exception as e:  # noqa: BLE001  (reported below, after stopping the others)
                error = error or e
    if error is not None:
        for d in daemons:
            d.stop(timeout=10)
        raise error
    return daemons


def stop_daemons(daemons):
    with ThreadPoolExecutor(max_workers=max(1, len(daemons))) as ex:
        list(ex.map(lambda d: d.stop(timeout=30), daemons))


def daemon_name(d):
    return d.name


# ------------------------------------------------------------------------ weight sync --
def buckets_for(args, size):
    """The bucket sizes that make sense for one size (no bucket larger than what is sent)."""
    return [b for b in args.buckets if b <= size["bytes"]] or [size["bytes"]]


def timed_pushes(clients, tensors, via, reps, bucket, group=None, device=None):
    """reps+1 pushes (the first warms up staging and NCCL channels); (transfer times, last stats)."""
    from rolloutd import trainer

    times, stats = [], {}
    for rep in range(reps + 1):
        stats = {}
        trainer.push_weights(clients, tensors, next(_VERSIONS), via=via, group=group, bucket_bytes=bucket,
                             device=device, stats=stats, timeout_s=120)
        if rep:
            times.append(stats["transfer_s"])
    return times, stats


def weight_sync(args, result, remote, colocated, sizes):
    import torch

    from rolloutd import trainer

    max_bytes = max(s["bytes"] for s in sizes)
    world = len(remote) + 1
    # The trainer's weights: one flat BF16 buffer (random: never time zeros), sent as 256 MiB views
    # (every bucket goes from where it lies; bench_push shows separate allocations cost the same
    # over NCCL, and holding both would halve the sizes that fit).
    n = SYNTHETIC_BLOCK_BYTES // 2
    flat = torch.randn(max_bytes // 2, dtype=torch.bfloat16, device=f"cuda:{TRAINER_GPU}")
    views = [(SYNTHETIC_NAME.format(i=i), flat[i * n:(i + 1) * n]) for i in range(max_bytes // SYNTHETIC_BLOCK_BYTES)]
    torch.cuda.synchronize()

    if "raw" not in args.skip:
        plan = [[s["bytes"], chunk] for s in sizes for chunk in buckets_for(args, s)]
        got = raw_ceilings(world, plan, args.reps, timeout_s=min(args.raw_timeout_s, max(30.0, args.watchdog.left() - 60)))
        for s in sizes:
            for chunk in buckets_for(args, s):
                times = got.get((s["bytes"], chunk))
                if times:
                    result["raw_nccl"].append({"bytes": s["bytes"], "chunk_bytes": chunk, "ranks": world,
                                               **summarize(times, s["bytes"])})
                    print(f"raw nccl  {s['bytes'] / GIB:5.1f} GiB chunk {chunk >> 20:5d} MiB to {world - 1} rank(s) "
                          f"{result['raw_nccl'][-1]['gbps']:7.1f} GB/s", flush=True)
        checkpoint(args, result)

    clients = [d.client(timeout_s=300) for d in remote]
    try:
        result["host"]["daemon_nccl"] = [c.hello().nccl_version for c in clients]
        for c in clients:
            probe = c.get_weights_by_name(SYNTHETIC_NAME.format(i=0), truncate=1)
            assert probe.dtype == "bfloat16" and probe.shape == [n], probe
        if "nccl" not in args.skip or "mxfp4" not in args.skip:
            with trainer.NcclWeightGroup(clients, device=TRAINER_GPU, timeout_s=120) as group:
                result["host"]["group_init_s"] = group.init_s
                result["host"]["group_ranks"] = group.world_size
                for kind in ("nccl", "nccl_mxfp4"):
                    if ("nccl" if kind == "nccl" else "mxfp4") in args.skip:
                        continue
                    for s in sizes:
                        blocks = s["bytes"] // SYNTHETIC_BLOCK_BYTES
                        tensors = views[:blocks] if kind == "nccl" else \
                            [(MX_NAME.format(i=i), t.view(MX_ROWS, MX_COLS)) for i, (_, t) in enumerate(views[:blocks])]
                        for bucket in buckets_for(args, s):
                            times, stats = timed_pushes(clients, tensors, "nccl", args.reps, bucket, group=group)
                            result[kind].append({"bytes": s["bytes"], "bucket_bytes": bucket, "daemons": len(clients),
                                                 "num_buckets": stats["num_buckets"], "num_direct": stats["num_direct"],
                                                 **summarize(times, s["bytes"]), "last_rep": breakdown(stats)})
                            r = result[kind][-1]
                            print(f"{kind:10s} {s['bytes'] / GIB:5.1f} GiB bucket {bucket >> 20:5d} MiB to "
                                  f"{len(clients)} daemon(s) {r['gbps']:7.1f} GB/s  {r['last_rep']}", flush=True)
                            checkpoint(args, result)
                    # Every daemon holds what was sent (BF16 as is; MXFP4 scales by the OCP rule:
                    # E8M0 = floor(log2(amax of 32)) - 2 + 127), checked on the first block.
                    if kind == "nccl":
                        want = views[0][1][:8].float().cpu().tolist()
                        for c in clients:
                            got = c.get_weights_by_name(SYNTHETIC_NAME.format(i=0), truncate=8).values
                            assert got == want, f"{c.endpoint} holds {got}, the trainer sent {want}"
                    else:
                        amax = views[0][1][:8 * 32].float().view(8, 32).abs().amax(dim=1)
                        want = (torch.floor(torch.log2(amax)) - 2 + 127).cpu().tolist()
                        for c in clients:
                            got = c.get_weights_by_name(MX_NAME.format(i=0) + "_scales", truncate=8).values
                            assert got == want, f"{c.endpoint}: MXFP4 scales {got}, the OCP rule gives {want}"
                    result["checks"].append(f"{kind}: first values equal on {len(clients)} daemon(s)")
                    checkpoint(args, result)
    finally:
        for c in clients:
            c.close()

    # ---- CUDA IPC push to the colocated daemon, and the device copy of the same bytes on GPU 0 ----
    if "ipc" not in args.skip and colocated is not None:
        with colocated.client(timeout_s=300) as c:
            for s in sizes:
                blocks = s["bytes"] // SYNTHETIC_BLOCK_BYTES
                for bucket in buckets_for(args, s):
                    times, stats = timed_pushes([c], views[:blocks], "cuda_ipc", args.reps, bucket, device=TRAINER_GPU)
                    result["ipc"].append({"bytes": s["bytes"], "bucket_bytes": bucket,
                                          "num_buckets": stats["num_buckets"], "num_direct": stats["num_direct"],
                                          **summarize(times, s["bytes"]), "last_rep": breakdown(stats)})
                    print(f"ipc push   {s['bytes'] / GIB:5.1f} GiB bucket {bucket >> 20:5d} MiB colocated "
                          f"{result['ipc'][-1]['gbps']:7.1f} GB/s  {result['ipc'][-1]['last_rep']}", flush=True)
                    checkpoint(args, result)
            got = c.get_weights_by_name(SYNTHETIC_NAME.format(i=0), truncate=8).values
            want = views[0][1][:8].float().cpu().tolist()
            assert got == want, f"the colocated daemon holds {got}, the trainer sent {want}"
            result["checks"].append("ipc: first values equal on the colocated daemon")
        src = flat.view(torch.uint8)
        for s in sizes:
            for bucket in buckets_for(args, s):
                dst = torch.empty(bucket, dtype=torch.uint8, device=f"cuda:{TRAINER_GPU}")
                times = []
                for rep in range(args.reps + 1):
                    torch.cuda.synchronize(TRAINER_GPU)
                    t0 = time.perf_counter()
                    for k in range(s["bytes"] // bucket):
                        dst.copy_(src[k * bucket:(k + 1) * bucket])
                    torch.cuda.synchronize(TRAINER_GPU)
                    if rep:
                        times.append(time.perf_counter() - t0)
                result["d2d_copy"].append({"bytes": s["bytes"], "chunk_bytes": bucket, **summarize(times, s["bytes"])})
                print(f"d2d copy   {s['bytes'] / GIB:5.1f} GiB chunk {bucket >> 20:5d} MiB GPU {TRAINER_GPU} "
                      f"{result['d2d_copy'][-1]['gbps']:7.1f} GB/s payload", flush=True)
                del dst
        checkpoint(args, result)
    del views, flat
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------- fleet rollouts --
class TokenSampler(threading.Thread):
    """Reads every daemon's rolloutd_tokens_generated_total every `period_s` during a run: when each
    daemon's count stopped growing says whether the daemons or this process's fan-in set the pace."""

    def __init__(self, daemons, period_s):
        super().__init__(name="scale-token-sampler", daemon=True)
        self.daemons, self.period_s = daemons, period_s
        self.samples = {daemon_name(d): [] for d in daemons}
        self.halt = threading.Event()

    def read(self):
        now = time.monotonic()
        for d in self.daemons:
            try:
                v = d.metric("rolloutd_tokens_generated_total")
            except Exception:  # noqa: BLE001  (a missed sample, not a failure)
                v = None
            if v is not None:
                self.samples[daemon_name(d)].append((now, v))

    def run(self):
        while not self.halt.wait(self.period_s):
            self.read()

    def finish(self):
        self.halt.set()
        self.join(timeout=10)
        self.read()

    def summary(self, t0):
        """Per daemon: tokens generated during the run, and when (s after t0) it reached that count."""
        out = {}
        for name, s in self.samples.items():
            if not s:
                continue
            first, last = s[0][1], s[-1][1]
            done_at = next(t for t, v in s if v == last)
            out[name] = {"tokens": last - first, "done_after_s": round(done_at - t0, 3)}
        return out


def rollout_run(daemons, num_requests, args, label):
    """One timed run: a Coordinator over `daemons`, a warm-up, then num_requests requests at once.
    Every event is read here: tokens per rid, final events per rid (exactly one each)."""
    import rolloutd
    from rolloutd.client import _is_final

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(num_requests)]
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    eps = [rolloutd.DaemonEndpoint(d.control, d.http, daemon_name(d)) for d in daemons]
    timeout_s = max(10.0, min(args.rollout_timeout_s, args.watchdog.left() - 20))
    out = {"label": label, "daemons": [daemon_name(d) for d in daemons], "num_requests": num_requests,
           "prompt_len": args.prompt_len, **sampling}
    with rolloutd.Coordinator(eps, timeout_s=60, request_timeout_s=timeout_s) as fleet:
        fleet.wait_ready(timeout_s=60)
        # Warm-up: first kernels, handles and KV blocks touched on every daemon, outside the timing.
        warm = fleet.generate_many([[1, 2, 3]] * (8 * len(daemons)), timeout_s=timeout_s, max_new_tokens=8)
        assert all(r.ok for r in warm), [r.error for r in warm if not r.ok][:3]
        while fleet.next_event(0.2) is not None:
            pass
        sampler = TokenSampler(daemons, args.sample_period_s)
        sampler.read()
        cpu0 = time.process_time()
        t0 = time.monotonic()
        sampler.start()
        rids = fleet.submit_many(prompts, seed=args.seed, **sampling)
        t_submitted = time.monotonic()
        want = set(rids)
        finals, tokens, completion, reasons, failed = {}, {}, {}, {}, []
        strays = num_events = 0
        t_last = t0
        deadline = time.monotonic() + timeout_s
        while len(finals) < len(want) and time.monotonic() < deadline:
            ev = fleet.next_event(min(1.0, max(0.0, deadline - time.monotonic())))
            if ev is None:
                continue
            num_events += 1
            if ev.rid not in want:
                strays += 1
                continue
            if isinstance(ev, rolloutd.TokensEvent):
                tokens[ev.rid] = tokens.get(ev.rid, 0) + len(ev.token_ids)
            elif isinstance(ev, rolloutd.RetractedEvent):
                tokens[ev.rid] = 0
            elif _is_final(ev):
                finals[ev.rid] = finals.get(ev.rid, 0) + 1
                t_last = time.monotonic()
                if isinstance(ev, rolloutd.FinishedEvent):
                    reasons[ev.reason] = reasons.get(ev.reason, 0) + 1
                    completion[ev.rid] = ev.completion_tokens
                else:
                    failed.append(f"{ev.rid}: {ev.error.code} {ev.error.message}")
        wall = t_last - t0
        cpu = time.process_time() - cpu0
        sampler.finish()
        # A second final event would come after the first: listen a little longer for one.
        settle_until = time.monotonic() + args.settle_s
        while time.monotonic() < settle_until:
            ev = fleet.next_event(max(0.0, settle_until - time.monotonic()))
            if ev is None:
                break
            num_events += 1
            if ev.rid in want and _is_final(ev):
                finals[ev.rid] = finals.get(ev.rid, 0) + 1
            elif ev.rid not in want:
                strays += 1
        missing = [r for r in rids if r not in finals]
        doubled = [r for r in rids if finals.get(r, 0) > 1]
        # What the final event says was generated equals the tokens streamed before it.
        mismatched = [r for r in completion if completion[r] != tokens.get(r, 0)]
        generated = sum(tokens.get(r, 0) for r in rids)
        out.update({
            "wall_s": wall, "submit_s": t_submitted - t0, "tokens": generated,
            "tokens_per_s": generated / wall if wall > 0 else 0.0, "events": num_events,
            "finish_reasons": reasons, "failed": len(failed), "failed_first": failed[:5],
            "missing_final": len(missing), "more_than_one_final": len(doubled), "stray_events": strays,
            "dropped_late_events": fleet.num_dropped_events, "tokens_ne_completion": len(mismatched),
            "process_cpu_s": cpu, "process_cpu_per_wall": cpu / wall if wall > 0 else 0.0,
            "per_daemon": sampler.summary(t0),
        })
        out["exactly_one_final"] = not missing and not doubled and fleet.num_dropped_events == 0 and not strays
        out["tokens_match"] = not mismatched
    done = [v["done_after_s"] for v in out["per_daemon"].values()]
    if done:
        out["daemons_done_after_s"] = max(done)
        out["daemon_side_tokens_per_s"] = generated / max(done) if max(done) > 0 else 0.0
    print(f"rollouts  {label:6s} {len(daemons)} daemon(s) {num_requests:5d} requests x {args.max_new_tokens} tokens: "
          f"{out['tokens_per_s']:9.0f} tokens/s ({wall:.2f} s, coordinator CPU {out['process_cpu_per_wall']:.2f} of wall); "
          f"finals ok: {out['exactly_one_final']}; per daemon {out['per_daemon']}", flush=True)
    return out


def fleet_rollouts(args, result, daemons):
    nd = len(daemons)
    per_daemon = math.ceil(args.num_requests / nd)
    # The single-daemon figure: the last daemon (not the trainer's GPU), alone, with one daemon's
    # share of the fleet's requests: the same load per daemon as in the fleet run.
    single = rollout_run([daemons[-1]], per_daemon, args, "single")
    result["fleet"]["single"] = single
    checkpoint(args, result)
    fleet = rollout_run(daemons, args.num_requests, args, "fleet")
    result["fleet"]["fleet"] = fleet
    linear = nd * single["tokens_per_s"]
    result["fleet"]["linear_tokens_per_s"] = linear
    result["fleet"]["vs_linear"] = fleet["tokens_per_s"] / linear if linear > 0 else 0.0
    if "daemon_side_tokens_per_s" in single and "daemon_side_tokens_per_s" in fleet:
        lin = nd * single["daemon_side_tokens_per_s"]
        result["fleet"]["daemon_side_vs_linear"] = fleet["daemon_side_tokens_per_s"] / lin if lin > 0 else 0.0
    checkpoint(args, result)


# ------------------------------------------------------------------------------ report --
def ratios(result):
    raw = {(r["bytes"], r["chunk_bytes"]): r["gbps"] for r in result["raw_nccl"]}
    copy = {}
    for r in result["d2d_copy"]:
        copy[r["bytes"]] = max(copy.get(r["bytes"], 0.0), r["gbps"])
    lines = []
    for kind, target in (("nccl", TARGETS["nccl_vs_raw"]), ("nccl_mxfp4", TARGETS["nccl_mxfp4_vs_raw"])):
        for r in result[kind]:
            ceiling = raw.get((r["bytes"], r["bucket_bytes"]))
            head = f"{kind:10s} {r['bytes'] / GIB:5.1f} GiB bucket {r['bucket_bytes'] >> 20:5d} MiB " \
                   f"to {r['daemons']} daemon(s) {r['best_s'] * 1e3:8.1f} ms {r['gbps']:7.1f} GB/s"
            if ceiling is None:
                lines.append(f"--  {head}, no same-run ceiling")
                continue
            r["vs_raw_nccl"] = r["gbps"] / ceiling
            ok = "ok " if r["vs_raw_nccl"] >= target else "LOW"
            lines.append(f"{ok} {head} = {r['vs_raw_nccl']:.3f} x raw NCCL ({ceiling:.1f}; target {target})")
    for r in result["ipc"]:
        head = f"ipc        {r['bytes'] / GIB:5.1f} GiB bucket {r['bucket_bytes'] >> 20:5d} MiB colocated   " \
               f"{r['best_s'] * 1e3:8.1f} ms {r['gbps']:7.1f} GB/s"
        if r["bytes"] not in copy:
            lines.append(f"--  {head}, no same-run ceiling")
            continue
        r["vs_d2d_copy"] = r["gbps"] / copy[r["bytes"]]
        ok = "ok " if r["vs_d2d_copy"] >= TARGETS["ipc_vs_copy"] else "LOW"
        lines.append(f"{ok} {head} = {r['vs_d2d_copy']:.3f} x device copy ({copy[r['bytes']]:.1f}; "
                     f"target {TARGETS['ipc_vs_copy']})")
    f = result["fleet"]
    if "single" in f and "fleet" in f:
        s, g = f["single"], f["fleet"]
        ok = "ok " if f["vs_linear"] >= TARGETS["fleet_vs_linear"] else "LOW"
        lines.append(f"{ok} fleet rollouts {len(g['daemons'])} daemons {g['tokens_per_s']:.0f} tokens/s = "
                     f"{f['vs_linear']:.3f} x linear ({len(g['daemons'])} x {s['tokens_per_s']:.0f} single; "
                     f"target {TARGETS['fleet_vs_linear']})")
        if "daemon_side_vs_linear" in f:
            lines.append(f"    daemon side (last token counted by the daemons): {g['daemon_side_tokens_per_s']:.0f} "
                         f"tokens/s = {f['daemon_side_vs_linear']:.3f} x linear; coordinator CPU/wall "
                         f"{s['process_cpu_per_wall']:.2f} single, {g['process_cpu_per_wall']:.2f} fleet")
        for run in (s, g):
            ok = "ok " if run["exactly_one_final"] else "BAD"
            lines.append(f"{ok} {run['label']}: {run['num_requests']} requests, {run['num_requests'] - run['missing_final']}"
                         f" with a final event, {run['more_than_one_final']} with more than one, {run['failed']} failed,"
                         f" {run['dropped_late_events']} late events dropped; reasons {run['finish_reasons']}; "
                         f"streamed tokens {'=' if run['tokens_match'] else '!='} completion_tokens")
    elif f:
        lines.append(f"--  fleet rollouts incomplete: {sorted(f)}")
    return lines


# -------------------------------------------------------------------------------- main --
def gpu_count():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def run(args):
    import rdgpu  # noqa: F401  (sets the NVLink-multicast variables before any NCCL starts)

    result = {"targets": TARGETS, "host": {}, "sizes": [], "raw_nccl": [], "nccl": [], "nccl_mxfp4": [],
              "ipc": [], "d2d_copy": [], "fleet": {}, "checks": [], "args": {
                  k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items() if k != "watchdog"}}
    args.result = result
    # A daemon aborts the requests of a client that leaves --outbox-limit events undelivered: one
    # daemon alone streams ~num_requests x max_new_tokens events, faster than Python may read them.
    fleet_flags = ["--max-running", str(args.max_running), "--max-waiting", str(max(4096, 2 * args.num_requests)),
                   "--outbox-limit", str(min(1 << 24, max(65536, 4 * args.num_requests * (args.max_new_tokens + 2)))),
                   "--stream-interval", str(args.stream_interval)]
    daemons = []
    try:
        if args.cpu_daemons:
            result["host"] = {"mode": f"{args.cpu_daemons} CPU daemon(s): fleet rollouts only"}
            daemons = start_daemons([(None, fleet_flags)] * args.cpu_daemons, args.start_timeout_s)
            fleet_rollouts(args, result, daemons)
            return result

        import torch
        import cupy
        import cupy.cuda.nccl  # noqa: F401

        from rolloutd import trainer

        n = torch.cuda.device_count()
        result["host"] = {"gpus": [torch.cuda.get_device_name(i) for i in range(n)], "n": n,
                          "torch": torch.__version__, "cupy": cupy.__version__,
                          "nccl": cupy.cuda.nccl.get_version(), "daemon_nccl_dir": trainer.nccl_lib_dir()}
        try:
            result["host"]["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                                        text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
        free = [torch.cuda.mem_get_info(i)[0] for i in range(n)]
        # bench_push's fit: GPU 0 holds the trainer's weights and the colocated daemon's copy (its
        # "separate + flat"), every other GPU a daemon with BF16 and MXFP4 parameters and staging.
        sizes = bp.fit_sizes([int(g * GIB) for g in args.sizes_gib], free[0], min(free[1:]))
        assert sizes, f"not even {SYNTHETIC_BLOCK_BYTES >> 20} MiB fit (free: {[f >> 30 for f in free]} GiB)"
        result["sizes"] = sizes
        max_bytes = max(s["bytes"] for s in sizes)
        print(f"N = {n} GPUs ({result['host']['gpus'][0]}); sizes {[s['bytes'] / GIB for s in sizes]} GiB; "
              f"{n - 1} daemon(s) in the NCCL group + 1 colocated", flush=True)
        specs = [(g, [SYNTHETIC_FLAG, str(max_bytes), MX_FLAG, str(max_bytes), *fleet_flags]) for g in range(1, n)]
        specs.append((TRAINER_GPU, [SYNTHETIC_FLAG, str(max_bytes), *fleet_flags]))
        t = time.monotonic()
        daemons = start_daemons(specs, args.start_timeout_s)
        result["host"]["daemons_start_s"] = time.monotonic() - t
        remote, colocated = daemons[:-1], daemons[-1]
        checkpoint(args, result)
        weight_sync(args, result, remote, colocated, sizes)
        if "fleet" not in args.skip:
            # The fleet: every daemon, one per GPU (the colocated one included; the trainer is idle).
            fleet_rollouts(args, result, [colocated, *remote])
        return result
    finally:
        stop_daemons(daemons)


def main(argv):
    if argv[:1] == ["--raw-rank"]:
        return raw_rank(int(argv[1]), int(argv[2]), argv[3], argv[4], int(argv[5]), float(argv[6]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--sizes-gib", type=lambda s: [float(x) for x in s.split(",")], default=[8, 32])
    ap.add_argument("--buckets-mib", dest="buckets", type=lambda s: [int(x) << 20 for x in s.split(",")],
                    default=BUCKETS)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (best reported)")
    ap.add_argument("--num-requests", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [1, vocab)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--max-running", type=int, default=256, help="each daemon's --max-running")
    ap.add_argument("--stream-interval", type=int, default=16,
                    help="each daemon's --stream-interval: tokens per streamed event (the coordinator pays per event)")
    ap.add_argument("--skip", type=lambda s: set(s.split(",")) - {""}, default=set(),
                    help="phases to leave out: raw,nccl,mxfp4,ipc,fleet")
    ap.add_argument("--cpu-daemons", type=int, default=0,
                    help="no GPU: K CPU daemons, fleet rollouts only (checks the logic anywhere)")
    ap.add_argument("--deadline-s", type=float, default=540, help="the whole run; then stacks, results, exit 3")
    ap.add_argument("--start-timeout-s", type=float, default=180)
    ap.add_argument("--raw-timeout-s", type=float, default=120)
    ap.add_argument("--rollout-timeout-s", type=float, default=120, help="one rollout run, at most")
    ap.add_argument("--sample-period-s", type=float, default=0.1)
    ap.add_argument("--settle-s", type=float, default=0.5, help="listen this long after the last final event")
    args = ap.parse_args(argv)

    if not args.cpu_daemons and gpu_count() < 2:
        print(f"skipped: the scale run needs at least 2 GPUs (this host shows {gpu_count()})")
        return 0

    def dump_partial():
        r = getattr(args, "result", None)
        if r is not None:
            r["aborted"] = f"deadline of {args.deadline_s} s reached"
            r["summary"] = ratios(r)
            checkpoint(args, r)
            print("\n".join(["", "== scale run (partial) =="] + r["summary"]), flush=True)

    args.watchdog = Watchdog(args.deadline_s, dump_partial)
    # run.sh's `timeout` (or a person) stopping us: unwind through the finally blocks (daemons stopped).
    def on_sigterm(*_):
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    t0 = time.monotonic()
    try:
        result = run(args)
    except BaseException:
        r = getattr(args, "result", None)
        if r is not None:
            r["summary"] = ratios(r)
            checkpoint(args, r)
        kill_started()
        raise
    finally:
        args.watchdog.cancel()
    result["summary"] = lines = ratios(result)
    result["wall_s"] = time.monotonic() - t0
    checkpoint(args, result)
    print("\n".join(["", f"== scale run, N = {result['host'].get('n', args.cpu_daemons)}, against same-run ceilings =="]
                    + lines))
    f = result["fleet"]
    bad = [run["label"] for run in (f.get("single"), f.get("fleet")) if run and not run["exactly_one_final"]]
    if args.cpu_daemons == 0 and "fleet" not in args.skip and not ("single" in f and "fleet" in f):
        bad.append("fleet rollouts did not run")
    if bad:
        print(f"FAILED: not every request ended with exactly one final event ({', '.join(bad)})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
