"""weights_checksum on the CUDA backend (label gpu; skips without a GPU): read back in slices
between engine steps (--checksum-slice-ms 0: one parameter a loop turn) while a request keeps
stepping, the sums are of the checkpoint-layout bytes: those of the NumPy weights for the tiny
model, and for an MXFP4 parameter (quantized on arrival, kept in the CUDA kernel layout) the same
sums as a CPU daemon fed the same BF16 bytes gives."""
import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"], "tests", "reference"))
import tiny_moe_reference as ref  # noqa: E402
from conftest import final_events, wait_queue  # noqa: E402  (tests/integration/conftest.py's, via this folder's)

MX_BYTES = 256 << 20  # one synthetic_mx parameter [32768, 4096] of BF16 as sent
MX_SHAPE = [32768, 4096]


def numpy_weights(seed):
    old = ref.SEED
    ref.SEED = seed
    try:
        return ref.build_weights(ref.CONFIG)
    finally:
        ref.SEED = old


def crcs(weights):
    return {name: zlib.crc32(np.ascontiguousarray(w).tobytes()) for name, w in weights.items()}


def checksum_line(d, n, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while len(lines := [x for x in d.log_lines() if x.get("msg") == "weights checksummed"]) < n:
        assert time.monotonic() < deadline, f"no log line for checksum {n}"
        time.sleep(0.01)
    return lines[n - 1]


def random_bf16(seed, count):
    # BF16 as the upper half of FP32 normals: finite, varied exponents, every block scale differs.
    f = np.random.default_rng(seed).standard_normal(count, dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def test_cuda_checksum_in_slices_while_generating(daemon_factory):
    d = daemon_factory(args=["--device", "cuda", "--gpu", "0", "--checksum-slice-ms", "0"])
    old, new_weights = crcs(numpy_weights(ref.SEED)), numpy_weights(4242)
    with d.client() as c, d.client() as g:
        c.hello()
        g.hello()
        rid = g.submit([3, 1, 4, 1, 5], max_new_tokens=4000, temperature=0.0)
        wait_queue(g, 1, 0)
        s = c.weights_checksum()
        assert dict(s) == old and s.weight_version == 0
        line = checksum_line(d, 1)
        assert line["parameters"] == len(old) and line["turns"] == len(old), line
        assert line["engine_steps"] >= len(old) - 2, f"the request stepped while the checksum ran: {line}"
        g.abort(rid)
        assert final_events(g, [rid], 30)[rid].reason in ("abort", "length")
        c.push_weights(list(new_weights.items()), weight_version=3)
        s = c.weights_checksum()
        assert dict(s) == crcs(new_weights) and s.weight_version == 3
    assert d.terminate() == 0


def test_cuda_mxfp4_checksum_equals_the_cpu_daemons(daemon_factory):
    # The CUDA kernel layout of MXFP4 rows (arranged E2M1 words) is not the CPU's: the sums are of
    # the checkpoint layout read back through the method's row map, so both backends must agree.
    flags = ["--synthetic-mxfp4-params", str(MX_BYTES), "--checksum-slice-ms", "0"]
    gpu = daemon_factory(args=["--device", "cuda", "--gpu", "0", *flags])
    cpu = daemon_factory(args=flags)
    data = random_bf16(11, MX_BYTES // 2)
    sums = []
    for d in (gpu, cpu):
        with d.client() as c:
            c.hello()
            before = dict(c.weights_checksum())
            c.push_weights([("synthetic_mx.0.weight", "bfloat16", MX_SHAPE, data)], weight_version=1,
                           timeout_s=300)
            s = c.weights_checksum()
            assert s.weight_version == 1
            # The pushed bytes reached both stored tensors, E2M1 blocks and E8M0 scales (their
            # sums are not those they started with).
            for name in ("synthetic_mx.0.weight_blocks", "synthetic_mx.0.weight_scales"):
                assert dict(s)[name] != before[name], name
            sums.append(dict(s))
    assert sums[0] == sums[1]
    assert gpu.terminate() == 0 and cpu.terminate() == 0
