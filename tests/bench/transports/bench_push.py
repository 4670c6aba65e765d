#!/usr/bin/env python3
"""GPU weight transports against their same-run ceilings (issue 7's performance targets).

On a host with two GPUs (the trainer is this process on GPU 0, one daemon runs on GPU 1):

- NCCL push of 4 GiB and 16 GiB of BF16 (fewer when memory is short) in 256 MiB, 512 MiB and
  1 GiB buckets, end to end (first bucket to the end_weight_update reply), against a raw CuPy
  NCCL broadcast of the same bytes in the same bucket sizes between the same two GPUs (this
  process and a receiver process), and against a per-tensor peer (4 MiB broadcasts one by one,
  what a loop of torch.distributed.broadcast does). Target: >= 0.9 x raw.
- CUDA IPC push of the same bytes into the same daemon (the trainer's tensors on GPU 1), against
  a same-run device-to-device copy of them on GPU 1. Target: >= 0.8 x copy.
- Per-tensor overhead: 10,000 small tensors in one bucket, per tensor. Target: <= 5 us.

Each push runs with the tensors as separate allocations (buckets of several tensors are packed
into staging) and as views of one flat buffer (every bucket goes straight from it).

    tests/gpu/bench-transports.sh BUILD_DIR OUT_DIR      # sets the environment, writes the files
    python3 tests/bench/transports/bench_push.py --out-json X.json [--sizes-gib 4,16] [--reps 3]
    ROLLOUTD_BENCH_TRANSPORTS_ARGS=--small-only tests/gpu/bench-transports.sh ...   # the small tensors only

The small-tensor part reports, per tensor, end to end (`*_us_per_tensor`: first bucket to the end
reply, what the target is about) and with the trainer's describe and plan before it
(`*_total_us_per_tensor`), and the breakdown of the best rep (describe, plan, pack, export, send,
wait, the daemon's receipt-to-reply), for IPC and NCCL; then the IPC push again with the trainer's
gather kernel off (ROLLOUTD_PACK_GATHER=0: the multi-tensor copy) to compare the two packings.

The daemon needs parameters that large: it registers them with SYNTHETIC_FLAG (BF16 blocks of
SYNTHETIC_BLOCK_BYTES named synthetic.{i}.weight), and the small-tensor part needs
SMALL_PARAMS_FLAG; if the daemon does not know that flag, that part is reported as skipped.
"""
import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.environ.get("ROLLOUTD_SOURCE_ROOT") or os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(SOURCE_ROOT, "tests", "gpu", "transports"))

# ---- the daemon's benchmark flags (daemon/config.cpp) ----
SYNTHETIC_FLAG = "--synthetic-params"        # N bytes of extra BF16 parameters ...
SYNTHETIC_BLOCK_BYTES = 256 << 20            # ... in blocks of this size ...
SYNTHETIC_NAME = "synthetic.{i}.weight"      # ... named so, shape [block bytes / 2]
MX_FLAG = "--synthetic-mxfp4-params"         # N bytes (BF16 as sent) quantized to MXFP4 on arrival ...
MX_NAME = "synthetic_mx.{i}.weight"          # ... named so, [MX_ROWS, MX_COLS] per 256 MiB block
MX_ROWS, MX_COLS = 32768, 4096
FP8_FLAG = "--synthetic-fp8-params"          # N bytes (BF16 as sent) quantized to blockwise FP8 on arrival ...
FP8_NAME = "synthetic_fp8.{i}.weight"        # ... named so, [MX_ROWS, MX_COLS], scales in <name>_scale_inv
SMALL_PARAMS_FLAG = "--synthetic-small-params"  # N extra BF16 parameters of SMALL_PARAM_ELEMS each
SMALL_PARAM_NAME = "synthetic_small.{i}.weight"
SMALL_PARAM_ELEMS = 1024
NUM_SMALL_TENSORS = 10000

TRAINER_GPU, DAEMON_GPU = 0, 1
BUCKETS = [256 << 20, 512 << 20, 1 << 30]
PER_TENSOR_PEER_BYTES = 4 << 20
GIB = 1 << 30
# A daemon refuses an end_weight_update below the version it serves: one counter for every push.
_VERSIONS = itertools.count(1)
TARGETS = {"nccl_vs_raw": 0.9, "nccl_mxfp4_vs_raw": 0.8, "nccl_fp8_vs_raw": 0.8, "ipc_vs_copy": 0.8,
           "per_tensor_us": 5.0}


