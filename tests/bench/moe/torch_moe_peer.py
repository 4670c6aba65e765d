#!/usr/bin/env python3
"""The PyTorch peer of moe_bench: a BF16 MoE layer on torch._grouped_mm, the same shapes and
token counts, timed with CUDA events (median), written as a TSV (shape, tokens, ms) that
moe_bench reads. tests/gpu/bench-moe.sh runs it on the GPU host (torch 2.11).

The layer: router logits (FP32 linear), top-k, softmax weights (gpt-oss: over the k; Qwen3:
over all experts, renormalized), a stable sort of the (token, k) pairs by expert, gate_up and
down as two torch._grouped_mm calls over per-expert offsets, SwiGLU in between (gpt-oss's
clamped variant with its biases), weighting and index_add_ back to tokens. Everything a real
layer does, in the grouped-GEMM form transformers 5 uses (integrations/moe.py,
grouped_mm_experts_forward).

    python3 tests/bench/moe/torch_moe_peer.py --tsv OUT.tsv [--quick]
"""
import argparse
import sys

import torch
import torch.nn.functional as F

SHAPES = [("gpt-oss-120b", 128, 2880, 2880, 4, True), ("qwen3-30b-a3b", 128, 2048, 768, 8, False)]


def make_layer(e, h, i, gpt_oss, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    w = {
        "router": torch.randn(e, h, device=dev, generator=g) / h ** 0.5,
        "gate_up": (torch.randn(e, 2 * i, h, device=dev, generator=g) * 0.02).to(torch.bfloat16),
        "down": (torch.randn(e, h, i, device=dev, generator=g) * 0.02).to(torch.bfloat16),
    }
    if gpt_oss:
        w["router_bias"] = torch.randn(e, device=dev, generator=g) * 0.1
        w["gate_up_bias"] = (torch.randn(e, 2 * i, device=dev, generator=g) * 0.1).to(torch.bfloat16)
        w["down_bias"] = (torch.randn(e, h, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    return w


def layer(x, w, e, k, gpt_oss):
    t = x.shape[0]
    logits = F.linear(x, w["router"], w.get("router_bias"))
    if gpt_oss:
        top_v, top_i = torch.topk(logits, k, dim=-1)
        top_w = torch.softmax(top_v, dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1)
        top_w, top_i = torch.topk(probs, k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.histc(flat.float(), bins=e, min=0, max=e - 1)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.to(torch.bfloat16)[token]
    gu = torch._grouped_mm(xs, w["gate_up"].transpose(-2, -1), offs=offs)
    if gpt_oss:
        gu = gu + w["gate_up_bias"][flat[order]]
        gate, up = gu[..., ::2], gu[..., 1::2]
        gate = gate.clamp(max=7.0)
        up = up.clamp(min=-7.0, max=7.0)
        hid = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    else:
        gate, up = gu.chunk(2, dim=-1)
        hid = F.silu(gate) * up
    y = torch._grouped_mm(hid, w["down"].transpose(-2, -1), offs=offs)
    if gpt_oss:
        y = y + w["down_bias"][flat[order]]
    y = y.float() * top_w.reshape(-1)[order, None]
    return torch.zeros(t, x.shape[1], device=x.device, dtype=torch.float32).index_add_(0, token, y)


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tsv", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not hasattr(torch, "_grouped_mm") or not torch.cuda.is_available():
        print("torch._grouped_mm or CUDA unavailable: no peer", file=sys.stderr)
        return 1
    dev = torch.device("cuda", 0)
    tokens = [1, 64] if args.quick else [1, 8, 64, 256, 1024, 8192]
    lines = []
    with torch.no_grad():
        for name, e, h, i, k, gpt_oss in SHAPES:
            w = make_layer(e, h, i, gpt_oss, dev)
            for t in tokens:
                x = torch.randn(t, h, device=dev)
                ms = median_ms(lambda: layer(x, w, e, k, gpt_oss), 3, 5 if t >= 4096 else 20)
                lines.append(f"{name}\t{t}\t{ms:.5f}")
                print(f"peer {name} T={t}: {ms:.4f} ms", file=sys.stderr)
            del w
            torch.cuda.empty_cache()
    with open(args.tsv, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
