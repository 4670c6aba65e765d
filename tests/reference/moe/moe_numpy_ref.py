"""A NumPy re-implementation of the MoE routers, SwiGLU variants and routed experts of
kernels/moe/moe_ops.hpp, written from the model families' definitions (Hugging Face
transformers 5: gpt_oss, qwen3_moe, deepseek_v3, deepseek_v4), not from the C++:

- scores and activations in float64, rounded to float32 where the model stores a float32;
- top-k as a lexicographic sort on (-value, expert id): descending value, NaN last, equal
  values -> lower id (the documented tie policy);
- GEMMs in float64 on float32 operands; activations rounded to bfloat16 or quantized to MXFP8
  (OCP MX v1.0, tests/reference/quant/make_quant_golden.py) where the precision asks.

Used by make_numpy_moe_golden.py (CI goldens) and make_hf_moe_golden.py (cross-check of this
implementation against the Hugging Face blocks on the GPU host).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "quant"))
import make_quant_golden as qg  # noqa: E402

# Enum values of kernels/moe/moe_ops.hpp.
ROUTER = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_grouped_topk": 2,
          "sqrt_softplus_topk": 3, "hash": 4}
SCORE = {"sqrt_softplus": 0, "sigmoid": 1, "softmax": 2}
ACT = {"swiglu": 0, "gpt_oss_swiglu": 1, "clamped_swiglu": 2}
PRECISION = {"f32": 0, "bf16": 1, "mxfp8": 2}
ORDER = {"concat": 0, "interleaved": 1}

F32 = np.float32


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(F32)


# ---- scalar functions (float64 in, float32 out) -------------------------------------------

def sigmoid(v):
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore"):
        return f32(1.0 / (1.0 + np.exp(-v)))


def softplus(v):
    """torch.nn.functional.softplus, beta 1, threshold 20."""
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore"):
        return np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))


def sqrt_softplus(v):
    return f32(np.sqrt(softplus(v)))


def silu64(v):
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore"):
        return v / (1.0 + np.exp(-v))


def activation(kind, g, u, limit=7.0, alpha=1.702):
    """h = act(g, u) for float32 arrays g, u; NaN propagates through the clamps."""
    g = np.asarray(g, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    if kind in ("gpt_oss_swiglu", "clamped_swiglu"):
        g = np.where(g > limit, limit, g)
        u = np.where(u > limit, limit, np.where(u < -limit, -limit, u))
    if kind == "gpt_oss_swiglu":
        with np.errstate(over="ignore"):
            glu = g / (1.0 + np.exp(-alpha * g))  # g * sigmoid(alpha g)
        return f32((u + 1.0) * glu)
    return f32(silu64(g) * u)


# ---- top-k ------------------------------------------------------------------------------------

def rank_order(values, allowed=None):
    """Expert ids by (value desc, id asc), NaN last; only `allowed` ids when given."""
    v = np.where(np.isnan(values), -np.inf, values.astype(np.float64))
    order = np.lexsort((np.arange(len(v)), -v))
    if allowed is not None:
        order = order[allowed[order]]
    return order


def margin(values, k, allowed=None):
    """Relative gap between the k-th and (k+1)-th ranked values (inf when none follows)."""
    order = rank_order(values, allowed)
    if len(order) <= k:
        return np.inf
    a, b = float(values[order[k - 1]]), float(values[order[k]])
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def route_token(kind, logits, k, logit_bias=None, corr=None, renormalize=True, scale=1.0,
                n_group=1, topk_group=1, token=None, tid2eid=None, hash_score="sqrt_softplus"):
    """One token's (ids, weights, selection margin) for a router of moe_ops.hpp."""
    v = f32(logits)
    if logit_bias is not None:
        v = f32(v.astype(np.float64) + logit_bias)
    e = len(v)
    if kind in ("softmax_topk", "topk_softmax"):
        ids = rank_order(v)[:k]
        if kind == "topk_softmax":
            x = np.exp(v[ids].astype(np.float64) - float(v[ids[0]]))
            return ids, f32(x / x.sum()), margin(v, k)
        p = np.exp(v.astype(np.float64) - np.nanmax(v))
        p = p / p.sum()
        w = p[ids]
        if renormalize:
            w = f32(w).astype(np.float64)
            w = w / w.sum()
        return ids, f32(w), margin(v, k)
    if kind in ("sigmoid_grouped_topk", "sqrt_softplus_topk"):
        s = sigmoid(v) if kind == "sigmoid_grouped_topk" else sqrt_softplus(v)
        c = s if corr is None else f32(s.astype(np.float64) + corr)
        allowed = None
        m = np.inf
        if n_group > 1:
            gsz = e // n_group
            cr = np.where(np.isnan(c), -np.inf, c.astype(np.float64)).reshape(n_group, gsz)
            top2 = -np.sort(-cr, axis=1)[:, :min(2, gsz)]
            gs = f32(top2.sum(axis=1))
            groups = rank_order(gs)[:topk_group]
            m = margin(gs, topk_group)
            allowed = np.zeros(e, dtype=bool)
            for g in groups:
                allowed[g * gsz:(g + 1) * gsz] = True
        ids = rank_order(c, allowed)[:k]
        m = min(m, margin(c, k, allowed))
        w = s[ids].astype(np.float64)
        if renormalize:
            w = w / (float(f32(w.sum())) + 1e-20)
        return ids, f32(f32(w).astype(np.float64) * scale), m
    if kind == "hash":
        ids = np.asarray(tid2eid[token], dtype=np.int64)
        if hash_score == "softmax":
            p = np.exp(v.astype(np.float64) - np.nanmax(v))
            w = (p / p.sum())[ids]
        else:
            w = (sigmoid(v) if hash_score == "sigmoid" else sqrt_softplus(v))[ids].astype(np.float64)
        if renormalize:
            w = w / (float(f32(w.sum())) + 1e-20)
        return ids, f32(f32(w).astype(np.float64) * scale), np.inf
    raise ValueError(kind)


