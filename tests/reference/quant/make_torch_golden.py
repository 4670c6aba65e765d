#!/usr/bin/env python3
"""Goldens for kernels/quant/ made with PyTorch's own low-precision dtypes, a second
implementation independent of make_quant_golden.py (NumPy) and of the C++.

Run it where torch >= 2.8 is installed (the GPU host has torch 2.11; it runs on the CPU, no GPU
needed), from the repository root:
    python3 tests/reference/quant/make_torch_golden.py
It writes tests/reference/quant/torch_golden.rdqg (format: golden_format.py), which
tests/unit/kernels/quant/quant_golden_test.cpp then matches bit for bit on CPU and GPU; commit it.

What PyTorch does here, and what it cannot:
- float8_e4m3fn: every E4M3 element code is torch's own float32 -> float8_e4m3fn cast
  (round to nearest even). That cast turns |x| >= 480 into NaN rather than saturating, so the
  scaled values are clamped to +-448 first: saturation is the documented rule of the formats.
  E4M3 decoding is torch's float8_e4m3fn -> float32 cast.
- float8_e8m0fnu: every scale byte is torch's float32 -> float8_e8m0fnu cast of the exact power
  of two (2^-127 included, a float32 subnormal), NaN for poisoned blocks; decoding is torch's
  float8_e8m0fnu -> float32 cast.
- float4_e2m1fn_x2: torch (2.11) has the packed dtype but no float -> fp4 conversion, so the
  E2M1 codes come from torch.round (round half to even) on the three binades of the grid; the
  packed bytes are viewed as float4_e2m1fn_x2 and back, and an fp4 -> float conversion is
  probed and, where torch has one, checked against the lookup-table decode used here. When
  transformers is installed, its gpt-oss MXFP4 dequantizer (convert_moe_packed_tensors) is
  run on the goldens' blocks as a further cross-check.
- MX scales: floor(log2 amax) from torch.log2 in float64 (exact for float32 inputs).
- UE8M0 scales: the power of two at or above float32(amax) / 448 via torch.frexp. (DeepGEMM's
  ceil_to_ue8m0 spells it torch.ceil(torch.log2(s)) in float32, which can land one binade low
  when s lies within float32 rounding of a power of two; the script counts such blocks.)
Policies (zeros, NaN/Inf poisoning, padding) are those stated in kernels/quant/*.hpp.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from golden_format import write_golden  # noqa: E402

CANON_NAN = 0x7FC00000
notes = []


def f32_bits(t):
    return t.contiguous().view(torch.int32).numpy().view(np.uint32).copy()


def bf16_bits(t):
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def canonical(t):
    """float32 tensor with every NaN made the canonical positive quiet NaN."""
    bits = t.contiguous().view(torch.int32).clone()
    bits[torch.isnan(t)] = CANON_NAN
    return bits.view(torch.float32)


def e8m0_bytes(scale_f32):
    return scale_f32.to(torch.float8_e8m0fnu).view(torch.uint8)


def e8m0_values(bytes_u8):
    return bytes_u8.contiguous().view(torch.float8_e8m0fnu).to(torch.float32)


def e4m3_bytes(scaled_f32):
    return scaled_f32.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_codes(scaled_f32):
    """E2M1 codes (sign in bit 3) by round-half-to-even in each binade, saturating at 6."""
    mag = scaled_f32.abs()
    low = torch.round(mag * 2)               # [0, 2]: steps of 0.5 -> codes 0..4
    mid = torch.round(mag) + 2               # (2, 4]: steps of 1   -> codes 4..6
    high = torch.clamp(torch.round(mag / 2) + 4, max=7)  # (4, ..): steps of 2 -> codes 6, 7
    code = torch.where(mag <= 2, low, torch.where(mag <= 4, mid, high)).to(torch.uint8)
    return code | (torch.signbit(scaled_f32).to(torch.uint8) << 3)


E2M1_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def probe_fp4(packed_u8, codes):
    """Views the packed bytes as float4_e2m1fn_x2; checks any fp4 -> float conversion torch has."""
    fp4 = packed_u8.view(torch.float4_e2m1fn_x2)
    assert torch.equal(fp4.view(torch.uint8), packed_u8)
    try:
        dec = fp4.to(torch.float32)
    except Exception as e:  # noqa: BLE001 - reporting what this torch lacks
        return f"float4_e2m1fn_x2 -> float32: not available ({type(e).__name__})"
    want = E2M1_LUT[codes.long()]
    if dec.numel() != want.numel():
        return f"float4_e2m1fn_x2 -> float32: exists but gives {dec.numel()} values for {want.numel()} elements"
    if torch.equal(dec.reshape(-1).contiguous().view(torch.int32), want.reshape(-1).contiguous().view(torch.int32)):
        return "float4_e2m1fn_x2 -> float32: matches the lookup-table decode"
    raise AssertionError("torch's float4_e2m1fn_x2 -> float32 disagrees with the E2M1 table")


# ---- MX -------------------------------------------------------------------------------------


def mx_quantize(x, fmt):
    """x float32 [R, K] -> codes [R, nkb*32] uint8, scale bytes [R, nkb] uint8."""
    r, k = x.shape
    nkb = -(-k // 32)
    blocks = torch.nn.functional.pad(x, (0, nkb * 32 - k)).view(r, nkb, 32)
    finite = torch.isfinite(blocks).all(-1)
    amax = torch.where(finite, blocks.abs().amax(-1), torch.zeros(()))
    emax = 2 if fmt == "e2m1" else 8
    e = (torch.floor(torch.log2(amax.double())) - emax).clamp(-127, 127)
    e = torch.where(amax == 0, torch.full_like(e, -127), e)
    pow2 = torch.exp2(e)  # float64, exact
    scale_bytes = e8m0_bytes(torch.where(finite, pow2.float(), torch.full_like(amax, float("nan"))))
    scaled = (blocks.double() / pow2.unsqueeze(-1)).float()  # exact where it matters
    codes = e2m1_codes(scaled) if fmt == "e2m1" else e4m3_bytes(scaled)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    return codes.view(r, nkb * 32), scale_bytes


def mx_dequantize(codes, scale_bytes, k, fmt):
    r, nkb = scale_bytes.shape
    scale = e8m0_values(scale_bytes).repeat_interleave(32, dim=1)[:, :k]
    if fmt == "e2m1":
        vals = E2M1_LUT[codes[:, :k].long()]
    else:
        vals = codes[:, :k].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return canonical(vals * scale)


def pack_fp4(codes):
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


# ---- UE8M0 FP8 ------------------------------------------------------------------------------


def ue8m0_exponent(s):
    m, ex = torch.frexp(s)
    k = torch.where(m == 0.5, ex - 1, ex)
    return torch.where(s == 0, torch.full_like(k, -127), k).clamp(-127, 127)


def fp8_quantize(x, block_rows):
    """x float32 [B, M, K] (block_rows 128) or [R, 1, K] (block_rows 1)."""
    b, m, k = x.shape
    mb, nkb = -(-m // block_rows), -(-k // 128)
    xp = torch.nn.functional.pad(x, (0, nkb * 128 - k, 0, mb * block_rows - m))
    blocks = xp.view(b, mb, block_rows, nkb, 128)
    finite = torch.isfinite(blocks).all(4).all(2)
    amax = torch.where(finite, blocks.abs().amax(dim=(2, 4)), torch.zeros(()))
    s = amax / 448.0
    kexp = ue8m0_exponent(s)
    dg = torch.ceil(torch.log2(s)).clamp(-127, 127)
    differ = int(((dg != kexp.float()) & (s > 0) & finite).sum())
    if differ:
        notes.append(f"{differ} blocks where DeepGEMM's ceil(log2(s)) picks another binade")
    pow2 = torch.exp2(kexp.double())
    scale_f32 = canonical(torch.where(finite, pow2.float(), torch.full_like(amax, float("nan"))))
    codes = e8m0_bytes(scale_f32)
    scaled = (blocks.double() / pow2[:, :, None, :, None]).float()
    q = e4m3_bytes(scaled)
    q = torch.where(finite[:, :, None, :, None], q, torch.zeros_like(q))
    q = q.view(b, mb * block_rows, nkb * 128)[:, :m, :k]
    packed = torch.zeros(b, mb, 4 * -(-nkb // 4), dtype=torch.uint8)
    packed[:, :, :nkb] = codes
    # Dequantize through torch's own decoders: E4M3 -> float32 times the E8M0 scale.
    sv = e8m0_values(codes).repeat_interleave(block_rows, 1).repeat_interleave(128, 2)[:, :m, :k]
    deq = canonical(q.contiguous().view(torch.float8_e4m3fn).to(torch.float32) * sv)
    return q, scale_f32, packed, deq


# ---- layout ---------------------------------------------------------------------------------


def kernel_rows(a, order):
    e, n = a.shape[:2]
    rest = a.shape[2:]
    if order == "plain":
        return a
    if order == "gate_up":
        return a.reshape(e, n // 32, 16, 2, *rest).transpose(2, 3).reshape(e, n, *rest)
    return a.reshape(e, 2, n // 32, 16, *rest).transpose(1, 2).reshape(e, n, *rest)


def kernel_blocks(blocks, order):
    e, n, kb, _ = blocks.shape
    rows = kernel_rows(blocks.reshape(e, n, kb * 16), order)
    return rows.reshape(e, n // 16, 16, kb // 2, 32).permute(0, 1, 3, 2, 4).reshape(e, n, kb, 16)


def kernel_words(tiled):
    """Step 4 of the kernel layout (v2), as the inverse of the decode kernel's extraction: the
    word holds slot q (elements (0,4), (1,5), (3,7), (2,6) for q = 0..3, as bf16 bits of
    E2M1 * 2^-126: sign at bit 15, e1 e0 m at 8..6, +16 for the second element) at the bits
    that rotr(word, r_q) & M reads, r = 0, 4, 10, and 6 / 14 for the last slot's
    sign-exponent / mantissa bits."""
    w = tiled.contiguous().reshape(-1, 4).to(torch.int64)
    v1 = w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)
    mask32 = 0xFFFFFFFF

    def raw(code):  # E2M1 code -> bf16 bits of its value * 2^-126
        return ((code >> 3) << 15) | ((code & 7) << 6)

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & mask32 if r else x

    out = torch.zeros_like(v1)
    for q, parts in enumerate(([(0x81C081C0, 0)], [(0x81C081C0, 4)], [(0x81C081C0, 10)],
                               [(0x81808180, 6), (0x00400040, 14)])):
        lo = (0, 1, 3, 2)[q]
        pair = raw((v1 >> (4 * lo)) & 15) | (raw((v1 >> (4 * (lo + 4))) & 15) << 16)
        for m, r in parts:
            out |= rotl(pair & m, r)
    b = torch.stack([(out >> (8 * i)) & 0xFF for i in range(4)], dim=1).to(torch.uint8)
    return b.reshape(tiled.shape)


def kernel_scales(scales, order):
    e, n, kb = scales.shape
    rows = kernel_rows(scales, order)
    return rows.reshape(e, n // 16, 16, kb // 2, 2).permute(0, 1, 3, 2, 4).reshape(e, n, kb)


# ---- inputs ---------------------------------------------------------------------------------

SPECIALS = [0.0, -0.0, 1.0, -2.0, 6.0, 448.0, 2.0 ** -126, -(2.0 ** -130), 1e30, -3e38, 1e-38,
            0.75, 1.75, 3.5]


def heavy_tailed(g, shape):
    """Ratio-of-normals (Cauchy-like) samples times 2^[-24, 24) per row, with exact specials."""
    num = torch.randn(shape, generator=g, dtype=torch.float64)
    den = torch.rand(shape, generator=g, dtype=torch.float64).clamp_min(1e-3)
    row = torch.randint(-24, 24, shape[:-1] + (1,), generator=g).double()
    x = (num / den * torch.exp2(row)).reshape(-1)
    idx = torch.randperm(x.numel(), generator=g)[: max(1, x.numel() // 40)]
    pick = torch.randint(0, len(SPECIALS), (idx.numel(),), generator=g)
    x[idx] = torch.tensor(SPECIALS, dtype=torch.float64)[pick]
    return x.reshape(shape)


def stored(x64, dtype):
    """(bits to store, float32 values the kernels see)"""
    x32 = x64.float()
    if dtype == "bfloat16":
        xb = x32.to(torch.bfloat16)
        return bf16_bits(xb), xb.float()
    return f32_bits(x32), x32


def rows_of(lists, k):
    out = torch.zeros(len(lists), k, dtype=torch.float64)
    for i, r in enumerate(lists):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return out


def mx_edges(fmt):
    top = 6.0 if fmt == "e2m1" else 448.0
    rows = [[0.0] * 32, [0.0, -0.0] * 16, [top, -top, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0],
            [4.0, 3.0, 1.5, -0.5, 0.25, -0.25, 0.75, -0.76], [8.0, 5.0, 7.0, 1.0, -3.0],
            [7.5, -7.0, 6.5, 1.0], [1.5 * 2.0 ** -127, 2.0 ** -133, -(2.0 ** -133), 2.0 ** -130],
            [2.0 ** -126, 2.0 ** -127, 2.0 ** -128], [1.0, math.nan, 2.0], [1.0, math.inf, 2.0],
            [-math.inf, 0.5], [3.0e38, -2.5e38, 1.0]]
    if fmt == "e4m3":
        rows += [[448.0, 464.0, 449.0, 15.5, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -9)],
                 [500.0, 480.0, 300.0], [512.0, 17.0, 0.5]]
    return rows_of(rows, 32)


def fp8_edges():
    return rows_of([[0.0] * 128, [-0.0, 0.0], [448.0, 1.0, -224.0, 2.0 ** -9], [450.0, 225.0, 449.0],
                    [896.0, 1.0], [1.0, 0.5], [1e-38, 2.0 ** -130, -(2.0 ** -133)], [3.0e38, 1.0],
                    [1.0, math.nan], [math.inf], [15.5, 16.5, 17.0]], 128)


# ---- cases ----------------------------------------------------------------------------------


def mx_case(rec, op, case, x64, dtype, fmt, with_f32=True):
    shape = tuple(x64.shape)
    bits, x = stored(x64, dtype)
    k = shape[-1]
    codes, sb = mx_quantize(x.reshape(-1, k), fmt)
    lead = shape[:-1]
    nkb = sb.shape[1]
    rec.append((f"{op}/{case}/x", dtype, bits.reshape(shape)))
    if fmt == "e2m1":
        packed = pack_fp4(codes)
        notes.append(probe_fp4(packed, codes))
        rec.append((f"{op}/{case}/blocks", "uint8", packed.numpy().reshape(lead + (nkb, 16))))
    else:
        rec.append((f"{op}/{case}/q", "uint8", codes[:, :k].contiguous().numpy().reshape(shape)))
    rec.append((f"{op}/{case}/scales", "uint8", sb.numpy().reshape(lead + (nkb,))))
    deq = mx_dequantize(codes, sb, k, fmt)
    if with_f32:
        rec.append((f"{op}/{case}/dequant_f32", "float32", f32_bits(deq).reshape(shape)))
    rec.append((f"{op}/{case}/dequant_bf16", "bfloat16", bf16_bits(deq.to(torch.bfloat16)).reshape(shape)))
    return codes, sb


def fp8_case(rec, op, case, x64, dtype, with_f32=True):
    shape = tuple(x64.shape)
    bits, x = stored(x64, dtype)
    k = shape[-1]
    if op == "fp8_1x128":
        q, s, p, deq = fp8_quantize(x.reshape(-1, 1, k), 1)
        lead = shape[:-1]
    else:
        m = shape[-2]
        q, s, p, deq = fp8_quantize(x.reshape(-1, m, k), 128)
        lead = shape[:-2] + (-(-m // 128),)
    rec.append((f"{op}/{case}/x", dtype, bits.reshape(shape)))
    rec.append((f"{op}/{case}/q", "uint8", q.contiguous().numpy().reshape(shape)))
    rec.append((f"{op}/{case}/scales", "float32", f32_bits(s).reshape(lead + (s.shape[-1],))))
    pk = p.numpy().reshape(-1, p.shape[-1]).view("<i4")
    rec.append((f"{op}/{case}/scales_ue8m0", "int32", pk.reshape(lead + (pk.shape[-1],))))
    if with_f32:
        rec.append((f"{op}/{case}/dequant_f32", "float32", f32_bits(deq).reshape(shape)))
    rec.append((f"{op}/{case}/dequant_bf16", "bfloat16", bf16_bits(deq.to(torch.bfloat16)).reshape(shape)))


def layout_case(rec, order, case, g, e, n, k):
    bits, x = stored(heavy_tailed(g, (e, n, k)), "bfloat16")
    codes, sb = mx_quantize(x.reshape(-1, k), "e2m1")
    blocks = pack_fp4(codes).reshape(e, n, k // 32, 16)
    scales = sb.reshape(e, n, k // 32)
    op = f"mxfp4_layout_{order}"
    rec.append((f"{op}/{case}/x", "bfloat16", bits))
    rec.append((f"{op}/{case}/blocks", "uint8", blocks.numpy()))
    rec.append((f"{op}/{case}/scales", "uint8", scales.numpy()))
    rec.append((f"{op}/{case}/kernel_blocks", "uint8", kernel_words(kernel_blocks(blocks, order)).numpy()))
    rec.append((f"{op}/{case}/kernel_scales", "uint8", kernel_scales(scales, order).contiguous().numpy()))
    return blocks, scales


def cross_check_transformers(blocks, scales, k):
    """transformers' gpt-oss dequantizer on our blocks, where it is installed."""
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except Exception as e:  # noqa: BLE001
        return f"transformers convert_moe_packed_tensors: not available ({type(e).__name__})"
    try:
        out = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32).float().cpu()
    except Exception as e:  # noqa: BLE001
        return f"transformers convert_moe_packed_tensors failed: {type(e).__name__}: {e}"
    e_, n, nkb, _ = blocks.shape
    ours = mx_dequantize(pack_unpack(blocks.reshape(-1, nkb * 16)), scales.reshape(-1, nkb), k, "e2m1")
    ours = ours.reshape(e_, n, k)
    candidates = [out] + ([out.transpose(1, 2)] if out.dim() == 3 else [])
    shaped = [c for c in candidates if tuple(c.shape) == (e_, n, k)]
    if not shaped:
        return f"transformers convert_moe_packed_tensors: unexpected shape {tuple(out.shape)}, not compared"
    if any(torch.equal(c.contiguous(), ours) for c in shaped):
        return "transformers convert_moe_packed_tensors: matches"
    raise AssertionError("transformers' MXFP4 dequantizer disagrees with this script's decode")


