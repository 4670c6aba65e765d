#!/usr/bin/env python3
"""Independent NumPy goldens for kernels/quant/ (MXFP4, MXFP8, UE8M0 blockwise FP8 and the
MXFP4 kernel layout), written from the spec rules, not from the C++:

- element rounding is a nearest-grid-point search over the full table of representable
  magnitudes (E2M1: 8 values, E4M3: 127 values) in float64, ties to the even code, saturating;
- the MX scale is floor(log2(amax)) - emax_elem via np.frexp (OCP MX v1.0 section 6.3);
- the UE8M0 scale is the power of two at or above float32(amax) / float32(448) via np.frexp;
- the kernel layout is a chain of reshapes and transposes, not index arithmetic, then a bit
  permutation of each word derived from the decode kernel's extraction formulas.

The policies for zeros, NaN/Inf and partial blocks are the ones stated in kernels/quant/*.hpp.

Run it with Debian's interpreter, which has python3-numpy (no other dependency):
    /usr/bin/python3 tests/reference/quant/make_quant_golden.py
It rewrites tests/reference/quant/numpy_golden.rdqg (format: golden_format.py). The C++ test
tests/unit/kernels/quant/quant_golden_test.cpp must match it bit for bit on CPU and GPU.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from golden_format import write_golden  # noqa: E402

# ---- bit helpers ---------------------------------------------------------------------------


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> quiet NaN keeping the sign."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = ((u & 0x7F800000) == 0x7F800000) & ((u & 0x7FFFFF) != 0)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_to_f32(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


CANON_NAN_F32 = np.uint32(0x7FC00000)

# ---- element grids -------------------------------------------------------------------------

E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3_value(code):
    e, m = (code >> 3) & 15, code & 7
    return m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)


E4M3_MAG = np.array([e4m3_value(c) for c in range(0x7F)])  # 0x00..0x7E, 0x7F is NaN


def nearest_code(mag, grid):
    """Index of the nearest grid value to each magnitude (float64), ties to the even index,
    saturating to the last index above the grid."""
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, len(grid) - 1)
    d_hi = np.abs(grid[hi] - mag)
    d_lo = np.abs(mag - grid[lo])
    pick = np.where(d_lo < d_hi, lo, hi)
    tie = (d_lo == d_hi) & (lo != hi)
    pick = np.where(tie, np.where(lo % 2 == 0, lo, hi), pick)
    return np.where(mag >= grid[-1], len(grid) - 1, pick)


def encode(scaled, fmt):
    """Codes (sign included) of finite float64 values already divided by the scale."""
    sign = np.signbit(scaled).astype(np.int64)
    if fmt == "e2m1":
        return (nearest_code(np.abs(scaled), E2M1_MAG) | (sign << 3)).astype(np.uint8)
    return (nearest_code(np.abs(scaled), E4M3_MAG) | (sign << 7)).astype(np.uint8)


def decode(codes, fmt):
    codes = codes.astype(np.int64)
    if fmt == "e2m1":
        mag = E2M1_MAG[codes & 7]
        neg = (codes & 8) != 0
    else:
        mag = np.where((codes & 0x7F) == 0x7F, np.nan, E4M3_MAG[np.minimum(codes & 0x7F, 0x7E)])
        neg = (codes & 0x80) != 0
    return np.where(neg, -mag, mag)


# ---- scale rules -----------------------------------------------------------------------------


def floor_log2(a):
    _, e = np.frexp(a)
    return e - 1


def mx_scale_code(block, emax):
    """OCP MX v1.0: 2^(floor(log2 amax) - emax), E8M0-clamped; 0 for a zero block, NaN (255)
    when the block holds a NaN or an infinity."""
    a = np.abs(block.astype(np.float64))
    if not np.all(np.isfinite(a)):
        return 255
    amax = a.max() if a.size else 0.0
    if amax == 0:
        return 0
    return int(np.clip(floor_log2(amax) - emax, -127, 127)) + 127


def ue8m0_scale_code(block):
    """The power of two at or above float32(amax) / 448 (computed in float32), E8M0-clamped."""
    a = np.abs(block.astype(np.float32))
    if not np.all(np.isfinite(a)):
        return 255
    s = np.float32(a.max() if a.size else 0.0) / np.float32(448.0)
    if s == 0:
        return 0
    m, e = np.frexp(np.float64(s))
    k = e - 1 if m == 0.5 else e
    return int(np.clip(k, -127, 127)) + 127


def scale_value(code):
    return np.nan if code == 255 else 2.0 ** (code - 127)


def to_f32_bits(vals):
    """float64 values (exact in float32 or overflowing) -> float32 bits, canonical NaN."""
    with np.errstate(over="ignore"):
        f = vals.astype(np.float32)
    u = f.view(np.uint32).copy()
    u[np.isnan(f)] = CANON_NAN_F32
    return u


# ---- reference quantizers ------------------------------------------------------------------


def as_f64(x, dtype):
    return (bf16_to_f32(x) if dtype == "bfloat16" else x.view(np.float32)).astype(np.float64)


def quantize_mx(xv, fmt):
    """xv: float64 [R, K] -> (codes [R, K] uint8, scales [R, ceil(K/32)] uint8)."""
    emax = 2 if fmt == "e2m1" else 8
    rows, k = xv.shape
    nkb = -(-k // 32)
    codes = np.zeros((rows, nkb * 32), np.uint8)
    scales = np.zeros((rows, nkb), np.uint8)
    for r in range(rows):
        for kb in range(nkb):
            blk = xv[r, kb * 32:(kb + 1) * 32]
            s = mx_scale_code(blk, emax)
            scales[r, kb] = s
            if s != 255:  # a poisoned block keeps all-zero codes
                c = encode(blk * 2.0 ** -(s - 127), fmt)
                codes[r, kb * 32:kb * 32 + len(blk)] = c
    return codes, scales


def pack_fp4(codes):
    """[R, 2n] codes -> [R, n] bytes, element 2j in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def dequantize_mx(codes, scales, k, fmt):
    vals = decode(codes[:, :k], fmt) * np.repeat([[scale_value(s) for s in row] for row in scales],
                                                 32, axis=1)[:, :k]
    return to_f32_bits(vals)


