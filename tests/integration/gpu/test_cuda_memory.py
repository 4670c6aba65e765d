"""Memory release and resume on the CUDA backend (label gpu; skips without a GPU): the daemon
gives its GPU memory to a colocated trainer and takes it back.

release(all) -> the device's free memory (cudaMemGetInfo) comes back to within BOUND of what
it was before the daemon started -> the trainer fills most of the GPU and frees it -> resume ->
push the same weights -> greedy tokens and routed experts equal the reference's; static state
bit-identical and no range or parameter moved. Figures go to $OUT/memory-gpu.json when OUT is set.
"""
import json
import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"], "tests", "reference"))
import tiny_moe_reference as ref  # noqa: E402

cp = pytest.importorskip("cupy")

SYNTHETIC_BYTES = 2 << 30  # 2 GiB of extra BF16 parameters (8 x 256 MiB), so a release frees something
# What may stay resident while everything is released: the daemon's CUDA context (~0.5 GiB on an
# H200), cuBLAS's workspace, the step workspaces (scratch arena, a 64 MiB piece) and the
# allocator's slack. Measured against the device's free memory before the daemon started.
BOUND = 1 << 30


def free_bytes():
    cp.cuda.Device(0).synchronize()
    return cp.cuda.runtime.memGetInfo()[0]


def status(d):
    code, body = d.get("/v1/status")
    assert code == 200
    return json.loads(body)


def memory_view(d):
    m = status(d)["memory"]
    return ({t: (m[t]["ranges"], m[t]["static_state"]["crc32"]) for t in ("weights", "kv_cache", "scratch")},
            m["parameters_address_digest"])


def test_cuda_release_gives_the_gpu_back_and_resume_serves_the_same_model(daemon_factory):
    golden = json.load(open(os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"], "tests/reference/tiny_moe_golden.json")))
    case = golden["cases"][0]
    n = len(case["greedy_tokens"])
    cp.cuda.Device(0).use()
    free0 = free_bytes()  # this process's context exists already: it is not the daemon's
    d = daemon_factory(args=["--device", "cuda", "--gpu", "0", "--synthetic-params", str(SYNTHETIC_BYTES)])
    fig = {"bound_bytes": BOUND, "free_before_daemon": free0}
    with d.client(timeout_s=120) as c:
        def greedy():
            r = c.generate(case["prompt"], max_new_tokens=n, temperature=0.0, return_routed_experts=True)
            return r.token_ids, r.routed_experts.to_numpy().tolist()

        assert greedy() == (case["greedy_tokens"], case["routed_experts"])
        view = memory_view(d)
        fig["free_daemon_resident"] = free_bytes()
        st = status(d)["memory"]
        fig["arena_backed_bytes"] = {t: st[t]["backed_bytes"] for t in st if isinstance(st[t], dict)}

        t0 = time.monotonic()
        r = c.release_memory()
        fig["release_wall_s"] = time.monotonic() - t0
        fig["release_reply"] = {"tags": r.tags, "num_bytes": r.num_bytes, "duration_s": r.duration_s}
        assert r.tags == ["weights", "kv_cache", "cuda_graph"]
        assert r.num_bytes >= SYNTHETIC_BYTES
        free2 = free_bytes()
        fig["free_released"] = free2
        fig["daemon_resident_while_released"] = free0 - free2
        st = status(d)["memory"]
        fig["per_tag_release_s"] = {t: st[t]["last_release"]["duration_s"] for t in ("weights", "kv_cache")}
        assert free2 >= fig["free_daemon_resident"] + SYNTHETIC_BYTES
        assert free0 - free2 <= BOUND, f"{(free0 - free2) / 2**20:.0f} MiB stay resident (bound {BOUND >> 20} MiB)"
        assert not c.status().ready

        # The trainer takes most of the GPU, writes it, gives it back.
        take = free2 - (512 << 20)
        block = cp.cuda.runtime.malloc(take)
        cp.cuda.runtime.memset(block, 0x7F, take)
        cp.cuda.Device(0).synchronize()
        fig["trainer_took_bytes"] = take
        cp.cuda.runtime.free(block)

        t0 = time.monotonic()
        r = c.resume_memory()
        fig["resume_wall_s"] = time.monotonic() - t0
        fig["resume_reply"] = {"tags": r.tags, "num_bytes": r.num_bytes, "duration_s": r.duration_s}
        assert r.tags == ["weights", "kv_cache", "cuda_graph"]
        st = status(d)["memory"]
        fig["per_tag_resume_s"] = {t: st[t]["last_resume"]["duration_s"] for t in ("weights", "kv_cache")}

        weights = list(ref.build_weights(ref.CONFIG).items())
        zeros = bytes(256 << 20)
        weights += [(f"synthetic.{i}.weight", "bfloat16", [128 << 20], zeros) for i in range(SYNTHETIC_BYTES >> 28)]
        t0 = time.monotonic()
        c.push_weights(weights, weight_version=1, bucket_bytes=256 << 20)
        fig["push_s"] = time.monotonic() - t0
        assert c.status().ready
        assert greedy() == (case["greedy_tokens"], case["routed_experts"])
        assert memory_view(d) == view
        fig["free_after_resume"] = free_bytes()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "memory-gpu.json"), "w") as f:
            json.dump(fig, f, indent=1)
    print(json.dumps(fig))
    assert d.terminate() == 0