# ------------------------------------------------------------------- raw NCCL ceiling --
def raw_rank(rank, uid_hex, plan_json, reps):
    """One rank of a plain CuPy NCCL pair (rank 0 on TRAINER_GPU sends, rank 1 on DAEMON_GPU
    receives). Both run the same plan [[size, chunk], ...] in lockstep: per entry a warm-up of up to
    4 chunks, then `reps` timed runs of size/chunk broadcasts; at most 256 are enqueued before the
    stream is drained (a full launch queue would otherwise block the host). Rank 0 prints one JSON
    line per entry: {"size", "chunk", "times"}."""
    import faulthandler
    faulthandler.dump_traceback_later(240, exit=True)  # a hang says where, then ends the process
    try:
        import torch  # noqa: F401  (first: CuPy's NCCL then binds to PyTorch's, as the trainer's does)
    except ImportError:
        pass
    import cupy
    from cupy.cuda import nccl

    plan = json.loads(plan_json)
    cupy.cuda.Device(TRAINER_GPU if rank == 0 else DAEMON_GPU).use()
    max_chunk = max(c for _, c in plan)
    buf = cupy.random.random(max_chunk // 4, dtype=cupy.float32).view(cupy.uint8)  # not zeros
    stream = cupy.cuda.Stream(non_blocking=True)
    raw = bytes.fromhex(uid_hex)
    # CuPy 14 takes the id as bytes; older CuPy took a tuple of signed chars: match get_unique_id().
    uid = raw if isinstance(nccl.get_unique_id(), (bytes, bytearray)) else tuple(b - 256 if b > 127 else b for b in raw)
    comm = nccl.NcclCommunicator(2, uid, rank)

    def run(size, chunk, count):
        for k in range(count):
            comm.bcast(buf.data.ptr, chunk, nccl.NCCL_UINT8, 0, stream.ptr)
            if k % 256 == 255:
                stream.synchronize()
        stream.synchronize()

    for size, chunk in plan:
        count = size // chunk
        run(size, chunk, min(count, 4))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(size, chunk, count)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            print(json.dumps({"size": size, "chunk": chunk, "times": times}), flush=True)
    comm.destroy()
    return 0


def raw_ceilings(plan, reps, timeout_s):
    """Runs raw_rank as two processes; {(size, chunk): [seconds, ...]} of what completed in time.
    Times are the sender's: each run starts when the receiver has (nearly) posted its side, since
    both ranks drain their streams between runs."""
    from cupy.cuda import nccl

    from rolloutd.trainer import daemon_env, unique_id_bytes

    uid = unique_id_bytes(nccl.get_unique_id()).hex()
    args = [json.dumps(plan), str(reps)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--raw-rank", str(r), uid, *args],
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True, env=daemon_env())
             for r in (0, 1)]
    out = {}
    try:
        stdout, _ = procs[0].communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"raw NCCL ceiling: timed out after {timeout_s} s", flush=True)
        stdout = ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[(r["size"], r["chunk"])] = r["times"]
    return out


# ------------------------------------------------------------------------------- the bench --
BREAKDOWN_KEYS = ("begin_s", "buckets_s", "end_s", "end_postprocess_s", "describe_s", "plan_s", "pack_s", "export_s",
                  "send_s", "wait_s", "reply_latency_s", "daemon_apply_s", "first_bucket_daemon_s")


def breakdown(stats):
    """Where one push's time went (ms): session begin, buckets (first sent to last answered), end
    (and the daemon's postprocess inside it); for CUDA IPC also the trainer's describe, plan, pack
    (staging copies), export (handles), send (encode + send) and wait (blocked on replies), the
    summed reply latency (send to reply) and the daemon's own apply time, summed over buckets."""
    return {k[:-2] + "_ms": round(stats[k] * 1e3, 3) for k in BREAKDOWN_KEYS if k in stats}