# ---- activations rounding -----------------------------------------------------------------

def round_act(a, precision):
    """Rows of float32 `a` rounded as GEMM inputs: f32 (none), bf16 (RNE), mxfp8 (per 32)."""
    a = np.ascontiguousarray(a, dtype=F32)
    if precision == "f32" or a.size == 0:
        return a
    if precision == "bf16":
        return qg.bf16_to_f32(qg.bf16_bits(a))
    rows, k = a.shape
    codes, scales = qg.quantize_mx(a.astype(np.float64), "e4m3")
    return qg.dequantize_mx(codes, scales, k, "e4m3").view(F32).reshape(rows, k)


# ---- MXFP4 weights ------------------------------------------------------------------------------

def random_mxfp4(rng, shape, scale_lo=-7, scale_hi=-4):
    """Random MXFP4 checkpoint tensors for [.., N, K]: blocks [.., N, K/32, 16] uint8 and scales
    [.., N, K/32] uint8 (exponents in [scale_lo, scale_hi]), plus the exact float32 values."""
    *lead, n, k = shape
    codes = rng.integers(0, 16, size=(*lead, n, k)).astype(np.uint8)
    scales = (rng.integers(scale_lo, scale_hi + 1, size=(*lead, n, k // 32)) + 127).astype(np.uint8)
    flat_codes = codes.reshape(-1, k)
    blocks = qg.pack_fp4(flat_codes).reshape(*lead, n, k // 32, 16)
    vals = qg.decode(flat_codes, "e2m1") * np.repeat(
        2.0 ** (scales.reshape(-1, k // 32).astype(np.float64) - 127), 32, axis=1)
    return blocks, scales, f32(vals).reshape(*lead, n, k)


def gate_up_rows(inter, order):
    j = np.arange(inter)
    if order == "interleaved":
        return 2 * j, 2 * j + 1
    return j, inter + j


def experts(x, ids, weights, l2p, w_gate_up, w_down, act="swiglu", limit=7.0, alpha=1.702,
            precision="f32", order="concat", gate_up_bias=None, down_bias=None, num_valid=None,
            out_init=None):
    """out[t] = (out_init[t] or 0) + sum_k w[t,k] (down_e(act(gate_up_e(x_t) + b)) + b_d), padding
    rows zero. w_gate_up [E, 2I, H] in checkpoint `order`, w_down [E, H, I] (float32)."""
    t_all, h = x.shape
    nv = t_all if num_valid is None else num_valid
    inter = w_gate_up.shape[1] // 2
    gr, ur = gate_up_rows(inter, order)
    out = np.zeros((t_all, h), dtype=F32)
    xa = round_act(x[:nv], precision)
    for t in range(nv):
        row = np.zeros(h, dtype=F32) if out_init is None else out_init[t].astype(F32).copy()
        for j in range(ids.shape[1]):
            e = l2p[ids[t, j]]
            gu = f32(w_gate_up[e].astype(np.float64) @ xa[t].astype(np.float64))
            if gate_up_bias is not None:
                gu = f32(gu.astype(np.float64) + gate_up_bias[e])
            hv = activation(act, gu[gr], gu[ur], limit, alpha)
            hv = round_act(hv[None, :], precision)[0]
            y = f32(w_down[e].astype(np.float64) @ hv.astype(np.float64))
            if down_bias is not None:
                y = f32(y.astype(np.float64) + down_bias[e])
            row = f32(row.astype(np.float64) + f32(np.float64(weights[t, j]) * y.astype(np.float64)))
        out[t] = row
    return out
