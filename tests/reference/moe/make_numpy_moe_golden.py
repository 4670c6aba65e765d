#!/usr/bin/env python3
"""Independent NumPy goldens for kernels/moe/ (every router, every SwiGLU variant, the routed
experts at every activation precision), from moe_numpy_ref.py.

Run it with Debian's interpreter, which has python3-numpy (no other dependency):
    /usr/bin/python3 tests/reference/moe/make_numpy_moe_golden.py
It rewrites tests/reference/moe/numpy_moe_golden.rdqg (format: tests/reference/quant/
golden_format.py), read by tests/unit/kernels/moe/moe_golden_test.cpp on CPU and GPU.

Records, per case:
  router/<case>/  logits [T,E] f32, [logit_bias [E]], [correction_bias [E]], [token_ids [T] i32,
                  tid2eid [V,K] i32], params f32 [kind, renormalize, scale, n_group, topk_group,
                  hash_score], ids [T,K] i32, weights [T,K] f32
  experts/<case>/ x [T,H] f32, topk_ids [T,K] i32, topk_weights [T,K] f32, l2p [E_log] i32,
                  gate_up_blocks [E,2I,H/32,16] u8 + gate_up_scales [E,2I,H/32] u8 (MXFP4,
                  checkpoint layout, rows in `order`), down_blocks, down_scales, [gate_up_bias
                  [E,2I] f32], [down_bias [E,H] f32], [out_init [T,H] f32], params f32 [act, limit,
                  alpha, precision, order, num_valid, accumulate], out [T,H] f32
The expert weights are MXFP4 values, exact in bfloat16 too: one golden serves both weight
formats. Rows past num_valid hold NaN activations and out-of-range ids: they must be ignored.
Random rows are redrawn until the k-th and (k+1)-th selection values differ by more than 1e-4
(relative), so the goldens never hinge on an ulp; tie rows are exact ties, resolved by the
documented policy (lower id first).
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "quant"))
import moe_numpy_ref as ref  # noqa: E402
from golden_format import write_golden  # noqa: E402

MIN_MARGIN = 1e-4


def router_case(records, rng, name, kind, t, e, k, *, bias=False, corr=False, renormalize=True,
                scale=1.0, n_group=1, topk_group=1, hash_score="sqrt_softplus", vocab=0,
                logit_scale=2.0, special=None):
    logit_bias = ref.f32(rng.normal(0, 0.5, e)) if bias else None
    correction = ref.f32(rng.normal(0, 0.05, e)) if corr else None
    tid2eid = None
    token_ids = None
    if kind == "hash":
        tid2eid = np.stack([rng.permutation(e)[:k] for _ in range(vocab)]).astype(np.int32)
        token_ids = rng.integers(0, vocab, t).astype(np.int32)
    logits = np.zeros((t, e), dtype=np.float32)
    ids = np.zeros((t, k), dtype=np.int32)
    weights = np.zeros((t, k), dtype=np.float32)
    for r in range(t):
        fixed = special.get(r) if special else None
        for _ in range(1000):
            row = ref.f32(fixed if fixed is not None else rng.normal(0, logit_scale, e))
            i, w, m = ref.route_token(kind, row, k, logit_bias, correction, renormalize, scale,
                                      n_group, topk_group,
                                      token_ids[r] if token_ids is not None else None, tid2eid,
                                      hash_score)
            if fixed is not None or m > MIN_MARGIN:
                break
        logits[r], ids[r], weights[r] = row, i, w
    p = f"router/{name}/"
    records.append((p + "logits", "float32", logits))
    if logit_bias is not None:
        records.append((p + "logit_bias", "float32", logit_bias))
    if correction is not None:
        records.append((p + "correction_bias", "float32", correction))
    if kind == "hash":
        records.append((p + "token_ids", "int32", token_ids))
        records.append((p + "tid2eid", "int32", tid2eid))
    params = np.array([ref.ROUTER[kind], float(renormalize), scale, n_group, topk_group,
                       ref.SCORE[hash_score]], dtype=np.float32)
    records.append((p + "params", "float32", params))
    records.append((p + "ids", "int32", ids))
    records.append((p + "weights", "float32", weights))


def experts_case(records, rng, name, act, precision, order, *, t=6, num_valid=5, k=2, e_log=4,
                 h=64, inter=64, x_scale=3.0, biases=False, accumulate=False, limit=7.0,
                 alpha=1.702):
    # Physical slots: logical e in slot e, except logical 2 -> slot e_log (a replica holding
    # slot 2's weights); slot e_log + 1 holds an unused expert.
    e_phys = e_log + 2
    l2p = np.arange(e_log, dtype=np.int32)
    gu_blocks, gu_scales, gu = ref.random_mxfp4(rng, (e_phys, 2 * inter, h))
    dn_blocks, dn_scales, dn = ref.random_mxfp4(rng, (e_phys, h, inter))
    if e_log > 2:
        l2p[2] = e_log
        for a in (gu_blocks, gu_scales, gu, dn_blocks, dn_scales, dn):
            a[e_log] = a[2]
    x = ref.f32(rng.normal(0, x_scale, (t, h)))
    x[num_valid:] = np.nan
    ids = np.stack([rng.permutation(e_log)[:k] for _ in range(t)]).astype(np.int32)
    ids[num_valid:] = 12345
    w = ref.f32(rng.uniform(0.1, 1.0, (t, k)))
    gub = ref.f32(rng.normal(0, 0.5, (e_phys, 2 * inter))) if biases else None
    dnb = ref.f32(rng.normal(0, 0.5, (e_phys, h))) if biases else None
    if biases and e_log > 2:
        gub[e_log], dnb[e_log] = gub[2], dnb[2]
    out_init = ref.f32(rng.normal(0, 1.0, (t, h))) if accumulate else None
    out = ref.experts(x, ids, w, l2p, gu, dn, act, limit, alpha, precision, order, gub, dnb,
                      num_valid, out_init)
    p = f"experts/{name}/"
    records += [(p + "x", "float32", x), (p + "topk_ids", "int32", ids),
                (p + "topk_weights", "float32", w), (p + "l2p", "int32", l2p),
                (p + "gate_up_blocks", "uint8", gu_blocks), (p + "gate_up_scales", "uint8", gu_scales),
                (p + "down_blocks", "uint8", dn_blocks), (p + "down_scales", "uint8", dn_scales)]
    if biases:
        records += [(p + "gate_up_bias", "float32", gub), (p + "down_bias", "float32", dnb)]
    if accumulate:
        records.append((p + "out_init", "float32", out_init))
    params = np.array([ref.ACT[act], limit, alpha, ref.PRECISION[precision], ref.ORDER[order],
                       num_valid, float(accumulate)], dtype=np.float32)
    records += [(p + "params", "float32", params), (p + "out", "float32", out)]


def self_checks():
    # Hand-checked values the C++ unit tests also use.
    assert abs(float(ref.sqrt_softplus(np.array([0.0]))[0]) - np.sqrt(np.log(2.0))) < 1e-7
    assert float(ref.sqrt_softplus(np.array([25.0]))[0]) == np.float32(5.0)
    h = ref.activation("gpt_oss_swiglu", np.array([10.0]), np.array([-9.0]))
    assert abs(float(h[0]) - 7.0 / (1 + np.exp(-7.0 * 1.702)) * (-6.0)) < 1e-5
    ids, w, _ = ref.route_token("softmax_topk", np.array([1.0, 3.0, 3.0, 2.0], np.float32), 2)
    assert list(ids) == [1, 2] and abs(float(w[0]) - 0.5) < 1e-7


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "numpy_moe_golden.rdqg"))
    args = ap.parse_args()
    self_checks()
    rng = np.random.default_rng(20260530)
    recs = []
    ties = {0: [1.0, 2.0, 2.0, 0.5, 2.0, -1.0, 0.0, 2.0] + [0.0] * 8}
    router_case(recs, rng, "softmax_renorm", "softmax_topk", 7, 16, 4, special=ties)
    router_case(recs, rng, "softmax_plain_bias", "softmax_topk", 5, 8, 2, bias=True,
                renormalize=False,
                special={1: [0.5, np.nan, 1.5, 0.25, -3.0, 1.0, 0.0, 2.0]})
    router_case(recs, rng, "topk_softmax_bias", "topk_softmax", 9, 32, 4, bias=True,
                special={2: [np.nan] + [0.0] * 31})
    router_case(recs, rng, "sigmoid_grouped", "sigmoid_grouped_topk", 8, 32, 4, corr=True,
                scale=2.5, n_group=4, topk_group=2)
    router_case(recs, rng, "sigmoid_flat_plain", "sigmoid_grouped_topk", 6, 16, 3, corr=True,
                renormalize=False)
    router_case(recs, rng, "sigmoid_group_of_one", "sigmoid_grouped_topk", 4, 8, 2, corr=True,
                n_group=8, topk_group=3, scale=1.5)
    router_case(recs, rng, "sqrt_softplus", "sqrt_softplus_topk", 8, 24, 3, corr=True, scale=1.5,
                logit_scale=12.0)
    router_case(recs, rng, "sqrt_softplus_grouped", "sqrt_softplus_topk", 5, 32, 4, corr=True,
                scale=1.5, n_group=8, topk_group=4)
    router_case(recs, rng, "hash_sqrt_softplus", "hash", 9, 16, 3, scale=1.5, vocab=20)
    router_case(recs, rng, "hash_sigmoid_plain", "hash", 4, 8, 2, renormalize=False,
                hash_score="sigmoid", vocab=5)
    router_case(recs, rng, "hash_softmax", "hash", 4, 8, 4, hash_score="softmax", vocab=7)

    for act, order, biases, limit, xs in (("swiglu", "concat", False, 7.0, 3.0),
                                          ("gpt_oss_swiglu", "interleaved", True, 7.0, 5.0),
                                          ("clamped_swiglu", "concat", False, 10.0, 8.0)):
        for precision in ("f32", "bf16", "mxfp8"):
            experts_case(recs, rng, f"{act}_{precision}_{order}", act, precision, order,
                         biases=biases, limit=limit, x_scale=xs)
    experts_case(recs, rng, "swiglu_bf16_interleaved_accumulate", "swiglu", "bf16", "interleaved",
                 accumulate=True)
    experts_case(recs, rng, "swiglu_mxfp8_one_token", "swiglu", "mxfp8", "concat", t=1,
                 num_valid=1, k=4, e_log=12, h=64, inter=64)
    experts_case(recs, rng, "gpt_oss_bf16_all_padding", "gpt_oss_swiglu", "bf16", "interleaved",
                 t=3, num_valid=0, biases=True)

    write_golden(args.out, recs)
    print(f"wrote {len(recs)} records, {os.path.getsize(args.out)} bytes to {args.out}")


if __name__ == "__main__":
    main()