def checkpoint(args, result):
    """Writes what is measured so far: a bench stopped by its time limit still leaves figures."""
    with open(args.out_json, "w") as f:
        json.dump(result, f, indent=1)


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def summarize(times, nbytes):
    return {"best_s": min(times), "median_s": statistics.median(times), "gbps": gbps(nbytes, min(times)),
            "median_gbps": gbps(nbytes, statistics.median(times)), "reps": len(times)}


def fit_sizes(requested, free0, free1):
    """The requested sizes, each capped by what both GPUs hold (same-run ceilings included)."""
    def fits(s):
        need0 = 2 * s + 2 * GIB + 2 * GIB                   # separate + flat, staging, slack
        need1 = s + 2 * GIB + 2 * s + 2 * GIB + 2 * GIB + 2 * GIB  # daemon + staging, sources, ours, slack
        return need0 <= free0 and need1 <= free1

    out = []
    for s in requested:
        t = s
        while t > GIB and not fits(t):
            t //= 2
        t -= t % SYNTHETIC_BLOCK_BYTES
        if t < SYNTHETIC_BLOCK_BYTES or not fits(t):
            continue
        out.append({"requested_bytes": s, "bytes": t})
    return out


def make_tensors(nbytes, device):
    """(separate, flat): nbytes of BF16 as SYNTHETIC_BLOCK_BYTES tensors, each its own allocation,
    and the same values as views of one flat buffer."""
    import torch

    n = SYNTHETIC_BLOCK_BYTES // 2
    separate = [(SYNTHETIC_NAME.format(i=i), torch.randn(n, dtype=torch.bfloat16, device=device))
                for i in range(nbytes // SYNTHETIC_BLOCK_BYTES)]
    flat = torch.cat([t for _, t in separate])
    views = [(name, flat[i * n:(i + 1) * n]) for i, (name, _) in enumerate(separate)]
    return separate, views, flat


def bench(args):
    global DAEMON_GPU
    import torch  # before CuPy: see the receiver
    import cupy
    import cupy.cuda.nccl  # noqa: F401  (a submodule: not loaded by `import cupy`)

    import rdgpu
    from rolloutd import trainer

    # One GPU: the daemon shares the trainer's GPU; the NCCL parts are skipped and the online
    # quantization formats are pushed by CUDA IPC instead (against the device copy).
    two = torch.cuda.device_count() >= 2
    if not two:
        DAEMON_GPU = TRAINER_GPU
        print("one GPU: NCCL parts skipped, online quantization pushed by CUDA IPC", flush=True)
    free0, _ = torch.cuda.mem_get_info(TRAINER_GPU)
    free1, _ = torch.cuda.mem_get_info(DAEMON_GPU)
    # One GPU holds both sides: half of it for each.
    sizes = fit_sizes([int(g * GIB) for g in args.sizes_gib], free0 if two else free0 // 2, free1 if two else free0 // 2)
    assert sizes, f"not even {SYNTHETIC_BLOCK_BYTES >> 20} MiB fit (free: {free0 >> 30}, {free1 >> 30} GiB)"
    max_bytes = max(s["bytes"] for s in sizes)
    result = {"host": {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "torch": torch.__version__,
                       "cupy": cupy.__version__, "nccl": cupy.cuda.nccl.get_version(),
                       "daemon_nccl_dir": trainer.nccl_lib_dir()},
              "targets": TARGETS, "sizes": sizes, "nccl": [], "nccl_mxfp4": [], "nccl_fp8": [], "ipc_mxfp4": [], "ipc_fp8": [], "ipc": [], "raw_nccl": [], "per_tensor_peer": [],
              "d2d_copy": [], "small_tensors": {}}

    # The ceilings first (METHOD: the floor, then the same-run ceiling), from the same tensors.
    separate0, views0, flat0 = make_tensors(max_bytes, f"cuda:{TRAINER_GPU}")
    torch.cuda.synchronize()
    # ---- raw NCCL ceilings between the same GPUs (two processes of their own) ----
    plan = [[size["bytes"], chunk] for size in sizes for chunk in args.buckets + [PER_TENSOR_PEER_BYTES]]
    got = raw_ceilings(plan, args.reps, timeout_s=240) if two else {}
    for size in sizes:
        for chunk in args.buckets + [PER_TENSOR_PEER_BYTES]:
            key = "per_tensor_peer" if chunk == PER_TENSOR_PEER_BYTES else "raw_nccl"
            times = got.get((size["bytes"], chunk))
            if not times:
                continue
            result[key].append({"bytes": size["bytes"], "chunk_bytes": chunk, **summarize(times, size["bytes"])})
            print(f"{key:15s} {size['bytes'] / GIB:5.1f} GiB chunk {chunk >> 20:5d} MiB "
                  f"{result[key][-1]['gbps']:7.1f} GB/s", flush=True)
    checkpoint(args, result)


    daemon = rdgpu.Daemon(DAEMON_GPU, [SYNTHETIC_FLAG, str(max_bytes), MX_FLAG, str(max_bytes), FP8_FLAG,
                                       str(max_bytes)], start_timeout_s=300)
    try:
        client = daemon.client(timeout_s=300)
        hello = client.hello()
        result["host"]["daemon_nccl"] = hello.nccl_version
        probe = client.get_weights_by_name(SYNTHETIC_NAME.format(i=0), truncate=1)
        assert probe.dtype == "bfloat16" and probe.shape == [SYNTHETIC_BLOCK_BYTES // 2], probe

        separate1, views1, flat1 = make_tensors(max_bytes, f"cuda:{DAEMON_GPU}")
        torch.cuda.synchronize()

        # ---- NCCL push ----
        with (trainer.NcclWeightGroup([client], device=TRAINER_GPU, timeout_s=120) if two
              else contextlib.nullcontext()) as group:
            if two:
                result["host"]["group_init_s"] = group.init_s
            for size in (sizes if two else []):
                blocks = size["bytes"] // SYNTHETIC_BLOCK_BYTES
                for bucket in args.buckets:
                    for layout, tensors in [x for x in (("separate", separate0), ("flat", views0))
                                            if x[0] in args.layouts]:
                        times, stats = [], {}
                        for rep in range(args.reps + 1):  # the first warms up (staging, NCCL channels)
                            stats = {}
                            trainer.push_weights([client], tensors[:blocks], next(_VERSIONS), via="nccl",
                                                 group=group, bucket_bytes=bucket, stats=stats)
                            if rep:
                                times.append(stats["transfer_s"])
                        result["nccl"].append({"bytes": size["bytes"], "bucket_bytes": bucket, "layout": layout,
                                               "num_buckets": stats["num_buckets"],
                                               "num_direct": stats["num_direct"], **summarize(times, size["bytes"]),
                                               "last_rep": breakdown(stats)})
                        print(f"nccl push {size['bytes'] / GIB:5.1f} GiB bucket {bucket >> 20:5d} MiB {layout:8s} "
                              f"{result['nccl'][-1]['gbps']:7.1f} GB/s  {result['nccl'][-1]['last_rep']}", flush=True)
                        checkpoint(args, result)
            if two:
                got = client.get_weights_by_name(SYNTHETIC_NAME.format(i=0), truncate=8).values
                sent = views0[0][1][:8].float().cpu().tolist()
                assert got == sent, f"the daemon holds {got}, the trainer sent {sent}"

            # ---- the same with online quantization of every tensor: MXFP4 (routed experts) and
            # blockwise FP8 with UE8M0 scales (DeepSeek-V3-style linears) ----
            for fmt, name in (("mxfp4", MX_NAME), ("fp8", FP8_NAME)):
                if fmt not in args.online:
                    continue
                via = "nccl" if two else "cuda_ipc"
                key = ("nccl_" if two else "ipc_") + fmt
                for size in sizes:
                    blocks = size["bytes"] // SYNTHETIC_BLOCK_BYTES
                    qt = [(name.format(i=i), t.view(MX_ROWS, MX_COLS)) for i, (_, t) in enumerate(views0[:blocks])]
                    for bucket in args.buckets:
                        times, stats = [], {}
                        for rep in range(args.reps + 1):
                            stats = {}
                            trainer.push_weights([client], qt, next(_VERSIONS), via=via, group=group,
                                                 bucket_bytes=bucket, stats=stats)
                            if rep:
                                times.append(stats["transfer_s"])
                        result[key].append({"bytes": size["bytes"], "bucket_bytes": bucket, "layout": "flat",
                                            "num_buckets": stats["num_buckets"], "num_direct": stats["num_direct"],
                                            **summarize(times, size["bytes"]), "last_rep": breakdown(stats)})
                        print(f"{via:4s} push {size['bytes'] / GIB:5.1f} GiB bucket {bucket >> 20:5d} MiB {fmt:8s} "
                              f"{result[key][-1]['gbps']:7.1f} GB/s  {result[key][-1]['last_rep']}", flush=True)
                        checkpoint(args, result)
                # Not timing zeros: the first scales follow each format's rule applied by torch to what was sent.
                if fmt == "mxfp4":
                    # OCP MX: E8M0 = floor(log2(amax of 32)) - 2 + 127; randn data has no zero block.
                    first = views0[0][1][:8 * 32].float().view(8, 32).abs().amax(dim=1)
                    want = (torch.floor(torch.log2(first)) - 2 + 127).cpu().tolist()
                    got = client.get_weights_by_name(MX_NAME.format(i=0) + "_scales", truncate=8).values
                else:
                    # UE8M0 blockwise: 2^ceil(log2(amax of a 128 x 128 block / 448)), first row of blocks.
                    w = views0[0][1].view(MX_ROWS, MX_COLS)[:128].float().abs().view(128, MX_COLS // 128, 128)
                    q = w.amax(dim=2).amax(dim=0) / 448.0
                    want = torch.exp2(torch.ceil(torch.log2(q)))[:8].cpu().tolist()
                    got = client.get_weights_by_name(FP8_NAME.format(i=0) + "_scale_inv", truncate=8).values
                assert got == want, f"the daemon's {fmt} scales {got}, the rule gives {want}"

        # ---- CUDA IPC push, and the device-to-device copy on the daemon's GPU ----
        for size in sizes:
            blocks = size["bytes"] // SYNTHETIC_BLOCK_BYTES
            for bucket in args.buckets:
                for layout, tensors in [x for x in (("separate", separate1), ("flat", views1)) if x[0] in args.layouts]:
                    times, stats = [], {}
                    for rep in range(args.reps + 1):
                        stats = {}
                        trainer.push_weights([client], tensors[:blocks], next(_VERSIONS), via="cuda_ipc",
                                             bucket_bytes=bucket, stats=stats)
                        if rep:
                            times.append(stats["transfer_s"])
                    result["ipc"].append({"bytes": size["bytes"], "bucket_bytes": bucket, "layout": layout,
                                          "num_buckets": stats["num_buckets"], "num_direct": stats["num_direct"],
                                          **summarize(times, size["bytes"]), "last_rep": breakdown(stats)})
                    checkpoint(args, result)
                    print(f"ipc push  {size['bytes'] / GIB:5.1f} GiB bucket {bucket >> 20:5d} MiB {layout:8s} "
                          f"{result['ipc'][-1]['gbps']:7.1f} GB/s  {result['ipc'][-1]['last_rep']}", flush=True)
            src = flat1.view(torch.uint8)
            for bucket in args.buckets:
                dst = torch.empty(bucket, dtype=torch.uint8, device=f"cuda:{DAEMON_GPU}")
                times = []
                for rep in range(args.reps + 1):
                    torch.cuda.synchronize(DAEMON_GPU)
                    t0 = time.perf_counter()
                    for k in range(size["bytes"] // bucket):
                        dst.copy_(src[k * bucket:(k + 1) * bucket])
                    torch.cuda.synchronize(DAEMON_GPU)
                    if rep:
                        times.append(time.perf_counter() - t0)
                result["d2d_copy"].append({"bytes": size["bytes"], "chunk_bytes": bucket,
                                           **summarize(times, size["bytes"])})
                print(f"d2d copy  {size['bytes'] / GIB:5.1f} GiB chunk {bucket >> 20:5d} MiB "
                      f"{result['d2d_copy'][-1]['gbps']:7.1f} GB/s payload", flush=True)
                del dst
        client.close()
    finally:
        daemon.stop()
    del separate0, views0, flat0, separate1, views1, flat1
    torch.cuda.empty_cache()

    result["small_tensors"] = bench_small(args)
    return result


def small_breakdown(stats):
    """A small-tensor push's phases in us per tensor: the timed part (first bucket to end reply),
    with describe and plan in front of it, and each phase."""
    per = {k[:-2] + "_us_per_tensor": round(stats[k] / NUM_SMALL_TENSORS * 1e6, 3)
           for k in BREAKDOWN_KEYS + ("transfer_s",) if k in stats}
    per["total_us_per_tensor"] = round((stats["describe_s"] + stats["plan_s"] + stats["transfer_s"])
                                       / NUM_SMALL_TENSORS * 1e6, 3)
    return per


def bench_small(args):
    """NUM_SMALL_TENSORS tensors of SMALL_PARAM_ELEMS BF16 in one bucket: seconds per tensor, end to end
    (NCCL and IPC), and the trainer's share alone (planning and packing)."""
    import torch

    import rdgpu
    from rolloutd import trainer

    out = {"num_tensors": NUM_SMALL_TENSORS, "tensor_bytes": SMALL_PARAM_ELEMS * 2}

    def best_push(client, tensors, via, group, label):
        """Best rep (after a warm-up) of a push: its us per tensor and its breakdown. The timed part
        is the best rep by transfer; the total (with describe and plan) the best rep by total, and
        every rep's describe and plan are kept (a garbage collection in one shows as an outlier)."""
        best = best_total = None
        total = lambda st: st["describe_s"] + st["plan_s"] + st["transfer_s"]  # noqa: E731
        reps = []
        for rep in range(args.reps + 1):
            stats = {}
            trainer.push_weights([client], tensors, next(_VERSIONS), via=via, group=group, bucket_bytes=64 << 20,
                                 stats=stats)
            if not rep:
                continue
            reps.append({k: round(stats[k] / NUM_SMALL_TENSORS * 1e6, 3) for k in ("describe_s", "plan_s", "transfer_s")})
            if best is None or stats["transfer_s"] < best["transfer_s"]:
                best = stats
            if best_total is None or total(stats) < total(best_total):
                best_total = stats
        out[f"{label}_us_per_tensor"] = best["transfer_s"] / NUM_SMALL_TENSORS * 1e6
        out[f"{label}_best_rep"] = small_breakdown(best)
        out[f"{label}_total_us_per_tensor"] = small_breakdown(best_total)["total_us_per_tensor"]
        out[f"{label}_reps_us_per_tensor"] = reps
        out["num_buckets"] = best["num_buckets"]
        print(f"small tensors, {label}, best rep per tensor: {out[f'{label}_best_rep']}", flush=True)
    tensors = [(SMALL_PARAM_NAME.format(i=i), torch.randn(SMALL_PARAM_ELEMS, dtype=torch.bfloat16,
                                                          device=f"cuda:{TRAINER_GPU}"))
               for i in range(NUM_SMALL_TENSORS)]
    # The trainer's part: describe, plan, pack into staging (no daemon).
    staging = torch.empty(NUM_SMALL_TENSORS * 2 * 1024 + (1 << 20), dtype=torch.uint8, device=f"cuda:{TRAINER_GPU}")
    times = []
    for _ in range(args.reps + 1):
        torch.cuda.synchronize(TRAINER_GPU)
        t0 = time.perf_counter()
        trainer.pack_device_bucket(staging, tensors)
        times.append(time.perf_counter() - t0)
    out["trainer_pack_us_per_tensor"] = min(times[1:]) / NUM_SMALL_TENSORS * 1e6

    try:
        daemon = rdgpu.Daemon(DAEMON_GPU, [SMALL_PARAMS_FLAG, str(NUM_SMALL_TENSORS)], start_timeout_s=120)
    except RuntimeError as e:
        out["skipped"] = f"the daemon does not take {SMALL_PARAMS_FLAG}: {str(e).splitlines()[0]}"
        print(f"small tensors: trainer side {out['trainer_pack_us_per_tensor']:.2f} us/tensor; "
              f"end to end skipped ({out['skipped']})", flush=True)
        return out
    try:
        with daemon.client(timeout_s=300) as client:
            with (trainer.NcclWeightGroup([client], device=TRAINER_GPU, timeout_s=120)
                  if TRAINER_GPU != DAEMON_GPU else contextlib.nullcontext()) as group:
                if group is not None:
                    best_push(client, tensors, "nccl", group, "nccl")
            on_daemon_gpu = [(n, t.to(f"cuda:{DAEMON_GPU}")) for n, t in tensors]
            best_push(client, on_daemon_gpu, "cuda_ipc", None, "ipc")
            # The same push with the garbage collector left on (the A/B of
            # trainer.PAUSE_GC_DURING_PUSH).
            trainer.PAUSE_GC_DURING_PUSH = False
            try:
                best_push(client, on_daemon_gpu, "cuda_ipc", None, "ipc_gc_on")
            finally:
                trainer.PAUSE_GC_DURING_PUSH = True
            # The same push with the multi-tensor copy instead of the gather kernel.
            os.environ["ROLLOUTD_PACK_GATHER"] = "0"
            trainer._GATHER_KERNELS.clear()
            try:
                best_push(client, on_daemon_gpu, "cuda_ipc", None, "ipc_foreach_pack")
            finally:
                del os.environ["ROLLOUTD_PACK_GATHER"]
                trainer._GATHER_KERNELS.clear()
            out["gather_kernel"] = trainer._gather_kernel(DAEMON_GPU) is not None
    finally:
        daemon.stop()
    print(f"small tensors: nccl {out.get('nccl_us_per_tensor', float('nan')):.2f} us/tensor, ipc {out['ipc_us_per_tensor']:.2f} "
          f"us/tensor (with describe and plan: nccl {out.get('nccl_total_us_per_tensor', float('nan')):.2f}, ipc "
          f"{out['ipc_total_us_per_tensor']:.2f}), ipc with the foreach pack {out['ipc_foreach_pack_us_per_tensor']:.2f}, "
          f"trainer side {out['trainer_pack_us_per_tensor']:.2f} us/tensor", flush=True)
    return out


def bench_small_only(args):
    global DAEMON_GPU
    import torch

    if torch.cuda.device_count() < 2:
        DAEMON_GPU = TRAINER_GPU
    result = {"host": {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                       "torch": torch.__version__}, "targets": TARGETS, "nccl": [], "nccl_mxfp4": [], "nccl_fp8": [],
              "ipc_mxfp4": [], "ipc_fp8": [], "ipc": [], "raw_nccl": [], "per_tensor_peer": [], "d2d_copy": []}
    result["small_tensors"] = bench_small(args)
    return result


def ratios(result):
    """Each push against its ceiling of the same size (and bucket size, for raw NCCL)."""
    raw = {(r["bytes"], r["chunk_bytes"]): r["gbps"] for r in result["raw_nccl"]}
    peer = {r["bytes"]: r["gbps"] for r in result["per_tensor_peer"]}
    copy = {}
    for r in result["d2d_copy"]:
        copy[r["bytes"]] = max(copy.get(r["bytes"], 0.0), r["gbps"])
    lines = []
    for r in result["nccl"]:
        if (r["bytes"], r["bucket_bytes"]) not in raw or r["bytes"] not in peer:
            lines.append(f"--  nccl {r['bytes'] / GIB:5.1f} GiB bucket {r['bucket_bytes'] >> 20} MiB {r['layout']}: "
                         f"{r['gbps']:.1f} GB/s, no same-run ceiling")
            continue
        r["vs_raw_nccl"] = r["gbps"] / raw[(r["bytes"], r["bucket_bytes"])]
        r["vs_per_tensor_peer"] = r["gbps"] / peer[r["bytes"]]
        ok = "ok " if r["vs_raw_nccl"] >= TARGETS["nccl_vs_raw"] else "LOW"
        lines.append(f"{ok} nccl {r['bytes'] / GIB:5.1f} GiB bucket {r['bucket_bytes'] >> 20:5d} MiB {r['layout']:8s} "
                     f"{r['gbps']:7.1f} GB/s = {r['vs_raw_nccl']:.3f} x raw NCCL "
                     f"({raw[(r['bytes'], r['bucket_bytes'])]:.1f}), {r['vs_per_tensor_peer']:.2f} x per-tensor peer "
                     f"({peer[r['bytes']]:.1f}); {r['num_direct']}/{r['num_buckets']} buckets direct")
    for fmt in ("mxfp4", "fp8"):
        for r in result["nccl_" + fmt]:
            if (r["bytes"], r["bucket_bytes"]) not in raw:
                continue
            r["vs_raw_nccl"] = r["gbps"] / raw[(r["bytes"], r["bucket_bytes"])]
            target = TARGETS[f"nccl_{fmt}_vs_raw"]
            ok = "ok " if r["vs_raw_nccl"] >= target else "LOW"
            lines.append(f"{ok} nccl+{fmt:5s} {r['bytes'] / GIB:5.1f} GiB bucket {r['bucket_bytes'] >> 20:5d} MiB "
                         f"{r['gbps']:7.1f} GB/s = {r['vs_raw_nccl']:.3f} x raw NCCL (target {target})")
    for fmt in ("mxfp4", "fp8"):
        for r in result["ipc_" + fmt]:
            if r["bytes"] not in copy:
                continue
            r["vs_d2d_copy"] = r["gbps"] / copy[r["bytes"]]
            lines.append(f"    ipc+{fmt:5s} {r['bytes'] / GIB:5.1f} GiB bucket {r['bucket_bytes'] >> 20:5d} MiB "
                         f"{r['gbps']:7.1f} GB/s (BF16 sent) = {r['vs_d2d_copy']:.3f} x device copy")
    for r in result["ipc"]:
        r["vs_d2d_copy"] = r["gbps"] / copy[r["bytes"]]
        ok = "ok " if r["vs_d2d_copy"] >= TARGETS["ipc_vs_copy"] else "LOW"
        lines.append(f"{ok} ipc  {r['bytes'] / GIB:5.1f} GiB bucket {r['bucket_bytes'] >> 20:5d} MiB {r['layout']:8s} "
                     f"{r['gbps']:7.1f} GB/s = {r['vs_d2d_copy']:.3f} x device copy ({copy[r['bytes']]:.1f}); "
                     f"{r['num_direct']}/{r['num_buckets']} buckets direct")
    s = result["small_tensors"]
    for key in ("nccl_us_per_tensor", "ipc_us_per_tensor", "nccl_total_us_per_tensor", "ipc_total_us_per_tensor",
                "ipc_foreach_pack_us_per_tensor", "trainer_pack_us_per_tensor"):
        if key in s:
            judged = key.startswith(("nccl_", "ipc_")) and "foreach" not in key
            ok = ("ok " if s[key] <= TARGETS["per_tensor_us"] else "LOW") if judged else "   "
            lines.append(f"{ok} {key} {s[key]:.2f} us ({s['num_tensors']} tensors of {s['tensor_bytes']} bytes)")
    if "skipped" in s:
        lines.append(f"--  small tensors end to end: {s['skipped']}")
    return lines


def main(argv):
    if argv[:1] == ["--raw-rank"]:
        return raw_rank(int(argv[1]), argv[2], argv[3], int(argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--sizes-gib", type=lambda s: [float(x) for x in s.split(",")], default=[4, 16])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buckets-mib", dest="buckets", type=lambda s: [int(x) << 20 for x in s.split(",")],
                    default=BUCKETS)
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=["separate", "flat"])
    ap.add_argument("--online", type=lambda s: [x for x in s.split(",") if x], default=["mxfp4", "fp8"],
                    help="online quantization formats to push (mxfp4,fp8; empty: none)")
    ap.add_argument("--hang-s", type=float, default=480, help="print every thread's stack if still running then")
    ap.add_argument("--small-only", action="store_true",
                    help="only the per-tensor part (10,000 small tensors), no large pushes or ceilings")
    args = ap.parse_args(argv)
    import faulthandler
    faulthandler.dump_traceback_later(args.hang_s, exit=False)
    t0 = time.monotonic()
    result = bench_small_only(args) if args.small_only else bench(args)
    lines = ratios(result)
    result["summary"] = lines
    result["wall_s"] = time.monotonic() - t0
    with open(args.out_json, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(["", "== transports against same-run ceilings =="] + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