def pack_unpack(packed):
    """[R, nkb*16] bytes -> [R, nkb*32] codes, element 2j from the low nibble."""
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    return codes


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "torch_golden.rdqg"))
    args = ap.parse_args()
    torch.set_flush_denormal(False)
    g = torch.Generator().manual_seed(20240605)
    rec = []
    for op, fmt in (("mxfp4", "e2m1"), ("mxfp8", "e4m3")):
        for dtype, shape in (("bfloat16", (16, 160)), ("float32", (8, 96)), ("bfloat16", (3, 2, 70))):
            case = f"torch_{'bf16' if dtype == 'bfloat16' else 'f32'}_{'x'.join(map(str, shape))}"
            mx_case(rec, op, case, heavy_tailed(g, shape), dtype, fmt, with_f32=shape[-1] != 160)
        for dtype in ("bfloat16", "float32"):
            mx_case(rec, op, f"torch_edges_{'bf16' if dtype == 'bfloat16' else 'f32'}", mx_edges(fmt), dtype, fmt)
    for dtype, shape in (("bfloat16", (6, 300)), ("float32", (4, 260))):
        case = f"torch_{'bf16' if dtype == 'bfloat16' else 'f32'}_{'x'.join(map(str, shape))}"
        fp8_case(rec, "fp8_1x128", case, heavy_tailed(g, shape), dtype, with_f32=False)
    for dtype in ("bfloat16", "float32"):
        fp8_case(rec, "fp8_1x128", f"torch_edges_{'bf16' if dtype == 'bfloat16' else 'f32'}", fp8_edges(), dtype)
    for dtype, shape in (("bfloat16", (129, 72)), ("float32", (2, 10, 136))):
        case = f"torch_{'bf16' if dtype == 'bfloat16' else 'f32'}_{'x'.join(map(str, shape))}"
        fp8_case(rec, "fp8_128x128", case, heavy_tailed(g, shape), dtype, with_f32=False)
    layout_case(rec, "plain", "torch_e2_n16_k128", g, 2, 16, 128)
    blocks, scales = layout_case(rec, "gate_up", "torch_e2_n32_k128", g, 2, 32, 128)
    layout_case(rec, "concat", "torch_e1_n64_k128", g, 1, 64, 128)
    notes.append(cross_check_transformers(blocks, scales, 128))

    summary = "; ".join(sorted(set(notes)))
    rec.append(("meta/torch/note", "uint8", np.frombuffer(
        f"torch {torch.__version__}: {summary}".encode(), dtype=np.uint8)))
    write_golden(args.out, rec)
    print(f"torch {torch.__version__}: wrote {len(rec)} records, {os.path.getsize(args.out)} bytes to {args.out}")
    for n in sorted(set(notes)):
        print("  " + n)


if __name__ == "__main__":
    main()
