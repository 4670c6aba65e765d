#!/usr/bin/python3
"""Independent NumPy re-implementation of the embedded default model
(core/model/embedded_model.cpp + core/model/moe_decoder.cpp): the deterministic
weight initialisation and a plain full-sequence forward pass in float64 (no KV
cache, no paging, no backend), used to write tests/reference/tiny_moe_golden.json.

Run with Debian's /usr/bin/python3 (python3-numpy):
    tests/reference/tiny_moe_reference.py > tests/reference/tiny_moe_golden.json

What it records for each prompt: the logits at every prompt position, the greedy
continuation, and the router's top-k logical expert ids of every layer for every
position that went through a forward pass.
"""
import json
import sys

import numpy as np

MASK64 = (1 << 64) - 1

CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=32, rope_theta=10000.0, rms_norm_eps=1e-6, norm_topk_prob=True)
SEED = 20261130
PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99], [200, 13, 7, 7, 7, 7, 250], [0]]
NEW_TOKENS = 16


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for c in s.encode():
        h ^= c
        h = (h * 0x100000001B3) & MASK64
    return h


def splitmix64_stream(seed, n):
    state = seed & MASK64
    out = np.empty(n, dtype=np.uint64)
    for i in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        out[i] = z ^ (z >> 31)
    return out


def fill_uniform(shape, name, scale, center=0.0):
    n = int(np.prod(shape))
    bits = splitmix64_stream(SEED ^ fnv1a64(name), n)
    u = (bits >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    t = np.float32(2.0) * u - np.float32(1.0)
    v = np.float32(center) + np.float32(scale) * t
    return v.astype(np.float32).reshape(shape)


def build_weights(c):
    H, D, QH, KVH = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    E, I, V = c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]
    shapes = {"model.embed_tokens.weight": (V, H)}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (QH * D, H),
            p + "self_attn.k_proj.weight": (KVH * D, H),
            p + "self_attn.v_proj.weight": (KVH * D, H),
            p + "self_attn.o_proj.weight": (H, QH * D),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate.weight": (E, H),
            p + "mlp.experts.gate_up_proj": (E, 2 * I, H),
            p + "mlp.experts.down_proj": (E, H, I),
        })
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    w = {}
    for name, shape in shapes.items():
        fan_in = shape[-1]
        if name.endswith("norm.weight"):
            w[name] = fill_uniform(shape, name, 0.1, 1.0)
        elif name == "model.embed_tokens.weight":
            w[name] = fill_uniform(shape, name, 1.0)
        else:
            gain = 2.0 if name.endswith("mlp.gate.weight") else 4.0 if name == "lm_head.weight" else 1.0
            scale = np.float32(gain) / np.sqrt(np.float32(fan_in))
            w[name] = fill_uniform(shape, name, scale)
    return w


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    # x [T, heads, D]; NeoX / rotate_half pairing (i, i + D/2).
    D = x.shape[-1]
    half = D // 2
    inv = theta ** (-2.0 * np.arange(half) / D)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(w, c, tokens):
    """Full causal forward over `tokens`; returns logits [T, V] and router ids [T, L, K]."""
    H, D, QH, KVH = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    E, K, I = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    f = lambda n: w[n].astype(np.float64)
    h = f("model.embed_tokens.weight")[tokens]
    ids_all = np.zeros((T, c["num_hidden_layers"], K), dtype=np.int64)
    mask = np.tril(np.ones((T, T), dtype=bool))
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        x = rmsnorm(h, f(p + "input_layernorm.weight"), c["rms_norm_eps"])
        q = (x @ f(p + "self_attn.q_proj.weight").T).reshape(T, QH, D)
        k = (x @ f(p + "self_attn.k_proj.weight").T).reshape(T, KVH, D)
        v = (x @ f(p + "self_attn.v_proj.weight").T).reshape(T, KVH, D)
        q, k = rope(q, pos, c["rope_theta"]), rope(k, pos, c["rope_theta"])
        attn = np.zeros((T, QH, D))
        for hq in range(QH):
            hk = hq // (QH // KVH)
            s = (q[:, hq, :] @ k[:, hk, :].T) / np.sqrt(D)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            attn[:, hq, :] = s @ v[:, hk, :]
        h = h + attn.reshape(T, QH * D) @ f(p + "self_attn.o_proj.weight").T
        x = rmsnorm(h, f(p + "post_attention_layernorm.weight"), c["rms_norm_eps"])
        logits = x @ f(p + "mlp.gate.weight").T
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        out = np.zeros_like(x)
        gu, dn = f(p + "mlp.experts.gate_up_proj"), f(p + "mlp.experts.down_proj")
        for t in range(T):
            order = np.argsort(-probs[t], kind="stable")[:K]  # ties: lower id first
            wts = probs[t, order]
            if c["norm_topk_prob"]:
                wts = wts / wts.sum()
            ids_all[t, l] = order
            for e, wt in zip(order, wts):
                g = gu[e, :I] @ x[t]
                u = gu[e, I:] @ x[t]
                out[t] += wt * (dn[e] @ (silu(g) * u))
        h = h + out
    x = rmsnorm(h, f("model.norm.weight"), c["rms_norm_eps"])
    return x @ f("lm_head.weight").T, ids_all


def main():
    w = build_weights(CONFIG)
    cases = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        margins = []
        for _ in range(NEW_TOKENS):
            logits, _ = forward(w, CONFIG, tokens)
            last = logits[-1]
            top2 = np.sort(last)[-2:]
            margins.append(float(top2[1] - top2[0]))
            tokens.append(int(np.argmax(last)))
        prompt_logits, _ = forward(w, CONFIG, list(prompt))
        # Router ids of every position that went through a forward pass (all but the last token).
        _, ids = forward(w, CONFIG, tokens[:-1])
        cases.append({
            "prompt": prompt,
            "prompt_logits": [[float(v) for v in row] for row in prompt_logits],
            "greedy_tokens": tokens[len(prompt):],
            "min_greedy_margin": min(margins),
            "routed_experts": ids.tolist(),
        })
    json.dump({
        "generator": "tests/reference/tiny_moe_reference.py (NumPy float64)",
        "config": CONFIG, "seed": SEED,
        # A few raw weights so a failure can tell init from forward-pass bugs.
        "weight_samples": {n: [float(v) for v in w[n].reshape(-1)[:8]] for n in
                           ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                            "model.layers.3.mlp.experts.down_proj", "lm_head.weight",
                            "model.norm.weight"]},
        "cases": cases,
    }, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