def quantize_fp8(xv, rows_per_batch, block_rows):
    """xv float64 [R, K]; scale rows as Fp8Geometry. -> q, scale codes [SR, KB]."""
    rows, k = xv.shape
    nkb = -(-k // 128)
    rbpb = -(-rows_per_batch // block_rows)
    nsr = rows // rows_per_batch * rbpb
    q = np.zeros((rows, k), np.uint8)
    codes = np.zeros((nsr, nkb), np.uint8)
    for sr in range(nsr):
        b, rb = divmod(sr, rbpb)
        r0 = b * rows_per_batch + rb * block_rows
        r1 = min(r0 + block_rows, (b + 1) * rows_per_batch)
        for kb in range(nkb):
            blk = xv[r0:r1, kb * 128:(kb + 1) * 128]
            s = ue8m0_scale_code(blk)
            codes[sr, kb] = s
            if s != 255:
                q[r0:r1, kb * 128:kb * 128 + blk.shape[1]] = encode(blk * 2.0 ** -(s - 127), "e4m3")
    return q, codes


def fp8_outputs(xv, rows_per_batch, block_rows):
    q, codes = quantize_fp8(xv, rows_per_batch, block_rows)
    nsr, nkb = codes.shape
    f32 = np.array([[scale_value(c) for c in row] for row in codes]).reshape(nsr, nkb)
    scales = to_f32_bits(f32)
    packed_bytes = np.zeros((nsr, 4 * -(-nkb // 4)), np.uint8)
    packed_bytes[:, :nkb] = codes
    packed = packed_bytes.view("<i4")  # four K-consecutive codes per int32, little-endian
    rows, k = xv.shape
    srow = np.array([(r // rows_per_batch) * (-(-rows_per_batch // block_rows)) +
                     (r % rows_per_batch) // block_rows for r in range(rows)], dtype=np.int64)
    svals = f32[srow][:, np.arange(k) // 128] if k else np.zeros((rows, 0))
    deq = to_f32_bits(decode(q, "e4m3") * svals)
    return q, scales, packed, deq


# ---- kernel layout (reshapes only) -----------------------------------------------------------


def kernel_row_order(a, order):
    """a [E, N, ...]: rows reordered to the kernel's: per 32 rows, 16 gate rows then the 16 up
    rows of the same features. gate_up: checkpoint rows alternate gate/up; concat: the
    checkpoint holds all gate rows, then all up rows."""
    if order == "plain":
        return a
    e, n = a.shape[:2]
    rest = a.shape[2:]
    if order == "gate_up":
        return a.reshape(e, n // 32, 16, 2, *rest).swapaxes(2, 3).reshape(e, n, *rest)
    return a.reshape(e, 2, n // 32, 16, *rest).swapaxes(1, 2).reshape(e, n, *rest)


def kernel_blocks(blocks, order):
    e, n, kb, _ = blocks.shape
    rows = kernel_row_order(blocks.reshape(e, n, kb * 16), order)
    return rows.reshape(e, n // 16, 16, kb // 2, 32).transpose(0, 1, 3, 2, 4).reshape(e, n, kb, 16)


# Step 4 (layout v2): the bits of every 32-bit word of the tiled values move so that the decode
# kernel reads slot q (elements SLOT_LOW[q] and SLOT_LOW[q] + 4, as bf16 bits of E2M1 * 2^-126:
# sign at bit 15, e1 e0 m at 8..6, +16 for the second) as rotr(word, r) & mask. Written from
# those formulas: (output bit, code bit) per slot and the rotation that reads it.
BF16_BIT_OF_CODE_BIT = {0: 6, 1: 7, 2: 8, 3: 15}  # m, e0, e1, sign
SLOT_LOW = (0, 1, 3, 2)


def word_bit_destinations():
    """dst[4 * element + code_bit] = the bit of the arranged word that holds it."""
    dst = np.full(32, -1)
    for q in range(4):
        for half, elem in ((0, SLOT_LOW[q]), (1, SLOT_LOW[q] + 4)):
            for cb, bf in BF16_BIT_OF_CODE_BIT.items():
                rot = (0, 4, 10, 14 if cb == 0 else 6)[q]  # pair (0,4) reads m with another rotation
                dst[4 * elem + cb] = (bf + 16 * half + rot) % 32
    assert sorted(dst) == list(range(32)), "the arrangement is a permutation"
    return dst


def kernel_words(tiled):
    """uint8 [..., 16] tiled values -> the same with each little-endian word's bits arranged."""
    bits = np.unpackbits(np.ascontiguousarray(tiled).reshape(-1, 4), axis=1, bitorder="little")
    out = np.zeros_like(bits)
    out[:, word_bit_destinations()] = bits
    return np.packbits(out, axis=1, bitorder="little").reshape(tiled.shape)


def kernel_scales(scales, order):
    e, n, kb = scales.shape
    rows = kernel_row_order(scales, order)
    return rows.reshape(e, n // 16, 16, kb // 2, 2).transpose(0, 1, 3, 2, 4).reshape(e, n, kb)


# ---- inputs -----------------------------------------------------------------------------------


def heavy_tailed(rng, shape):
    """Student-t (df 2) samples times a per-row scale spread over 10^-8 .. 10^8, with a sprinkle
    of exact edge values (zeros of both signs, powers of two, huge and tiny values)."""
    x = rng.standard_t(2.0, size=shape) * 10.0 ** rng.uniform(-8, 8, size=shape[:-1] + (1,))
    flat = x.reshape(-1)
    specials = np.array([0.0, -0.0, 1.0, -2.0, 6.0, 448.0, 2.0 ** -126, -(2.0 ** -130),
                         1e30, -3e38, 1e-38, 0.75, 1.75, 3.5])
    idx = rng.choice(flat.size, size=max(1, flat.size // 40), replace=False)
    flat[idx] = rng.choice(specials, size=idx.size)
    return x


def as_input(x64, dtype):
    """float64 -> the stored input (bf16 bits or float32 bits) and its exact float64 value."""
    with np.errstate(over="ignore"):
        f = x64.astype(np.float32)
    if dtype == "bfloat16":
        b = bf16_bits(f)
        return b, bf16_to_f32(b).astype(np.float64)
    return f.view(np.uint32), f.astype(np.float64)


def pad_rows(rows, k):
    out = np.zeros((len(rows), k))
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def mx_edge_rows(fmt):
    """One 32-element block per row, each exercising one rule."""
    top = 6.0 if fmt == "e2m1" else 448.0
    sub = 2.0 ** -133  # the smallest bfloat16 subnormal
    rows = [
        [0.0] * 32,                                          # zero block
        [0.0, -0.0] * 16,                                     # signed zeros
        [top, -top, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0],  # ties
        [4.0, 3.0, 1.5, -0.5, 0.25, -0.25, 0.75, -0.76],     # amax a power of two (2^2)
        [8.0, 5.0, 7.0, 1.0, -3.0],                           # amax 2^3
        [7.5, -7.0, 6.5, 1.0],                                # clipping at the element maximum
        [1.5 * 2.0 ** -127, sub, -sub, 2.0 ** -130, 0.0],     # bfloat16 subnormals only
        [2.0 ** -126, 2.0 ** -127, 2.0 ** -128],              # amax the smallest normal
        [1.0, np.nan, 2.0],                                   # NaN poisons the block
        [1.0, np.inf, 2.0],                                   # +Inf poisons the block
        [-np.inf, 0.5],                                       # -Inf poisons the block
        [3.0e38, -2.5e38, 1.0],                               # near FLT_MAX
        [0.1, -0.2, 0.3, 1e-3],                               # ordinary small values
    ]
    if fmt == "e4m3":
        rows += [
            [448.0, 464.0, 449.0, 15.5, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -9)],
            [500.0, 480.0, 300.0],      # amax above 448 with the same exponent: saturation
            [512.0, 17.0, 0.5],         # amax 2^9
            [256.0, 2.0 ** -1, 2.0 ** -2],
        ]
    return pad_rows(rows, 32)


def fp8_edge_rows():
    rows = [
        [0.0] * 128,
        [-0.0, 0.0, -0.0],
        [448.0, 1.0, -224.0, 2.0 ** -9],        # amax/448 exactly 1
        [450.0, 225.0, 449.0, 1.0],             # just above: scale 2 (449 is not bf16)
        [896.0, 1.0, -3.0],                     # amax/448 = 2
        [1.0, 0.5, 0.25],                       # amax/448 = 1/448: scale 2^-8
        [1e-38, 2.0 ** -130, -(2.0 ** -133)],   # amax/448 subnormal: scale 2^-127
        [3.0e38, 1.0],                          # near FLT_MAX
        [1.0, np.nan],                          # poisoned
        [np.inf, 1.0],
        [-np.inf],
        [15.5, 16.5, 17.0, 0.0625],
    ]
    return pad_rows(rows, 128)


# ---- cases ---------------------------------------------------------------------------------


def mx_case(records, op, case, x_stored, xv, dtype, shape, fmt, with_f32=True):
    k = shape[-1]
    x2 = xv.reshape(-1, k)
    codes, scales = quantize_mx(x2, fmt)
    lead = tuple(shape[:-1])
    nkb = scales.shape[1]
    records.append((f"{op}/{case}/x", dtype, x_stored.reshape(shape)))
    if fmt == "e2m1":
        records.append((f"{op}/{case}/blocks", "uint8", pack_fp4(codes).reshape(lead + (nkb, 16))))
    else:
        records.append((f"{op}/{case}/q", "uint8", codes[:, :k].reshape(shape)))
    records.append((f"{op}/{case}/scales", "uint8", scales.reshape(lead + (nkb,))))
    deq = dequantize_mx(codes, scales, k, fmt)
    records.append((f"{op}/{case}/dequant_bf16", "bfloat16",
                    bf16_bits(deq.view(np.float32)).reshape(shape)))
    if with_f32:
        records.append((f"{op}/{case}/dequant_f32", "float32", deq.reshape(shape)))


def fp8_case(records, op, case, x_stored, xv, dtype, shape, with_f32=True, with_bf16=True):
    k = shape[-1]
    if op == "fp8_1x128":
        rpb, br = 1, 1
        lead = tuple(shape[:-1])
    else:
        rpb, br = shape[-2], 128
        lead = tuple(shape[:-2]) + (-(-shape[-2] // 128),)
    q, scales, packed, deq = fp8_outputs(xv.reshape(-1, k), rpb, br)
    records.append((f"{op}/{case}/x", dtype, x_stored.reshape(shape)))
    records.append((f"{op}/{case}/q", "uint8", q.reshape(shape)))
    records.append((f"{op}/{case}/scales", "float32", scales.reshape(lead + (scales.shape[1],))))
    records.append((f"{op}/{case}/scales_ue8m0", "int32", packed.reshape(lead + (packed.shape[1],))))
    if with_bf16:
        records.append((f"{op}/{case}/dequant_bf16", "bfloat16",
                        bf16_bits(deq.view(np.float32)).reshape(shape)))
    if with_f32:
        records.append((f"{op}/{case}/dequant_f32", "float32", deq.reshape(shape)))


def layout_case(records, order, case, rng, e, n, k):
    x_stored, xv = as_input(heavy_tailed(rng, (e, n, k)), "bfloat16")
    codes, scales = quantize_mx(xv.reshape(-1, k), "e2m1")
    blocks = pack_fp4(codes).reshape(e, n, k // 32, 16)
    scales = scales.reshape(e, n, k // 32)
    op = f"mxfp4_layout_{order}"
    records.append((f"{op}/{case}/x", "bfloat16", x_stored))
    records.append((f"{op}/{case}/blocks", "uint8", blocks))
    records.append((f"{op}/{case}/scales", "uint8", scales))
    records.append((f"{op}/{case}/kernel_blocks", "uint8", kernel_words(kernel_blocks(blocks, order))))
    records.append((f"{op}/{case}/kernel_scales", "uint8", kernel_scales(scales, order)))


def self_checks():
    # Every grid value encodes to its own code; midpoints go to the even neighbour.
    assert (encode(E2M1_MAG, "e2m1") == np.arange(8)).all()
    assert (encode(E4M3_MAG, "e4m3") == np.arange(127)).all()
    mids = (E2M1_MAG[:-1] + E2M1_MAG[1:]) / 2
    assert list(encode(mids, "e2m1")) == [0, 2, 2, 4, 4, 6, 6]
    assert encode(np.array([-0.0]), "e2m1")[0] == 8 and encode(np.array([1e9]), "e4m3")[0] == 0x7E
    assert mx_scale_code(np.array([6.0]), 2) == 127 and mx_scale_code(np.array([8.0]), 2) == 128
    assert ue8m0_scale_code(np.array([448.0])) == 127 and ue8m0_scale_code(np.array([449.0])) == 128
    b = np.arange(2 * 64 * 4 * 16, dtype=np.uint32).reshape(2, 64, 4, 16)
    assert (kernel_blocks(b, "gate_up").reshape(2, 4, 2, 16, 32)[0, 0, 1, 0, 0]
            == b.reshape(2, 64, 64)[0, 0, 32])  # kernel tile (0, kt=1), row 0 = checkpoint row 0
    assert (kernel_blocks(b, "gate_up").reshape(2, 4, 2, 16, 32)[0, 0, 0, 1, 0]
            == b.reshape(2, 64, 64)[0, 2, 0])   # kernel row 1 = gate 1 = checkpoint row 2
    assert (kernel_blocks(b, "concat").reshape(2, 4, 2, 16, 32)[1, 1, 0, 0, 0]
            == b.reshape(2, 64, 64)[1, 32, 0])  # kernel row 16 = up 0 = checkpoint row 32
    assert (kernel_blocks(b, "concat").reshape(2, 4, 2, 16, 32)[1, 2, 0, 0, 0]
            == b.reshape(2, 64, 64)[1, 16, 0])  # kernel row 32 = gate 16 = checkpoint row 16
    # Arranged words decode by the kernel's formulas to the E2M1 codes of the v1 word.
    M = 0x81C081C0
    rotr = lambda x, r: ((x >> r) | (x << (32 - r))) & 0xFFFFFFFF  # noqa: E731
    raw = lambda c: ((c >> 3) << 15) | ((c & 7) << 6)  # noqa: E731  E2M1 code -> bf16 bits of value * 2^-126
    w = np.random.default_rng(5).integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    a = kernel_words(w.view(np.uint8)).view(np.uint32)
    for v1, arr in zip(w.tolist(), a.tolist()):
        pairs = [arr & M, rotr(arr, 4) & M, rotr(arr, 10) & M,
                 (rotr(arr, 6) & 0x81808180) | (rotr(arr, 14) & 0x00400040)]
        for q in range(4):
            lo = SLOT_LOW[q]
            assert pairs[q] == raw((v1 >> (4 * lo)) & 15) | (raw((v1 >> (4 * (lo + 4))) & 15) << 16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "numpy_golden.rdqg"))
    args = ap.parse_args()
    self_checks()
    rng = np.random.default_rng(20240604)
    records = []
    for op, fmt in (("mxfp4", "e2m1"), ("mxfp8", "e4m3")):
        for dtype, shape in (("bfloat16", (16, 160)), ("float32", (16, 96)), ("bfloat16", (3, 2, 70))):
            case = f"rand_{'bf16' if dtype == 'bfloat16' else 'f32'}_{'x'.join(map(str, shape))}"
            xs, xv = as_input(heavy_tailed(rng, shape), dtype)
            mx_case(records, op, case, xs, xv, dtype, shape, fmt, with_f32=dtype == "float32")
        edges = mx_edge_rows(fmt)
        for dtype in ("bfloat16", "float32"):
            xs, xv = as_input(edges, dtype)
            mx_case(records, op, f"edges_{'bf16' if dtype == 'bfloat16' else 'f32'}", xs, xv, dtype,
                    edges.shape, fmt)
    # float32 values that are not bfloat16: quantized from their own value.
    near = pad_rows([[1.2500001, 1.2499999, 6.0, 0.7500001, 0.7499999, 2.5000002, 0.2500001]], 32)
    xs, xv = as_input(near, "float32")
    mx_case(records, "mxfp4", "near_ties_f32", xs, xv, "float32", near.shape, "e2m1")

    for dtype, shape in (("bfloat16", (5, 300)), ("float32", (5, 260)), ("bfloat16", (2, 3, 136))):
        case = f"rand_{'bf16' if dtype == 'bfloat16' else 'f32'}_{'x'.join(map(str, shape))}"
        xs, xv = as_input(heavy_tailed(rng, shape), dtype)
        fp8_case(records, "fp8_1x128", case, xs, xv, dtype, shape)
    edges = fp8_edge_rows()
    for dtype in ("bfloat16", "float32"):
        xs, xv = as_input(edges, dtype)
        fp8_case(records, "fp8_1x128", f"edges_{'bf16' if dtype == 'bfloat16' else 'f32'}", xs, xv,
                 dtype, edges.shape)
    for dtype, shape in (("float32", (129, 24)), ("bfloat16", (2, 10, 136))):
        case = f"rand_{'bf16' if dtype == 'bfloat16' else 'f32'}_{'x'.join(map(str, shape))}"
        xs, xv = as_input(heavy_tailed(rng, shape), dtype)
        fp8_case(records, "fp8_128x128", case, xs, xv, dtype, shape)
    # A 2 x 2 grid of blocks (two of them partial), one rule each.
    w = np.zeros((136, 136))
    w[:128, :128] = heavy_tailed(rng, (128, 128)) * 1e-6
    w[5, 100] = 450.0                                     # amax just above 448: scale 2
    w[0:3, 128:131] = -0.0                                # zeros of both signs: scale 2^-127
    w[130, 30], w[131, 31] = np.nan, 1.0                  # poisoned
    w[135, 135], w[130, 130] = -(2.0 ** -133), 2.0 ** -130  # subnormals only
    xs, xv = as_input(w, "bfloat16")
    fp8_case(records, "fp8_128x128", "edges_bf16", xs, xv, "bfloat16", w.shape, with_f32=False,
             with_bf16=False)

    layout_case(records, "plain", "e2_n16_k128", rng, 2, 16, 128)
    layout_case(records, "plain", "e1_n32_k192", rng, 1, 32, 192)
    layout_case(records, "gate_up", "e2_n32_k64", rng, 2, 32, 64)
    layout_case(records, "gate_up", "e1_n64_k128", rng, 1, 64, 128)
    layout_case(records, "concat", "e2_n32_k64", rng, 2, 32, 64)
    layout_case(records, "concat", "e1_n64_k128", rng, 1, 64, 128)

    write_golden(args.out, records)
    print(f"wrote {len(records)} records, {os.path.getsize(args.out)} bytes to {args.out}")


if __name__ == "__main__":
    main()
